-- Batch campaigns (`agentq batch`): one operation per document, with controls.
--
-- A batch's id is derived from what it migrates (tenant, kind, source, target, instructions),
-- so re-running the same `batch start` after a crash or Ctrl-C finds the same batch and
-- enqueues only the documents it is missing (each operation's dedupe key is
-- `batch:<id>:<document>`).

CREATE TABLE batches (
    id            uuid        PRIMARY KEY,
    tenant_id     text        NOT NULL,
    kind          text        NOT NULL,
    source        text        NOT NULL,
    target        text        NOT NULL,
    instructions  text        NOT NULL,
    options       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status        text        NOT NULL DEFAULT 'running'
                  CHECK (status IN ('canary', 'running', 'paused', 'cancelled')),
    canary        integer,
    documents     integer     NOT NULL DEFAULT 0,
    -- Auto-pause: when at least `pause_ratio` of the last `pause_window` outcomes failed.
    pause_window  integer     NOT NULL DEFAULT 20 CHECK (pause_window > 0),
    pause_ratio   real        NOT NULL DEFAULT 0.5 CHECK (pause_ratio > 0 AND pause_ratio <= 1),
    paused_reason text,
    -- Auto-pause counts outcomes from this moment on. A resume sets it 10 s ahead: the
    -- failures that caused the pause are forgiven, and so are the parks of workers whose
    -- circuit breaker has not yet probed the recovered provider (its cooldown is 5 s).
    count_from    timestamptz NOT NULL DEFAULT '-infinity',
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- True when `batch` is paused or cancelled: the claim refuses its operations and the
-- dispatch sweeps skip them (resuming re-dispatches them).
CREATE FUNCTION in_stopped_batch(batch uuid) RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT batch IS NOT NULL AND EXISTS (
        SELECT 1 FROM batches b WHERE b.id = batch AND b.status IN ('paused', 'cancelled'))
$$;

-- One row per attempt outcome of a batch's operations: success, a failed attempt that will be
-- retried (or parked for an overloaded provider), or death. The scheduler's auto-pause reads the newest `pause_window` of them.
CREATE TABLE batch_outcomes (
    id          bigserial   PRIMARY KEY,
    batch_id    uuid        NOT NULL REFERENCES batches (id) ON DELETE CASCADE,
    ok          boolean     NOT NULL,
    error_class text,
    at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX batch_outcomes_recent ON batch_outcomes (batch_id, id DESC);

CREATE FUNCTION agentq_batch_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A library caller may set batch_id without a batches row: record nothing then.
    IF NEW.status = 'succeeded' THEN
        INSERT INTO batch_outcomes (batch_id, ok)
        SELECT NEW.batch_id, true WHERE EXISTS (SELECT 1 FROM batches WHERE id = NEW.batch_id);
    ELSIF NEW.status = 'dead'
       OR (NEW.status = 'queued' AND OLD.status = 'running' AND NEW.error_class IS NOT NULL) THEN
        INSERT INTO batch_outcomes (batch_id, ok, error_class)
        SELECT NEW.batch_id, false, NEW.error_class
         WHERE EXISTS (SELECT 1 FROM batches WHERE id = NEW.batch_id);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER operations_batch_outcome AFTER UPDATE OF status ON operations
    FOR EACH ROW WHEN (NEW.batch_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION agentq_batch_outcome();
