//! SQL for the `operations` table: insert (idempotent enqueue), claim, lease renewal, the final
//! transitions, dispatch bookkeeping and reads.
//!
//! Every write after a claim is fenced by `id AND epoch AND status = 'running'`: zero rows
//! updated means the lease was lost and the caller must stop writing for that operation.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgConnection, PgPool};
use uuid::Uuid;

use super::steps::{bind_journal, bind_steps, journal_cte, journal_many_cte, owned_rows};
use super::{Result, StepWrite};
use crate::operation::{Lane, OperationId, OperationView};
use crate::state::transition::{FAIL_CANCEL, FAIL_DEAD, FAIL_RETRY, from_sql, to_sql};
use crate::state::{ErrorClass, Status, terminal_sql};

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

/// Inserts an operation, or finds the one its `(tenant, dedupe_key)` already names.
/// Takes a connection so it can run inside the caller's own transaction.
pub async fn insert_operation(conn: &mut PgConnection, op: &NewOperation) -> Result<Inserted> {
    let row: Option<(Uuid, i64)> = sqlx::query_as(
        "INSERT INTO operations (id, tenant_id, kind, lane, concurrency_limit, input,
                                 input_sha256, dedupe_key, ordering_key, batch_id, max_attempts,
                                 run_at, deadline, request_id, traceparent, schedule_id,
                                 concurrency_key, parent_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, COALESCE($12, now()), $13, $14, $15,
                 $16, $17, $18)
         ON CONFLICT (tenant_id, dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING
         RETURNING id, epoch",
    )
    .bind(op.id.0)
    .bind(&op.tenant)
    .bind(&op.kind)
    .bind(op.lane.as_str())
    .bind(op.concurrency_limit)
    .bind(&op.input)
    .bind(&op.input_sha256)
    .bind(&op.dedupe_key)
    .bind(&op.ordering_key)
    .bind(op.batch_id)
    .bind(op.max_attempts)
    .bind(op.run_at)
    .bind(op.deadline)
    .bind(&op.request_id)
    .bind(&op.traceparent)
    .bind(op.schedule_id)
    .bind(&op.concurrency_key)
    .bind(op.parent_id)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some((id, epoch)) = row {
        return Ok(Inserted::Created {
            id: OperationId(id),
            epoch,
        });
    }
    // A status this build does not know is a decoding error, never a guess.
    let (id, status, input_sha256): (Uuid, Status, String) = sqlx::query_as(
        "SELECT id, status, input_sha256 FROM operations WHERE tenant_id = $1 AND dedupe_key = $2",
    )
    .bind(&op.tenant)
    .bind(&op.dedupe_key)
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

/// An operation a worker has just claimed: everything it needs to run the job function.
#[derive(Clone, Debug, FromRow)]
pub struct Claimed {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    /// The version of its kind it runs on (pinned by its first claim).
    pub kind_version: String,
    /// Set by an operator's upgrade: the last journal position a divergence may rebase from.
    pub upgrade_through: Option<i32>,
    pub input: Value,
    pub epoch: i64,
    pub attempt: i32,
    pub max_attempts: i32,
    pub restarts: i32,
    pub deadline: Option<DateTime<Utc>>,
    /// The `x-request-id` of the request that created it (for log lines about it).
    pub request_id: Option<String>,
    /// The W3C trace context it was created in: the worker's span for it is that span's child.
    pub traceparent: Option<String>,
    /// Whether the journal has rows; a first run skips loading it.
    pub has_journal: bool,
}

/// Claims every operation of `ids` that is queued and due, in one committed statement: status
/// `running`, a new epoch, the next attempt and a lease for `owner`. Ids that are running
/// elsewhere, finished, not yet due, behind an unfinished operation of their ordering key, over
/// their concurrency key's limit, or unknown are simply not returned.
pub async fn claim_operations(
    pool: &PgPool,
    ids: &[Uuid],
    runnable: &super::versions::Runnable,
    owner: &str,
    lease_ttl: Duration,
) -> Result<Vec<Claimed>> {
    let q = sqlx::query_as(concat!(
        "WITH locked AS (
            -- Lock in id order: batches of overlapping ids (duplicate pointers on two workers,
            -- dispatch marks) then queue behind each other instead of deadlocking.
            -- Found by primary key only: the status test is written so that no partial index
            -- over queued rows can serve it. Right after a bulk enqueue the planner's row
            -- estimates for those indexes are stale (hundreds, not the 100k queued), and it
            -- would scan the whole backlog bitmap per claim, O(backlog) instead of O(batch).
            -- The columns read below are the locked (latest) row versions'.
            SELECT id, tenant_id, kind, kind_version, ordering_key, concurrency_key,
                   concurrency_limit, created_at, batch_id
              FROM operations
             WHERE id = ANY($1) AND COALESCE(status, '') IN ",
        from_sql!(CLAIM),
        " AND run_at <= now()
             ORDER BY id
               FOR UPDATE
         ), startable AS (
            SELECT o.* FROM locked o
             -- Only a worker that runs the operation's version (or, for one not run yet, the
             -- newest live version of its kind) may claim it.
             WHERE ",
        super::versions::runnable_sql!(),
        "
               -- Ordering keys: only the oldest unfinished operation of its key may start.
               AND (o.ordering_key IS NULL OR NOT EXISTS (
                       SELECT 1 FROM operations p
                        WHERE p.tenant_id = o.tenant_id AND p.ordering_key = o.ordering_key
                          AND p.status NOT IN ",
        terminal_sql!(),
        "
                          AND (p.created_at, p.id) < (o.created_at, o.id)))
               -- A paused or cancelled batch starts nothing; resuming re-dispatches its queue.
               AND NOT in_stopped_batch(o.batch_id)
         ), counters AS (
            -- Concurrency keys: lock the batch's counters (after its operations, in key order,
            -- like every other statement that takes both) and read how many run now.
            SELECT c.tenant_id, c.key, c.running, c.lim FROM concurrency_keys c
             WHERE (c.tenant_id, c.key) IN (SELECT tenant_id, concurrency_key FROM startable
                                             WHERE concurrency_key IS NOT NULL)
             ORDER BY c.tenant_id, c.key
               FOR UPDATE
         ), admitted AS (
            -- A key's operations start oldest first while the key stays under its limit.
            SELECT s.id FROM (
                -- The key's limit (its first operation's), whatever this operation asked.
                SELECT o.id, o.concurrency_key IS NULL AS free,
                       COALESCE(c.lim, o.concurrency_limit) AS concurrency_limit,
                       row_number() OVER (PARTITION BY o.tenant_id, o.concurrency_key
                                          ORDER BY o.created_at, o.id) AS nth,
                       c.running
                  FROM startable o
                  LEFT JOIN counters c
                    ON c.tenant_id = o.tenant_id AND c.key = o.concurrency_key) s
             WHERE s.free OR s.running + s.nth <= s.concurrency_limit
         )
         UPDATE operations o
            SET status = ",
        to_sql!(CLAIM),
        ", epoch = o.epoch + 1, attempt = o.attempt + 1,
                lease_owner = $6, lease_expires_at = now() + make_interval(secs => $7),
                updated_at = now(), version_parked = false, share_held = false,
                -- The first claim pins the version: the claiming worker's for this kind.
                kind_version = COALESCE(o.kind_version,
                    (SELECT p.version FROM unnest($4::text[], $5::text[]) AS p(kind, version)
                      WHERE p.kind = o.kind LIMIT 1))
           FROM admitted
          WHERE o.id = admitted.id
      RETURNING o.id, o.tenant_id, o.kind, o.kind_version, o.upgrade_through, o.input,
                o.epoch, o.attempt, o.max_attempts, o.restarts, o.deadline, o.request_id,
                o.traceparent,
                EXISTS (SELECT 1 FROM operation_steps s WHERE s.op_id = o.id) AS has_journal"
    ))
    .bind(ids);
    let rows = runnable
        .bind(q)
        .bind(owner)
        .bind(lease_ttl.as_secs_f64())
        .fetch_all(pool)
        .await?;
    Ok(rows)
}

