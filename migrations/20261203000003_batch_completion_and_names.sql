-- Batches finish, and are named.
--
-- A running batch whose `batch start` enqueued every document (`filled_at`) and which has no
-- unfinished operation left is `completed` by the scheduler (`db::batches::complete`, one
-- index probe per batch on `operations_batch_unfinished`); a DLQ retry of one of its dead
-- operations reopens it (`running`) in the retry's transaction. `started_at` / `finished_at`
-- bound it; `running_secs` (closed running intervals) plus `now() - running_since` (the open
-- one) is its running time, which excludes time paused and time a canary waited for its
-- promotion, so a rate over it means what the workers did.
--
-- A batch (like a schedule) may have a name, unique in its tenant, accepted wherever its id is.
-- A name never reads as a UUID, so an id and a name cannot be mistaken for each other.

ALTER TABLE batches DROP CONSTRAINT batches_status_check;
ALTER TABLE batches ADD CONSTRAINT batches_status_check
    CHECK (status IN ('canary', 'running', 'paused', 'cancelled', 'completed'));

ALTER TABLE batches
    ADD COLUMN name          text
        CHECK (name ~ '^[A-Za-z0-9_.:-]{1,128}$'
               AND name !~* '^(urn:uuid:)?([0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$'),
    ADD COLUMN started_at    timestamptz,
    ADD COLUMN finished_at   timestamptz,
    -- Set when `batch start` (or a resume) has enqueued every document; NULL while a start
    -- is under way or was interrupted (a re-run sets it). Nothing completes before it is set.
    ADD COLUMN filled_at     timestamptz,
    ADD COLUMN running_secs  double precision NOT NULL DEFAULT 0 CHECK (running_secs >= 0),
    -- Set while (and only while) the batch is `running`.
    ADD COLUMN running_since timestamptz;

-- Batches from before: started when created; filled when they have an operation per document
-- (a batch with refused documents, or an interrupted start, is filled by its next `batch
-- start`); running since they were created (their pauses were not recorded).
UPDATE batches b
   SET started_at = b.created_at,
       filled_at = CASE WHEN b.status <> 'canary'
                         AND (SELECT count(*) FROM operations o WHERE o.batch_id = b.id)
                             >= b.documents
                        THEN b.updated_at END,
       running_since = CASE WHEN b.status = 'running' THEN b.created_at END,
       finished_at = CASE WHEN b.status = 'cancelled' THEN b.updated_at END;

ALTER TABLE batches ALTER COLUMN started_at SET DEFAULT now();
ALTER TABLE batches ALTER COLUMN started_at SET NOT NULL;

CREATE UNIQUE INDEX batches_tenant_name ON batches (tenant_id, name) WHERE name IS NOT NULL;
-- `batch list` and `GET /v1/batches`: newest first, keyset by (created_at, id).
CREATE INDEX batches_created ON batches (created_at DESC, id DESC);

-- The completion pass's probe: does this batch have an unfinished operation? Finished
-- operations are not in it, so a 50,000-document batch near its end costs one probe.
CREATE INDEX operations_batch_unfinished ON operations (batch_id)
    WHERE batch_id IS NOT NULL AND status IN ('queued', 'running', 'sleeping', 'waiting');
