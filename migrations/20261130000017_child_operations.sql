-- Child operations: `ctx.spawn(kind, input)` inserts an operation with `parent_id` set and the
-- dedupe key `child:<parent's step idempotency key>`, so a replayed spawn finds the child it
-- made instead of making a second. `ctx.join(children)` records the children it waits for in
-- `joining` and parks the parent as `waiting` for `(children)` (a name no signal can have);
-- the scheduler's wake sweep queues it once every one of them has finished.
ALTER TABLE operations
    ADD COLUMN parent_id uuid,
    ADD COLUMN joining   uuid[];

CREATE INDEX operations_children ON operations (parent_id, created_at, id)
    WHERE parent_id IS NOT NULL;
-- Only parents parked on a join: the wake sweep reads this, never the whole table.
CREATE INDEX operations_joining ON operations (id)
    WHERE status = 'waiting' AND waiting_for = '(children)';

ALTER TABLE operation_steps DROP CONSTRAINT operation_steps_kind_check;
ALTER TABLE operation_steps ADD CONSTRAINT operation_steps_kind_check
    CHECK (kind IN ('model', 'tool', 'sleep', 'signal', 'now', 'custom', 'patch', 'spawn',
                    'join'));

-- A cancelled operation's unfinished children are cancelled with it: queued, sleeping and
-- waiting ones at once, running ones through their worker (which then cascades to theirs).
CREATE FUNCTION agentq_cancel_children() RETURNS trigger AS $$
BEGIN
    UPDATE operations
       SET status = 'cancelled', error_class = 'cancelled',
           error_message = 'cancelled with its parent ' || NEW.id,
           waiting_for = NULL, finished_at = now(), updated_at = now()
     WHERE parent_id = NEW.id AND status IN ('queued', 'sleeping', 'waiting');
    UPDATE operations SET cancel_requested = true
     WHERE parent_id = NEW.id AND status = 'running' AND NOT cancel_requested;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

CREATE TRIGGER operations_cancel_children
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.status = 'cancelled' AND OLD.status IS DISTINCT FROM 'cancelled')
    EXECUTE FUNCTION agentq_cancel_children();
