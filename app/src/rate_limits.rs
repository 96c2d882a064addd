//! Rate limits: tokens and requests of model calls per window, for a model or provider, a
//! tenant, or a key a tenant's operations name (`rate_key`). Set, removed and listed by the
//! same flows for `agentq limits`, the API and the console.
//!
//! Who may: an admin sets any limit; an operator sets and removes its own tenant's key limits
//! (a limit on a key only slows the tenant's own operations); a producer lists its tenant's.
//! Workers read the limits at most a second after they change (`agentq-worker`'s snapshot).

use agentq_core::db::rate_limits::{self, Scope, Spec};
pub use agentq_core::db::rate_limits::{LimitView, Scope as LimitScope, parse_waiting_for};
use agentq_core::operation::TenantId;

use crate::{App, AppError, Caller, Result, Role};

/// The longest name a limit may have.
pub const MAX_NAME_LEN: usize = 200;
/// The window a limit that names none has: a minute, as providers count.
pub const DEFAULT_WINDOW_SECS: i32 = 60;

/// A limit as asked for.
#[derive(Clone, Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitRequest {
    /// `model` (name: a model, a provider's host, or `<host>/<model>`), `tenant` (name: the
    /// tenant) or `key` (name: the `rate_key` the tenant's operations give)
    pub scope: Scope,
    pub name: String,
    /// The tenant whose key it is (scope `key`); a non-admin's own when left out
    pub tenant: Option<String>,
    /// The window's length in seconds, 1 to 86400; default 60
    pub window_secs: Option<i32>,
    /// Tokens (prompt + completion) in any window
    pub max_tokens: Option<i64>,
    /// Model calls in any window
    pub max_requests: Option<i64>,
    /// Kept in the audit trail
    pub reason: Option<String>,
}

/// The name a limit of `scope` has, checked; and the tenant a key limit belongs to.
fn named(caller: &Caller, scope: Scope, name: &str, tenant: Option<&str>) -> Result<String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.chars().any(char::is_whitespace) {
        return Err(AppError::invalid(
            "/name",
            format!("a limit's name is 1-{MAX_NAME_LEN} characters without spaces (got {name:?})"),
        ));
    }
    match scope {
        Scope::Model => {
            caller.require(Role::Admin)?;
            Ok(String::new())
        }
        Scope::Tenant => {
            caller.require(Role::Admin)?;
            TenantId::parse(name)
                .map_err(|e| AppError::invalid("/name", format!("tenant {name:?}: {e}")))?;
            Ok(String::new())
        }
        Scope::Key => {
            caller.require(Role::Operator)?;
            let tenant = caller.tenant_for_write(tenant)?;
            TenantId::parse(&tenant)
                .map_err(|e| AppError::invalid("/tenant", format!("tenant {tenant:?}: {e}")))?;
            Ok(tenant)
        }
    }
}

/// Sets (creates or replaces) a limit, audited; what it is now, with its window's usage.
pub async fn set(app: &App, caller: &Caller, request: &LimitRequest) -> Result<LimitView> {
    let tenant = named(
        caller,
        request.scope,
        &request.name,
        request.tenant.as_deref(),
    )?;
    let window_secs = request.window_secs.unwrap_or(DEFAULT_WINDOW_SECS);
    if !(1..=86_400).contains(&window_secs) {
        return Err(AppError::invalid(
            "/window_secs",
            format!("a window is 1 to 86400 seconds (got {window_secs})"),
        ));
    }
    for (field, value) in [
        ("/max_tokens", request.max_tokens),
        ("/max_requests", request.max_requests),
    ] {
        if value.is_some_and(|v| v < 1) {
            return Err(AppError::invalid(
                field,
                format!("{} must be 1 or more", &field[1..]),
            ));
        }
    }
    if request.max_tokens.is_none() && request.max_requests.is_none() {
        return Err(AppError::invalid(
            "/max_tokens",
            "a limit caps tokens (max_tokens), requests (max_requests) or both: give one",
        ));
    }
    let spec = Spec {
        scope: request.scope,
        name: request.name.clone(),
        tenant,
        window_secs,
        max_tokens: request.max_tokens,
        max_requests: request.max_requests,
    };
    Ok(rate_limits::set(&app.pool, &spec, &caller.actor, request.reason.as_deref()).await?)
}

/// Removes a limit, audited; not found when there is none.
pub async fn delete(
    app: &App,
    caller: &Caller,
    scope: Scope,
    name: &str,
    tenant: Option<&str>,
) -> Result<()> {
    let tenant = named(caller, scope, name, tenant)?;
    if rate_limits::delete(&app.pool, scope, &tenant, name, &caller.actor).await? {
        Ok(())
    } else {
        Err(AppError::NotFound(format!(
            "no {} rate limit named {name:?}{}: `agentq limits list` shows them",
            scope.as_str(),
            if tenant.is_empty() {
                String::new()
            } else {
                format!(" for tenant {tenant:?}")
            }
        )))
    }
}

/// The limits the caller may see, each with its window's usage: an admin's every one (or the
/// named tenant's), anyone else's its tenant's key limits and its tenant limit.
pub async fn list(app: &App, caller: &Caller, tenant: Option<&str>) -> Result<Vec<LimitView>> {
    let tenant = caller.tenant_filter(tenant)?;
    Ok(rate_limits::list(&app.pool, tenant.as_deref()).await?)
}