/// Extends the leases of every operation `owner` runs, in one statement. Returns the ids still
/// held, each with whether a cancel was requested; an id missing from the answer was lost.
pub async fn renew_leases(
    pool: &PgPool,
    owner: &str,
    held: &[(Uuid, i64)],
    lease_ttl: Duration,
) -> Result<Vec<(Uuid, bool)>> {
    let (ids, epochs): (Vec<Uuid>, Vec<i64>) = held.iter().copied().unzip();
    let rows = sqlx::query_as(
        "WITH locked AS (
            SELECT o.id FROM operations o
              JOIN unnest($2::uuid[], $3::bigint[]) AS h(id, epoch)
                ON o.id = h.id AND o.epoch = h.epoch
             WHERE o.status = 'running' AND o.lease_owner = $1
             ORDER BY o.id
               FOR UPDATE
         )
         UPDATE operations o
            SET lease_expires_at = now() + make_interval(secs => $4)
           FROM locked
          WHERE o.id = locked.id AND o.status = 'running' AND o.lease_owner = $1
            AND o.lease_expires_at > now()
      RETURNING o.id, o.cancel_requested",
    )
    .bind(owner)
    .bind(&ids)
    .bind(&epochs)
    .bind(lease_ttl.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// One running operation's success, for [`complete_operations`].
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: Uuid,
    pub epoch: i64,
    pub result: Value,
    /// Its pending journal rows.
    pub steps: Vec<StepWrite>,
}

