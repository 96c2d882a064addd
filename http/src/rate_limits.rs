//! The rate limit routes: set, remove and list limits on model calls per window (for a model
//! or provider, a tenant, or a key operations name); the same `agentq_app::rate_limits` flows
//! as `agentq limits`.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::rate_limits::{LimitRequest, LimitScope, LimitView};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, QueryParams, body};

/// `GET /v1/rate-limits`'s and `DELETE`'s query: the tenant (an admin's list may name one; a
/// key limit's removal names its tenant).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantQuery {
    tenant: Option<String>,
}

/// The limits the caller may see, each with what its current window holds.
#[derive(Debug, Serialize, JsonSchema)]
pub struct LimitList {
    pub items: Vec<LimitView>,
}

/// What a removal removed.
#[derive(Debug, Serialize, JsonSchema)]
pub struct LimitRemoved {
    pub scope: LimitScope,
    pub name: String,
}

/// `GET /v1/rate-limits`.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<TenantQuery>,
) -> ApiResult<Json<LimitList>> {
    let items = app::rate_limits::list(&state.app, &caller.app(), q.tenant.as_deref()).await?;
    Ok(Json(LimitList { items }))
}

/// `POST /v1/rate-limits`: set (create or replace) a limit.
pub async fn set(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<LimitView>> {
    let req: LimitRequest = body::json(&headers, body).await?;
    Ok(Json(
        app::rate_limits::set(&state.app, &caller.app(), &req).await?,
    ))
}

/// `DELETE /v1/rate-limits/{scope}/{name}`.
pub async fn delete(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params((scope, name)): Params<(String, String)>,
    QueryParams(q): QueryParams<TenantQuery>,
) -> ApiResult<Json<LimitRemoved>> {
    let scope = LimitScope::parse(&scope).ok_or_else(|| {
        app::AppError::invalid(
            "scope",
            format!("scope {scope:?}: a rate limit's scope is model, tenant or key"),
        )
    })?;
    let caller = caller.app();
    app::rate_limits::delete(&state.app, &caller, scope, &name, q.tenant.as_deref()).await?;
    Ok(Json(LimitRemoved { scope, name }))
}
