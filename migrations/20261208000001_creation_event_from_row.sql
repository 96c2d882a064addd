-- An operation's first event, its creation as `queued`, is served from its own row instead of
-- a row in `operation_events` (the way a step's event is served from its journal row since
-- migration 20261207000001): the row carries the event's id (`created_event_id`, drawn by the
-- INSERT from the shared sequence, so it is the operation's first id) and the event's data
-- follows from columns that never change: `{"status": "queued", "attempt": 0, "run_at":
-- created_at}`, at `created_at`. The event log every reader reads
-- (`agentq_core::db::events::event_log!`) adds it. An enqueue now writes one row instead of
-- two (docs/benchmarks.md, "The creation event from the operation row").
--
-- Only a row inserted in exactly that state is served so: `queued`, attempt 0, nothing it waits
-- for, no error, and due at once (`run_at = created_at`; a delayed or debounced enqueue is due
-- later, and its event names when). Any other insert (a delayed enqueue, a debounced one, a
-- fixture written in another state) keeps `created_event_id` NULL and its event is written to
-- `operation_events` by the trigger, as before; so do the rows inserted before this migration.
-- Later status changes are written as before (`operations_event_status`).

-- Added without a default, then given one, so the table is not rewritten.
ALTER TABLE operations ADD COLUMN created_event_id bigint;
ALTER TABLE operations ALTER COLUMN created_event_id SET DEFAULT nextval('agentq_event_ids');

CREATE FUNCTION agentq_creation_event_apart() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.created_event_id := NULL;
    RETURN NEW;
END $$;

-- The condition is checked by PostgreSQL before any function is called: the common enqueue
-- runs no trigger function at all.
CREATE TRIGGER operations_creation_event_apart BEFORE INSERT ON operations
    FOR EACH ROW WHEN (NOT (NEW.status = 'queued' AND NEW.attempt = 0
                            AND NEW.waiting_for IS NULL AND NEW.error_class IS NULL
                            AND NEW.error_message IS NULL AND NEW.run_at = NEW.created_at))
    EXECUTE FUNCTION agentq_creation_event_apart();

DROP TRIGGER operations_event_insert ON operations;
CREATE TRIGGER operations_event_insert AFTER INSERT ON operations
    FOR EACH ROW WHEN (NEW.created_event_id IS NULL)
    EXECUTE FUNCTION agentq_operation_event();
