//! SQL for the `operations` table outside a run: insert (idempotent enqueue) and the
//! concurrency-key limit it keeps, and reads (one operation, a tenant's unfinished count, the
//! benchmark's counts and timings).
//!
//! A claim and what follows it are `db::claim`; the ends of a run `db::settle`; dispatch
//! bookkeeping `db::dispatch`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgConnection, PgPool};
use uuid::Uuid;

use super::Result;
use crate::operation::{Lane, OperationId, OperationView};
use crate::state::Status;

/// What an enqueue asks to store.
#[derive(Clone, Debug)]
pub struct NewOperation {
    pub id: OperationId,
    pub tenant: String,
    pub kind: String,
    pub lane: Lane,
    pub input: Value,
    pub input_sha256: String,
    pub dedupe_key: Option<String>,
    pub ordering_key: Option<String>,
    /// With `concurrency_limit`: at most that many operations of the key run at once.
    pub concurrency_key: Option<String>,
    pub concurrency_limit: Option<i32>,
    /// Its model calls count against the tenant's rate limits of this key.
    pub rate_key: Option<String>,
    pub batch_id: Option<Uuid>,
    pub max_attempts: i32,
    pub run_at: Option<DateTime<Utc>>,
    pub deadline: Option<DateTime<Utc>>,
    pub request_id: Option<String>,
    pub traceparent: Option<String>,
    /// The schedule that fired it (`db::schedules::fire_due`).
    pub schedule_id: Option<Uuid>,
    /// The operation that spawned it (`db::children::spawn`).
    pub parent_id: Option<Uuid>,
    /// Its token budget, written with it (`db::budgets`).
    pub budget: Option<super::budgets::Spec>,
}

/// The columns of a new operation's budget row (`budgets`: measure, limit, timeout), as an
/// enqueue's statement binds them; no limit: no row.
pub(crate) fn budget_columns(
    budget: Option<super::budgets::Spec>,
) -> (&'static str, Option<i64>, i32) {
    (
        budget.map(|b| b.measure.as_str()).unwrap_or("total"),
        budget.map(|b| b.tokens),
        budget.map_or(super::budgets::DEFAULT_TIMEOUT_SECS, |b| b.timeout_secs),
    )
}

/// The outcome of [`insert_operation`].
#[derive(Clone, Debug, PartialEq)]
pub enum Inserted {
    /// A new row; `epoch` is what a dispatch of it must be stamped with.
    Created { id: OperationId, epoch: i64 },
    /// The dedupe key already named an operation; the caller compares `input_sha256`.
    Existing {
        id: OperationId,
        status: Status,
        input_sha256: String,
    },
}

/// The epoch of an operation just inserted: every insert writes it, and a dispatch of the new
/// operation is stamped with it.
pub const NEW_EPOCH: i64 = 0;

