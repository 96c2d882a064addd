//! SQL of batch campaigns (`batches`, `batch_outcomes`): bulk enqueue, the controls (pause,
//! resume, cancel), auto-pause, completion and reopening, names, the list, progress and the
//! per-document report.
//!
//! Every write of `batches.status` is a named transition of `state::transition::batch`, and
//! every one keeps the running clock: `running_since` is set exactly while a batch is
//! `running`, and leaving `running` adds the open interval to `running_secs` ([`CLOCK`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::state::BatchStatus;
use crate::state::transition::batch::{self, Transition};
use crate::state::transition::{from_sql, to_sql};

/// A batch as stored.
#[derive(Clone, Debug, Serialize, FromRow)]
pub struct Batch {
    pub id: Uuid,
    #[sqlx(rename = "tenant_id")]
    pub tenant: String,
    pub kind: String,
    pub source: String,
    pub target: String,
    #[serde(skip)]
    pub instructions: String,
    pub options: Value,
    pub status: BatchStatus,
    pub canary: Option<i32>,
    pub documents: i32,
    pub pause_window: i32,
    pub pause_ratio: f32,
    pub paused_reason: Option<String>,
    /// Unique in its tenant; accepted wherever its id is.
    pub name: Option<String>,
    pub started_at: DateTime<Utc>,
    /// When it completed or was cancelled (none while it may still run).
    pub finished_at: Option<DateTime<Utc>>,
    /// When a `batch start` (or resume) had enqueued every document; none while one is under
    /// way or was interrupted. Nothing completes before it.
    pub filled_at: Option<DateTime<Utc>>,
    /// Seconds spent `running` up to now (not paused, not a canary waiting for its promotion).
    pub running_secs: f64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, tenant_id, kind, source, target, instructions, options, status, canary,
    documents, pause_window, pause_ratio, paused_reason, name, started_at, finished_at, filled_at,
    (running_secs + COALESCE(extract(epoch FROM now() - running_since), 0))::float8
        AS running_secs,
    created_at, updated_at";

/// The `SET` items every status write of a batch `b` carries (with `$to` replaced by the new
/// status' SQL literal): the running clock closes the open interval when the batch leaves
/// `running` (and, leaving `canary`, counts the canary's run: from the start to its last
/// operation's end, not the wait for a person after it), opens one when it enters `running`;
/// `finished_at` is set by the finishing statuses and cleared by the others.
pub const CLOCK: &str = "running_secs = b.running_secs
        + COALESCE(extract(epoch FROM now() - b.running_since), 0)
        + CASE WHEN b.status = 'canary'
               THEN COALESCE(GREATEST(0, extract(epoch FROM
                        (SELECT max(o.finished_at) FROM operations o WHERE o.batch_id = b.id)
                        - b.started_at)), 0)
               ELSE 0 END,
    running_since = CASE WHEN $to = 'running' THEN now() END,
    finished_at = CASE WHEN $to IN ('completed', 'cancelled') THEN now() END";

/// [`CLOCK`] for a write to `to`.
pub(super) fn clock(to: BatchStatus) -> String {
    CLOCK.replace("$to", &format!("'{to}'"))
}

/// What [`create_batch`] found.
#[derive(Debug)]
pub enum Created {
    /// A new batch.
    New(Batch),
    /// The batch with that id existed (a re-run); its name is set if it had none.
    Existing(Batch),
    /// Another batch of the tenant has the name; nothing was written.
    NameTaken,
}

/// Whether `e` is the violation of the unique name of batches in a tenant.
fn name_taken(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.constraint() == Some("batches_tenant_name"))
}

/// Creates the batch `b` (status `canary` when it has a canary, else `running`) unless a batch
/// with its id exists, which a re-run finds (its document count may grow; a name is set if it
/// had none). A name another batch of the tenant has writes nothing.
pub async fn create_batch(pool: &PgPool, b: &Batch, actor: &str) -> Result<Created> {
    match create(pool, b, actor).await {
        Err(super::Error::Sqlx(e)) if name_taken(&e) => Ok(Created::NameTaken),
        other => other,
    }
}

