//! The batch routes: start a batch, list batches, a batch's progress, its controls (pause,
//! resume — also the rest of a canary — and cancel) and its per-document report: the same
//! `agentq_app::batches` flows as `agentq batch` and the console, for an operator of the
//! batch's tenant. A path's `{id}` is the batch's id or its name (`agentq_app::names`).

use std::sync::Arc;

use agentq_app as app;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::auth::{Caller, Role};
use super::problem::ApiResult;
use super::{ApiState, Params, QueryParams, body, page_limit};

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

/// The body of `POST /v1/batches`: what `agentq batch start` takes.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StartBatch {
    /// Only for admin tokens; others start batches in their own tenant
    tenant: Option<String>,
    /// The kind each document runs (default `doc_migration`)
    kind: Option<String>,
    /// The store documents are read from (registered with `agentq stores add`)
    source: String,
    /// The store documents are written to
    target: String,
    /// The instructions for the model
    instructions: String,
    /// Run only the first N documents, then wait for a resume
    canary: Option<u32>,
    /// Auto-pause window: the newest M outcomes (default 20)
    pause_window: Option<i32>,
    /// Auto-pause when at least this share of the window failed (default 0.5)
    pause_ratio: Option<f32>,
    /// Strings every output must contain
    require: Option<Vec<String>>,
    /// Characters per model call (large documents are split)
    chunk_chars: Option<u32>,
    /// Unique in the tenant, not a UUID: every batch route takes it instead of the id
    name: Option<String>,
    /// A token budget on the batch's operations together: when it cannot cover a model call,
    /// the batch pauses
    budget: Option<app::budgets::BudgetRequest>,
}

/// The batch a path's `{id}` names: its id, or its name in the caller's tenant.
async fn resolve(state: &ApiState, caller: &Caller, id: &str) -> ApiResult<Uuid> {
    Ok(app::names::resolve_batch(&state.app, &caller.app(), id, None).await?)
}

/// `GET /v1/batches`'s query: an admin may name one tenant; `status` one batch status.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    tenant: Option<String>,
    status: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

/// One page of batches, newest first.
#[derive(Debug, Serialize, JsonSchema)]
pub struct BatchPage {
    pub items: Vec<app::batches::Item>,
    /// Pass it as `after` for the next page; none on the last page.
    pub next_cursor: Option<String>,
}

/// `GET /v1/batches`: one keyset page of the batches the caller may see, newest first.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(q): QueryParams<ListQuery>,
) -> ApiResult<Json<BatchPage>> {
    let query = app::batches::ListQuery {
        tenant: q.tenant,
        status: q.status,
    };
    let limit = page_limit(q.limit.as_deref());
    let page =
        app::batches::list(&state.app, &caller.app(), &query, limit, q.after.as_deref()).await?;
    Ok(Json(BatchPage {
        items: page.items.iter().map(app::batches::Item::of).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// `POST /v1/batches`: creates a batch (or finds it again: its id is derived from tenant,
/// kind, stores and instructions) and enqueues one operation per document it is missing; 201
/// when created, 200 for a re-run. A large source takes a while (100,000 documents ≈ 16 s); a
/// start cut short by the request timeout is finished by sending it again.
pub async fn start(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    caller.require(Role::Operator)?;
    let req: StartBatch = body::json(&headers, body).await?;
    let caller = caller.app();
    let tenant = caller.tenant_for_write(req.tenant.as_deref())?;
    state.admit().await?;
    let new = app::batches::NewBatch {
        tenant,
        kind: req.kind.unwrap_or_else(|| "doc_migration".into()),
        source: req.source,
        target: req.target,
        instructions: req.instructions,
        options: app::batches::options(&req.require.unwrap_or_default(), req.chunk_chars),
        canary: req.canary,
        pause_window: req.pause_window.unwrap_or(20),
        pause_ratio: req.pause_ratio.unwrap_or(0.5),
        name: req.name,
        budget: req.budget,
    };
    let started = app::batches::start(
        &state.app,
        &caller,
        new,
        app::batches::CHUNK,
        &app::batches::Quiet,
    )
    .await?;
    let code = if started.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(started.summary())).into_response())
}

/// `GET /v1/batches/{id}/report`: one line per document, enqueued or not.
pub async fn report(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<app::batches::Report>> {
    let id = resolve(&state, &caller, &id).await?;
    Ok(Json(
        app::batches::report(&state.app, &caller.app(), id).await?,
    ))
}

/// `GET /v1/batches/{id}`: totals by status, rate, ETA, token usage, top failures.
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<app::batches::Overview>> {
    let id = resolve(&state, &caller, &id).await?;
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
    let id = resolve(&state, &caller, &id).await?;
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
    let id = resolve(&state, &caller, &id).await?;
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
    let id = resolve(&state, &caller, &id).await?;
    let req: ReasonRequest = body::optional_json(&headers, body).await?;
    let c = app::batches::cancel(&state.app, &caller.app(), id, req.reason.as_deref()).await?;
    Ok(Json(BatchResult {
        batch_id: id,
        outcome: BatchOutcome::Cancelled(c),
    }))
}
