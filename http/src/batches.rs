//! The batch routes: a batch's progress and its controls (pause, resume — also the rest of a
//! canary — and cancel), the same `agentq_app::batches` flows as `agentq batch` and the
//! console, for an operator of the batch's tenant.

use std::sync::Arc;

use agentq_app as app;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, body, parse_id};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    reason: Option<String>,
}

/// `GET /v1/batches/{id}`: totals by status, rate, ETA, token usage, top failures.
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<Value>> {
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
) -> ApiResult<Json<Value>> {
    let id = parse_id(&id, "id")?;
    let req: ReasonBody = body::optional_json(&headers, body).await?;
    app::batches::pause(&state.app, &caller.app(), id, req.reason.as_deref()).await?;
    Ok(Json(json!({ "batch_id": id, "result": "paused" })))
}

/// `POST /v1/batches/{id}/resume`.
pub async fn resume(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let id = parse_id(&id, "id")?;
    let _: ReasonBody = body::optional_json(&headers, body).await?;
    let r = app::batches::resume(&state.app, &caller.app(), id, &app::batches::Quiet).await?;
    Ok(Json(json!({
        "batch_id": id, "result": "resumed", "was": r.was, "enqueued": r.enqueued,
        "redispatched": r.redispatched,
    })))
}

/// `POST /v1/batches/{id}/cancel`.
pub async fn cancel(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let id = parse_id(&id, "id")?;
    let req: ReasonBody = body::optional_json(&headers, body).await?;
    let c = app::batches::cancel(&state.app, &caller.app(), id, req.reason.as_deref()).await?;
    Ok(Json(json!({
        "batch_id": id, "result": "cancelled", "cancelled": c.now, "requested": c.requested,
    })))
}
