-- Caps that count everything (docs/security.md, "Capacity").
--
-- A tenant's unfinished operations (queued, running, sleeping, waiting) are counted, up to the
-- cap, through this partial index, for every way an operation is born: an enqueue, a webhook
-- delivery, a batch, a spawn, a schedule's firing. The same index answers a worker's question
-- "has another tenant work queued in this lane?" (fair shares, below) with two index probes.
-- It replaces the index of queued operations by tenant.
DROP INDEX operations_queued_by_tenant;
CREATE INDEX operations_unfinished ON operations (lane, status, tenant_id)
    WHERE status IN ('queued', 'running', 'sleeping', 'waiting');

-- Fair shares of worker slots: a tenant at its share of a worker's slots in a lane while
-- another tenant has work queued there is not started; its operation is held (`share_held`,
-- still `queued`, its pointer acked) and a worker with room for that tenant pulls it, oldest
-- first, through the same claim.
ALTER TABLE operations ADD COLUMN share_held boolean NOT NULL DEFAULT false;
CREATE INDEX operations_share_held ON operations (lane, created_at, id)
    WHERE share_held AND status = 'queued';

-- Children an operation has spawned, counted by the spawn's insert itself (AGENTQ_MAX_CHILDREN).
ALTER TABLE operations ADD COLUMN children_spawned integer NOT NULL DEFAULT 0;

-- A schedule's ticks not fired because its tenant was at its cap of unfinished operations.
ALTER TABLE schedules ADD COLUMN skipped_capacity bigint NOT NULL DEFAULT 0;

-- A concurrency key's limit is the key's: the first operation of a key sets it (`lim`), the
-- claim admits by it whatever later operations ask, and an enqueue asking another limit while
-- the key has unfinished operations is refused (an idle key takes the new one). Keys made
-- before this migration have none: their operations' own limits apply, as before.
ALTER TABLE concurrency_keys ADD COLUMN lim integer CHECK (lim BETWEEN 1 AND 1000);

CREATE OR REPLACE FUNCTION agentq_concurrency_key_row() RETURNS trigger AS $$
BEGIN
    INSERT INTO concurrency_keys (tenant_id, key, lim)
        VALUES (NEW.tenant_id, NEW.concurrency_key, NEW.concurrency_limit)
        ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION agentq_concurrency_count() RETURNS trigger AS $$
DECLARE
    now_running integer;
    key_limit integer;
BEGIN
    IF NEW.status = 'running' THEN
        UPDATE concurrency_keys SET running = running + 1
         WHERE tenant_id = NEW.tenant_id AND key = NEW.concurrency_key;
        RETURN NULL;
    END IF;
    SELECT running, COALESCE(lim, NEW.concurrency_limit) INTO now_running, key_limit
      FROM concurrency_keys
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
                   LIMIT LEAST(100, GREATEST(1, key_limit - now_running + 1)));
    UPDATE concurrency_keys SET running = running - 1
     WHERE tenant_id = NEW.tenant_id AND key = NEW.concurrency_key;
    RETURN NULL;
END
$$ LANGUAGE plpgsql;
