//! Operations: enqueue (with Idempotency-Key), list and search, read, journal, signals, cancel.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::operations::EnqueueRequest;
use agentq_core::operation::{Lane, OperationId, Status, StepView, input_sha256};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::auth::{Caller, Role};
use super::problem::{ApiError, ApiResult, request_id};
use super::{ApiState, Params, QueryParams, body, page_limit, parse_id};

/// The body of `POST /v1/operations`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOperation {
    /// A job kind this deployment runs
    kind: String,
    /// The job's input (≤ 1 MiB)
    input: Value,
    /// Only for admin tokens; others enqueue in their own tenant
    tenant: Option<String>,
    /// Operations sharing it run one at a time, in order
    ordering_key: Option<String>,
    /// With `concurrency_limit`: the tenant's operations sharing it run at most that many at once
    concurrency_key: Option<String>,
    #[schemars(range(min = 1, max = 1000))]
    concurrency_limit: Option<i32>,
    /// Its model calls count against the tenant's rate limits of this key
    rate_key: Option<String>,
    /// `interactive` unless said otherwise; interactive work never waits behind batch work
    lane: Option<Lane>,
    #[schemars(range(min = 1, max = 1000))]
    max_attempts: Option<i32>,
    /// Not started before this instant
    run_at: Option<DateTime<Utc>>,
    /// Dead with `deadline_exceeded` if not finished by then
    deadline: Option<DateTime<Utc>>,
    /// A token budget: a model call it cannot cover is not sent, and the operation waits for
    /// a raise (`budget_exceeded` after `timeout_secs`)
    budget: Option<agentq_app::budgets::BudgetRequest>,
    /// Debounce on this key (1-256 characters, with `debounce`): while the tenant's operation
    /// of the key is pending (queued, not started), an enqueue naming it replaces its input and
    /// pushes its start back to now + `debounce`, never past its first arrival + `max_delay`
    debounce_key: Option<String>,
    /// The debounce window: a duration such as `500ms`, `2s`, `5m` (more than 0, at most 1 day)
    debounce: Option<String>,
    /// The latest start after the key's first arrival (at least the window; default 10 windows)
    max_delay: Option<String>,
    /// When the key's operation has started: `queue` (default: a new pending operation),
    /// `skip` (answer with the started one), `cancel_running` (cancel it, then a new pending one)
    on_running: Option<String>,
}

/// The answer to an accepted enqueue or webhook delivery.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Accepted {
    pub op_id: OperationId,
    pub status: Status,
    /// False when the Idempotency-Key or webhook-id named an operation already.
    pub created: bool,
    /// Where to read the operation (also the Location header).
    pub status_url: String,
    /// Where to follow its events.
    pub events_url: String,
    /// A debounced enqueue or delivery: what it did (joined the key's pending operation, made
    /// it, or was skipped for the key's running one) and when the operation starts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub debounce: Option<app::debounce::Answer>,
}

/// A page of an operation's journal (`?after=&limit=`).
#[derive(Debug, Serialize, JsonSchema)]
pub struct Steps {
    pub op_id: OperationId,
    /// Oldest first: at most `limit` (default 100, at most 1000) and about 1 MiB of outputs.
    pub steps: Vec<StepView>,
    /// Pass as `after` for the next page; null on the last page.
    pub next_after: Option<i32>,
}

/// `GET /v1/operations/{id}/steps`'s query.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepsQuery {
    after: Option<String>,
    limit: Option<String>,
}

/// What a sent signal did.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SignalResult {
    pub op_id: OperationId,
    pub signal: String,
    pub result: Delivery,
}

/// Whether a signal reached its operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// The operation was waiting for it and is queued again.
    Delivered,
    /// Kept until the operation waits for it.
    Kept,
}

impl From<&app::operations::Signalled> for Delivery {
    fn from(s: &app::operations::Signalled) -> Self {
        match s {
            app::operations::Signalled::Delivered => Delivery::Delivered,
            app::operations::Signalled::Kept { .. } => Delivery::Kept,
        }
    }
}

/// What a cancel did.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CancelResult {
    pub op_id: OperationId,
    pub result: Cancellation,
}

/// How an operation is cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Cancellation {
    /// It was queued, sleeping or waiting: cancelled now.
    Cancelled,
    /// It is running: its worker stops it at the next step boundary.
    Requested,
}

impl From<app::operations::Cancelled> for Cancellation {
    fn from(c: app::operations::Cancelled) -> Self {
        match c {
            app::operations::Cancelled::Now => Cancellation::Cancelled,
            app::operations::Cancelled::Requested => Cancellation::Requested,
        }
    }
}

/// Longest accepted Idempotency-Key.
const MAX_IDEMPOTENCY_KEY: usize = 256;

