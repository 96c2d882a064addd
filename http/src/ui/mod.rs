//! The operator console at `/ui`: server-rendered HTML pages over the same application layer
//! as the CLI and the JSON API (`agentq_app::operations::decide`, `agentq_app::dlq::act`,
//! `agentq_app::batches::pause` / `resume`, `agentq_app::schedules`, `agentq_app::pauses`), so the three never
//! disagree.
//!
//! Invariants kept here:
//! - A session is a random id in an HttpOnly, SameSite=Strict cookie, mapped in memory to the
//!   token it was opened with; the token never leaves the server, and it is re-checked on every
//!   request (a revoked token ends its sessions). Producer tokens cannot open one.
//! - Every form POST carries the session's CSRF token, and a cross-site `Origin` or
//!   `Sec-Fetch-Site` is refused before any handler runs.
//! - Every query takes the session's tenant scope (`Caller::scope`): another tenant's id is
//!   "not found". An operation's input, result and step outputs show on its own page only,
//!   each view audited (`reveal_payloads`) and redacted (`agentq_app::redact`).
//! - Pages are maud templates (`html.rs` and each page's module): every value spliced into one
//!   is escaped, and no page uses `PreEscaped`.
//! - A form POST is written once ([`form::FormPost`]): CSRF checked, outcome flashed, redirect.
//! - The console names no `agentq_core::db`: its reads are `agentq_app::console`, its token
//!   lookup `agentq_app::access::authenticate`.

mod approvals;
mod batches;
mod budgets;
mod dlq;
mod form;
mod html;
mod kinds;
mod limits;
mod operation;
mod operations;
mod overview;
mod pauses;
mod schedules;
mod session;
mod versions;

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};

use super::ApiState;

pub use session::Sessions;

/// What the console's handlers share: the API's state and the sessions.
pub struct UiState {
    api: Arc<ApiState>,
    sessions: Sessions,
}

/// The console's routes under `/ui`, with their own state (merged into the API's router).
pub fn router<S>(api: Arc<ApiState>) -> Router<S> {
    let state = Arc::new(UiState {
        api,
        sessions: Sessions::default(),
    });
    Router::new()
        .route("/ui", get(overview::overview))
        .route("/ui/", get(|| async { Redirect::to("/ui") }))
        .route("/ui/console.css", get(html::stylesheet))
        .route("/ui/login", get(session::login_page).post(session::login))
        .route("/ui/logout", post(session::logout))
        .route("/ui/operations", get(operations::list))
        .route("/ui/operations/{id}", get(operation::show))
        .route("/ui/operations/{id}/reveal", post(operation::reveal))
        .route("/ui/operations/{id}/approve", post(approvals::approve))
        .route("/ui/operations/{id}/reject", post(approvals::reject))
        .route("/ui/operations/{id}/signal", post(operation::signal))
        .route("/ui/operations/{id}/cancel", post(operation::cancel))
        .route("/ui/operations/{id}/pause", post(pauses::pause_operation))
        .route("/ui/operations/{id}/budget", post(budgets::raise))
        .route(
            "/ui/operations/{id}/budget/allow-once",
            post(budgets::allow_once),
        )
        .route("/ui/operations/{id}/resume", post(pauses::resume_operation))
        .route("/ui/approvals", get(approvals::list))
        .route("/ui/batches", get(batches::list))
        .route("/ui/versions", get(versions::report))
        .route("/ui/kinds", get(kinds::list))
        .route("/ui/limits", get(limits::list))
        .route("/ui/batches/{id}/pause", post(batches::pause))
        .route("/ui/batches/{id}/resume", post(batches::resume))
        .route("/ui/batches/{id}/cancel", post(batches::cancel))
        .route("/ui/schedules", get(schedules::list))
        .route("/ui/schedules/{id}/pause", post(schedules::pause))
        .route("/ui/schedules/{id}/resume", post(schedules::resume))
        .route("/ui/schedules/{id}/delete", post(schedules::delete))
        .route("/ui/pauses", get(pauses::list).post(pauses::create))
        .route("/ui/pauses/{id}/resume", post(pauses::resume))
        .route("/ui/dlq", get(dlq::inbox))
        .route("/ui/dlq/{id}/retry", post(dlq::retry))
        .route("/ui/dlq/{id}/resolve", post(dlq::resolve))
        .route("/ui/dlq/{id}/discard", post(dlq::discard))
        .layer(middleware::from_fn(guard))
        .with_state(state)
}

/// Every console response: refuse cross-site form posts, and add the security headers (no
/// caching of pages that may hold revealed payloads, no framing, no foreign scripts or styles).
async fn guard(req: Request, next: Next) -> Response {
    if req.method() == Method::POST
        && let Some(why) = cross_site(&req)
    {
        return html::error_page(StatusCode::FORBIDDEN, &why);
    }
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}

/// Why a POST is refused as cross-site, if it is: a `Sec-Fetch-Site` other than same-origin
/// (or none: typed by the user), or an `Origin` whose host is not this request's `Host`.
fn cross_site(req: &Request) -> Option<String> {
    let headers = req.headers();
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or("");
        if site != "same-origin" && site != "none" {
            return Some(format!(
                "cross-site form post refused (Sec-Fetch-Site: {site}); use the console's own forms"
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        let origin_host = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .unwrap_or("");
        if origin_host.is_empty() || origin_host != host {
            return Some(format!(
                "cross-origin form post refused (Origin {origin} is not this server); use the \
                 console's own forms"
            ));
        }
    }
    None
}

/// A console failure, answered as an HTML page.
#[derive(Debug)]
pub struct UiError {
    status: StatusCode,
    message: String,
}

impl UiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn not_found(what: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, what)
    }

    fn bad_request(what: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, what)
    }

    /// A failure: logged with its details, answered as a 500 naming the request.
    fn internal(e: &dyn std::fmt::Display, what: &str) -> Self {
        let id = super::problem::request_id().unwrap_or_default();
        tracing::error!(error = %e, "console: {what}");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("internal error (request {id}); the details are in the server log"),
        )
    }
}

/// A page whose application-layer call was refused: the status the API answers
/// ([`crate::problem::status_of`], the one mapping), with the message as the page. A failure
/// (the database's) is a page naming the request, its details only in the log.
impl From<agentq_app::AppError> for UiError {
    fn from(e: agentq_app::AppError) -> Self {
        let status = crate::problem::status_of(&e);
        if let agentq_app::AppError::Db(_) = e {
            let mut page = Self::internal(&e, "database error");
            page.status = status;
            return page;
        }
        Self::new(status, e.to_string())
    }
}

impl From<anyhow::Error> for UiError {
    fn from(e: anyhow::Error) -> Self {
        Self::internal(&e, "internal error")
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        html::error_page(self.status, &self.message)
    }
}

/// The result of a console handler.
pub type UiResult<T = Response> = Result<T, UiError>;
