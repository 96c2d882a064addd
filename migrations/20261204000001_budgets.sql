-- Token budgets: one on an operation or on a batch (its operations together). Every model call
-- of an operation under a budget first holds its estimated tokens (`budget_holds`) against
-- each budget over it, in a transaction that locks the budget rows; a call whose estimate does
-- not fit is never sent. The call's reported usage then replaces its hold in `spent_tokens`
-- (a call with no reported usage is charged its estimate). A hold left by a run that crashed
-- mid-call still counts; the operation's next call charges it as spent (by estimate).
CREATE TABLE budgets (
    id             uuid        PRIMARY KEY,
    tenant_id      text        NOT NULL,
    op_id          uuid        REFERENCES operations ON DELETE CASCADE,
    batch_id       uuid        REFERENCES batches ON DELETE CASCADE,
    -- Which tokens count: prompt (input), completion (output), or both.
    measure        text        NOT NULL DEFAULT 'total'
                               CHECK (measure IN ('input', 'output', 'total')),
    limit_tokens   bigint      NOT NULL CHECK (limit_tokens > 0),
    spent_tokens   bigint      NOT NULL DEFAULT 0 CHECK (spent_tokens >= 0),
    -- Calls charged by their estimate (no usage reported, or cut short by a crash).
    estimated_calls integer    NOT NULL DEFAULT 0,
    -- How long an operation refused by its own budget waits for a raise before it is dead
    -- (`budget_exceeded`).
    timeout_secs   integer     NOT NULL DEFAULT 86400 CHECK (timeout_secs > 0),
    -- When it first refused a call since it was set or last raised.
    exceeded_at    timestamptz,
    -- An operator's "resume once": the next refused call is let through, once.
    allow_once     boolean     NOT NULL DEFAULT false,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((op_id IS NULL) <> (batch_id IS NULL))
);
CREATE UNIQUE INDEX budgets_op ON budgets (op_id) WHERE op_id IS NOT NULL;
CREATE UNIQUE INDEX budgets_batch ON budgets (batch_id) WHERE batch_id IS NOT NULL;

CREATE TABLE budget_holds (
    call_id   uuid        NOT NULL,
    budget_id uuid        NOT NULL REFERENCES budgets ON DELETE CASCADE,
    op_id     uuid        NOT NULL,
    -- The attempt (epoch) that made the call: a hold of an earlier epoch is a crashed call's.
    epoch     bigint      NOT NULL,
    -- The estimate in the budget's measure.
    tokens    bigint      NOT NULL,
    held_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (call_id, budget_id)
);
CREATE INDEX budget_holds_budget ON budget_holds (budget_id);
CREATE INDEX budget_holds_op ON budget_holds (op_id);
