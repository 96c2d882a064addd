//! Opening agentq's database for a process: the pool, the migrations, and the deadline every
//! call runs under. Every front end starts here; the SQL itself stays in `agentq_core::db`.

use std::time::Duration;

use sqlx::PgPool;

pub use agentq_core::db::Error;

/// A pool of at most `max_connections` to `url` (every connection with agentq's session
/// settings).
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool, Error> {
    agentq_core::db::connect(url, max_connections).await
}

/// Creates the database if it is missing and applies the migrations it lacks.
pub async fn migrate(url: &str) -> Result<(), Error> {
    agentq_core::db::migrate(url).await
}

/// The deadline of every database call of this process (`AGENTQ_DB_TIMEOUT_SECS`); set once,
/// before anything connects.
pub fn set_call_deadline(deadline: Duration) {
    agentq_core::db::set_call_deadline(deadline);
}