/// Finishes many running operations with their results and pending journal rows in one
/// statement (one commit), each fenced by its own epoch and status. Returns the ids written;
/// an id missing from it lost its lease (nothing was written for it).
/// The journal upsert is `journal_cte!`'s, joined on each row's operation instead of one.
pub async fn complete_operations(pool: &PgPool, batch: &[Completion]) -> Result<Vec<Uuid>> {
    let ids: Vec<Uuid> = batch.iter().map(|c| c.id).collect();
    let epochs: Vec<i64> = batch.iter().map(|c| c.epoch).collect();
    let results: Vec<&Value> = batch.iter().map(|c| &c.result).collect();
    let (steps, owners) = owned_rows(batch.iter().map(|c| (c.id, c.steps.as_slice())));
    const SQL: &str = concat!(
        "WITH input AS (
            SELECT * FROM unnest($13::uuid[], $14::bigint[], $15::jsonb[]) AS i(id, epoch, result)
         ), locked AS (
            -- Lock in id order, like the claim and the heartbeat, so they cannot deadlock.
            SELECT o.id, i.epoch, i.result FROM operations o JOIN input i ON o.id = i.id
             WHERE o.epoch = i.epoch AND o.status IN ",
        from_sql!(COMPLETE),
        "
             ORDER BY o.id
               FOR UPDATE OF o
         ), done AS (
            UPDATE operations o
               SET status = ",
        to_sql!(COMPLETE),
        ", result = l.result, finished_at = now(), updated_at = now(),
                   lease_owner = NULL, lease_expires_at = NULL,
                   error_class = NULL, error_message = NULL
              FROM locked l
             WHERE o.id = l.id AND o.epoch = l.epoch AND o.status IN ",
        from_sql!(COMPLETE),
        "
         RETURNING o.id, o.epoch
         ), ",
        journal_many_cte!("done", "$16"),
        "
         SELECT id FROM done"
    );
    let done: Vec<Uuid> = bind_steps(sqlx::query_scalar(SQL), steps)
        .bind(&ids)
        .bind(&epochs)
        .bind(&results)
        .bind(&owners)
        .fetch_all(pool)
        .await?;
    Ok(done)
}

