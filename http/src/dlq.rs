//! The DLQ operator routes: the same listing, grouping, details and actions as `agentq dlq`
//! (one implementation, in `agentq_app::dlq` and `db::dead_letters`), scoped to the caller's tenant
//! and audited under the token's prefix.

use std::sync::Arc;

use agentq_app as app;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::{Caller, Role};
use super::problem::{ApiError, ApiResult};
use super::{ApiState, Params, QueryParams, body, parse_id};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterQuery {
    tenant: Option<String>,
    kind: Option<String>,
    class: Option<String>,
    since: Option<String>,
    batch: Option<String>,
    status: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

impl FilterQuery {
    fn query(&self) -> app::dlq::Query<'_> {
        app::dlq::Query {
            tenant: self.tenant.as_deref(),
            kind: self.kind.as_deref(),
            class: self.class.as_deref(),
            since: self.since.as_deref(),
            batch: self.batch.as_deref(),
            status: self.status.as_deref(),
        }
    }
}

/// `GET /v1/dlq`: one keyset page, newest first.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<FilterQuery>,
) -> ApiResult<Json<Value>> {
    let limit = match q.limit.as_deref() {
        None => 100,
        Some(l) => l.parse::<i64>().unwrap_or(0),
    };
    let page = app::dlq::list(
        &state.app,
        &caller.app(),
        q.query(),
        limit,
        q.after.as_deref(),
    )
    .await?;
    let items: Vec<Value> = page.items.iter().map(app::dlq::listed).collect();
    Ok(Json(
        json!({ "items": items, "next_cursor": page.next_cursor }),
    ))
}

/// `GET /v1/dlq/stats`: open dead letters grouped by class, kind and reason fingerprint.
pub async fn stats(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<FilterQuery>,
) -> ApiResult<Json<Value>> {
    if q.limit.is_some() || q.after.is_some() {
        return Err(ApiError::bad_request(
            "stats takes filters only, not limit or after",
        ));
    }
    let groups = app::dlq::stats(&state.app, &caller.app(), q.query()).await?;
    Ok(Json(json!({ "groups": groups })))
}

/// `GET /v1/dlq/{id}`.
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<app::dlq::Details>> {
    let id = parse_id(&id, "id")?;
    Ok(Json(
        app::dlq::details(&state.app, &caller.app(), id).await?,
    ))
}

async fn act(
    state: &ApiState,
    caller: &Caller,
    id: &str,
    request: app::dlq::Request,
    reason: Option<String>,
) -> ApiResult<Json<Value>> {
    let id = parse_id(id, "id")?;
    let acted = app::dlq::act(&state.app, &caller.app(), id, request, reason).await?;
    Ok(Json(acted.to_json()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBody {
    patch_input: Option<Value>,
    reason: Option<String>,
}

/// `POST /v1/dlq/{id}/retry`, optionally with an RFC 7386 merge patch of the input.
pub async fn retry(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    caller.require(Role::Operator)?;
    let req: RetryBody = body::optional_json(&headers, body).await?;
    let request = app::dlq::Request::Retry {
        patch: req.patch_input,
    };
    act(&state, &caller, &id, request, req.reason).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveBody {
    happened: bool,
    output: Option<Value>,
    reason: Option<String>,
}

/// `POST /v1/dlq/{id}/resolve`: what happened at an `unknown_side_effect` step.
pub async fn resolve(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    caller.require(Role::Operator)?;
    let req: ResolveBody = body::json(&headers, body).await?;
    let request = app::dlq::Request::Resolve {
        happened: req.happened,
        output: req.output,
    };
    act(&state, &caller, &id, request, req.reason).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscardBody {
    reason: String,
}

/// `POST /v1/dlq/{id}/discard`, with the reason kept in the audit trail.
pub async fn discard(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    caller.require(Role::Operator)?;
    let req: DiscardBody = body::json(&headers, body).await?;
    act(
        &state,
        &caller,
        &id,
        app::dlq::Request::Discard,
        Some(req.reason),
    )
    .await
}
