//! The reads of `agentq why`: an operation's row as the claim sees it, and one evidence query
//! per gate that can hold it (`agentq_app::why` decides which gate holds it, in the order the
//! claim applies them: [`super::claim::CLAIM_GATES`]). Every read is by primary key or by a
//! bounded index probe; none is written.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::operation::Lane;
use crate::state::{Status, terminal_sql};

/// What the claim reads of one operation, and what tells its other states apart.
#[derive(Clone, Debug, FromRow)]
pub struct Row {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub kind_version: Option<String>,
    pub version_parked: bool,
    pub lane: String,
    pub status: Status,
    pub attempt: i32,
    pub max_attempts: i32,
    pub run_at: DateTime<Utc>,
    /// `run_at > now()`, by PostgreSQL's clock (the claim's).
    pub not_due: bool,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    pub waiting_for: Option<String>,
    pub joining: Option<Vec<Uuid>>,
    pub batch_id: Option<Uuid>,
    pub ordering_key: Option<String>,
    pub concurrency_key: Option<String>,
    pub concurrency_limit: Option<i32>,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<DateTime<Utc>>,
    pub share_held: bool,
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Its debounce key, and while it is pending, its latest start (first arrival + max_delay).
    pub debounce_key: Option<String>,
    pub debounce_until: Option<DateTime<Utc>>,
}

/// The operation `id` within `tenant` (`None`: any tenant).
pub async fn row(pool: &PgPool, id: Uuid, tenant: Option<&str>) -> Result<Option<Row>> {
    let row = sqlx::query_as(
        "SELECT id, tenant_id, kind, kind_version, version_parked, lane, status, attempt,
                max_attempts, run_at, run_at > now() AS not_due, created_at, updated_at,
                finished_at, error_class, error_message, waiting_for, joining, batch_id,
                ordering_key, concurrency_key, concurrency_limit, lease_owner,
                lease_expires_at, share_held, dispatched_at, debounce_key, debounce_until
           FROM operations
          WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)",
    )
    .bind(id)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// When `id` last became `running` (its status events), if they say.
pub async fn running_since(pool: &PgPool, id: Uuid) -> Result<Option<DateTime<Utc>>> {
    let at = sqlx::query_scalar(
        "SELECT max(at) FROM operation_events
          WHERE op_id = $1 AND type = 'status' AND data->>'status' = 'running'",
    )
    .bind(id)
    .fetch_one(pool)
    .await?;
    Ok(at)
}

/// Whether a signal `name` sent to `id` waits to be consumed (0 or 1: one per name).
pub async fn pending_signals(pool: &PgPool, id: Uuid, name: &str) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM signals WHERE op_id = $1 AND name = $2 AND consumed_at IS NULL",
    )
    .bind(id)
    .bind(name)
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// Of the children `ids` a join waits for, the unfinished ones (oldest first): id and status.
pub async fn unfinished(pool: &PgPool, ids: &[Uuid]) -> Result<Vec<(Uuid, Status)>> {
    let rows = sqlx::query_as(concat!(
        "SELECT id, status FROM operations WHERE id = ANY($1) AND status NOT IN ",
        terminal_sql!(),
        " ORDER BY created_at, id"
    ))
    .bind(ids)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The operation ahead of one in its ordering key: the oldest unfinished operation of the key.
#[derive(Clone, Debug, FromRow)]
pub struct Holder {
    pub id: Uuid,
    pub status: Status,
    pub lease_owner: Option<String>,
    pub updated_at: DateTime<Utc>,
}

/// The oldest unfinished operation of `(tenant, key)` created before `(created_at, id)`: what
/// the claim's ordering-key gate waits for (none: the gate is open).
pub async fn ordering_holder(
    pool: &PgPool,
    tenant: &str,
    key: &str,
    created_at: DateTime<Utc>,
    id: Uuid,
) -> Result<Option<Holder>> {
    let row = sqlx::query_as(concat!(
        "SELECT id, status, lease_owner, updated_at FROM operations
          WHERE tenant_id = $1 AND ordering_key = $2 AND status NOT IN ",
        terminal_sql!(),
        " AND (created_at, id) < ($3, $4)
          ORDER BY created_at, id LIMIT 1"
    ))
    .bind(tenant)
    .bind(key)
    .bind(created_at)
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// A concurrency key's counter: how many of its operations run, its limit (the key's first
/// operation's), and how many of its queued, due operations are older than `(created_at, id)`
/// (the claim admits a key's operations oldest first).
pub async fn concurrency(
    pool: &PgPool,
    tenant: &str,
    key: &str,
    created_at: DateTime<Utc>,
    id: Uuid,
) -> Result<Option<(i32, Option<i32>, i64)>> {
    let row = sqlx::query_as(
        "SELECT c.running, c.lim,
                (SELECT count(*) FROM operations o
                  WHERE o.tenant_id = $1 AND o.concurrency_key = $2 AND o.status = 'queued'
                    AND o.run_at <= now() AND (o.created_at, o.id) < ($3, $4))
           FROM concurrency_keys c WHERE c.tenant_id = $1 AND c.key = $2",
    )
    .bind(tenant)
    .bind(key)
    .bind(created_at)
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// How many operations of `tenant` run in `lane` now.
pub async fn running_in_lane(pool: &PgPool, tenant: &str, lane: Lane) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM operations
          WHERE tenant_id = $1 AND lane = $2 AND status = 'running'",
    )
    .bind(tenant)
    .bind(lane.as_str())
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// The most [`queued_ahead`] counts: past it, "at least" is all an operator needs.
pub const AHEAD_CAP: i64 = 10_000;

/// How many queued, due operations of `lane` are older than `(created_at, id)`, up to
/// [`AHEAD_CAP`]: of every tenant, or only `tenant`'s (what a tenant's caller may know).
pub async fn queued_ahead(
    pool: &PgPool,
    lane: Lane,
    created_at: DateTime<Utc>,
    id: Uuid,
    tenant: Option<&str>,
) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM (
            SELECT 1 FROM operations
             WHERE lane = $1 AND status = 'queued' AND run_at <= now()
               AND (created_at, id) < ($2, $3)
               AND ($5::text IS NULL OR tenant_id = $5)
             LIMIT $4) ahead",
    )
    .bind(lane.as_str())
    .bind(created_at)
    .bind(id)
    .bind(AHEAD_CAP)
    .bind(tenant)
    .fetch_one(pool)
    .await?;
    Ok(n)
}
