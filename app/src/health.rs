//! The database connection's health: whether it answers (readiness), and marking a call a
//! front end abandoned so the pool checks the connection it held.

use crate::{App, Result};

/// One round trip to PostgreSQL: what a readiness probe asks.
pub async fn ping(app: &App) -> Result<()> {
    Ok(agentq_core::db::ping(&app.pool).await?)
}

/// Records that a call was abandoned midway (a front end gave up on a request that timed
/// out): for a while, connections handed back to the pool are checked before reuse, so the
/// abandoned call's connection is not handed to the next caller mid-call.
pub fn abandoned() {
    agentq_core::db::abandoned();
}