/// Inserts many operations in one statement, each with its budget row when it has one; one
/// whose `(tenant, dedupe_key)` names an operation already stored (or an earlier one of
/// `ops`) is skipped. Returns the created ones as dispatch targets, in no particular order.
/// Every enqueue of a producer goes through it: one at a time ([`insert_operation`]),
/// grouped (`group_commit`), or many at once (`Producer::enqueue_many`); a debounced enqueue
/// and a child's spawn have statements of their own (`debounce`, `children`).
pub async fn insert_operations<'c>(
    conn: impl sqlx::PgExecutor<'c>,
    ops: &[NewOperation],
) -> Result<Vec<super::dispatch::Dispatch>> {
    let col = |f: fn(&NewOperation) -> Option<String>| ops.iter().map(f).collect::<Vec<_>>();
    let budgets: Vec<_> = ops.iter().map(|o| budget_columns(o.budget)).collect();
    let rows = sqlx::query_as(
        "WITH inserted AS (
            INSERT INTO operations (id, tenant_id, kind, lane, concurrency_limit, input,
                                    input_sha256, dedupe_key, ordering_key, batch_id,
                                    max_attempts, run_at, deadline, request_id, traceparent,
                                    schedule_id, concurrency_key, parent_id, rate_key, epoch)
            SELECT u.id, u.tenant, u.kind, u.lane, u.concurrency_limit, u.input, u.sha, u.key,
                   u.ordering, u.batch, u.max_attempts, COALESCE(u.run_at, now()), u.deadline,
                   u.request_id, u.traceparent, u.schedule, u.concurrency_key, u.parent,
                   u.rate_key, $24
              FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::int4[],
                          $6::jsonb[], $7::text[], $8::text[], $9::text[], $10::uuid[],
                          $11::int4[], $12::timestamptz[], $13::timestamptz[], $14::text[],
                          $15::text[], $16::uuid[], $17::text[], $18::uuid[], $19::text[])
                AS u(id, tenant, kind, lane, concurrency_limit, input, sha, key, ordering, batch,
                     max_attempts, run_at, deadline, request_id, traceparent, schedule,
                     concurrency_key, parent, rate_key)
            ON CONFLICT (tenant_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
            RETURNING id, tenant_id, kind, lane, epoch, traceparent
         ), budget AS (
            -- Its budget in the same statement: no claim can see it without one.
            INSERT INTO budgets (id, tenant_id, op_id, measure, limit_tokens, timeout_secs,
                                 born_apart)
            SELECT b.id, i.tenant_id, i.id, b.measure, b.tokens, b.timeout_secs, false
              FROM inserted i
              JOIN unnest($1::uuid[], $20::uuid[], $21::text[], $22::int8[], $23::int4[])
                AS b(op_id, id, measure, tokens, timeout_secs) ON b.op_id = i.id
             WHERE b.tokens IS NOT NULL
         )
         SELECT id, tenant_id, kind, lane, epoch, traceparent FROM inserted",
    )
    .bind(ops.iter().map(|o| o.id.0).collect::<Vec<_>>())
    .bind(col(|o| Some(o.tenant.clone())))
    .bind(col(|o| Some(o.kind.clone())))
    .bind(col(|o| Some(o.lane.as_str().to_string())))
    .bind(ops.iter().map(|o| o.concurrency_limit).collect::<Vec<_>>())
    .bind(ops.iter().map(|o| &o.input).collect::<Vec<_>>())
    .bind(col(|o| Some(o.input_sha256.clone())))
    .bind(col(|o| o.dedupe_key.clone()))
    .bind(col(|o| o.ordering_key.clone()))
    .bind(ops.iter().map(|o| o.batch_id).collect::<Vec<_>>())
    .bind(ops.iter().map(|o| o.max_attempts).collect::<Vec<_>>())
    .bind(ops.iter().map(|o| o.run_at).collect::<Vec<_>>())
    .bind(ops.iter().map(|o| o.deadline).collect::<Vec<_>>())
    .bind(col(|o| o.request_id.clone()))
    .bind(col(|o| o.traceparent.clone()))
    .bind(ops.iter().map(|o| o.schedule_id).collect::<Vec<_>>())
    .bind(col(|o| o.concurrency_key.clone()))
    .bind(ops.iter().map(|o| o.parent_id).collect::<Vec<_>>())
    .bind(col(|o| o.rate_key.clone()))
    .bind(ops.iter().map(|_| Uuid::new_v4()).collect::<Vec<_>>())
    .bind(budgets.iter().map(|b| b.0).collect::<Vec<_>>())
    .bind(budgets.iter().map(|b| b.1).collect::<Vec<_>>())
    .bind(budgets.iter().map(|b| b.2).collect::<Vec<_>>())
    .bind(NEW_EPOCH)
    .fetch_all(conn)
    .await?;
    Ok(rows)
}

