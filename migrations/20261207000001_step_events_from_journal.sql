-- A step's event is served from its journal row instead of a second row in `operation_events`:
-- the journal row carries the id and time of the event of its current status (`event_id`,
-- `event_at`), and the event log an operation's stream reads is `operation_events` plus its
-- journal rows (`agentq_core::db::events::event_log!`). A safe step, written once as
-- `completed`, now writes one row instead of two (docs/benchmarks.md, "Step events from the
-- journal"). A row whose status changes later (an unsafe call's `started`, a sleep, a wait, an
-- `unknown` resolved by an operator) first archives the event of its old status into
-- `operation_events`, with its id and time, and takes a new id; a row moved out of the journal
-- (a rebase onto a new kind version) archives its event the same way.
--
-- Event ids now come from one sequence shared by all operations, so they are no longer
-- 1, 2, 3… per operation; they still increase in commit order within each operation, with none
-- missed or repeated by a reader that resumes after the last id it saw. That holds because
-- every writer of an operation's events draws its ids while it holds the operation's row lock
-- (FOR NO KEY UPDATE or stronger, kept to commit), and the sequence has no per-session cache
-- (CACHE 1, the default): a transaction that writes events of the operation after another one
-- committed draws larger ids, and a transaction cannot draw ids for it while another holds
-- the lock. The journal's batched write (`record_steps_many`) locks its operations FOR NO KEY
-- UPDATE for that reason; the other journal writes update the operation row in the same
-- statement. Ids already issued stay as they were: the sequence starts above the largest.

CREATE SEQUENCE agentq_event_ids AS bigint;
ALTER TABLE operation_events ALTER COLUMN seq TYPE bigint;
SELECT setval('agentq_event_ids', COALESCE((SELECT max(seq) FROM operation_events), 0) + 1, false);
ALTER TABLE operation_events ALTER COLUMN seq SET DEFAULT nextval('agentq_event_ids');
ALTER SEQUENCE agentq_event_ids OWNED BY operation_events.seq;

-- Rows journaled before this migration keep NULL: their events are in operation_events.
-- (Added without a default, then given one, so the table is not rewritten.)
ALTER TABLE operation_steps ADD COLUMN event_id bigint, ADD COLUMN event_at timestamptz;
ALTER TABLE operation_steps ALTER COLUMN event_id SET DEFAULT nextval('agentq_event_ids'),
                            ALTER COLUMN event_at SET DEFAULT clock_timestamp();

-- A step event's data, from the columns of its journal row: what the trigger of migration
-- 20261203000002 wrote, now computed where the event is read (and where it is archived).
CREATE FUNCTION agentq_step_event_data(p_seq integer, p_name text, p_kind text, p_status text,
                                       p_output jsonb)
RETURNS jsonb LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT jsonb_strip_nulls(jsonb_build_object(
        'seq', p_seq, 'name', p_name, 'kind', p_kind, 'status', p_status,
        'about', CASE WHEN p_kind = 'signal' AND p_status = 'started'
                      THEN p_output -> 'about' END))
$$;

CREATE OR REPLACE FUNCTION agentq_append_event(p_op uuid, p_type text, p_data jsonb, p_lock boolean)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_lock THEN
        PERFORM 1 FROM operations WHERE id = p_op FOR NO KEY UPDATE;
    END IF;
    -- The id is drawn here, after the lock (the column's default).
    INSERT INTO operation_events (op_id, type, data) VALUES (p_op, p_type, p_data);
END $$;

DROP TRIGGER operation_steps_event_insert ON operation_steps;
DROP TRIGGER operation_steps_event_status ON operation_steps;
DROP FUNCTION agentq_step_event();

CREATE FUNCTION agentq_step_event_archive() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Every writer of the operation's events holds this lock (see above); the writers of a
    -- status change already do, and taking it again is cheap.
    PERFORM 1 FROM operations WHERE id = NEW.op_id FOR NO KEY UPDATE;
    IF OLD.event_id IS NOT NULL THEN
        INSERT INTO operation_events (op_id, seq, at, type, data)
        VALUES (OLD.op_id, OLD.event_id, OLD.event_at, 'step',
                agentq_step_event_data(OLD.seq, OLD.name, OLD.kind, OLD.status, OLD.output));
    END IF;
    NEW.event_id := nextval('agentq_event_ids');
    NEW.event_at := clock_timestamp();
    RETURN NEW;
END $$;

CREATE TRIGGER operation_steps_event_status BEFORE UPDATE OF status ON operation_steps
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION agentq_step_event_archive();