/// Where a failed attempt sends a running operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FailTo {
    /// Back to `queued`, not before `run_at`. `count_attempt: false` gives the attempt back
    /// (an overloaded provider is not the operation's fault).
    Retry {
        run_at: DateTime<Utc>,
        count_attempt: bool,
    },
    /// `dead`, with an open dead letter for a human.
    Dead,
    /// `cancelled` (stopped on request).
    Cancelled,
}

/// Ends a running attempt as failed, writing its pending journal rows in the same statement.
/// Returns false when the lease was lost (nothing was written).
#[allow(clippy::too_many_arguments)]
pub async fn fail_operation(
    pool: &PgPool,
    id: Uuid,
    epoch: i64,
    class: ErrorClass,
    message: &str,
    to: FailTo,
    failed_step: Option<i32>,
    steps: &[StepWrite],
) -> Result<bool> {
    let (status, run_at, uncounted) = match to {
        FailTo::Retry {
            run_at,
            count_attempt,
        } => (FAIL_RETRY.to, Some(run_at), !count_attempt),
        FailTo::Dead => (FAIL_DEAD.to, None, false),
        FailTo::Cancelled => (FAIL_CANCEL.to, None, false),
    };
    let done: Option<Uuid> = bind_journal(
        sqlx::query_scalar(concat!(
            "WITH failed AS (
                UPDATE operations
                   SET status = $17, run_at = COALESCE($18, run_at), dispatched_at = NULL,
                       attempt = CASE WHEN $19 THEN attempt - 1 ELSE attempt END,
                       finished_at = CASE WHEN $17 = ",
            to_sql!(FAIL_RETRY),
            " THEN NULL ELSE now() END,
                       error_class = $15, error_message = $16, updated_at = now(),
                       lease_owner = NULL, lease_expires_at = NULL
                 WHERE id = $14 AND epoch = $13 AND status IN ",
            from_sql!(FAIL_RETRY),
            "
             RETURNING id, tenant_id, kind, attempt, status
             ), letter AS (
                INSERT INTO dead_letters (id, op_id, tenant_id, kind, class, reason, failed_step, attempts)
                SELECT gen_random_uuid(), id, tenant_id, kind, $15, $16, $20, attempt
                  FROM failed WHERE status = 'dead'
                ON CONFLICT (op_id) WHERE status = 'open' DO UPDATE
                   SET class = EXCLUDED.class, reason = EXCLUDED.reason,
                       failed_step = EXCLUDED.failed_step, attempts = EXCLUDED.attempts
             ), ",
            journal_cte!("failed"),
            " SELECT id FROM failed"
        )),
        steps,
        epoch,
        id,
    )
    .bind(class)
    .bind(message)
    .bind(status)
    .bind(run_at)
    .bind(uncounted)
    .bind(failed_step)
    .fetch_optional(pool)
    .await?;
    Ok(done.is_some())
}

/// A pointer to (re)publish: the fields of the message plus the epoch it was taken at.
#[derive(Clone, Debug, PartialEq, FromRow)]
pub struct Dispatch {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub lane: String,
    pub epoch: i64,
    /// The W3C trace context stored with the operation, sent along as an AMQP header.
    #[sqlx(default)]
    pub traceparent: Option<String>,
}

