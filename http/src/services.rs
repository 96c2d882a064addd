//! The service routes: register, list and remove the services remote kinds run in (the step
//! protocol, docs/protocol.md); the same `agentq_app::services` flows as `agentq services`.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::services::{Checked, Registered, ServiceRequest, ServiceView};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::Serialize;

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, body};

/// The registered services.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ServiceList {
    pub items: Vec<ServiceView>,
}

/// What a check of the services' live manifests found.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ServiceChecks {
    pub items: Vec<Checked>,
}

/// What a removal removed.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ServiceRemoved {
    pub name: String,
}

/// `GET /v1/services`.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
) -> ApiResult<Json<ServiceList>> {
    let items = app::services::list(&state.app, &caller.app()).await?;
    Ok(Json(ServiceList { items }))
}

/// `POST /v1/services`: register a service (or its new manifest).
pub async fn register(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Registered>> {
    let req: ServiceRequest = body::json(&headers, body).await?;
    Ok(Json(
        app::services::register(&state.app, &caller.app(), &req).await?,
    ))
}

/// `POST /v1/services/check`: compare every service's live manifest with its registration.
pub async fn check(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
) -> ApiResult<Json<ServiceChecks>> {
    let items = app::services::check(&state.app, &caller.app(), None).await?;
    Ok(Json(ServiceChecks { items }))
}

/// `DELETE /v1/services/{name}`.
pub async fn remove(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(name): Params<String>,
) -> ApiResult<Json<ServiceRemoved>> {
    app::services::remove(&state.app, &caller.app(), &name).await?;
    Ok(Json(ServiceRemoved { name }))
}
