-- A join is woken by a count, not a scan: `join_pending` is how many of the children a parked
-- `ctx.join` waits for are unfinished. `db::children::resolve_join` sets it (with `joining`)
-- after locking the parent; a trigger moves it as children finish (or an operator's retry
-- makes a dead child unfinished again). The scheduler's wake sweep then reads only parked
-- parents whose count is zero, instead of re-checking every joined child on every pass.
--
-- Why it cannot miss a child: the trigger locks the parent row whenever one of its children
-- finishes, joined or not. A join being decided holds that lock from before it counts (in a
-- statement of its own, so the count sees every child that committed meanwhile) until it
-- commits; a child finishing meanwhile waits for it and then counts itself down.
ALTER TABLE operations ADD COLUMN join_pending integer;

-- Parents parked before this migration: counted once here.
UPDATE operations p
   SET join_pending = (SELECT count(*) FROM operations c
                        WHERE c.id = ANY(p.joining)
                          AND c.status NOT IN ('succeeded', 'dead', 'cancelled', 'discarded'))
 WHERE p.status = 'waiting' AND p.waiting_for = '(children)';

CREATE FUNCTION agentq_child_finished() RETURNS trigger AS $$
DECLARE
    delta integer := CASE
        WHEN NEW.status IN ('succeeded', 'dead', 'cancelled', 'discarded') THEN -1
        ELSE 1 END;
BEGIN
    -- The lock, whatever the parent does: a join being decided and this child's end are
    -- ordered by it.
    PERFORM 1 FROM operations WHERE id = NEW.parent_id FOR NO KEY UPDATE;
    UPDATE operations
       SET join_pending = join_pending + delta
     WHERE id = NEW.parent_id AND join_pending IS NOT NULL AND NEW.id = ANY(joining);
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

-- A child entering a terminal status, or leaving one (an operator's retry of a dead child).
CREATE TRIGGER operations_child_finished
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL
          AND (NEW.status IN ('succeeded', 'dead', 'cancelled', 'discarded'))
              IS DISTINCT FROM
              (OLD.status IN ('succeeded', 'dead', 'cancelled', 'discarded')))
    EXECUTE FUNCTION agentq_child_finished();

-- No index names `join_pending`, so counting down a parked parent is a heap-only update; the
-- wake sweep reads the parked parents through `operations_joining` and checks their counts.
