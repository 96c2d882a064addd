//! agentq-http: the HTTP API and the operator console (`agentq serve`). Producers enqueue,
//! read, signal and cancel; senders deliver signed webhooks; operators work the DLQ, batches
//! and schedules; monitors probe health, readiness and metrics. Handlers parse, call the application
//! layer (`agentq-app`, the same functions as the CLI) and render.
//!
//! Invariants kept here: no handler runs for a caller below its route's access
//! (`routes::enforce`); every route that takes an id filters by the caller's tenant
//! (`auth::Caller::scope`); bad input is answered 4xx before anything is written; a request
//! that cannot be stored is answered 429/503 "not started", never accepted and dropped.

mod auth;
mod batches;
mod body;
mod budgets;
mod dlq;
mod events;
mod kinds;
pub mod meta;
pub mod openapi;
mod operations;
mod pauses;
mod problem;
mod rate_limits;
pub mod routes;
mod schedules;
mod services;
mod tenants;
mod throttle;
mod ui;
mod webhooks;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentq_core::Config;
use axum::Router;
use axum::extract::{FromRequestParts, MatchedPath, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt as _;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use problem::{ApiError, REQUEST_ID};

/// Longest a request other than an event stream may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest single header value, and all headers together.
const MAX_HEADER_BYTES: usize = 8 * 1024;
const MAX_HEADERS_BYTES: usize = 32 * 1024;
/// How long the broker's health is trusted before re-checking.
const PROBE_TTL: Duration = Duration::from_secs(1);

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

tokio::task_local! {
    /// The caller's valid `traceparent` header, if it sent one (set by [`observe`]).
    static INCOMING_TRACEPARENT: Option<String>;
}

/// The `traceparent` an operation created by the current request carries to its worker: the
/// request's own span when spans are exported, else the caller's header passed through.
pub(crate) fn traceparent() -> Option<String> {
    agentq_core::telemetry::current_traceparent()
        .or_else(|| INCOMING_TRACEPARENT.try_with(Clone::clone).ok().flatten())
}

/// What every handler shares.
pub struct ApiState {
    /// The application layer every handler calls, with the pool, producer and dispatcher.
    app: agentq_app::App,
    /// Open event streams, per token and in all (`AGENTQ_STREAMS_PER_TOKEN`, `AGENTQ_STREAMS_MAX`),
    /// and the one poller they share.
    streams: events::Streams,
    broker: Mutex<Option<(Instant, bool)>>,
    metrics: meta::Metrics,
    /// Each token's request rate (`AGENTQ_API_TOKEN_RATE`).
    throttle: throttle::Throttle,
    shutdown: CancellationToken,
}

impl ApiState {
    /// True when the broker was reachable at most [`PROBE_TTL`] ago (probing if needed).
    async fn broker_up(&self) -> bool {
        if let Some((at, up)) = *self.broker.lock().expect("broker probe lock")
            && at.elapsed() < PROBE_TTL
        {
            return up;
        }
        let up = tokio::time::timeout(
            Duration::from_secs(2),
            self.app.dispatcher.with_connection(async |_| Ok(())),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        *self.broker.lock().expect("broker probe lock") = Some((Instant::now(), up));
        up
    }

    /// Refuses new work while the broker is unreachable (the tenant's caps are the application
    /// layer's, `agentq_app::capacity`, which the flows apply).
    async fn admit(&self) -> Result<(), ApiError> {
        if !self.broker_up().await {
            return Err(ApiError::unavailable(
                "the message broker is unavailable; the request was not started: retry later",
                5,
            ));
        }
        Ok(())
    }
}

/// Path parameters, with a problem answer when they cannot be read.
pub struct Params<T>(pub T);

impl<T, S> FromRequestParts<S> for Params<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        if has_nul(parts.uri.path()) {
            return Err(nul_refused("the path"));
        }
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(t)| Params(t))
            .map_err(|e| ApiError::bad_request(format!("the path is not valid: {}", e.body_text())))
    }
}

