-- A child's end never waits for its parent's row lock. The child-finished trigger (migration
-- 18) locked the parent of every child that finished, in the order the statement updated the
-- children, after the journal writer had locked its batch in id order: two journal statements
-- finishing each other's parents' children (a spawn fan-out) deadlocked, and so did a writer and
-- a heartbeat, a cancel or the reaper.
--
-- Now the trigger takes the parent's lock only if it is free (SKIP LOCKED) and counts the child
-- down there as before; when another transaction holds it, the child's change is appended to
-- `join_deltas` instead, which nobody locks. A delta commits with its child's status, so:
-- - a join being decided (`db::children::resolve_join`, which holds the parent's lock) counts
--   the children and deletes the parent's deltas in one statement, with one snapshot: an end
--   that statement sees is counted and its delta deleted; an end it does not see keeps its
--   delta;
-- - the wake sweep (`db::timers::wake_due`) wakes a parked parent when its count plus its
--   joined children's deltas reaches zero.
-- No end is missed or counted twice. No foreign key: its check would take a share lock on the
-- parent (the wait this removes). Deltas of parents that finished are deleted by retention.
CREATE TABLE join_deltas (
    parent_id uuid    NOT NULL,
    child_id  uuid    NOT NULL,
    delta     integer NOT NULL CHECK (delta IN (-1, 1))
);
CREATE INDEX join_deltas_parent ON join_deltas (parent_id) INCLUDE (child_id, delta);

CREATE OR REPLACE FUNCTION agentq_child_finished() RETURNS trigger AS $$
DECLARE
    delta integer := CASE
        WHEN NEW.status IN ('succeeded', 'dead', 'cancelled', 'discarded') THEN -1
        ELSE 1 END;
BEGIN
    PERFORM 1 FROM operations WHERE id = NEW.parent_id FOR NO KEY UPDATE SKIP LOCKED;
    IF FOUND THEN
        UPDATE operations
           SET join_pending = join_pending + delta
         WHERE id = NEW.parent_id AND join_pending IS NOT NULL AND NEW.id = ANY(joining);
    ELSE
        INSERT INTO join_deltas (parent_id, child_id, delta) VALUES (NEW.parent_id, NEW.id, delta);
    END IF;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

-- A cancelled operation's unfinished children are locked in id order (as the claim, the
-- heartbeat and the journal writer lock operations) before they are changed: in scan order
-- they deadlocked with a journal statement holding two of them.
CREATE OR REPLACE FUNCTION agentq_cancel_children() RETURNS trigger AS $$
BEGIN
    PERFORM 1 FROM operations
      WHERE parent_id = NEW.id AND status IN ('queued', 'running', 'sleeping', 'waiting')
      ORDER BY id
        FOR NO KEY UPDATE;
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
