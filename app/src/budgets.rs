//! Token budgets, for operators: set or raise an operation's or a batch's budget, let an
//! operation's next refused call through once, and read the budgets over an operation. The
//! same flows for `agentq budget`, the API and the console.
//!
//! A raise (or an allow-once) of an operation waiting for its budget queues it again at once;
//! a batch its budget paused stays paused until an operator resumes it (`batches::resume`),
//! so that a raise can be made before anything runs again.

use agentq_core::db::budgets::{self, On, Spec};
pub use agentq_core::db::budgets::{BudgetView, Measure, WAITING_FOR};
use agentq_core::dispatch::Target;
use agentq_core::operation::OperationId;
use uuid::Uuid;

use crate::{App, AppError, Caller, Result, Role};

/// A budget as asked for: `tokens` of `measure` (default `total`); an operation it refuses
/// waits `timeout_secs` (default a day) for a raise.
#[derive(Clone, Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetRequest {
    pub tokens: i64,
    /// `input` (prompt tokens), `output` (completion tokens) or `total` (default).
    pub measure: Option<Measure>,
    /// How long an operation this budget refuses waits for a raise before it is dead
    /// (`budget_exceeded`); default 86400.
    pub timeout_secs: Option<i32>,
}

impl BudgetRequest {
    /// The budget it asks for, checked (the message names the field as the API does).
    pub fn spec(&self) -> Result<Spec> {
        self.over(None)
    }

    /// The budget it asks for in place of `existing`: what it leaves out (the measure, the
    /// timeout) stays as it was, so a raise is only a raise.
    fn over(&self, existing: Option<&BudgetView>) -> Result<Spec> {
        let spec = Spec {
            tokens: self.tokens,
            measure: self
                .measure
                .or_else(|| existing.and_then(|b| Measure::parse(&b.measure)))
                .unwrap_or(Measure::Total),
            timeout_secs: self
                .timeout_secs
                .or(existing.map(|b| b.timeout_secs))
                .unwrap_or(budgets::DEFAULT_TIMEOUT_SECS),
        };
        budgets::check(&spec).map_err(|(field, m)| AppError::invalid(field, m))?;
        Ok(spec)
    }
}

/// What a set did.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct BudgetSet {
    pub budget: BudgetView,
    /// The operation (a tenant's: some operation) was waiting for a budget and is queued
    /// again.
    pub resumed: bool,
    /// The batch is paused (by its budget, or by an operator): `batch resume` runs it again.
    pub batch_paused: bool,
}

impl BudgetSet {
    /// In words, for the command line and the console.
    pub fn summary(&self) -> String {
        let b = &self.budget;
        let mut s = format!(
            "budget {} {} tokens ({} spent, {} held)",
            b.limit_tokens, b.measure, b.spent_tokens, b.held_tokens
        );
        if self.resumed {
            s.push_str("; the operation waiting for it is queued again");
        }
        if self.batch_paused {
            s.push_str("; the batch is paused: `agentq batch resume` runs it again");
        }
        s
    }
}

/// Sets (or raises) operation `op`'s budget; if it waits for its budget it is queued again.
pub async fn set_for_operation(
    app: &App,
    caller: &Caller,
    op: OperationId,
    request: &BudgetRequest,
    reason: Option<&str>,
) -> Result<BudgetSet> {
    caller.require(Role::Operator)?;
    request.spec()?;
    let found = crate::operations::find(app, caller, op).await?;
    let existing = budgets::over(&app.pool, op.0).await?;
    let spec = request.over(existing.iter().find(|b| b.scope == "operation"))?;
    let budget = budgets::set(
        &app.pool,
        &found.tenant,
        On::Operation(op.0),
        spec,
        &caller.actor,
        reason,
    )
    .await?;
    let resumed = lift(app, op.0).await?;
    Ok(BudgetSet {
        budget,
        resumed,
        batch_paused: false,
    })
}