/// Query parameters, with a problem answer when they cannot be read.
pub struct QueryParams<T>(pub T);

impl<T, S> FromRequestParts<S> for QueryParams<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        if has_nul(parts.uri.query().unwrap_or_default()) {
            return Err(nul_refused("the query string"));
        }
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(t)| QueryParams(t))
            .map_err(|e| {
                ApiError::bad_request(format!("the query string is not valid: {}", e.body_text()))
            })
    }
}

/// True when a percent-encoded URI part decodes to a NUL character (which no stored text may hold).
fn has_nul(raw: &str) -> bool {
    raw.as_bytes()
        .windows(3)
        .any(|w| w[0] == b'%' && w[1] == b'0' && w[2] == b'0')
}

fn nul_refused(what: &str) -> ApiError {
    ApiError::bad_request(format!(
        "{what} contains an encoded NUL character (%00); remove it"
    ))
}

/// `response` with a `Location` header pointing at `url` (none when `url` cannot be a header).
fn with_location(mut response: Response, url: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(url) {
        response
            .headers_mut()
            .insert(axum::http::header::LOCATION, v);
    }
    response
}

/// Parses an id from the path (an operation or dead letter id: a UUID).
fn parse_id(s: &str, field: &str) -> Result<uuid::Uuid, ApiError> {
    agentq_core::OperationId::parse(s)
        .map(|o| o.0)
        .map_err(|e| ApiError::bad_request(e).field(field))
}

/// The page size a list route was asked for: 100 when not given; anything that is not a
/// number is 0, which the application layer refuses naming `limit`.
fn page_limit(limit: Option<&str>) -> i64 {
    match limit {
        None => 100,
        Some(l) => l.parse::<i64>().unwrap_or(0),
    }
}

/// The API's routes, from [`routes::ROUTES`], each behind the check of its access
/// ([`routes::mount`]); shared by `serve`, `dev` and the benchmark.
pub fn router(state: Arc<ApiState>) -> Router {
    // Every route of the table and the console; event streams are exempt from the request
    // timeout (their polls have the database call deadline instead).
    let (mut timed, mut streams) = (Router::new(), Router::new());
    for r in routes::ROUTES {
        if r.path.ends_with("/events") {
            streams = streams.route(r.path, routes::mount(r, &state));
        } else {
            timed = timed.route(r.path, routes::mount(r, &state));
        }
    }
    let timed = timed.layer(middleware::from_fn(timeout));
    Router::new()
        .merge(timed)
        .merge(ui::router(state.clone()).layer(middleware::from_fn(timeout)))
        .merge(streams)
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn(catch_panic))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// `GET /openapi.json`: the document, with this deployment's kinds linked in. (At the crate's
/// root: the route table names it, and `openapi` reads the route table.)
async fn openapi_document(State(state): State<Arc<ApiState>>) -> axum::Json<serde_json::Value> {
    axum::Json(openapi::spec_for(state.app.producer.catalog().as_ref()))
}

async fn unknown_route() -> ApiError {
    ApiError::not_found("no such route; see /openapi.json for the routes this server has")
}

async fn wrong_method() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "this route does not take that method; see /openapi.json",
    )
}

/// A handler that panics (a bug) answers a problem+json 500 naming the request id; `observe`
/// (outside this layer) logs and counts it like any server error, and the server keeps serving.
async fn catch_panic(req: Request, next: Next) -> Response {
    std::panic::AssertUnwindSafe(next.run(req))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| ApiError::internal("the handler panicked").into_response())
}

async fn timeout(req: Request, next: Next) -> Response {
    match tokio::time::timeout(REQUEST_TIMEOUT, next.run(req)).await {
        Ok(r) => r,
        Err(_) => {
            agentq_app::health::abandoned();
            ApiError::unavailable(
                "the request took longer than 30 s and was abandoned; it may or may not have taken \
             effect: retry (with the same Idempotency-Key for an enqueue)",
                1,
            )
            .into_response()
        }
    }
}

