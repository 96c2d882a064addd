//! `GET /v1/kinds`: the deployment's kinds and tools, the same `agentq_app::kinds::list` as
//! `agentq kinds` and the console's Kinds page.

use std::sync::Arc;

use agentq_app as app;
use axum::Json;
use axum::extract::State;

use super::ApiState;
use super::auth::Caller;
use super::problem::ApiResult;

/// `GET /v1/kinds`.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
) -> ApiResult<Json<app::kinds::Kinds>> {
    Ok(Json(app::kinds::list(&state.app, &caller.app()).await?))
}
