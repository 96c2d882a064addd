-- The event log behind `GET /v1/operations/{id}/events`: one row per status change, journal
-- step transition and received signal, numbered 1, 2, 3… per operation.
--
-- Numbering is gap-free and in commit order because every writer of an operation's events
-- holds that operation's row lock (an UPDATE of the row, the journal's FOR UPDATE, or the
-- explicit lock below), so two transactions never number events of one operation at once and
-- a reader resuming after event n can never miss one that commits later with a smaller number.
-- Event data carries no inputs, outputs or payloads: the terminal result is read from the
-- operation itself when the event is served.

CREATE TABLE operation_events (
    op_id uuid        NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    seq   integer     NOT NULL,
    at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    type  text        NOT NULL CHECK (type IN ('status', 'step', 'signal')),
    data  jsonb       NOT NULL,
    PRIMARY KEY (op_id, seq)
);

CREATE FUNCTION agentq_append_event(p_op uuid, p_type text, p_data jsonb, p_lock boolean)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_lock THEN
        PERFORM 1 FROM operations WHERE id = p_op FOR NO KEY UPDATE;
    END IF;
    INSERT INTO operation_events (op_id, seq, type, data)
    SELECT p_op, COALESCE(max(seq), 0) + 1, p_type, p_data
      FROM operation_events WHERE op_id = p_op;
END $$;

CREATE FUNCTION agentq_operation_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The row is already locked by the INSERT or UPDATE that fired this trigger.
    PERFORM agentq_append_event(NEW.id, 'status', jsonb_strip_nulls(jsonb_build_object(
        'status', NEW.status, 'attempt', NEW.attempt, 'run_at', NEW.run_at,
        'waiting_for', NEW.waiting_for, 'error_class', NEW.error_class,
        'error_message', NEW.error_message)), false);
    RETURN NULL;
END $$;

CREATE TRIGGER operations_event_insert AFTER INSERT ON operations
    FOR EACH ROW EXECUTE FUNCTION agentq_operation_event();
-- Deferred to commit, so a transaction that journals steps and then parks or finishes the
-- operation logs the steps first and the new status last (a statement's CTEs run in no
-- guaranteed order).
CREATE CONSTRAINT TRIGGER operations_event_status AFTER UPDATE OF status ON operations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION agentq_operation_event();

CREATE FUNCTION agentq_step_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agentq_append_event(NEW.op_id, 'step', jsonb_build_object(
        'seq', NEW.seq, 'name', NEW.name, 'kind', NEW.kind, 'status', NEW.status), true);
    RETURN NULL;
END $$;

CREATE TRIGGER operation_steps_event_insert AFTER INSERT ON operation_steps
    FOR EACH ROW EXECUTE FUNCTION agentq_step_event();
CREATE TRIGGER operation_steps_event_status AFTER UPDATE OF status ON operation_steps
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION agentq_step_event();

CREATE FUNCTION agentq_signal_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM agentq_append_event(NEW.op_id, 'signal', jsonb_build_object('name', NEW.name), true);
    RETURN NULL;
END $$;

CREATE TRIGGER signals_event_insert AFTER INSERT ON signals
    FOR EACH ROW EXECUTE FUNCTION agentq_signal_event();
CREATE TRIGGER signals_event_resend AFTER UPDATE OF received_at ON signals
    FOR EACH ROW WHEN (OLD.received_at IS DISTINCT FROM NEW.received_at)
    EXECUTE FUNCTION agentq_signal_event();

-- Admission control counts a tenant's queued operations (`POST /v1/operations` answers 429
-- above the limit).
CREATE INDEX operations_queued_by_tenant ON operations (tenant_id) WHERE status = 'queued';