fn valid_request_id(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    (!s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':')))
    .then(|| s.to_string())
}

/// Every request: its id (kept from `x-request-id` if valid, else minted), header limits, a
/// span, and the request metrics.
async fn observe(State(state): State<Arc<ApiState>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let request_id = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(valid_request_id)
        .unwrap_or_else(|| format!("req_{}", uuid::Uuid::new_v4().simple()));
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().clone();
    // Bounded: a made-up method is `other` in the span, as in the metrics.
    let method_label = meta::method_label(&method);
    // The request's span is the root of its trace, or a child of the caller's `traceparent`.
    let incoming = req
        .headers()
        .get(agentq_core::telemetry::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(agentq_core::telemetry::valid_traceparent);
    let span = tracing::info_span!(
        "http",
        request_id = %request_id,
        method = method_label,
        %route,
        otel.name = %format_args!("{method_label} {route}"),
        otel.kind = "server",
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    agentq_core::telemetry::set_parent(&span, incoming.as_deref());
    let oversized = req
        .headers()
        .iter()
        .find(|(_, v)| v.len() > MAX_HEADER_BYTES)
        .map(|(k, _)| k.to_string());
    let total: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    let run = async {
        if let Some(name) = oversized {
            return ApiError::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "header-too-large",
                format!("header {name} is longer than {MAX_HEADER_BYTES} bytes"),
            )
            .field(name)
            .into_response();
        }
        if total > MAX_HEADERS_BYTES {
            return ApiError::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "header-too-large",
                format!("the headers total more than {MAX_HEADERS_BYTES} bytes"),
            )
            .into_response();
        }
        next.run(req).await
    };
    let mut response = INCOMING_TRACEPARENT
        .scope(
            incoming,
            REQUEST_ID.scope(
                request_id.clone(),
                tracing::Instrument::instrument(run, span.clone()),
            ),
        )
        .await;
    let status = response.status();
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
    state
        .metrics
        .observe(&method, &route, status.as_u16(), started.elapsed());
    if status.is_server_error() {
        span.in_scope(|| tracing::warn!(status = status.as_u16(), "request failed"));
    }
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(X_REQUEST_ID.clone(), v);
    }
    response
}

/// Builds the API's state over `app` (its pool, producer and dispatcher).
pub fn state(config: &Config, app: agentq_app::App, shutdown: CancellationToken) -> Arc<ApiState> {
    Arc::new(ApiState {
        app,
        streams: events::Streams::new(config.streams_per_token, config.streams_max),
        broker: Mutex::new(None),
        metrics: meta::Metrics,
        throttle: throttle::Throttle::new(config.api_token_rate),
        shutdown,
    })
}

/// Serves the API on `listen` until `shutdown`; prints the bound address once listening.
pub async fn serve(
    config: &Config,
    app: agentq_app::App,
    listen: &str,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await.map_err(|e| {
        anyhow::anyhow!("cannot listen on {listen}: {e}; pick another --listen address")
    })?;
    let addr: SocketAddr = listener.local_addr()?;
    let state = state(config, app, shutdown.clone());
    let router = router(state.clone());
    println!("listening on http://{addr}");
    tracing::info!(%addr, "agentq serve listening");
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    state.app.dispatcher.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use axum::routing::get;

    use super::*;

    #[tokio::test]
    async fn a_panicking_handler_answers_a_problem_500_and_the_server_keeps_serving() {
        async fn boom() -> &'static str {
            panic!("a bug")
        }
        let app = Router::new()
            .route("/boom", get(boom))
            .route("/ok", get(|| async { "ok" }))
            .layer(middleware::from_fn(catch_panic));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        let r = client
            .get(format!("http://{addr}/boom"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 500);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        let ok = client
            .get(format!("http://{addr}/ok"))
            .send()
            .await
            .unwrap();
        assert_eq!(ok.text().await.unwrap(), "ok");
        server.abort();
    }
}