/// Records that pointers were confirmed by the broker. A mark stamped with an older epoch (the
/// operation was claimed meanwhile), for an operation no longer queued, or for a row locked at
/// this moment changes nothing (at worst the sweeper publishes a harmless duplicate later).
pub async fn mark_dispatched(pool: &PgPool, sent: &[(Uuid, i64)]) -> Result<u64> {
    let (ids, epochs): (Vec<Uuid>, Vec<i64>) = sent.iter().copied().unzip();
    let n = sqlx::query(
        "WITH locked AS (
            SELECT o.id
              FROM unnest($1::uuid[], $2::bigint[]) AS d(id, epoch),
                   -- One primary-key lookup per id. `OFFSET 0` keeps the status conditions
                   -- out of the subquery: pushed in, they let the planner pick the partial
                   -- `operations_undispatched` index and scan all of it for every id (its
                   -- statistics lag a bulk load), which made a 100,000-row enqueue quadratic.
                   LATERAL (SELECT id, epoch, status, dispatched_at FROM operations
                             WHERE id = d.id OFFSET 0
                               -- Never wait: a row locked right now is being claimed (its
                               -- epoch moves on, so no mark is needed), and a mark that
                               -- never waits can't deadlock.
                               FOR UPDATE SKIP LOCKED) o
             WHERE o.epoch = d.epoch AND o.status = 'queued' AND o.dispatched_at IS NULL
         )
         -- The rows are locked and were checked above; nothing can change them meanwhile.
         UPDATE operations o SET dispatched_at = now() FROM locked WHERE o.id = locked.id",
    )
    .bind(&ids)
    .bind(&epochs)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}

/// Queued rows locked for dispatch inside an open transaction. The caller publishes their
/// pointers and then [`marks`](Locked::mark) the confirmed ones: the marks commit together with
/// the release of the locks, so no failure leaves a row marked but unpublished. A scheduler
/// killed meanwhile, a lost connection or a commit whose answer never arrived rolls back (the
/// rows stay due for the next sweep, at worst with a second, harmless pointer); a publish that
/// fails leaves its row unmarked. While locked, the rows are skipped by other sweepers, and a
/// worker's claim of one waits for the commit (milliseconds: one round of confirms).
pub struct Locked {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    pub rows: Vec<Dispatch>,
}

impl Locked {
    /// Runs `query` (a `SELECT … FOR UPDATE` or an `UPDATE … RETURNING` of dispatch rows) in
    /// a new transaction left open.
    pub(crate) async fn lock(
        pool: &PgPool,
        query: sqlx::query::QueryAs<'_, sqlx::Postgres, Dispatch, sqlx::postgres::PgArguments>,
    ) -> Result<Self> {
        let mut tx = pool.begin().await?;
        let rows = query.fetch_all(&mut *tx).await?;
        Ok(Self { tx, rows })
    }

    /// Records that the pointers of `sent` (a subset of [`Locked::rows`]) were confirmed and
    /// releases every lock; returns how many rows were marked.
    pub async fn mark(mut self, sent: &[(Uuid, i64)]) -> Result<u64> {
        let (ids, epochs): (Vec<Uuid>, Vec<i64>) = sent.iter().copied().unzip();
        let n = if ids.is_empty() {
            0
        } else {
            sqlx::query(
                "UPDATE operations o SET dispatched_at = now()
                   FROM unnest($1::uuid[], $2::bigint[]) AS d(id, epoch)
                  WHERE o.id = d.id AND o.epoch = d.epoch AND o.status = 'queued'",
            )
            .bind(&ids)
            .bind(&epochs)
            .execute(&mut *self.tx)
            .await?
            .rows_affected()
        };
        self.tx.commit().await?;
        Ok(n)
    }
}

/// Locks up to `limit` due, queued operations that were committed at least `grace` ago but
/// whose pointer was never confirmed (the producer died between commit and publish, a retry
/// came due, a lease was released or reaped, a wake's publish failed). `SKIP LOCKED` lets
/// several schedulers sweep at once without taking the same rows.
pub async fn lock_undispatched(pool: &PgPool, grace: Duration, limit: i64) -> Result<Locked> {
    let query = sqlx::query_as(
        "SELECT id, tenant_id, kind, lane, epoch, traceparent FROM operations
          WHERE status = 'queued' AND dispatched_at IS NULL
            AND run_at <= now() AND NOT in_stopped_batch(batch_id)
            -- The grace period waits out a producer's own publish; a row
            -- scheduled for later (a retry) has none in flight.
            AND (updated_at < now() - make_interval(secs => $1)
                 OR run_at > updated_at)
          ORDER BY updated_at
          LIMIT $2
          FOR UPDATE SKIP LOCKED",
    )
    .bind(grace.as_secs_f64())
    .bind(limit);
    Locked::lock(pool, query).await
}