async fn create(pool: &PgPool, b: &Batch, actor: &str) -> Result<Created> {
    let mut tx = pool.begin().await?;
    if let Some(name) = &b.name {
        let taken: Option<Uuid> = sqlx::query_scalar(
            "SELECT id FROM batches WHERE tenant_id = $1 AND name = $2 AND id <> $3",
        )
        .bind(&b.tenant)
        .bind(name)
        .bind(b.id)
        .fetch_optional(&mut *tx)
        .await?;
        if taken.is_some() {
            return Ok(Created::NameTaken);
        }
    }
    let created: Option<Batch> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO batches (id, tenant_id, kind, source, target, instructions, options, status,
                              canary, documents, pause_window, pause_ratio, name, running_since)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13,
                 CASE WHEN $8 = 'running' THEN now() END)
         ON CONFLICT (id) DO NOTHING RETURNING {COLUMNS}"
    )))
    .bind(b.id)
    .bind(&b.tenant)
    .bind(&b.kind)
    .bind(&b.source)
    .bind(&b.target)
    .bind(&b.instructions)
    .bind(&b.options)
    .bind(b.status)
    .bind(b.canary)
    .bind(b.documents)
    .bind(b.pause_window)
    .bind(b.pause_ratio)
    .bind(&b.name)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(created) = created {
        audit(
            &mut tx,
            actor,
            "batch_start",
            b.id,
            None,
            Some(created.status.as_str()),
            None,
        )
        .await?;
        tx.commit().await?;
        return Ok(Created::New(created));
    }
    // Re-run: the document count may have grown; everything else identifies the batch.
    let existing: Batch = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE batches SET documents = GREATEST(documents, $2), name = COALESCE(name, $3),
                            updated_at = now()
          WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(b.id)
    .bind(b.documents)
    .bind(&b.name)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Created::Existing(existing))
}

/// A batch, in `tenant` if given.
pub async fn find_batch(pool: &PgPool, id: Uuid, tenant: Option<&str>) -> Result<Option<Batch>> {
    let b = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM batches WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)"
    )))
    .bind(id)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(b)
}

/// The dedupe keys of the operations a batch already has.
pub async fn enqueued_keys(pool: &PgPool, batch: Uuid) -> Result<Vec<String>> {
    let keys = sqlx::query_scalar(
        "SELECT dedupe_key FROM operations WHERE batch_id = $1 AND dedupe_key IS NOT NULL",
    )
    .bind(batch)
    .fetch_all(pool)
    .await?;
    Ok(keys)
}

/// Moves a batch by one of the named transitions `named` (all to the same status; audited as
/// `batch_<to>`); returns the status it had, or `None` when it was in none of their from-sets
/// (nothing changed).
pub async fn transition(
    pool: &PgPool,
    id: Uuid,
    named: &[Transition],
    actor: &str,
    reason: Option<&str>,
) -> Result<Option<BatchStatus>> {
    let Some(to) = named.first().map(|t| t.to) else {
        return Ok(None);
    };
    assert!(
        named.iter().all(|t| t.to == to),
        "one status write leads to one status"
    );
    let mut tx = pool.begin().await?;
    let before: Option<BatchStatus> =
        sqlx::query_scalar("SELECT status FROM batches WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(t) = before.and_then(|s| named.iter().find(|t| t.starts_from(s))) else {
        return Ok(None);
    };
    let before = before.expect("found above");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE batches b
            SET status = {to_sql}, updated_at = now(),
                paused_reason = CASE WHEN {to_sql} = 'paused' THEN $2 END,
                -- Resuming forgives the failures so far: auto-pause counts anew, after the
                -- workers' circuit breakers have had time to probe the provider again.
                count_from = CASE WHEN {to_sql} = 'running' THEN now() + interval '10 seconds'
                                  ELSE count_from END,
                {clock}
          WHERE id = $1 AND status IN {from}",
        to_sql = t.to_sql(),
        clock = clock(t.to),
        from = t.from_sql(),
    )))
    .bind(id)
    .bind(
        reason
            .map(|r| format!("paused by {actor}: {r}"))
            .unwrap_or_else(|| format!("paused by {actor}")),
    )
    .execute(&mut *tx)
    .await?;
    audit(
        &mut tx,
        actor,
        &format!("batch_{to}"),
        id,
        Some(before.as_str()),
        Some(to.as_str()),
        reason,
    )
    .await?;
    tx.commit().await?;
    // `batch::PROMOTE`, `batch::PAUSE`, `batch::RESUME` and `batch::CANCEL` are written here.
    Ok(Some(before))
}

