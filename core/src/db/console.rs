//! SQL of the operator console's read views: the overview counts and per-minute series,
//! payload reads and the audit row of a payload reveal. (Its operations list and
//! pending approvals are `db::listing`, shared with the API and the CLI.)
//!
//! Every function takes the caller's tenant scope (`None` only for an admin) and filters by it,
//! so the console, like the API, never shows another tenant's rows.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::Result;

/// Operations by status, in `tenant` if given.
pub async fn status_counts(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<(String, i64)>> {
    let rows = sqlx::query_as(
        "SELECT status, count(*) FROM operations
          WHERE $1::text IS NULL OR tenant_id = $1 GROUP BY status ORDER BY status",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Open dead letters by class, in `tenant` if given.
pub async fn open_dead_letters_by_class(
    pool: &PgPool,
    tenant: Option<&str>,
) -> Result<Vec<(String, i64)>> {
    let rows = sqlx::query_as(
        "SELECT class, count(*) FROM dead_letters
          WHERE status = 'open' AND ($1::text IS NULL OR tenant_id = $1)
          GROUP BY class ORDER BY count(*) DESC, class",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Seconds the oldest due queued operation has waited, by lane.
pub async fn oldest_queued(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<(String, f64)>> {
    let rows = sqlx::query_as(
        "SELECT lane, EXTRACT(EPOCH FROM now() - min(run_at))::float8 FROM operations
          WHERE status = 'queued' AND run_at <= now() AND ($1::text IS NULL OR tenant_id = $1)
          GROUP BY lane ORDER BY lane",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// One minute of the overview's charts.
#[derive(Clone, Debug, FromRow)]
pub struct Minute {
    pub minute: DateTime<Utc>,
    /// Operations that succeeded in the minute.
    pub succeeded: i64,
    /// Operations that went dead in the minute.
    pub dead: i64,
    /// Attempts that failed in the minute and were scheduled for a retry.
    pub retried: i64,
    /// The longest queue wait (due → claimed), in seconds, of the claims made in the minute.
    pub max_wait_secs: f64,
}

/// The last `minutes` minutes, oldest first (every minute present, zeros where idle).
pub async fn minutes(pool: &PgPool, tenant: Option<&str>, minutes: i32) -> Result<Vec<Minute>> {
    let rows = sqlx::query_as(
        "WITH m AS (
            SELECT generate_series(date_trunc('minute', now()) - make_interval(mins => $2 - 1),
                                   date_trunc('minute', now()), interval '1 minute') AS minute
         ), fin AS (
            SELECT date_trunc('minute', finished_at) AS minute,
                   count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
                   count(*) FILTER (WHERE status = 'dead') AS dead
              FROM operations
             WHERE finished_at >= date_trunc('minute', now()) - make_interval(mins => $2 - 1)
               AND ($1::text IS NULL OR tenant_id = $1)
             GROUP BY 1
         ), ev AS (
            SELECT date_trunc('minute', e.at) AS minute,
                   count(*) FILTER (WHERE e.data->>'status' = 'queued'
                                      AND e.data ? 'error_class') AS retried,
                   COALESCE(max(EXTRACT(EPOCH FROM e.at - (e.data->>'run_at')::timestamptz))
                            FILTER (WHERE e.data->>'status' = 'running'), 0)::float8 AS max_wait
              FROM operation_events e JOIN operations o ON o.id = e.op_id
             WHERE e.type = 'status'
               AND e.at >= date_trunc('minute', now()) - make_interval(mins => $2 - 1)
               AND ($1::text IS NULL OR o.tenant_id = $1)
             GROUP BY 1
         )
         SELECT m.minute, COALESCE(fin.succeeded, 0) AS succeeded, COALESCE(fin.dead, 0) AS dead,
                COALESCE(ev.retried, 0) AS retried,
                GREATEST(COALESCE(ev.max_wait, 0), 0)::float8 AS max_wait_secs
           FROM m LEFT JOIN fin USING (minute) LEFT JOIN ev USING (minute)
          ORDER BY m.minute",
    )
    .bind(tenant)
    .bind(minutes)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The input, result and error of an operation: what the console shows only on "reveal".
#[derive(Clone, Debug, FromRow)]
pub struct Payloads {
    pub input: Value,
    pub result: Option<Value>,
    pub error_message: Option<String>,
}

/// An operation's payloads, in `tenant` if given.
pub async fn payloads(pool: &PgPool, op: Uuid, tenant: Option<&str>) -> Result<Option<Payloads>> {
    let row = sqlx::query_as(
        "SELECT input, result, error_message FROM operations
          WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)",
    )
    .bind(op)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// Audits that `actor` read the payloads of `op` through `via` (`console`, `api`, `cli`).
pub async fn audit_reveal(
    pool: &PgPool,
    op: Uuid,
    actor: &str,
    status: &str,
    via: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, status_before, status_after, details)
         VALUES ($1, 'reveal_payloads', $2, $3, $3, jsonb_build_object('via', $4::text))",
    )
    .bind(actor)
    .bind(op)
    .bind(status)
    .bind(via)
    .execute(pool)
    .await?;
    Ok(())
}

/// The audit trail of one operation, oldest first.
pub async fn operation_actions(
    pool: &PgPool,
    op: Uuid,
) -> Result<Vec<super::dead_letters::ActionView>> {
    let rows = sqlx::query_as(
        "SELECT actor, action, op_id, dead_letter_id, reason, status_before, status_after,
                details, created_at
           FROM operator_actions WHERE op_id = $1 ORDER BY created_at, id",
    )
    .bind(op)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// An open dead letter with its fingerprint (the grouping of [`super::dead_letters::stats`]).
#[derive(Clone, Debug, FromRow)]
pub struct InboxItem {
    #[sqlx(flatten)]
    pub dead_letter: super::dead_letters::DeadLetterView,
    pub fingerprint: String,
}

/// The newest `limit` dead letters matching `filter`, each with its fingerprint.
pub async fn inbox(
    pool: &PgPool,
    filter: &super::dead_letters::Filter,
    limit: i64,
) -> Result<Vec<InboxItem>> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(concat!(
        "SELECT ",
        super::dead_letters::view_fields!(),
        ", "
    ));
    q.push(super::dead_letters::FINGERPRINT)
        .push(" AS fingerprint FROM dead_letters d LEFT JOIN operations o ON o.id = d.op_id");
    q.push(" WHERE d.status = ").push_bind(filter.status());
    if let Some(t) = &filter.tenant {
        q.push(" AND d.tenant_id = ").push_bind(t.clone());
    }
    if let Some(k) = &filter.kind {
        q.push(" AND d.kind = ").push_bind(k.clone());
    }
    if let Some(c) = &filter.class {
        q.push(" AND d.class = ").push_bind(c.clone());
    }
    q.push(" ORDER BY d.created_at DESC, d.id DESC LIMIT ")
        .push_bind(limit);
    Ok(q.build_query_as().fetch_all(pool).await?)
}