/// Locks the operations `ids` a wake just queued that are still queued and unmarked, for their
/// publish: while the pointers go out, the sweeper skips these rows (so a burst whose confirms
/// lag past its grace period is not published twice), and a claim of one waits for the marks.
/// Rows locked elsewhere are skipped (they stay unmarked, and the sweeper publishes them).
pub async fn lock_woken(pool: &PgPool, ids: &[Uuid]) -> Result<Locked> {
    let query = sqlx::query_as(
        "SELECT id, tenant_id, kind, lane, epoch, traceparent FROM operations
          WHERE id = ANY($1) AND status = 'queued' AND dispatched_at IS NULL
          ORDER BY id
          FOR UPDATE SKIP LOCKED",
    )
    .bind(ids);
    Locked::lock(pool, query).await
}

/// Locks up to `limit` due, queued operations of `lane` whose pointer was confirmed more than
/// `stale` ago. Only called when the lane's queue is empty, so these pointers were lost (a
/// broker reset, a purged queue): republishing them cannot flood a legitimate backlog.
pub async fn lock_lost_dispatches(
    pool: &PgPool,
    lane: Lane,
    stale: Duration,
    limit: i64,
) -> Result<Locked> {
    let query = sqlx::query_as(
        "SELECT id, tenant_id, kind, lane, epoch, traceparent FROM operations
          WHERE status = 'queued' AND lane = $1 AND run_at <= now()
            AND NOT in_stopped_batch(batch_id)
            -- A parked or held operation's pointer was acked on purpose: a worker pulls it.
            AND NOT version_parked AND NOT share_held
            AND dispatched_at < now() - make_interval(secs => $2)
          ORDER BY run_at
          LIMIT $3
          FOR UPDATE SKIP LOCKED",
    )
    .bind(lane.as_str())
    .bind(stale.as_secs_f64())
    .bind(limit);
    Locked::lock(pool, query).await
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

/// Holds the queued operations `ids` for fair shares (`share_held`): their tenant is at its
/// share of the claiming worker's slots while another tenant has work queued. Their pointers
/// are acked; a worker with room for the tenant pulls them ([`share_held_in`]). Returns how many.
pub async fn hold_for_share(pool: &PgPool, ids: &[Uuid]) -> Result<u64> {
    let n = sqlx::query(
        "UPDATE operations SET share_held = true
          WHERE id = ANY($1) AND status = 'queued' AND NOT share_held",
    )
    .bind(ids)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}

/// Whether a tenant other than `tenant` has an operation queued in `lane`: the next tenant
/// after it and the one before it in the index `operations_unfinished`, two probes whatever
/// the backlog.
pub async fn others_queued(pool: &PgPool, lane: Lane, tenant: &str) -> Result<bool> {
    // Work a worker could start: due, its pointer out, not parked for a version nor held for
    // a share itself (a tenant over its share does not count as waiting on another).
    let found: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM operations
                         WHERE lane = $1 AND status = 'queued' AND tenant_id > $2
                           AND run_at <= now() AND dispatched_at IS NOT NULL
                           AND NOT version_parked AND NOT share_held)
             OR EXISTS (SELECT 1 FROM operations
                         WHERE lane = $1 AND status = 'queued' AND tenant_id < $2
                           AND run_at <= now() AND dispatched_at IS NOT NULL
                           AND NOT version_parked AND NOT share_held)",
    )
    .bind(lane.as_str())
    .bind(tenant)
    .fetch_one(pool)
    .await?;
    Ok(found)
}

