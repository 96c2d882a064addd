//! The database layer: the only place in agentq that contains SQL.
//!
//! Every state transition is one statement guarded by the expected current status (and by the
//! epoch for anything written after a claim), so a transition attempted twice, or by two
//! processes, happens once. Nothing here holds a transaction across an await on anything but
//! PostgreSQL itself.

pub mod access;
pub mod batch_source;
pub mod batches;
pub mod budgets;
pub mod cancel;
pub mod children;
pub mod claim;
pub mod console;
pub mod dead_letters;
pub mod debounce;
pub mod dispatch;
pub mod events;
pub mod gauges;
pub mod listing;
pub mod names;
pub mod operations;
pub mod pauses;
pub mod rate_limits;
pub mod retention;
pub mod schedules;
pub mod services;
pub mod settle;
pub mod signals;
pub mod steps;
pub mod stores;
pub mod tenant_kinds;
pub mod timers;
pub mod versions;
pub mod why;

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection};

/// Errors of the database layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL could not be parsed.
    #[error("invalid DATABASE_URL: {0}")]
    Url(String),
    /// PostgreSQL refused or failed a query.
    #[error(transparent)]
    Sqlx(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("applying migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// PostgreSQL did not answer within the call deadline ([`within`]); the connection that
    /// carried the call is closed, never reused.
    #[error(
        "PostgreSQL did not answer within {0:?} (AGENTQ_DB_TIMEOUT_SECS); the connection was closed"
    )]
    Deadline(Duration),
    /// A grouped write's writer stopped (a panic, a shutdown) while it held the write, and the
    /// row was not found afterwards. It was almost surely not written; a statement cut off in
    /// flight may still have committed, so a repeat should carry a dedupe key.
    #[error(
        "the write was taken by a writer that stopped before answering, and its row was not found; send it again (with an Idempotency-Key, a repeat cannot store it twice)"
    )]
    Unanswered,
}

impl Error {
    /// True when the server could not be reached or would not take a connection yet: refused,
    /// reset, silent past the deadline, cut off mid-message, starting up or shutting down
    /// (SQLSTATE class 57P), a connection failure (class 08), or out of connection slots
    /// (53300). Such a failure may pass by itself; a bad URL, a refused role or password, or a
    /// missing database needs the operator, and is false.
    pub fn is_unreachable(&self) -> bool {
        match self {
            Error::Deadline(_) => true,
            Error::Sqlx(
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut,
            ) => true,
            Error::Sqlx(sqlx::Error::Database(e)) => e
                .code()
                .is_some_and(|c| c.starts_with("57P") || c.starts_with("08") || c == "53300"),
            _ => false,
        }
    }
}

/// Result alias of the database layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn options(url: &str) -> Result<PgConnectOptions> {
    // A client whose connection goes silent in the middle of a transaction (its COMMIT never
    // arrives) would leave the transaction open on the server for good, holding its row locks
    // and blocking every claim of those operations: the server aborts a transaction idle for
    // longer than this (three call deadlines, at least 15 s: longer than any transaction
    // agentq keeps open between statements, a sweep's publish included).
    let idle = (call_deadline() * 3).max(Duration::from_secs(15));
    PgConnectOptions::from_str(url)
        .map_err(|e| Error::Url(e.to_string()))
        .map(|o| {
            o.disable_statement_logging().options([(
                "idle_in_transaction_session_timeout",
                format!("{}", idle.as_millis()),
            )])
        })
}

/// One round trip to PostgreSQL (`SELECT 1`): what readiness probes ask.
pub async fn ping(pool: &PgPool) -> Result<()> {
    sqlx::query_scalar::<_, i32>("SELECT 1")
        .fetch_one(pool)
        .await?;
    Ok(())
}

/// The call deadline, in milliseconds (see [`set_call_deadline`]).
static CALL_DEADLINE_MS: AtomicU64 = AtomicU64::new(10_000);

/// Sets this process's call deadline (`AGENTQ_DB_TIMEOUT_SECS`, 10 s by default): the longest
/// an engine call to PostgreSQL ([`within`]), a pool's connection attempt and a returned
/// connection's release check may take.
///
/// Why client-side deadlines: a connection that stays open at the TCP level but never answers
/// again (a wedged pooler or proxy in between, a NAT that dropped its state, a partition that
/// never sends a reset) hangs every call on it. sqlx has no query timeout, `statement_timeout`
/// is enforced by the server, which never sees the call, and TCP keepalives are answered by
/// whatever proxy is in between. So the engine's loops bound each call, and the pool closes a
/// connection that does not answer its release check in time instead of reusing it.
pub fn set_call_deadline(deadline: Duration) {
    CALL_DEADLINE_MS.store(deadline.as_millis().max(1) as u64, Ordering::Relaxed);
}

/// This process's call deadline.
pub fn call_deadline() -> Duration {
    Duration::from_millis(CALL_DEADLINE_MS.load(Ordering::Relaxed))
}

/// Runs one database call under the call deadline. When it expires the call is abandoned (its
/// future dropped) and [`Error::Deadline`] returned: the connection it held goes back to the
/// pool in the middle of a call, fails the release check (a ping under the same deadline) and
/// is closed, so the next call gets a fresh connection.
pub async fn within<T>(call: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    let deadline = call_deadline();
    // Pinned here so the call (and the connection it holds) is dropped only when this function
    // returns: after `abandoned` has armed the check of the release it causes.
    let mut call = std::pin::pin!(call);
    match tokio::time::timeout(deadline, call.as_mut()).await {
        Ok(done) => done,
        Err(_) => {
            abandoned();
            Err(Error::Deadline(deadline))
        }
    }
}