/// Inserts an operation, or finds the one its `(tenant, dedupe_key)` already names.
/// Takes a connection so it can run inside the caller's own transaction.
pub async fn insert_operation(conn: &mut PgConnection, op: &NewOperation) -> Result<Inserted> {
    let created = insert_operations(&mut *conn, std::slice::from_ref(op)).await?;
    if let Some(c) = created.into_iter().next() {
        return Ok(Inserted::Created {
            id: OperationId(c.id),
            epoch: c.epoch,
        });
    }
    existing(conn, &op.tenant, op.dedupe_key.as_deref()).await
}

/// The epoch of operation `id`, if it is stored.
pub async fn epoch_of(conn: &mut PgConnection, id: Uuid) -> Result<Option<i64>> {
    let epoch = sqlx::query_scalar("SELECT epoch FROM operations WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(epoch)
}

/// The operation `(tenant, dedupe_key)` names, for an insert that created nothing. A status
/// this build does not know is a decoding error, never a guess.
pub async fn existing(
    conn: &mut PgConnection,
    tenant: &str,
    dedupe_key: Option<&str>,
) -> Result<Inserted> {
    let (id, status, input_sha256): (Uuid, Status, String) = sqlx::query_as(
        "SELECT id, status, input_sha256 FROM operations WHERE tenant_id = $1 AND dedupe_key = $2",
    )
    .bind(tenant)
    .bind(dedupe_key)
    .fetch_one(&mut *conn)
    .await?;
    Ok(Inserted::Existing {
        id: OperationId(id),
        status,
        input_sha256,
    })
}

#[derive(FromRow)]
struct OperationRow {
    id: Uuid,
    tenant_id: String,
    kind: String,
    kind_version: Option<String>,
    version_parked: bool,
    lane: String,
    status: Status,
    attempt: i32,
    max_attempts: i32,
    restarts: i32,
    run_at: DateTime<Utc>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    result: Option<Value>,
    error_class: Option<String>,
    error_message: Option<String>,
    waiting_for: Option<String>,
    batch_id: Option<Uuid>,
    dedupe_key: Option<String>,
    ordering_key: Option<String>,
    concurrency_key: Option<String>,
    concurrency_limit: Option<i32>,
    request_id: Option<String>,
    schedule_id: Option<Uuid>,
    parent_id: Option<Uuid>,
}

impl From<OperationRow> for OperationView {
    fn from(r: OperationRow) -> Self {
        OperationView {
            op_id: OperationId(r.id),
            tenant: r.tenant_id,
            kind: r.kind,
            kind_version: r.kind_version,
            version_parked: r.version_parked,
            lane: r.lane.parse().unwrap_or_default(),
            status: r.status,
            attempt: r.attempt,
            max_attempts: r.max_attempts,
            restarts: r.restarts,
            run_at: r.run_at,
            created_at: r.created_at,
            updated_at: r.updated_at,
            finished_at: r.finished_at,
            result: r.result,
            error_class: r.error_class,
            error_message: r.error_message,
            waiting_for: r.waiting_for,
            batch_id: r.batch_id,
            dedupe_key: r.dedupe_key,
            ordering_key: r.ordering_key,
            concurrency_key: r.concurrency_key,
            concurrency_limit: r.concurrency_limit,
            request_id: r.request_id,
            schedule_id: r.schedule_id,
            parent_id: r.parent_id,
        }
    }
}

/// Reads one operation; with `tenant`, another tenant's id is not found (never "forbidden").
pub async fn find_operation(
    pool: &PgPool,
    id: OperationId,
    tenant: Option<&str>,
) -> Result<Option<OperationView>> {
    let row: Option<OperationRow> = sqlx::query_as(
        "SELECT o.id, o.tenant_id, o.kind, o.kind_version, o.version_parked, o.lane, o.status, o.attempt, o.max_attempts, o.restarts,
                o.run_at, o.created_at, o.updated_at, o.finished_at, o.result, o.error_class,
                o.error_message, o.batch_id, o.dedupe_key, o.ordering_key, o.waiting_for,
                o.concurrency_key, o.concurrency_limit, o.request_id, o.schedule_id,
                o.parent_id
           FROM operations o
          WHERE o.id = $1 AND ($2::text IS NULL OR o.tenant_id = $2)",
    )
    .bind(id.0)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(Into::into))
}

