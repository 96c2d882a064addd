//! The pause routes: pause and resume live work (an operation, every operation of a kind, a
//! tenant, a lane or a schedule, or the whole deployment), and list the pauses in force; the
//! same `agentq_app::pauses` flows as `agentq pause` / `resume` / `pauses` and the console.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::pauses::{PauseRequest, PauseView, Paused, Resumed, Target};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, QueryParams, body, page_limit};

/// `GET /v1/pauses`'s query: an admin may name one tenant; a page of `limit` (default 100, at
/// most 1000) continues `after` the previous page's `next_cursor`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    tenant: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

/// A page of the pauses in force the caller may see, oldest first.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PauseList {
    pub items: Vec<PauseView>,
    /// Set when the page is full: pass it as `after` for the next one.
    pub next_cursor: Option<String>,
}

/// The body of a resume, or of one operation's pause (where the reason is required).
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseReason {
    /// Kept in the audit trail (required to pause)
    reason: Option<String>,
    /// Count what it would hold and change nothing (pause only)
    #[serde(default)]
    dry_run: bool,
}

/// `GET /v1/pauses`.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<ListQuery>,
) -> ApiResult<Json<PauseList>> {
    let page = app::pauses::list(
        &state.app,
        &caller.app(),
        q.tenant.as_deref(),
        q.after.as_deref(),
        page_limit(q.limit.as_deref()),
    )
    .await?;
    Ok(Json(PauseList {
        items: page.items,
        next_cursor: page.next_cursor,
    }))
}

/// `POST /v1/pauses`: pause a scope (or count it, `dry_run`).
pub async fn create(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Paused>> {
    let req: PauseRequest = body::json(&headers, body).await?;
    let caller = caller.app();
    let paused = app::pauses::pause(&state.app, &caller, &req.scope, &req.reason, req.dry_run);
    Ok(Json(paused.await?))
}

/// `POST /v1/pauses/{id}/resume`.
pub async fn resume(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Resumed>> {
    let id = app::pauses::parse_id(&id)?;
    let req: PauseReason = body::optional_json(&headers, body).await?;
    let caller = caller.app();
    let resumed = app::pauses::resume(&state.app, &caller, id, req.reason.as_deref());
    Ok(Json(resumed.await?))
}

/// `POST /v1/operations/{id}/pause`.
pub async fn pause_operation(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Paused>> {
    let target = operation(&id)?;
    let req: PauseReason = body::optional_json(&headers, body).await?;
    let reason = req.reason.unwrap_or_default();
    let caller = caller.app();
    let paused = app::pauses::pause(&state.app, &caller, &target, &reason, req.dry_run);
    Ok(Json(paused.await?))
}

/// `POST /v1/operations/{id}/resume`: lifts the operation's own pause.
pub async fn resume_operation(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Resumed>> {
    let target = operation(&id)?;
    let req: PauseReason = body::optional_json(&headers, body).await?;
    let caller = caller.app();
    let resumed = app::pauses::resume_target(&state.app, &caller, &target, req.reason.as_deref());
    Ok(Json(resumed.await?))
}

fn operation(id: &str) -> ApiResult<Target> {
    let op = app::operations::parse_id(id)?;
    Ok(Target {
        op_id: Some(op.0),
        ..Target::default()
    })
}
