-- Schedules (`agentq schedules`, `/v1/schedules`, the console's Schedules page): a tenant's kind
-- and input, fired as an ordinary operation at every tick of a cron expression in an IANA time
-- zone, or of a fixed interval (ticks at multiples of it since the Unix epoch).
--
-- The scheduler locks due rows (`FOR UPDATE SKIP LOCKED`), inserts one operation per tick it
-- fires with the dedupe key `schedule:<id>:<tick, RFC 3339 UTC>` and moves `next_tick` on in the
-- same transaction, so any number of schedulers fire each tick exactly once.
CREATE TABLE schedules (
    id              uuid        PRIMARY KEY,
    tenant_id       text        NOT NULL CHECK (tenant_id <> ''),
    name            text        NOT NULL,
    kind            text        NOT NULL,
    -- Checked against the kind when the schedule was added, like an enqueue's.
    input           jsonb       NOT NULL,
    lane            text        NOT NULL DEFAULT 'interactive' CHECK (lane IN ('interactive', 'batch')),
    priority        smallint    NOT NULL DEFAULT 0,
    max_attempts    integer     NOT NULL CHECK (max_attempts > 0),
    -- Either a cron expression and its time zone, or an interval in seconds.
    cron            text,
    time_zone       text,
    interval_secs   bigint      CHECK (interval_secs > 0),
    overlap         text        NOT NULL CHECK (overlap IN ('skip', 'buffer_one', 'allow')),
    -- After downtime, a tick at most this old still fires; older ones are skipped and counted.
    catchup_secs    bigint      NOT NULL CHECK (catchup_secs > 0),
    paused          boolean     NOT NULL DEFAULT false,
    -- The next tick to fire (NULL: the expression has no tick left before the year 10000).
    next_tick       timestamptz,
    -- buffer_one: the tick waiting for the previous firing's operation to end.
    buffered_tick   timestamptz,
    -- The latest firing: its tick and its operation (the overlap policies look at it).
    last_tick       timestamptz,
    last_op_id      uuid,
    fired           bigint      NOT NULL DEFAULT 0,
    -- Ticks not fired because the previous firing was unfinished (skip, buffer_one).
    skipped_overlap bigint      NOT NULL DEFAULT 0,
    -- Ticks older than the catch-up window when a scheduler got to them.
    skipped_missed  bigint      NOT NULL DEFAULT 0,
    created_by      text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((cron IS NOT NULL AND time_zone IS NOT NULL AND interval_secs IS NULL)
        OR (cron IS NULL AND time_zone IS NULL AND interval_secs IS NOT NULL)),
    UNIQUE (tenant_id, name)
);

-- The scheduler's pass: due ticks, and buffered ticks waiting for their previous firing.
CREATE INDEX schedules_due ON schedules (next_tick) WHERE NOT paused;
CREATE INDEX schedules_buffered ON schedules (buffered_tick)
    WHERE NOT paused AND buffered_tick IS NOT NULL;

-- Which schedule fired an operation (NULL for everything else). No foreign key: the operations
-- of a deleted schedule keep its id.
ALTER TABLE operations ADD COLUMN schedule_id uuid;
CREATE INDEX operations_schedule ON operations (schedule_id, created_at)
    WHERE schedule_id IS NOT NULL;