/// The limit of `tenant`'s concurrency key `key` when an enqueue asks for `wanted`: `None` when
/// the key is new or idle (no unfinished operation: it takes `wanted`), else the limit the key
/// keeps, for the caller to refuse a different one.
pub async fn concurrency_key_limit(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    wanted: i32,
) -> Result<Option<i32>> {
    let kept: Option<Option<i32>> = sqlx::query_scalar(
        "UPDATE concurrency_keys c SET lim = $3
          WHERE c.tenant_id = $1 AND c.key = $2 AND c.lim IS DISTINCT FROM $3
            AND NOT EXISTS (SELECT 1 FROM operations o
                             WHERE o.tenant_id = $1 AND o.concurrency_key = $2
                               AND o.status IN ('queued', 'running', 'sleeping', 'waiting'))
      RETURNING NULL::integer",
    )
    .bind(tenant)
    .bind(key)
    .bind(wanted)
    .fetch_optional(&mut *conn)
    .await?;
    if kept.is_some() {
        return Ok(None);
    }
    let lim: Option<Option<i32>> =
        sqlx::query_scalar("SELECT lim FROM concurrency_keys WHERE tenant_id = $1 AND key = $2")
            .bind(tenant)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(lim.flatten().filter(|l| *l != wanted))
}

/// The `WHERE` of a tenant's (`$1`) unfinished operations, as the index
/// `operations_unfinished (lane, status, tenant_id)` serves it.
macro_rules! unfinished_of_tenant {
    () => {
        "WHERE lane IN ('interactive', 'batch')
           AND status IN ('queued', 'running', 'sleeping', 'waiting') AND tenant_id = $1"
    };
}
pub(crate) use unfinished_of_tenant;

/// How many unfinished operations (queued, running, sleeping, waiting) `tenant` has, counting
/// at most `cap + 1` (a cap only needs to know whether it is exceeded) through the partial index
/// `operations_unfinished_by_tenant`.
pub async fn unfinished_count(pool: &PgPool, tenant: &str, cap: i64) -> Result<i64> {
    let n = sqlx::query_scalar(concat!(
        "SELECT count(*) FROM (SELECT 1 FROM operations ",
        unfinished_of_tenant!(),
        " LIMIT $2) q"
    ))
    .bind(tenant)
    .bind(cap.saturating_add(1))
    .fetch_one(pool)
    .await?;
    Ok(n)
}

/// Counts operations by status (for `agentq bench` and, later, `/metrics`).
pub async fn count_by_status(pool: &PgPool) -> Result<Vec<(String, i64)>> {
    let rows = sqlx::query_as("SELECT status, count(*) FROM operations GROUP BY status")
        .fetch_all(pool)
        .await?;
    Ok(rows)
}

/// Timing of finished operations, for `agentq bench`: created, first claimed, finished.
pub async fn finished_timings(
    pool: &PgPool,
) -> Result<Vec<(DateTime<Utc>, DateTime<Utc>, DateTime<Utc>)>> {
    let rows = sqlx::query_as(
        "SELECT o.created_at, COALESCE(min(s.started_at), o.finished_at), o.finished_at
           FROM operations o LEFT JOIN operation_steps s ON s.op_id = o.id
          WHERE o.finished_at IS NOT NULL
          GROUP BY o.id",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The input of an operation (operators patch it before a retry).
pub async fn operation_input(pool: &PgPool, id: Uuid) -> Result<Option<Value>> {
    let v = sqlx::query_scalar("SELECT input FROM operations WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await?;
    Ok(v)
}
