-- Versioned kinds: an operation runs on the version of its kind it first ran on; workers say
-- which versions they run; patches and operator upgrades are recorded in the journal.
-- Forward-only: never edit this file once landed; add a new migration instead.

ALTER TABLE operations
    -- Pinned by the first claim (the claiming worker's newest version of the kind, which is the
    -- newest version any live worker runs); NULL until then.
    ADD COLUMN kind_version    text,
    -- A worker that does not run the operation's version refused its pointer: the operation
    -- stays queued, its pointer acked, until a worker that runs the version pulls it from here.
    ADD COLUMN version_parked  boolean NOT NULL DEFAULT false,
    -- Set by an operator's upgrade to the last journal position at the time: where a run on
    -- the new version first asks for another step than the journal recorded at or before it,
    -- the journal from there on is moved to operation_steps_superseded and runs anew.
    ADD COLUMN upgrade_through integer;

-- Workers pull the parked operations they can run.
CREATE INDEX operations_version_parked ON operations (kind, kind_version) WHERE version_parked;

-- The versions each live worker runs, refreshed with every lease heartbeat and deleted when the
-- worker stops. A row whose live_until passed belongs to a worker that died.
CREATE TABLE workers (
    owner       text        PRIMARY KEY,
    kinds       text[]      NOT NULL,
    versions    text[]      NOT NULL CHECK (cardinality(versions) = cardinality(kinds)),
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),
    live_until  timestamptz NOT NULL
);

-- ctx.patched records a marker step.
ALTER TABLE operation_steps DROP CONSTRAINT operation_steps_kind_check;
ALTER TABLE operation_steps ADD CONSTRAINT operation_steps_kind_check
    CHECK (kind IN ('model', 'tool', 'sleep', 'signal', 'now', 'custom', 'patch'));

-- Journal rows an upgrade's rebase took out of the journal: kept for the audit trail.
CREATE TABLE operation_steps_superseded (
    op_id           uuid        NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    seq             integer     NOT NULL,
    name            text        NOT NULL,
    kind            text        NOT NULL,
    status          text        NOT NULL,
    output          jsonb,
    error           text,
    epoch           bigint      NOT NULL,
    started_at      timestamptz NOT NULL,
    completed_at    timestamptz,
    -- The version the operation was upgraded to when its run moved these rows.
    to_version      text,
    superseded_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX operation_steps_superseded_op ON operation_steps_superseded (op_id, superseded_at);