fn idempotency_key(headers: &HeaderMap) -> ApiResult<Option<String>> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let bad = || {
        ApiError::bad_request(format!(
            "Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY} printable ASCII characters"
        ))
        .field("Idempotency-Key")
    };
    let s = v.to_str().map_err(|_| bad())?.trim();
    if s.is_empty() || s.len() > MAX_IDEMPOTENCY_KEY || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad());
    }
    Ok(Some(s.to_string()))
}

/// Where to watch an operation.
fn links(op: OperationId) -> (String, String) {
    let status = format!("/v1/operations/{op}");
    let events = format!("{status}/events");
    (status, events)
}

/// `POST /v1/operations`: 202 when created, 200 when the Idempotency-Key names it already.
pub async fn create(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    caller.require(Role::Producer)?;
    body::require_json(&headers)?;
    let bytes = body::bytes(body).await?;
    let value = body::parse_value(&bytes)?;
    if !value.is_object() {
        return Err(ApiError::unprocessable(
            "the body must be a JSON object such as {\"kind\": \"echo\", \"input\": {\"text\": \"hi\"}}",
        ));
    }
    let fingerprint = input_sha256(&value);
    no_priority(&value)?;
    let req: CreateOperation = body::decode(value)?;
    let tenant = caller
        .app()
        .tenant_for_write(req.tenant.as_deref())
        .map_err(|e| ApiError::from(e).field("/tenant"))?;
    let key = idempotency_key(&headers)?;
    let debounce = app::debounce::Request {
        key: req.debounce_key,
        window: req.debounce,
        max_delay: req.max_delay,
        on_running: req.on_running,
    }
    .spec(app::debounce::Fields::API)?;
    state.admit().await?;
    let enqueue = EnqueueRequest {
        tenant,
        kind: req.kind,
        input: req.input,
        dedupe_key: key,
        ordering_key: req.ordering_key,
        concurrency_key: req.concurrency_key,
        concurrency_limit: req.concurrency_limit,
        rate_key: req.rate_key,
        lane: req.lane.unwrap_or_default(),
        max_attempts: req.max_attempts,
        run_at: req.run_at,
        deadline: req.deadline,
        request_id: request_id(),
        traceparent: super::traceparent(),
        fingerprint: Some(fingerprint),
        budget: req.budget.as_ref().map(|b| b.spec()).transpose()?,
        ..EnqueueRequest::default()
    };
    let c = app::create::operation(&state.app, &caller.app(), enqueue, debounce.as_ref()).await?;
    Ok(accepted(c.op_id, c.created, c.status, c.debounce))
}

/// Refuses the `priority` field agentq once accepted and never acted on, saying what acts.
fn no_priority(body: &Value) -> ApiResult<()> {
    if body.get("priority").is_some() {
        return Err(ApiError::unprocessable(
            "there is no priority field: what runs first is chosen by the lane (\"interactive\" \
             never waits behind \"batch\"); drop \"priority\" and set \"lane\"",
        )
        .field("/priority"));
    }
    Ok(())
}

