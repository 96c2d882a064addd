-- agentq initial schema: operations, the step journal, signals, dead letters, operator audit.
-- Forward-only: never edit this file once landed; add a new migration instead.

CREATE TABLE operations (
    id               uuid        PRIMARY KEY,
    tenant_id        text        NOT NULL CHECK (tenant_id <> ''),
    kind             text        NOT NULL,
    lane             text        NOT NULL DEFAULT 'interactive' CHECK (lane IN ('interactive', 'batch')),
    priority         smallint    NOT NULL DEFAULT 0,
    input            jsonb       NOT NULL,
    input_sha256     text        NOT NULL,
    dedupe_key       text,
    ordering_key     text,
    batch_id         uuid,
    status           text        NOT NULL DEFAULT 'queued'
                     CHECK (status IN ('queued', 'running', 'sleeping', 'waiting',
                                       'succeeded', 'dead', 'cancelled', 'discarded')),
    attempt          integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 5 CHECK (max_attempts > 0),
    epoch            bigint      NOT NULL DEFAULT 0,
    restarts         integer     NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    deadline         timestamptz,
    lease_owner      text,
    lease_expires_at timestamptz,
    dispatched_at    timestamptz,
    cancel_requested boolean     NOT NULL DEFAULT false,
    result           jsonb,
    error_class      text,
    error_message    text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    request_id       text,
    traceparent      text
);

-- Idempotent enqueue: one operation per (tenant, dedupe key).
CREATE UNIQUE INDEX operations_dedupe_key ON operations (tenant_id, dedupe_key)
    WHERE dedupe_key IS NOT NULL;
-- Due timers: sleeping wake-ups, waits' timeouts, delayed retries.
CREATE INDEX operations_due ON operations (run_at)
    WHERE status IN ('queued', 'sleeping', 'waiting');
-- The reaper: expired leases of running operations.
CREATE INDEX operations_lease_expiry ON operations (lease_expires_at)
    WHERE status = 'running';
-- The dispatch sweeper: committed but never (or no longer) published.
CREATE INDEX operations_undispatched ON operations (updated_at)
    WHERE status = 'queued' AND dispatched_at IS NULL;
-- Ordering keys: the next operation per (tenant, key) in creation order.
CREATE INDEX operations_ordering ON operations (tenant_id, ordering_key, created_at, id)
    WHERE ordering_key IS NOT NULL
      AND status NOT IN ('succeeded', 'dead', 'cancelled', 'discarded');
CREATE INDEX operations_batch ON operations (batch_id) WHERE batch_id IS NOT NULL;

-- The journal: one row per ctx call, replayed on every (re)start.
CREATE TABLE operation_steps (
    op_id           uuid        NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    seq             integer     NOT NULL CHECK (seq >= 0),
    name            text        NOT NULL,
    kind            text        NOT NULL CHECK (kind IN ('model', 'tool', 'sleep', 'signal', 'now', 'custom')),
    replay          text        NOT NULL CHECK (replay IN ('safe', 'unsafe')),
    idempotency_key text        NOT NULL,
    status          text        NOT NULL CHECK (status IN ('started', 'completed', 'failed', 'unknown')),
    output          jsonb,
    error           text,
    epoch           bigint      NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,
    wake_at         timestamptz,
    usage           jsonb,
    PRIMARY KEY (op_id, seq)
);

-- Signals, kept even when they arrive before the wait that consumes them.
CREATE TABLE signals (
    op_id       uuid        NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    name        text        NOT NULL,
    payload     jsonb       NOT NULL DEFAULT 'null'::jsonb,
    sent_by     text,
    received_at timestamptz NOT NULL DEFAULT now(),
    consumed_at timestamptz,
    PRIMARY KEY (op_id, name)
);

-- The human DLQ: one open row per dead operation or undecodable broker message.
CREATE TABLE dead_letters (
    id          uuid        PRIMARY KEY,
    op_id       uuid        REFERENCES operations (id) ON DELETE CASCADE,
    tenant_id   text,
    kind        text,
    class       text        NOT NULL,
    reason      text        NOT NULL,
    failed_step integer,
    attempts    integer     NOT NULL DEFAULT 0,
    raw_message bytea,
    status      text        NOT NULL DEFAULT 'open'
                CHECK (status IN ('open', 'retried', 'discarded', 'resolved')),
    resolved_by text,
    resolved_at timestamptz,
    note        text,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX dead_letters_one_open_per_op ON dead_letters (op_id) WHERE status = 'open';
CREATE INDEX dead_letters_page ON dead_letters (tenant_id, created_at DESC, id DESC);

-- Append-only audit of every operator action.
CREATE TABLE operator_actions (
    id              bigserial   PRIMARY KEY,
    actor           text        NOT NULL,
    action          text        NOT NULL,
    op_id           uuid,
    dead_letter_id  uuid,
    reason          text,
    status_before   text,
    status_after    text,
    details         jsonb,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX operator_actions_op ON operator_actions (op_id, created_at);
