//! The budget routes: set or raise an operation's or a batch's token budget, let an
//! operation's next refused model call through once, read the budgets over an operation; the
//! same `agentq_app::budgets` flows as `agentq budget`.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::budgets::{BudgetRequest, BudgetSet, BudgetView};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, body};

/// The body of a budget's set: the budget, and why.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SetBudget {
    tokens: i64,
    /// `input` (prompt tokens), `output` (completion tokens) or `total` (default)
    measure: Option<app::budgets::Measure>,
    /// How long an operation this budget refuses waits for a raise before it is dead
    /// (`budget_exceeded`); default 86400
    timeout_secs: Option<i32>,
    /// Kept in the audit trail
    reason: Option<String>,
}

impl SetBudget {
    fn budget(&self) -> BudgetRequest {
        BudgetRequest {
            tokens: self.tokens,
            measure: self.measure,
            timeout_secs: self.timeout_secs,
        }
    }
}

/// The body of a tenant's budget: tokens per period.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SetTenantBudget {
    tokens: i64,
    /// `input` (prompt tokens), `output` (completion tokens) or `total` (default)
    measure: Option<app::budgets::Measure>,
    /// The period (60 s to 30 days): the spend starts again at each period's start, periods
    /// aligned to multiples of it since the Unix epoch
    period_secs: i32,
    /// Kept in the audit trail
    reason: Option<String>,
}

/// The optional body of an allow-once.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AllowOnceRequest {
    /// Kept in the audit trail
    reason: Option<String>,
}

/// What an allow-once did.
#[derive(Debug, Serialize, JsonSchema)]
pub struct AllowedOnce {
    /// The operation was waiting for its budget and is queued again.
    pub resumed: bool,
}

/// The budgets over an operation: its own, then its batch's.
#[derive(Debug, Serialize, JsonSchema)]
pub struct BudgetList {
    pub items: Vec<BudgetView>,
}

/// `PUT /v1/operations/{id}/budget`.
pub async fn set_operation(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<BudgetSet>> {
    let op = app::operations::parse_id(&id)?;
    let req: SetBudget = body::json(&headers, body).await?;
    let (caller, budget) = (caller.app(), req.budget());
    let set =
        app::budgets::set_for_operation(&state.app, &caller, op, &budget, req.reason.as_deref());
    Ok(Json(set.await?))
}

/// `PUT /v1/batches/{id}/budget`: `{id}` is the batch's id or its name.
pub async fn set_batch(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<BudgetSet>> {
    let req: SetBudget = body::json(&headers, body).await?;
    let (caller, budget) = (caller.app(), req.budget());
    let set = app::budgets::set_for_batch(
        &state.app,
        &caller,
        &id,
        None,
        &budget,
        req.reason.as_deref(),
    );
    Ok(Json(set.await?))
}

/// `PUT /v1/tenants/{tenant}/budget`: an admin's.
pub async fn set_tenant(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(tenant): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<BudgetSet>> {
    let req: SetTenantBudget = body::json(&headers, body).await?;
    let budget = BudgetRequest {
        tokens: req.tokens,
        measure: req.measure,
        timeout_secs: None,
    };
    let caller = caller.app();
    let set = app::budgets::set_for_tenant(
        &state.app,
        &caller,
        &tenant,
        req.period_secs,
        &budget,
        req.reason.as_deref(),
    );
    Ok(Json(set.await?))
}

/// `GET /v1/tenants/{tenant}/budget`.
pub async fn of_tenant(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(tenant): Params<String>,
) -> ApiResult<Json<BudgetView>> {
    let caller = caller.app();
    let shown = app::budgets::of_tenant(&state.app, &caller, Some(&tenant));
    Ok(Json(shown.await?))
}

/// `POST /v1/operations/{id}/budget/allow-once`.
pub async fn allow_once(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<AllowedOnce>> {
    let op = app::operations::parse_id(&id)?;
    let req: AllowOnceRequest = body::optional_json(&headers, body).await?;
    let caller = caller.app();
    let resumed = app::budgets::allow_once(&state.app, &caller, op, req.reason.as_deref());
    Ok(Json(AllowedOnce {
        resumed: resumed.await?,
    }))
}

/// `GET /v1/operations/{id}/budgets`.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<BudgetList>> {
    let op = app::operations::parse_id(&id)?;
    let items = app::budgets::over_operation(&state.app, &caller.app(), op).await?;
    Ok(Json(BudgetList { items }))
}
