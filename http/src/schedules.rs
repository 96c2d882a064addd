//! The schedule routes: add, list, read, pause, resume and delete schedules, the same
//! `agentq_app::schedules` flows as `agentq schedules` and the console, for an operator of the
//! schedule's tenant (another tenant's schedule is not found). A path's `{id}` is the
//! schedule's id or its name (`agentq_app::names`).

use std::sync::Arc;

use agentq_app as app;
use agentq_app::schedules::{Control, NewSchedule, ScheduleView};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::auth::Caller;
use super::problem::ApiResult;
use super::{ApiState, Params, QueryParams, body};

/// `GET /v1/schedules`'s query: an admin may name one tenant.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    tenant: Option<String>,
}

/// The schedules the caller may see, by tenant and name.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ScheduleList {
    pub items: Vec<ScheduleView>,
}

/// `GET /v1/schedules`.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<ListQuery>,
) -> ApiResult<Json<ScheduleList>> {
    let items = app::schedules::list(&state.app, &caller.app(), q.tenant.as_deref()).await?;
    Ok(Json(ScheduleList { items }))
}

/// `POST /v1/schedules`: 201 with the schedule and its next firings; nothing is written when
/// anything is refused.
pub async fn create(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let new: NewSchedule = body::json(&headers, body).await?;
    let s = app::schedules::add(&state.app, &caller.app(), new).await?;
    let location = format!("/v1/schedules/{}", s.schedule.schedule_id);
    Ok(super::with_location(
        (StatusCode::CREATED, Json(s)).into_response(),
        &location,
    ))
}

/// `GET /v1/schedules/{id}`.
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<ScheduleView>> {
    let caller = caller.app();
    let id = app::names::resolve_schedule(&state.app, &caller, &id, None).await?;
    Ok(Json(app::schedules::find(&state.app, &caller, id).await?))
}

/// `POST /v1/schedules/{id}/pause`.
pub async fn pause(
    state: State<Arc<ApiState>>,
    caller: Caller,
    id: Params<String>,
) -> ApiResult<Json<ScheduleView>> {
    control(state, caller, id, Control::Pause).await
}

/// `POST /v1/schedules/{id}/resume`.
pub async fn resume(
    state: State<Arc<ApiState>>,
    caller: Caller,
    id: Params<String>,
) -> ApiResult<Json<ScheduleView>> {
    control(state, caller, id, Control::Resume).await
}

/// `DELETE /v1/schedules/{id}`: the schedule as it was; its operations stay.
pub async fn delete(
    state: State<Arc<ApiState>>,
    caller: Caller,
    id: Params<String>,
) -> ApiResult<Json<ScheduleView>> {
    control(state, caller, id, Control::Delete).await
}

async fn control(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    what: Control,
) -> ApiResult<Json<ScheduleView>> {
    let caller = caller.app();
    let id = app::names::resolve_schedule(&state.app, &caller, &id, None).await?;
    Ok(Json(
        app::schedules::control(&state.app, &caller, id, what).await?,
    ))
}
