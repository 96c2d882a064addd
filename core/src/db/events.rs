//! SQL of the operation event log (`operation_events`, written by triggers: see migration
//! `20261130000008_operation_events.sql`) and of API admission control.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;

/// One event of an operation's life: `status`, `step` or `signal`, numbered from 1.
#[derive(Clone, Debug, Serialize, FromRow)]
pub struct Event {
    pub seq: i32,
    pub at: DateTime<Utc>,
    #[sqlx(rename = "type")]
    #[serde(rename = "type")]
    pub kind: String,
    pub data: Value,
}

/// Up to `limit` events of operation `op` after event `after`, in order.
pub async fn events_after(pool: &PgPool, op: Uuid, after: i32, limit: i64) -> Result<Vec<Event>> {
    let rows = sqlx::query_as(
        "SELECT seq, at, type, data FROM operation_events
          WHERE op_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
    )
    .bind(op)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// How many operations `tenant` has queued, counting at most `cap + 1` (admission control
/// only needs to know whether the cap is exceeded).
pub async fn queued_count(pool: &PgPool, tenant: &str, cap: i64) -> Result<i64> {
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM operations
                                WHERE tenant_id = $1 AND status = 'queued' LIMIT $2) q",
    )
    .bind(tenant)
    .bind(cap + 1)
    .fetch_one(pool)
    .await?;
    Ok(n)
}
