//! Model usage per tenant and kind (`agentq usage`): operations, model calls and tokens from
//! the journal, with the calls whose provider reported no counts said apart.

use chrono::{DateTime, Utc};

pub use agentq_core::db::steps::UsageRow;

use crate::{App, Caller, Result, Role};

/// Usage of the tenant the caller may see (an admin: the one it names, or every tenant) since
/// `since` (else ever).
pub async fn summary(
    app: &App,
    caller: &Caller,
    tenant: Option<&str>,
    since: Option<DateTime<Utc>>,
) -> Result<Vec<UsageRow>> {
    caller.require(Role::Producer)?;
    let tenant = caller.tenant_filter(tenant)?;
    Ok(agentq_core::db::steps::usage(&app.pool, tenant.as_deref(), since).await?)
}
