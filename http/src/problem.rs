//! Errors as `application/problem+json` (RFC 9457), each with a detail that says what was
//! wrong and what to do, the field at fault when there is one, and the request id.
//! A 500 says nothing about internals: the cause goes to the log under the request id.

use agentq_app::AppError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::Serialize;

tokio::task_local! {
    /// The id of the request being served (set by the request-id middleware).
    pub static REQUEST_ID: String;
}

/// The current request's id, if called while serving one.
pub fn request_id() -> Option<String> {
    REQUEST_ID.try_with(Clone::clone).ok()
}

/// An error answer as sent: `application/problem+json` (RFC 9457).
#[derive(Debug, Serialize, JsonSchema)]
pub struct Problem {
    /// `https://agentq.dev/problems/` and a stable name of the problem.
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status's reason phrase.
    pub title: String,
    pub status: u16,
    /// What was wrong and what to do
    pub detail: String,
    /// The field, header or parameter at fault
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Quote it when reporting a problem
    pub request_id: Option<String>,
}

/// An error answer.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub slug: &'static str,
    pub detail: String,
    pub field: Option<String>,
    pub retry_after: Option<u64>,
}

/// Result of a handler.
pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, slug: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            slug,
            detail: detail.into(),
            field: None,
            retry_after: None,
        }
    }

    /// Names the field (a JSON pointer, a header or a parameter) at fault.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid-request", detail)
    }

    pub fn unprocessable(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "unprocessable", detail)
    }

    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", detail)
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", detail)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", detail)
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", detail)
    }

    /// 429: the caller is over a limit (queued operations, open streams); nothing was started.
    pub fn busy(detail: impl Into<String>, retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "busy", detail)
        }
    }

    /// 503: a service agentq needs is down; nothing was started.
    pub fn unavailable(detail: impl Into<String>, retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail)
        }
    }

    /// 500: logs the cause under the request id; the answer names only the request id.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        tracing::error!(request_id = request_id().as_deref().unwrap_or("-"), error = %cause, "request failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; nothing about it is shown here: quote the request id to an operator",
        )
    }

    fn title(&self) -> &'static str {
        self.status.canonical_reason().unwrap_or("Error")
    }

    /// The body this error is answered with.
    fn problem(&self) -> Problem {
        Problem {
            kind: format!("https://agentq.dev/problems/{}", self.slug),
            title: self.title().to_string(),
            status: self.status.as_u16(),
            detail: self.detail.clone(),
            field: self.field.clone(),
            request_id: request_id(),
        }
    }
}

/// The HTTP status of an application-layer error: the one mapping of [`AppError`] to a status,
/// which the API's problems ([`ApiError`]'s `From<AppError>`) and the console's pages share.
/// A database failure is 503 when the database is unreachable or exhausted (the request was not
/// started: retry later), else 500.
pub fn status_of(e: &AppError) -> StatusCode {
    match e {
        AppError::Invalid { .. } | AppError::KeyReused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        AppError::Malformed { .. } => StatusCode::BAD_REQUEST,
        AppError::NotFound(_) => StatusCode::NOT_FOUND,
        AppError::Conflict(_) => StatusCode::CONFLICT,
        AppError::Forbidden(_) => StatusCode::FORBIDDEN,
        AppError::Busy { .. } => StatusCode::TOO_MANY_REQUESTS,
        AppError::Db(_) if e.is_unavailable() => StatusCode::SERVICE_UNAVAILABLE,
        AppError::Db(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The application layer's errors as problems: the status of [`status_of`], a stable slug,
/// the field at fault; a database failure's cause goes to the log, not the answer.
impl From<AppError> for ApiError {
    fn from(e: AppError) -> Self {
        let status = status_of(&e);
        match e {
            AppError::Invalid { field, message } => {
                ApiError::new(status, "unprocessable", message).field(field)
            }
            AppError::Malformed { field, message } => {
                ApiError::new(status, "invalid-request", message).field(field)
            }
            AppError::NotFound(m) => ApiError::new(status, "not-found", m).field("id"),
            AppError::Conflict(m) => ApiError::new(status, "conflict", m),
            AppError::Forbidden(m) => ApiError::new(status, "forbidden", m),
            AppError::Busy {
                message,
                retry_after_secs,
            } => ApiError {
                // A cap that waiting does not lift (a count of schedules) says no time.
                retry_after: (retry_after_secs > 0).then_some(retry_after_secs),
                ..ApiError::new(status, "busy", message)
            },
            AppError::KeyReused { key, op_id } => ApiError::new(
                status,
                "idempotency-key-reused",
                format!(
                    "Idempotency-Key {key:?} was already used for operation {op_id} with a \
                     different request; send the same request to get that operation, or use a \
                     new key"
                ),
            )
            .field("Idempotency-Key"),
            AppError::Db(e) if status == StatusCode::SERVICE_UNAVAILABLE => {
                tracing::warn!(error = %e, "database unavailable");
                ApiError::unavailable(
                    "the database is unavailable; the request was not started: retry later",
                    5,
                )
            }
            AppError::Db(e) => ApiError::internal(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_string(&self.problem()).expect("a problem serializes");
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(s) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body was not read: the connection cannot carry another request.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
