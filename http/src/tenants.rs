//! `GET` and `PUT /v1/tenants/{tenant}/kinds`: the kinds a tenant may create operations of,
//! the same `agentq_app::tenants` flows as `agentq tenants kinds`. Reading is for the tenant's
//! own tokens and admins; changing is an admin's (audited). `{tenant}` `*` is the default list.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::tenants::{Allow, TenantKinds};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::Deserialize;

use super::auth::Caller;
use super::problem::{ApiError, ApiResult};
use super::{ApiState, Params, body};

/// `PUT /v1/tenants/{tenant}/kinds`: exactly one of `allow`, `production`, `unset`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "SetTenantKinds")]
pub struct SetTenantKinds {
    /// Allow exactly these kinds (each one the deployment runs; `[]` allows none).
    #[serde(default)]
    pub allow: Option<Vec<String>>,
    /// Allow every kind the deployment runs that is not for tests, as of now.
    #[serde(default)]
    pub production: bool,
    /// Remove the tenant's own list: the default list applies (for `*`: every kind).
    #[serde(default)]
    pub unset: bool,
}

/// `GET /v1/tenants/{tenant}/kinds`.
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(tenant): Params<String>,
) -> ApiResult<Json<TenantKinds>> {
    Ok(Json(
        app::tenants::kinds(&state.app, &caller.app(), &tenant).await?,
    ))
}

/// `PUT /v1/tenants/{tenant}/kinds`: the tenant's kinds after the change, with the schedules it
/// paused.
pub async fn set(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(tenant): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<TenantKinds>> {
    let req: SetTenantKinds = body::json(&headers, body).await?;
    let allow = match (req.allow, req.production, req.unset) {
        (Some(kinds), false, false) => Allow::Kinds(kinds),
        (None, true, false) => Allow::Production,
        (None, false, true) => Allow::Unset,
        _ => {
            return Err(ApiError::unprocessable(
                "give exactly one of \"allow\" (a list of kinds), \"production\": true or \
                 \"unset\": true",
            ));
        }
    };
    Ok(Json(
        app::tenants::set_kinds(&state.app, &caller.app(), &tenant, allow).await?,
    ))
}