/// The answer to an accepted enqueue: 202 + Location the first time, 200 for a repeat.
pub fn accepted(
    op: OperationId,
    created: bool,
    status: Status,
    debounce: Option<app::debounce::Answer>,
) -> Response {
    let (status_url, events_url) = links(op);
    let code = if created {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    let location = status_url.clone();
    let response = (
        code,
        Json(Accepted {
            op_id: op,
            status,
            created,
            status_url,
            events_url,
            debounce,
        }),
    )
        .into_response();
    super::with_location(response, &location)
}

/// One page of operations, newest first (no inputs, results or error messages).
#[derive(Debug, Serialize, JsonSchema)]
pub struct OperationPage {
    pub items: Vec<app::operations::Listed>,
    /// Pass it as `after` for the next page; none on the last page.
    pub next_cursor: Option<String>,
}

/// The query parameters of `GET /v1/operations`; `status` may repeat (any of them matches).
pub const LIST_PARAMETERS: [&str; 12] = [
    "tenant",
    "status",
    "kind",
    "batch",
    "schedule",
    "parent",
    "created_after",
    "created_before",
    "finished_after",
    "finished_before",
    "limit",
    "after",
];

/// `GET /v1/operations`: one keyset page of the caller's operations, newest first, filtered.
/// Every parameter but `status` is given at most once; an unknown, repeated or empty one is a
/// 400 naming it, as is every value the application layer refuses.
pub async fn list(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    QueryParams(pairs): QueryParams<Vec<(String, String)>>,
) -> ApiResult<Json<OperationPage>> {
    let mut q = app::operations::ListQuery::default();
    let (mut limit, mut after) = (None, None);
    for (name, value) in pairs {
        let shown: String = name.chars().take(64).collect();
        let refuse =
            |why: &str| Err(ApiError::bad_request(format!("{shown:?} {why}")).field(&shown));
        if value.is_empty() {
            return refuse("is empty: give a value or leave the parameter out");
        }
        let slot = match name.as_str() {
            "status" => {
                q.status.push(value);
                continue;
            }
            "tenant" => &mut q.tenant,
            "kind" => &mut q.kind,
            "batch" => &mut q.batch,
            "schedule" => &mut q.schedule,
            "parent" => &mut q.parent,
            "created_after" => &mut q.created_after,
            "created_before" => &mut q.created_before,
            "finished_after" => &mut q.finished_after,
            "finished_before" => &mut q.finished_before,
            "limit" => &mut limit,
            "after" => &mut after,
            _ => {
                return refuse(&format!(
                    "is not a parameter of this route; it takes {}",
                    LIST_PARAMETERS.join(", ")
                ));
            }
        };
        if slot.replace(value).is_some() {
            return refuse("is given more than once; give it once");
        }
    }
    let page = app::operations::list(
        &state.app,
        &caller.app(),
        &q,
        page_limit(limit.as_deref()),
        after.as_deref(),
    )
    .await?;
    Ok(Json(OperationPage {
        items: page.items.iter().map(app::operations::listed).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// `GET /v1/operations/{id}`'s query: `include=input` (an operator's, audited).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShowQuery {
    include: Option<String>,
}

/// `GET /v1/operations/{id}`: the operation, what it waits for, and with `include=input` its
/// input (`agentq_app::decision::show`).
pub async fn show(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    QueryParams(q): QueryParams<ShowQuery>,
) -> ApiResult<Json<app::decision::Shown>> {
    let op = OperationId(parse_id(&id, "id")?);
    let include = app::decision::Include::parse(q.include.as_deref())?;
    Ok(Json(
        app::decision::show(&state.app, &caller.app(), op, include, "api").await?,
    ))
}

/// `GET /v1/operations/{id}/steps`.
pub async fn steps(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    QueryParams(q): QueryParams<StepsQuery>,
) -> ApiResult<Json<Steps>> {
    let op = OperationId(parse_id(&id, "id")?);
    let after = app::operations::steps_after(q.after.as_deref())?;
    let page = app::operations::steps(
        &state.app,
        &caller.app(),
        op,
        after,
        page_limit(q.limit.as_deref()),
    )
    .await?;
    Ok(Json(Steps {
        op_id: op,
        steps: page.steps,
        next_after: page.next_after,
    }))
}

/// `GET /v1/operations/{id}/why`: the one gate that holds it now, or what it is doing.
pub async fn why(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
) -> ApiResult<Json<app::why::Why>> {
    let op = OperationId(parse_id(&id, "id")?);
    Ok(Json(app::why::why(&state.app, &caller.app(), op).await?))
}

/// `POST /v1/operations/{id}/signals/{name}`: the body is the signal's payload (or null).
pub async fn signal(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params((id, name)): Params<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let op = OperationId(parse_id(&id, "id")?);
    app::operations::check_signal_name(&name)?;
    let payload: Value = body::optional_json(&headers, body).await?;
    let audit = app::operations::Audit {
        action: "signal",
        reason: None,
    };
    let sent =
        app::operations::signal(&state.app, &caller.app(), op, &name, &payload, audit).await?;
    let result = Delivery::from(&sent);
    Ok((
        StatusCode::ACCEPTED,
        Json(SignalResult {
            op_id: op,
            signal: name,
            result,
        }),
    )
        .into_response())
}

/// `POST /v1/operations/{id}/approve` and `/reject`: the approval convention (`agentq
/// approve` / `reject`, the console's buttons), audited as `approve` / `reject`.
pub async fn approve(
    state: State<Arc<ApiState>>,
    caller: Caller,
    id: Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    decide(state, caller, id, headers, body, true).await
}

/// `POST /v1/operations/{id}/reject`.
pub async fn reject(
    state: State<Arc<ApiState>>,
    caller: Caller,
    id: Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    decide(state, caller, id, headers, body, false).await
}

async fn decide(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
    approved: bool,
) -> ApiResult<Response> {
    let op = OperationId(parse_id(&id, "id")?);
    let req: CancelRequest = body::optional_json(&headers, body).await?;
    let sent = app::operations::decide(
        &state.app,
        &caller.app(),
        op,
        approved,
        req.reason.as_deref(),
    )
    .await?;
    let result = Delivery::from(&sent);
    Ok((
        StatusCode::ACCEPTED,
        Json(SignalResult {
            op_id: op,
            signal: "approval".into(),
            result,
        }),
    )
        .into_response())
}

/// The optional body of a cancel, an approval or a rejection.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// Kept in the audit trail
    reason: Option<String>,
}

/// `POST /v1/operations/{id}/cancel`.
pub async fn cancel(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let op = OperationId(parse_id(&id, "id")?);
    let req: CancelRequest = body::optional_json(&headers, body).await?;
    let done =
        app::operations::cancel(&state.app, &caller.app(), op, req.reason.as_deref()).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(CancelResult {
            op_id: op,
            result: done.into(),
        }),
    )
        .into_response())
}
