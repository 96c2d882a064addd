//! SQL of the operations list and search: keyset pages, newest first by `(created_at, id)`,
//! over the filters `GET /v1/operations`, `agentq list` and the console share. The rows are
//! compact: never an input, a result or an error message (those stay on the operation).
//!
//! Every query takes the tenant the caller is confined to (`None` only for an admin, who may
//! name one), so a list never shows another tenant's rows, whatever the other filters or the
//! cursor say.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::Result;
use crate::state::Status;

/// Which operations a list shows; every part optional.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// The caller's scope (or, for an admin, the tenant asked for).
    pub tenant: Option<String>,
    /// Any of these statuses; empty means any status.
    pub statuses: Vec<Status>,
    pub kind: Option<String>,
    pub batch: Option<Uuid>,
    /// Fired by this schedule.
    pub schedule: Option<Uuid>,
    /// Spawned by this operation (its children).
    pub parent: Option<Uuid>,
    /// Created at or after.
    pub created_after: Option<DateTime<Utc>>,
    /// Created before.
    pub created_before: Option<DateTime<Utc>>,
    /// Finished at or after (only finished operations match).
    pub finished_after: Option<DateTime<Utc>>,
    /// Finished before (only finished operations match).
    pub finished_before: Option<DateTime<Utc>>,
    /// Only operations waiting for this signal (the console's pending approvals).
    pub waiting_for: Option<String>,
}

/// One operation as lists show it.
#[derive(Clone, Debug, Serialize, FromRow, schemars::JsonSchema)]
#[schemars(rename = "OperationSummary")]
pub struct Summary {
    pub op_id: Uuid,
    pub tenant: String,
    pub kind: String,
    pub status: Status,
    pub attempt: i32,
    pub max_attempts: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// When it reached a terminal status.
    pub finished_at: Option<DateTime<Utc>>,
    pub batch_id: Option<Uuid>,
    /// Its Idempotency-Key, webhook-id or batch document key.
    pub dedupe_key: Option<String>,
    /// The class of its last failure (a dead operation's: why it died).
    pub error_class: Option<String>,
    /// The signal a waiting operation waits for.
    pub waiting_for: Option<String>,
}

/// One keyset page of operations, newest first, after `(created_at, id)` of the previous page.
pub async fn list(
    pool: &PgPool,
    f: &Filter,
    limit: i64,
    after: Option<(DateTime<Utc>, Uuid)>,
) -> Result<Vec<Summary>> {
    Ok(page_query("", f, limit, after)
        .build_query_as()
        .fetch_all(pool)
        .await?)
}

/// The plan of [`list`]'s query for `f` (a test checks that a tenant's page is read through
/// the tenant's index, never by reading other tenants' rows).
pub async fn explain(pool: &PgPool, f: &Filter, limit: i64) -> Result<String> {
    let lines: Vec<String> = page_query("EXPLAIN ", f, limit, None)
        .build_query_scalar()
        .fetch_all(pool)
        .await?;
    Ok(lines.join("\n"))
}

fn page_query(
    prefix: &str,
    f: &Filter,
    limit: i64,
    after: Option<(DateTime<Utc>, Uuid)>,
) -> QueryBuilder<Postgres> {
    let mut q: QueryBuilder<Postgres> = QueryBuilder::new(prefix);
    q.push(
        "SELECT id AS op_id, tenant_id AS tenant, kind, status, attempt, max_attempts,
                created_at, updated_at, finished_at, batch_id, dedupe_key, error_class,
                waiting_for
           FROM operations WHERE true",
    );
    if let Some(t) = &f.tenant {
        q.push(" AND tenant_id = ").push_bind(t.clone());
    }
    if !f.statuses.is_empty() {
        let names: Vec<String> = f.statuses.iter().map(|s| s.as_str().to_string()).collect();
        q.push(" AND status = ANY(").push_bind(names).push(")");
    }
    if let Some(k) = &f.kind {
        q.push(" AND kind = ").push_bind(k.clone());
    }
    if let Some(b) = f.batch {
        q.push(" AND batch_id = ").push_bind(b);
    }
    if let Some(s) = f.schedule {
        q.push(" AND schedule_id = ").push_bind(s);
    }
    if let Some(p) = f.parent {
        q.push(" AND parent_id = ").push_bind(p);
    }
    for (column, op, at) in [
        ("created_at", ">=", f.created_after),
        ("created_at", "<", f.created_before),
        ("finished_at", ">=", f.finished_after),
        ("finished_at", "<", f.finished_before),
    ] {
        if let Some(at) = at {
            q.push(format_args!(" AND {column} {op} ")).push_bind(at);
        }
    }
    if let Some(w) = &f.waiting_for {
        q.push(" AND status = 'waiting' AND waiting_for = ")
            .push_bind(w.clone());
    }
    if let Some((at, id)) = after {
        q.push(" AND (created_at, id) < (")
            .push_bind(at)
            .push(", ")
            .push_bind(id)
            .push(")");
    }
    q.push(" ORDER BY created_at DESC, id DESC LIMIT ")
        .push_bind(limit);
    q
}
