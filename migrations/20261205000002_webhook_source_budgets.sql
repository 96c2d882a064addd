-- A webhook source's token budget: every operation a delivery makes is born with a budget of
-- its own (`budgets`, scope operation), as an enqueue with `budget` is. JSON as
-- `agentq_core::db::budgets::Spec` writes it: {"tokens", "measure", "timeout_secs"}.
ALTER TABLE webhook_sources ADD COLUMN budget jsonb;