/// Reopens the batch `id` inside `tx` if it is `completed` (audited as `actor`), and holds its
/// row lock until `tx` ends: the caller is about to give it unfinished work (a DLQ retry
/// re-queues one of its operations, `batch start` enqueues documents it was missing), and the
/// completion pass, which locks the rows it completes, then either sees that work or has
/// completed the batch before this reopens it. Returns whether it reopened it.
pub async fn reopen(tx: &mut sqlx::PgConnection, id: Uuid, actor: &str) -> Result<bool> {
    let t = batch::REOPEN;
    let status: Option<BatchStatus> =
        sqlx::query_scalar("SELECT status FROM batches WHERE id = $1 FOR UPDATE")
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
    if !status.is_some_and(|s| t.starts_from(s)) {
        return Ok(false);
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE batches b
            SET status = {to}, updated_at = now(),
                count_from = now() + interval '10 seconds', {clock}
          WHERE id = $1 AND status IN {from}",
        to = t.to_sql(),
        clock = clock(t.to),
        from = t.from_sql(),
    )))
    .bind(id)
    .execute(&mut *tx)
    .await?;
    audit(
        tx,
        actor,
        "batch_reopen",
        id,
        Some(BatchStatus::Completed.as_str()),
        Some(BatchStatus::Running.as_str()),
        None,
    )
    .await?;
    Ok(true)
}

/// Before `batch start` enqueues documents a batch is missing: the batch is not filled until
/// [`mark_filled`] (so it cannot complete meanwhile), and a completed one is reopened.
pub async fn begin_fill(pool: &PgPool, id: Uuid, actor: &str) -> Result<()> {
    let mut tx = pool.begin().await?;
    reopen(&mut tx, id, actor).await?;
    sqlx::query("UPDATE batches SET filled_at = NULL WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Every document of the batch has been enqueued (kept from the first time it was).
pub async fn mark_filled(pool: &PgPool, id: Uuid) -> Result<()> {
    sqlx::query("UPDATE batches SET filled_at = COALESCE(filled_at, now()) WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await?;
    Ok(())
}

/// A batch the completion pass completed.
#[derive(Clone, Debug, FromRow)]
pub struct Completed {
    pub id: Uuid,
    pub tenant_id: String,
}

/// Completes every filled `running` batch with no unfinished operation (audited as
/// `scheduler`): one probe of `operations_batch_unfinished` per running batch, so a batch
/// near the end of 50,000 documents costs what an empty one does. The candidates are locked
/// (`FOR UPDATE SKIP LOCKED`) and checked again by a second statement, whose snapshot is taken
/// with the locks held: a DLQ retry re-queues an operation holding its batch's lock
/// ([`reopen`]), so it has either committed before that snapshot (and is seen), or is skipped,
/// or waits for this commit and then reopens the batch.
pub async fn complete(pool: &PgPool) -> Result<Vec<Completed>> {
    let t = batch::COMPLETE;
    let unfinished = "NOT EXISTS (SELECT 1 FROM operations o
                       WHERE o.batch_id = b.id
                         AND o.status IN ('queued', 'running', 'sleeping', 'waiting'))";
    let mut tx = pool.begin().await?;
    let candidates: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT b.id FROM batches b
          WHERE b.status IN {from} AND b.filled_at IS NOT NULL AND {unfinished}
          ORDER BY b.id
            FOR UPDATE SKIP LOCKED",
        from = t.from_sql(),
    )))
    .fetch_all(&mut *tx)
    .await?;
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    let done: Vec<Completed> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH done AS (
            UPDATE batches b
               SET status = {to}, updated_at = now(), {clock}
             WHERE b.id = ANY($1) AND b.status IN {from} AND b.filled_at IS NOT NULL
               AND {unfinished}
            RETURNING b.id, b.tenant_id
         ), audited AS (
            INSERT INTO operator_actions (actor, action, status_before, status_after, details)
            SELECT 'scheduler', 'batch_completed', 'running', 'completed',
                   jsonb_build_object('batch_id', id)
              FROM done
         )
         SELECT id, tenant_id FROM done",
        to = t.to_sql(),
        clock = clock(t.to),
        from = t.from_sql(),
    )))
    .bind(&candidates)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(done)
}