/// When a call was last abandoned in the middle (milliseconds since [`EPOCH`]; 0: never).
static LAST_ABANDONED_MS: AtomicU64 = AtomicU64::new(0);
static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn now_ms() -> u64 {
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1
}

/// Records that a call was abandoned in the middle (a deadline, an HTTP request timeout): for
/// a while, connections handed back to the pool are checked under the deadline (see
/// [`connect`]).
pub fn abandoned() {
    LAST_ABANDONED_MS.store(now_ms(), Ordering::Relaxed);
}

/// How long after an abandoned call released connections are checked under the deadline: the
/// abandoned call's connection is released at once (its future is dropped), so this is ample.
const CHECK_AFTER_ABANDONED: Duration = Duration::from_secs(60);

fn checking_releases() -> bool {
    let last = LAST_ABANDONED_MS.load(Ordering::Relaxed);
    last != 0 && now_ms().saturating_sub(last) <= CHECK_AFTER_ABANDONED.as_millis() as u64
}

/// Opens a pool. `acquire_timeout` is short so an exhausted pool shows up as an error, not a
/// hang. sqlx pings every connection handed back, without a deadline, to flush a call
/// abandoned midway; on a silent connection that ping would hang and hold its pool slot for
/// good. So while calls are being abandoned ([`abandoned`], the last minute), a connection
/// handed back is first pinged under the call deadline and closed if it does not answer. At
/// other times the extra round trip is skipped: it cost 8 % of `agentq bench --scenario e2e`.
///
/// One connection is opened first, alone: its error says why the server cannot be used
/// (refused, an unknown role, a missing database), where a pool's says only that it timed out.
pub async fn connect(url: &str, max_connections: u32) -> Result<PgPool> {
    let options = options(url)?;
    let acquire = Duration::from_secs(10).max(call_deadline());
    let first = tokio::time::timeout(acquire, options.connect())
        .await
        .map_err(|_| Error::Deadline(acquire))??;
    let _ = tokio::time::timeout(call_deadline(), first.close()).await;
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire)
        .after_release(|conn, _| {
            Box::pin(async move {
                if !checking_releases() {
                    return Ok(true);
                }
                match tokio::time::timeout(call_deadline(), conn.ping()).await {
                    Ok(answered) => answered.map(|()| true),
                    // An error (not `Ok(false)`) makes the pool drop the socket at once instead
                    // of saying goodbye to a server that is not listening.
                    Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no answer to the release ping within the call deadline",
                    ))),
                }
            })
        })
        .connect_with(options)
        .await?;
    Ok(pool)
}

/// Creates the database named in `url` when it does not exist, then applies the migrations.
/// Safe to run twice and from two processes at once: creation tolerates losing the race and
/// the migrator serializes itself with an advisory lock.
pub async fn migrate(url: &str) -> Result<()> {
    create_database_if_missing(url).await?;
    let mut conn = options(url)?.connect().await?;
    crate::MIGRATOR.run(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// The maintenance connection (database `postgres`) of the server in `url`, and the database name.
async fn maintenance(url: &str) -> Result<(PgConnection, String)> {
    let opts = options(url)?;
    let name = opts
        .get_database()
        .map(str::to_string)
        .ok_or_else(|| Error::Url("the URL names no database".into()))?;
    let conn = opts.database("postgres").connect().await?;
    Ok((conn, name))
}

/// Creates the database of `url` if it is missing; returns whether it created it.
pub async fn create_database_if_missing(url: &str) -> Result<bool> {
    let (mut conn, name) = maintenance(url).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut conn)
            .await?;
    if exists {
        return Ok(false);
    }
    let sql = format!("CREATE DATABASE {}", quote_ident(&name));
    let created = match sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
    {
        Ok(_) => true,
        // 42P04 duplicate_database / 23505: another process created it first.
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42P04" | "23505")) => {
            false
        }
        Err(e) => return Err(e.into()),
    };
    conn.close().await?;
    Ok(created)
}

/// Drops the database of `url` (tests and `agentq bench` clean up after themselves with it).
pub async fn drop_database(url: &str) -> Result<()> {
    let (mut conn, name) = maintenance(url).await?;
    let sql = format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        quote_ident(&name)
    );
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(())
}

/// Commits in the database of `url` so far (`pg_stat_database.xact_commit`), for `agentq bench`.
pub async fn commit_count(pool: &PgPool) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?;
    Ok(n)
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Replaces the database name in `url` (tests and the benchmark run in databases of their own).
pub fn with_database(url: &str, database: &str) -> Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let path_start = base[scheme_end..]
        .find('/')
        .map(|i| i + scheme_end)
        .unwrap_or(base.len());
    let mut out = format!("{}/{}", &base[..path_start], database);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    options(&out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_name() {
        assert_eq!(
            with_database("postgres://u@h:5432/agentq", "t1").unwrap(),
            "postgres://u@h:5432/t1"
        );
        assert_eq!(
            with_database("postgres://u@h:5432/agentq?sslmode=disable", "t1").unwrap(),
            "postgres://u@h:5432/t1?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://u@h", "t1").unwrap(),
            "postgres://u@h/t1"
        );
    }
}
