-- An operation's `succeeded` event is served from its row, like its creation event (migration
-- 20261208000001): the completion statement (`db::settle::complete_operations`) draws the event's
-- id and time into `finished_event_id` and `finished_event_at` after it has written the
-- operation's last journal rows (whose events come first), and the event's data follows from the
-- row's columns (`agentq_status_event_data`, what the status trigger writes). The deferred status
-- trigger skips a change that carries its event so; every other status change (a claim, a
-- failure, a cancel, an operator's) writes its event as before. `succeeded` is never left (no
-- transition starts from it), but should any of the event's columns change later, the row first
-- archives the event into `operation_events` with its id and time (a trigger), as a journal row
-- does. A job's success now writes no event row: a one-step job writes one event row (its
-- `running`) instead of three (docs/benchmarks.md, "The success event from the operation row").

-- Added without defaults: no rewrite.
ALTER TABLE operations ADD COLUMN finished_event_id bigint, ADD COLUMN finished_event_at timestamptz;

-- A status event's data, from the row's columns: the one definition, for the trigger that
-- writes status events, the readers that build them from a row, and the archive below.
-- STABLE, not IMMUTABLE: a time's text follows the session's time zone.
CREATE FUNCTION agentq_status_event_data(p_status text, p_attempt integer, p_run_at timestamptz,
                                         p_waiting_for text, p_error_class text,
                                         p_error_message text)
RETURNS jsonb LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT jsonb_strip_nulls(jsonb_build_object(
        'status', p_status, 'attempt', p_attempt, 'run_at', p_run_at,
        'waiting_for', p_waiting_for, 'error_class', p_error_class,
        'error_message', p_error_message))
$$;

CREATE OR REPLACE FUNCTION agentq_operation_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The row is already locked by the INSERT or UPDATE that fired this trigger.
    PERFORM agentq_append_event(NEW.id, 'status', agentq_status_event_data(
        NEW.status, NEW.attempt, NEW.run_at, NEW.waiting_for, NEW.error_class,
        NEW.error_message), false);
    RETURN NULL;
END $$;

DROP TRIGGER operations_event_status ON operations;
CREATE CONSTRAINT TRIGGER operations_event_status AFTER UPDATE OF status ON operations
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status AND NEW.finished_event_id IS NULL)
    EXECUTE FUNCTION agentq_operation_event();

CREATE FUNCTION agentq_finished_event_archive() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The updater holds the row's lock; the event keeps the id and time it was served with.
    INSERT INTO operation_events (op_id, seq, at, type, data)
    VALUES (OLD.id, OLD.finished_event_id, OLD.finished_event_at, 'status',
            agentq_status_event_data(OLD.status, OLD.attempt, OLD.run_at, OLD.waiting_for,
                                     OLD.error_class, OLD.error_message));
    NEW.finished_event_id := NULL;
    NEW.finished_event_at := NULL;
    RETURN NEW;
END $$;

CREATE TRIGGER operations_finished_event_archive BEFORE UPDATE ON operations
    FOR EACH ROW WHEN (OLD.finished_event_id IS NOT NULL
                       AND NEW.finished_event_id IS NOT DISTINCT FROM OLD.finished_event_id
                       AND (OLD.status, OLD.attempt, OLD.run_at, OLD.waiting_for,
                            OLD.error_class, OLD.error_message)
                           IS DISTINCT FROM (NEW.status, NEW.attempt, NEW.run_at,
                                             NEW.waiting_for, NEW.error_class,
                                             NEW.error_message))
    EXECUTE FUNCTION agentq_finished_event_archive();
