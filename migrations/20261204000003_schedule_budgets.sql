-- A schedule's token budget: every operation it fires is born with a budget of its own
-- (`budgets`, scope operation), as an enqueue with `budget` is.
ALTER TABLE schedules
    ADD COLUMN budget_tokens       bigint  CHECK (budget_tokens > 0),
    ADD COLUMN budget_measure      text    CHECK (budget_measure IN ('input', 'output', 'total')),
    ADD COLUMN budget_timeout_secs integer CHECK (budget_timeout_secs > 0),
    ADD CHECK ((budget_tokens IS NULL) = (budget_measure IS NULL)
               AND (budget_tokens IS NULL) = (budget_timeout_secs IS NULL));