/// Up to `limit` operations of `lane` held for fair shares, oldest first: id and tenant.
pub async fn share_held_in(pool: &PgPool, lane: Lane, limit: i64) -> Result<Vec<(Uuid, String)>> {
    let rows = sqlx::query_as(
        "SELECT id, tenant_id FROM operations
          WHERE share_held AND status = 'queued' AND lane = $1 AND run_at <= now()
          ORDER BY created_at, id
          LIMIT $2",
    )
    .bind(lane.as_str())
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
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

/// What the reaper did with one expired lease.
#[derive(Clone, Debug, FromRow)]
pub struct Reaped {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub lane: String,
    pub epoch: i64,
    /// `queued` (will run again) or `dead` (`crash_loop`): see
    /// [`crate::state::failure::after_lease_expiry`].
    pub status: Status,
    pub restarts: i32,
    /// The unsafe step that was in flight (`started` in the journal), if any.
    pub in_flight: Option<i32>,
}

/// Recovers up to `limit` running operations whose lease expired (their worker died or hung):
/// `restarts + 1` and the attempt given back, back to `queued`, or `dead` with class `crash_loop` (and an open dead letter)
/// when restarts exceed `restart_limit`. The message names the step in flight.
/// The decision is [`crate::state::failure::after_lease_expiry`], written here as SQL so one
/// statement decides many rows; a test checks the two agree.
pub async fn reap_expired_leases(
    pool: &PgPool,
    restart_limit: i32,
    limit: i64,
) -> Result<Vec<Reaped>> {
    let rows = sqlx::query_as(REAP_EXPIRED_LEASES)
        .bind(restart_limit)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(rows)
}

/// The reaper's statement: `$1` the restart limit, `$2` how many rows at most.
const REAP_EXPIRED_LEASES: &str = concat!(
    "WITH expired AS (
            SELECT o.id,
                   (SELECT s.seq FROM operation_steps s
                     WHERE s.op_id = o.id AND s.status = 'started'
                     ORDER BY s.seq DESC LIMIT 1) AS in_flight
              FROM operations o
             WHERE o.status IN ",
    from_sql!(REAP),
    " AND o.lease_expires_at < now()
             ORDER BY o.lease_expires_at
             LIMIT $2
               FOR UPDATE SKIP LOCKED
         ), reaped AS (
            UPDATE operations o
               SET restarts = o.restarts + 1,
                   status = CASE WHEN o.restarts + 1 > $1 THEN ",
    to_sql!(CRASH_LOOP),
    " ELSE ",
    to_sql!(REAP),
    " END,
                   -- An attempt cut short by a crash is not a failure of the job: it is given
                   -- back (the next claim counts it again); `restarts` has its own limit.
                   attempt = CASE WHEN o.restarts + 1 > $1 THEN o.attempt
                                  ELSE GREATEST(o.attempt - 1, 0) END,
                   error_class = CASE WHEN o.restarts + 1 > $1 THEN 'crash_loop' ELSE 'lease_expired' END,
                   error_message = format('lease of %s expired (worker died or hung) %s; restart %s of %s',
                                          o.lease_owner,
                                          CASE WHEN e.in_flight IS NULL THEN 'with no unsafe step in flight'
                                               ELSE format('during step %s', e.in_flight) END,
                                          o.restarts + 1, $1),
                   finished_at = CASE WHEN o.restarts + 1 > $1 THEN now() END,
                   run_at = now(), updated_at = now(),
                   -- Published and then marked by the reaper, as a producer does; if it
                   -- dies first, the sweeper publishes them after its grace period.
                   dispatched_at = NULL,
                   lease_owner = NULL, lease_expires_at = NULL
              FROM expired e
             WHERE o.id = e.id
         RETURNING o.id, o.tenant_id, o.kind, o.lane, o.epoch, o.status, o.restarts, o.attempt,
                   o.error_message, e.in_flight
         ), letters AS (
            INSERT INTO dead_letters (id, op_id, tenant_id, kind, class, reason, failed_step, attempts)
            SELECT gen_random_uuid(), id, tenant_id, kind, 'crash_loop', error_message, in_flight, attempt
              FROM reaped WHERE status = 'dead'
            ON CONFLICT (op_id) WHERE status = 'open' DO NOTHING
         )
         SELECT id, tenant_id, kind, lane, epoch, status, restarts, in_flight FROM reaped"
);

