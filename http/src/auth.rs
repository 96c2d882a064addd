//! Bearer-token authentication and the role and tenant rules of every route.
//!
//! A token is looked up by the application layer ([`agentq_app::access::authenticate`], by its
//! SHA-256: only the hash is stored), once per request: the route's access check
//! ([`crate::routes::enforce`]) hands the caller it found to the handler. Roles nest: `producer` runs
//! and reads operations of its tenant, `operator` also works its tenant's DLQ, `admin` does
//! everything in every tenant. A non-admin is scoped to its tenant: every query takes
//! [`Caller::scope`], so another tenant's id is simply not found (404), never "forbidden".

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{Extensions, HeaderMap, header};

use super::ApiState;
use super::problem::ApiError;

pub use agentq_app::Role;

/// The authenticated caller of a request.
#[derive(Clone, Debug)]
pub struct Caller {
    pub tenant: String,
    pub role: Role,
    /// The token's public prefix (`agq_` and 8 characters), used as the audit actor.
    pub prefix: String,
    /// The token's SHA-256: a long request (an event stream) re-checks it is still valid.
    pub token_hash: String,
}

impl Caller {
    /// Refuses callers below `min` (403, saying which role the route needs): the
    /// application layer's rule ([`agentq_app::Caller::require`]).
    pub fn require(&self, min: Role) -> Result<(), ApiError> {
        Ok(self.app().require(min)?)
    }

    /// The name operator actions are audited under.
    pub fn actor(&self) -> String {
        format!("token:{}", self.prefix)
    }

    /// The caller as the application layer sees it.
    pub fn app(&self) -> agentq_app::Caller {
        agentq_app::Caller {
            tenant: self.tenant.clone(),
            role: self.role,
            actor: self.actor(),
        }
    }
}

impl From<agentq_app::access::Authenticated> for Caller {
    fn from(a: agentq_app::access::Authenticated) -> Self {
        Caller {
            tenant: a.caller.tenant,
            role: a.caller.role,
            prefix: a.prefix,
            token_hash: a.token_hash,
        }
    }
}

impl Caller {
    /// The caller of a request (its extensions and headers): the one the route's access check
    /// found ([`crate::routes::enforce`]), else the one its `Authorization: Bearer` token names
    /// ([`agentq_app::access::authenticate`]); 401 when there is none.
    pub async fn of_request(
        state: &ApiState,
        extensions: &Extensions,
        headers: &HeaderMap,
    ) -> Result<Self, ApiError> {
        match extensions.get::<Caller>() {
            Some(c) => Ok(c.clone()),
            None => Self::of_headers(state, headers).await,
        }
    }

    /// The caller the `Authorization: Bearer` header names.
    async fn of_headers(state: &ApiState, headers: &HeaderMap) -> Result<Self, ApiError> {
        let token = bearer(headers)?;
        let found = agentq_app::access::authenticate(&state.app, token).await?;
        found.map(Caller::from).ok_or_else(|| {
            ApiError::unauthorized("the token is unknown or revoked; ask an admin for a new one")
                .field("Authorization")
        })
    }
}

/// The agentq token an `Authorization: Bearer` header carries (its form checked, nothing
/// looked up); 401 when there is none or it is malformed.
pub(crate) fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers.get(header::AUTHORIZATION).ok_or_else(|| {
        ApiError::unauthorized(
            "no Authorization header; send `Authorization: Bearer <token>` (create one with \
             `agentq tokens create`)",
        )
        .field("Authorization")
    })?;
    let malformed = || {
        ApiError::unauthorized(
            "the Authorization header is not `Bearer <token>` with an agentq token (agq_…)",
        )
        .field("Authorization")
    };
    let text = value.to_str().map_err(|_| malformed())?;
    let (scheme, token) = text.trim().split_once(' ').ok_or_else(malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer")
        || !token.starts_with("agq_")
        || token.len() > 256
        || !token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(malformed());
    }
    Ok(token)
}

impl FromRequestParts<Arc<ApiState>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<ApiState>,
    ) -> Result<Self, Self::Rejection> {
        Self::of_request(state, &parts.extensions, &parts.headers).await
    }
}
