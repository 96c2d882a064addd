-- Concurrency keys: operations of one tenant sharing a `concurrency_key` run at most
-- `concurrency_limit` at once (an ordering key is the limit-1 case that also keeps order).
--
-- `concurrency_keys.running` counts the key's operations in status `running`; triggers keep it
-- exact on every transition into or out of `running`, whatever statement makes it. The claim
-- locks the batch's counter rows (after its operation rows, in key order) and admits a key's
-- operations, oldest first, only while `running` stays under their limit. An operation
-- waiting (a durable sleep, a signal, an approval) holds no slot.
ALTER TABLE operations
    ADD COLUMN concurrency_key   text,
    ADD COLUMN concurrency_limit integer CHECK (concurrency_limit BETWEEN 1 AND 1000),
    ADD CONSTRAINT operations_concurrency_pair
        CHECK ((concurrency_key IS NULL) = (concurrency_limit IS NULL));

CREATE TABLE concurrency_keys (
    tenant_id text    NOT NULL,
    key       text    NOT NULL,
    running   integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    PRIMARY KEY (tenant_id, key)
);

CREATE INDEX operations_concurrency ON operations (tenant_id, concurrency_key, created_at, id)
    WHERE concurrency_key IS NOT NULL;

-- Every key has its counter row before its first claim: the claim only locks rows, never
-- inserts them. `DO NOTHING` takes no lock on an existing row.
CREATE FUNCTION agentq_concurrency_key_row() RETURNS trigger AS $$
BEGIN
    INSERT INTO concurrency_keys (tenant_id, key) VALUES (NEW.tenant_id, NEW.concurrency_key)
        ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

CREATE TRIGGER operations_concurrency_key_row
    AFTER INSERT ON operations
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION agentq_concurrency_key_row();

-- Into `running`: one slot more. Out of it: one slot less, and the freed slots go to the
-- key's oldest queued, due operations, whose pointers may have been consumed (and dropped)
-- while the key was full: clearing `dispatched_at` hands them to the dispatch sweeper, bumping
-- `epoch` voids any late dispatch mark (as for ordering keys' successors). Their rows are
-- locked before the counter row, the order a claim takes (operations, then counters).
CREATE FUNCTION agentq_concurrency_count() RETURNS trigger AS $$
DECLARE
    now_running integer;
BEGIN
    IF NEW.status = 'running' THEN
        UPDATE concurrency_keys SET running = running + 1
         WHERE tenant_id = NEW.tenant_id AND key = NEW.concurrency_key;
        RETURN NULL;
    END IF;
    SELECT running INTO now_running FROM concurrency_keys
     WHERE tenant_id = NEW.tenant_id AND key = NEW.concurrency_key;
    UPDATE operations
       SET dispatched_at = NULL, epoch = epoch + 1
     WHERE id IN (SELECT id FROM operations
                   WHERE tenant_id = NEW.tenant_id
                     AND concurrency_key = NEW.concurrency_key
                     AND status = 'queued' AND run_at <= now() AND NOT version_parked
                     AND NOT in_stopped_batch(batch_id)
                     AND id <> NEW.id
                   ORDER BY created_at, id
                   LIMIT LEAST(100, GREATEST(1, NEW.concurrency_limit - now_running + 1)));
    UPDATE concurrency_keys SET running = running - 1
     WHERE tenant_id = NEW.tenant_id AND key = NEW.concurrency_key;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

CREATE TRIGGER operations_concurrency_count
    AFTER UPDATE OF status ON operations
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL
          AND (OLD.status = 'running') IS DISTINCT FROM (NEW.status = 'running'))
    EXECUTE FUNCTION agentq_concurrency_count();