/// Hands operations back on a graceful shutdown: each still running at `epoch` under `owner`
/// returns to `queued` without counting a restart or using up its attempt, for the dispatch
/// sweeper to publish again.
/// `updated_at` is set in the past so the sweeper takes them at its next tick: no producer
/// publish is in flight for them, so the sweeper's grace period has nothing to wait for.
pub async fn release_leases(pool: &PgPool, owner: &str, held: &[(Uuid, i64)]) -> Result<u64> {
    let (ids, epochs): (Vec<Uuid>, Vec<i64>) = held.iter().copied().unzip();
    let n = sqlx::query(concat!(
        "UPDATE operations o
            SET status = ",
        to_sql!(RELEASE),
        ", run_at = now(), dispatched_at = NULL,
                attempt = GREATEST(o.attempt - 1, 0),
                lease_owner = NULL, lease_expires_at = NULL, updated_at = now() - interval '1 hour'
           FROM unnest($2::uuid[], $3::bigint[]) AS h(id, epoch)
          WHERE o.id = h.id AND o.epoch = h.epoch AND o.status IN ",
        from_sql!(RELEASE),
        " AND o.lease_owner = $1"
    ))
    .bind(owner)
    .bind(&ids)
    .bind(&epochs)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}

/// Hands a running operation this worker stopped for fair shares back to the queue, held
/// (`share_held`: a worker with room for its tenant pulls it), its attempt given back and no
/// restart counted: it resumes from its journal. Its finished steps not yet written (`steps`)
/// are written in the same statement. Fenced by the epoch and the lease owner.
pub async fn release_for_share(
    pool: &PgPool,
    owner: &str,
    id: Uuid,
    epoch: i64,
    steps: &[StepWrite],
) -> Result<bool> {
    let released: Option<Uuid> = bind_journal(
        sqlx::query_scalar(concat!(
            "WITH released AS (
                UPDATE operations
                   SET status = ",
            to_sql!(RELEASE_FOR_SHARE),
            ", run_at = now(), share_held = true,
                       dispatched_at = COALESCE(dispatched_at, now()),
                       attempt = GREATEST(attempt - 1, 0),
                       lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
                 WHERE id = $14 AND epoch = $13 AND status IN ",
            from_sql!(RELEASE_FOR_SHARE),
            " AND lease_owner = $15
             RETURNING id
             ), ",
            journal_cte!("released"),
            " SELECT id FROM released"
        )),
        steps,
        epoch,
        id,
    )
    .bind(owner)
    .fetch_optional(pool)
    .await?;
    Ok(released.is_some())
}

/// The input of an operation (operators patch it before a retry).
pub async fn operation_input(pool: &PgPool, id: Uuid) -> Result<Option<Value>> {
    let v = sqlx::query_scalar("SELECT input FROM operations WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::failure::after_lease_expiry;

    /// The reaper's SQL is [`after_lease_expiry`] for many rows: the same boundary
    /// (`restarts + 1 > limit`), the same statuses and classes on each side of it.
    #[test]
    fn the_reaper_sql_mirrors_the_lease_expiry_decision() {
        let limit = 3;
        let (dead, crash_loop) = after_lease_expiry(limit, limit);
        let (queued, lease_expired) = after_lease_expiry(limit - 1, limit);
        let sql = REAP_EXPIRED_LEASES;
        for expected in [
            format!("status = CASE WHEN o.restarts + 1 > $1 THEN '{dead}' ELSE '{queued}' END"),
            format!(
                "error_class = CASE WHEN o.restarts + 1 > $1 THEN '{crash_loop}' ELSE '{lease_expired}' END"
            ),
            format!("SELECT gen_random_uuid(), id, tenant_id, kind, '{crash_loop}', error_message"),
            format!("FROM reaped WHERE status = '{dead}'"),
        ] {
            assert!(
                sql.contains(&expected),
                "the reaper's SQL lacks {expected:?}"
            );
        }
    }
}