/// Makes every queued operation of a batch due now, committed: its retry delays are cut short,
/// as a resume means the operator fixed what made them fail. Apart from [`lock_queued`], as
/// a claim of a row whose `run_at` changed under a lock not yet committed reads the old one
/// and skips it (`super::dispatch::Locked`). Returns how many were waiting for a retry.
pub async fn cut_retry_delays(pool: &PgPool, batch: Uuid) -> Result<u64> {
    Ok(sqlx::query(
        "UPDATE operations SET run_at = now()
          WHERE batch_id = $1 AND status = 'queued' AND run_at > now()",
    )
    .bind(batch)
    .execute(pool)
    .await?
    .rows_affected())
}

/// Locks up to `limit` due, queued operations of a batch not dispatched since `cutoff`, for
/// the caller to publish and then mark ([`super::dispatch::Locked`]). One not due yet (a retry
/// that failed after [`cut_retry_delays`]) is left to the dispatch sweep, which publishes it
/// when it is.
pub async fn lock_queued(
    pool: &PgPool,
    batch: Uuid,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> Result<super::dispatch::Locked> {
    let query = sqlx::query_as(
        "SELECT id, tenant_id, kind, lane, epoch, traceparent FROM operations
          WHERE batch_id = $1 AND status = 'queued' AND run_at <= now()
            AND (dispatched_at IS NULL OR dispatched_at < $2)
          ORDER BY id LIMIT $3
          FOR UPDATE SKIP LOCKED",
    )
    .bind(batch)
    .bind(cutoff)
    .bind(limit);
    super::dispatch::Locked::lock(pool, query).await
}

/// Cancels every unfinished operation of a batch: at once when queued, sleeping or waiting,
/// at the next step boundary when running. Returns (cancelled now, stop requested).
pub async fn cancel_operations(pool: &PgPool, batch: Uuid, actor: &str) -> Result<(u64, u64)> {
    let now = sqlx::query(concat!(
        "UPDATE operations
            SET status = ",
        to_sql!(CANCEL),
        ", error_class = 'cancelled', error_message = $2,
                waiting_for = NULL, finished_at = now(), updated_at = now()
          WHERE batch_id = $1 AND status IN ",
        from_sql!(CANCEL)
    ))
    .bind(batch)
    .bind(format!("batch cancelled by {actor}"))
    .execute(pool)
    .await?
    .rows_affected();
    let running = sqlx::query(
        "UPDATE operations SET cancel_requested = true WHERE batch_id = $1 AND status = 'running'",
    )
    .bind(batch)
    .execute(pool)
    .await?
    .rows_affected();
    Ok((now, running))
}

/// A batch paused by the scheduler because too many recent outcomes failed.
#[derive(Clone, Debug, FromRow)]
pub struct AutoPaused {
    pub id: Uuid,
    pub tenant_id: String,
    pub failed: i64,
    pub pause_window: i32,
}

/// Pauses every running (or canary) batch where at least `pause_ratio` of its newest
/// `pause_window` outcomes since the last resume failed; audited as `scheduler`. An attempt
/// requeued because its worker died (`lease_expired`) says nothing about the documents or the
/// provider and is not an outcome here: one killed worker with many operations in flight must
/// not pause a healthy campaign.
pub async fn auto_pause(pool: &PgPool) -> Result<Vec<AutoPaused>> {
    let t = batch::AUTO_PAUSE;
    let rows = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH tripped AS (
            SELECT b.id, w.failed, b.pause_window
              FROM batches b
             CROSS JOIN LATERAL (
                   SELECT count(*) FILTER (WHERE NOT r.ok) AS failed, count(*) AS n
                     FROM (SELECT ok FROM batch_outcomes x
                            WHERE x.batch_id = b.id AND x.at >= b.count_from
                              AND x.error_class IS DISTINCT FROM 'lease_expired'
                            ORDER BY x.id DESC LIMIT b.pause_window) r) w
             WHERE b.status IN {from}
               AND w.n >= b.pause_window AND w.failed >= ceil(b.pause_ratio * b.pause_window)
               FOR UPDATE OF b SKIP LOCKED
         ), paused AS (
            UPDATE batches b
               SET status = {to}, updated_at = now(),
                   paused_reason = format('auto-paused: %s of the last %s operations failed',
                                          t.failed, t.pause_window),
                   {clock}
              FROM tripped t WHERE b.id = t.id AND b.status IN {from}
            RETURNING b.id, b.tenant_id, t.failed, t.pause_window, b.paused_reason
         ), audited AS (
            INSERT INTO operator_actions (actor, action, reason, status_before, status_after, details)
            SELECT 'scheduler', 'batch_paused', paused_reason, 'running', 'paused',
                   jsonb_build_object('batch_id', id)
              FROM paused
         )
         SELECT id, tenant_id, failed, pause_window FROM paused",
        from = t.from_sql(),
        to = t.to_sql(),
        clock = clock(t.to),
    )))
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Operations of a batch by status.
pub async fn counts(pool: &PgPool, batch: Uuid) -> Result<Vec<(String, i64)>> {
    let rows = sqlx::query_as(
        "SELECT status, count(*) FROM operations WHERE batch_id = $1 GROUP BY status ORDER BY status",
    )
    .bind(batch)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Model calls and tokens of a batch: (calls, prompt tokens, completion tokens).
pub async fn usage(pool: &PgPool, batch: Uuid) -> Result<(i64, i64, i64)> {
    let row = sqlx::query_as(
        "SELECT count(*),
                COALESCE(sum((s.usage->>'prompt_tokens')::bigint), 0)::bigint,
                COALESCE(sum((s.usage->>'completion_tokens')::bigint), 0)::bigint
           FROM operations o JOIN operation_steps s ON s.op_id = o.id
          WHERE o.batch_id = $1 AND s.kind = 'model' AND s.status = 'completed'
            AND s.usage IS NOT NULL",
    )
    .bind(batch)
    .fetch_one(pool)
    .await?;
    Ok(row)
}

/// The most common failures of a batch's unfinished or dead operations.
#[derive(Clone, Debug, Serialize, FromRow, schemars::JsonSchema)]
#[schemars(rename = "BatchFailure")]
pub struct Failure {
    pub error_class: String,
    pub reason: String,
    pub count: i64,
}

pub async fn top_failures(pool: &PgPool, batch: Uuid, limit: i64) -> Result<Vec<Failure>> {
    let rows = sqlx::query_as(
        "SELECT error_class,
                left(regexp_replace(COALESCE(error_message, ''), '[0-9]+', '<n>', 'g'), 160) AS reason,
                count(*) AS count
           FROM operations
          WHERE batch_id = $1 AND error_class IS NOT NULL AND status IN ('queued', 'dead')
          GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT $2",
    )
    .bind(batch)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// One line of `batch report`.
#[derive(Clone, Debug, Serialize, FromRow)]
pub struct ReportRow {
    pub doc_id: Option<String>,
    pub op_id: Uuid,
    pub status: String,
    pub attempt: i32,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    pub sha256: Option<String>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// A keyset page of a batch's report, by operation id.
pub async fn report_page(
    pool: &PgPool,
    batch: Uuid,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<ReportRow>> {
    let rows = sqlx::query_as(
        "SELECT input->>'doc_id' AS doc_id, id AS op_id, status, attempt, error_class,
                error_message, result->>'sha256' AS sha256, finished_at
           FROM operations
          WHERE batch_id = $1 AND ($2::uuid IS NULL OR id > $2)
          ORDER BY id LIMIT $3",
    )
    .bind(batch)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// A batch as lists show it: what identifies it, its times, and its operations counted.
#[derive(Clone, Debug, Serialize, FromRow, schemars::JsonSchema)]
#[schemars(rename = "ListedBatch")]
pub struct Listed {
    pub batch_id: Uuid,
    pub name: Option<String>,
    pub tenant: String,
    pub kind: String,
    pub status: BatchStatus,
    pub paused_reason: Option<String>,
    /// Documents in its source store.
    pub documents: i32,
    pub enqueued: i64,
    pub succeeded: i64,
    /// Dead, discarded or cancelled.
    pub failed: i64,
    /// Queued, running, sleeping or waiting.
    pub unfinished: i64,
    pub created_at: DateTime<Utc>,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// Which batches a list shows.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// One tenant's (none: every tenant's).
    pub tenant: Option<String>,
    pub status: Option<BatchStatus>,
}

/// A keyset page of batches, newest first by `(created_at, id)`, after `after`.
pub async fn list(
    pool: &PgPool,
    filter: &Filter,
    limit: i64,
    after: Option<(DateTime<Utc>, Uuid)>,
) -> Result<Vec<Listed>> {
    let rows = sqlx::query_as(
        "SELECT b.id AS batch_id, b.name, b.tenant_id AS tenant, b.kind, b.status,
                b.paused_reason, b.documents,
                COALESCE(c.enqueued, 0) AS enqueued, COALESCE(c.succeeded, 0) AS succeeded,
                COALESCE(c.failed, 0) AS failed, COALESCE(c.unfinished, 0) AS unfinished,
                b.created_at, b.started_at, b.finished_at
           FROM batches b
           LEFT JOIN LATERAL (
                SELECT count(*) AS enqueued,
                       count(*) FILTER (WHERE status = 'succeeded') AS succeeded,
                       count(*) FILTER (WHERE status IN ('dead', 'discarded', 'cancelled')) AS failed,
                       count(*) FILTER (WHERE status IN ('queued', 'running', 'sleeping', 'waiting'))
                           AS unfinished
                  FROM operations o WHERE o.batch_id = b.id) c ON true
          WHERE ($1::text IS NULL OR b.tenant_id = $1)
            AND ($2::text IS NULL OR b.status = $2)
            AND ($3::timestamptz IS NULL OR (b.created_at, b.id) < ($3, $4))
          ORDER BY b.created_at DESC, b.id DESC LIMIT $5",
    )
    .bind(&filter.tenant)
    .bind(filter.status)
    .bind(after.map(|a| a.0))
    .bind(after.map(|a| a.1))
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

async fn audit(
    tx: &mut sqlx::PgConnection,
    actor: &str,
    action: &str,
    batch: Uuid,
    before: Option<&str>,
    after: Option<&str>,
    reason: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, reason, status_before, status_after, details)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(actor)
    .bind(action)
    .bind(reason)
    .bind(before)
    .bind(after)
    .bind(serde_json::json!({ "batch_id": batch }))
    .execute(tx)
    .await?;
    Ok(())
}
