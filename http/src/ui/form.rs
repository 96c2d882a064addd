//! The console's form POSTs, written once. [`FormPost`] extracts the session and the form's
//! fields and refuses a form without the session's CSRF token (403) before a handler runs;
//! [`FormPost::done`] leaves the action's outcome for the session's next page and redirects
//! back. A handler only reads its fields, calls the application layer and words the outcome.

use std::collections::HashMap;
use std::sync::Arc;

use agentq_app::{AppError, Caller};
use axum::Form;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use uuid::Uuid;

use super::session::{self, Session};
use super::{UiError, UiResult, UiState};

/// A form's fields.
pub type Fields = HashMap<String, String>;

/// A console form POST whose CSRF token is this session's: the session and the form's fields.
pub struct FormPost {
    pub session: Session,
    pub fields: Fields,
}

impl FromRequest<Arc<UiState>> for FormPost {
    type Rejection = Response;

    async fn from_request(req: Request, state: &Arc<UiState>) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = req.into_parts();
        let session = Session::from_request_parts(&mut parts, state).await?;
        // A body that is not a form has no CSRF token: refused below like a missing one.
        let fields = Form::<Fields>::from_request(Request::from_parts(parts, body), state)
            .await
            .map(|Form(f)| f)
            .unwrap_or_default();
        let given = fields.get("csrf").map(String::as_str).unwrap_or("");
        if !session::same(given, &session.csrf) {
            return Err(UiError::new(
                StatusCode::FORBIDDEN,
                "the form's CSRF token is missing or belongs to another session; reload the page \
                 and try again",
            )
            .into_response());
        }
        Ok(Self { session, fields })
    }
}

impl FormPost {
    /// Who acts: the session's caller.
    pub fn caller(&self) -> &Caller {
        &self.session.caller
    }

    /// The value of the field `name`, trimmed; `None` when it is absent or blank.
    pub fn filled(&self, name: &str) -> Option<&str> {
        self.fields
            .get(name)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Leaves the action's outcome for the session's next page — its message, or `refused: …`
    /// when the application layer refused it — and redirects to the form's `next` (a console
    /// path) or else `back`. Something missing is a 404 page and a failure a 500: the same
    /// mapping for every console action.
    pub fn done(
        &self,
        state: &UiState,
        outcome: agentq_app::Result<String>,
        back: &str,
    ) -> UiResult {
        let message = match outcome {
            Ok(m) => m,
            Err(e @ (AppError::NotFound(_) | AppError::Db(_))) => return Err(e.into()),
            Err(refused) => format!("refused: {refused}"),
        };
        state.sessions.flash(&self.session.id, message);
        let next = self
            .fields
            .get("next")
            .filter(|n| n.starts_with("/ui") && !n.contains("//") && !n.contains('\\'))
            .map(String::as_str)
            .unwrap_or(back);
        Ok(Redirect::to(next).into_response())
    }
}

/// The id in a console path (`what`: what it names); a malformed one is not found (404).
pub fn parse_id(s: &str, what: &str) -> UiResult<Uuid> {
    Uuid::parse_str(s.trim()).map_err(|_| UiError::not_found(format!("no {what} {s}")))
}
