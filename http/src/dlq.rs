//! The DLQ operator routes: the same listing, grouping, details and actions as `agentq dlq`
//! (one implementation, in `agentq_app::dlq`), scoped to the caller's tenant
//! and audited under the token's prefix.

use std::sync::Arc;

use agentq_app as app;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::auth::{Caller, Role};
use super::problem::{ApiError, ApiResult};
use super::{ApiState, Params, QueryParams, body, page_limit, parse_id};

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

/// One page of dead letters, newest first.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DeadLetterPage {
    pub items: Vec<app::dlq::Listed>,
    /// Pass it as `after` for the next page; none on the last page.
    pub next_cursor: Option<String>,
}

/// Open dead letters grouped by class, kind and reason fingerprint, the largest group first.
#[derive(Debug, Serialize, JsonSchema)]
pub struct DeadLetterStats {
    pub groups: Vec<app::dlq::StatRow>,
}

/// `GET /v1/dlq`: one keyset page, newest first.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<FilterQuery>,
) -> ApiResult<Json<DeadLetterPage>> {
    let page = app::dlq::list(
        &state.app,
        &caller.app(),
        q.query(),
        page_limit(q.limit.as_deref()),
        q.after.as_deref(),
    )
    .await?;
    Ok(Json(DeadLetterPage {
        items: page.items.iter().map(app::dlq::listed).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// `GET /v1/dlq/stats`: open dead letters grouped by class, kind and reason fingerprint.
pub async fn stats(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<FilterQuery>,
) -> ApiResult<Json<DeadLetterStats>> {
    if q.limit.is_some() || q.after.is_some() {
        return Err(ApiError::bad_request(
            "stats takes filters only, not limit or after",
        ));
    }
    let groups = app::dlq::stats(&state.app, &caller.app(), q.query()).await?;
    Ok(Json(DeadLetterStats { groups }))
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
) -> ApiResult<Json<app::dlq::Acted>> {
    let id = parse_id(id, "id")?;
    let acted = app::dlq::act(&state.app, &caller.app(), id, request, reason).await?;
    Ok(Json(acted))
}

/// The optional body of a retry.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryRequest {
    /// RFC 7386 merge patch applied to the input
    patch_input: Option<Value>,
    /// Run it on this version of its kind (a live worker must run it): the journal is replayed
    /// on that version and, from the first step it asks for differently, runs anew
    to_version: Option<String>,
    /// Kept in the audit trail
    reason: Option<String>,
}

/// `POST /v1/dlq/{id}/retry`, optionally with an RFC 7386 merge patch of the input.
pub async fn retry(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<app::dlq::Acted>> {
    caller.require(Role::Operator)?;
    let req: RetryRequest = body::optional_json(&headers, body).await?;
    let request = app::dlq::Request::Retry {
        patch: req.patch_input,
        to_version: req.to_version,
    };
    act(&state, &caller, &id, request, req.reason).await
}

/// What happened at an `unknown_side_effect` step.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveRequest {
    /// Whether the step's side effect happened
    happened: bool,
    /// What the step returned, if it happened
    output: Option<Value>,
    /// Kept in the audit trail
    reason: Option<String>,
}

/// `POST /v1/dlq/{id}/resolve`: what happened at an `unknown_side_effect` step.
pub async fn resolve(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<app::dlq::Acted>> {
    caller.require(Role::Operator)?;
    let req: ResolveRequest = body::json(&headers, body).await?;
    let request = app::dlq::Request::Resolve {
        happened: req.happened,
        output: req.output,
    };
    act(&state, &caller, &id, request, req.reason).await
}

/// Why a dead letter is discarded.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DiscardRequest {
    /// Kept in the audit trail
    #[schemars(length(min = 1))]
    reason: String,
}

/// `POST /v1/dlq/{id}/discard`, with the reason kept in the audit trail.
pub async fn discard(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<app::dlq::Acted>> {
    caller.require(Role::Operator)?;
    let req: DiscardRequest = body::json(&headers, body).await?;
    act(
        &state,
        &caller,
        &id,
        app::dlq::Request::Discard,
        Some(req.reason),
    )
    .await
}
