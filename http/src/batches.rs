//! The batch routes: a batch's progress and its controls (pause, resume — also the rest of a
//! canary — and cancel), the same `agentq_app::batches` flows as `agentq batch` and the
//! console, for an operator of the batch's tenant.

use std::sync::Arc;

use agentq_app as app;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, body, parse_id};

/// The optional body of a batch control.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonRequest {
    /// Kept in the audit trail
    reason: Option<String>,
}

/// What a batch control did.
#[derive(Debug, Serialize, JsonSchema)]
pub struct BatchResult {
    pub batch_id: Uuid,
    #[serde(flatten)]
    pub outcome: BatchOutcome,
}

/// The control's `result`, with what it did.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum BatchOutcome {
    Paused,
    Resumed(app::batches::Resumed),
    Cancelled(app::batches::CancelledBatch),
}

/// `GET /v1/batches/{id}`: totals by status, rate, ETA, token usage, top failures.
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<app::batches::Overview>> {
    let id = parse_id(&id, "id")?;
    Ok(Json(
        app::batches::status(&state.app, &caller.app(), id).await?,
    ))
}

/// `POST /v1/batches/{id}/pause`.
pub async fn pause(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<BatchResult>> {
    let id = parse_id(&id, "id")?;
    let req: ReasonRequest = body::optional_json(&headers, body).await?;
    app::batches::pause(&state.app, &caller.app(), id, req.reason.as_deref()).await?;
    Ok(Json(BatchResult {
        batch_id: id,
        outcome: BatchOutcome::Paused,
    }))
}

/// `POST /v1/batches/{id}/resume`.
pub async fn resume(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<BatchResult>> {
    let id = parse_id(&id, "id")?;
    let _: ReasonRequest = body::optional_json(&headers, body).await?;
    let r = app::batches::resume(&state.app, &caller.app(), id, &app::batches::Quiet).await?;
    Ok(Json(BatchResult {
        batch_id: id,
        outcome: BatchOutcome::Resumed(r),
    }))
}

/// `POST /v1/batches/{id}/cancel`.
pub async fn cancel(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<BatchResult>> {
    let id = parse_id(&id, "id")?;
    let req: ReasonRequest = body::optional_json(&headers, body).await?;
    let c = app::batches::cancel(&state.app, &caller.app(), id, req.reason.as_deref()).await?;
    Ok(Json(BatchResult {
        batch_id: id,
        outcome: BatchOutcome::Cancelled(c),
    }))
}