/// Sets (or raises) the budget of the batch `batch` names (its id or its name).
pub async fn set_for_batch(
    app: &App,
    caller: &Caller,
    batch: &str,
    tenant: Option<&str>,
    request: &BudgetRequest,
    reason: Option<&str>,
) -> Result<BudgetSet> {
    request.spec()?;
    let id = crate::names::resolve_batch(app, caller, batch, tenant).await?;
    caller.require(Role::Operator)?;
    let found = agentq_core::db::batches::find_batch(&app.pool, id, caller.scope())
        .await?
        .ok_or_else(|| AppError::NotFound(format!("no batch {id}")))?;
    let spec = request.over(budgets::of_batch(&app.pool, id).await?.as_ref())?;
    let budget = budgets::set(
        &app.pool,
        &found.tenant,
        On::Batch(id),
        spec,
        &caller.actor,
        reason,
    )
    .await?;
    // Children of its documents that wait for it go on (the documents resume with the batch).
    for w in budgets::lift_tree_batch(&app.pool, id).await? {
        crate::operations::dispatch(app, &Target::from(w)).await;
    }
    Ok(BudgetSet {
        budget,
        resumed: false,
        batch_paused: found.status == agentq_core::state::BatchStatus::Paused,
    })
}

/// Sets (or raises) `tenant`'s budget per period of `period_secs` (an admin's act); every
/// operation of the tenant waiting for a budget is queued again (one another budget still
/// refuses waits again).
pub async fn set_for_tenant(
    app: &App,
    caller: &Caller,
    tenant: &str,
    period_secs: i32,
    request: &BudgetRequest,
    reason: Option<&str>,
) -> Result<BudgetSet> {
    caller.require(Role::Admin)?;
    let spec = request.spec()?;
    agentq_core::operation::TenantId::parse(tenant)
        .map_err(|e| AppError::invalid("tenant", format!("tenant {tenant:?}: {e}")))?;
    if !(60..=budgets::MAX_TIMEOUT_SECS).contains(&period_secs) {
        return Err(AppError::invalid(
            "/period_secs",
            format!(
                "a tenant's budget period is 60 s to {} s (30 days) (got {period_secs})",
                budgets::MAX_TIMEOUT_SECS
            ),
        ));
    }
    let budget = budgets::set(
        &app.pool,
        tenant,
        On::Tenant { period_secs },
        spec,
        &caller.actor,
        reason,
    )
    .await?;
    let woken = budgets::lift_tenant(&app.pool, tenant).await?;
    let resumed = !woken.is_empty();
    for w in woken {
        crate::operations::dispatch(app, &Target::from(w)).await;
    }
    Ok(BudgetSet {
        budget,
        resumed,
        batch_paused: false,
    })
}

/// Lets operation `op`'s next call its own budget refuses through, once, and queues it again
/// if it waits for its budget.
pub async fn allow_once(
    app: &App,
    caller: &Caller,
    op: OperationId,
    reason: Option<&str>,
) -> Result<bool> {
    caller.require(Role::Operator)?;
    crate::operations::find(app, caller, op).await?;
    if !budgets::allow_once(&app.pool, op.0, &caller.actor, reason).await? {
        return Err(AppError::Conflict(format!(
            "operation {op} has no token budget: there is nothing to let through"
        )));
    }
    lift(app, op.0).await
}

/// The budgets over operation `op`: its own, then its batch's.
pub async fn over_operation(
    app: &App,
    caller: &Caller,
    op: OperationId,
) -> Result<Vec<BudgetView>> {
    crate::operations::find(app, caller, op).await?;
    Ok(budgets::over(&app.pool, op.0).await?)
}

/// The budget per period of `tenant` (a non-admin's own when left out): what it allows, what
/// the current period has spent and held, and when the period ends; not found when it has none.
pub async fn of_tenant(app: &App, caller: &Caller, tenant: Option<&str>) -> Result<BudgetView> {
    let tenant = caller.tenant_for_write(tenant)?;
    budgets::of_tenant(&app.pool, &tenant)
        .await?
        .ok_or_else(|| {
            AppError::NotFound(format!(
                "tenant {tenant:?} has no token budget; an admin sets one with `agentq budget set \
             --tenant {tenant} --period 1d --budget-tokens N`"
            ))
        })
}

/// Queues `op` again if it waits for a budget, and the operations below it in its tree that
/// do (its budget is over them), and dispatches them; whether `op` itself was.
async fn lift(app: &App, op: Uuid) -> Result<bool> {
    let woken = budgets::lift(&app.pool, op).await?;
    let itself = woken.iter().any(|w| w.id == op);
    for w in woken {
        crate::operations::dispatch(app, &Target::from(w)).await;
    }
    Ok(itself)
}
