-- A tenant's token budget per period (a day, an hour…): every model call of the tenant's
-- operations holds against it too. Its spend starts again at each period's start; an
-- operation it refuses waits for the next period (or a raise), never dead for it.
ALTER TABLE budgets
    ADD COLUMN tenant_scope text,
    ADD COLUMN period_secs  integer CHECK (period_secs > 0),
    ADD COLUMN period_start timestamptz,
    DROP CONSTRAINT budgets_check,
    ADD CHECK (num_nonnulls(op_id, batch_id, tenant_scope) = 1),
    ADD CHECK ((tenant_scope IS NULL) = (period_secs IS NULL)
               AND (tenant_scope IS NULL) = (period_start IS NULL));
CREATE UNIQUE INDEX budgets_tenant ON budgets (tenant_scope) WHERE tenant_scope IS NOT NULL;
