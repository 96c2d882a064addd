//! SQL of dispatch bookkeeping: marking pointers confirmed by the broker (`dispatched_at`), and
//! the queued rows a sweep, a wake or a batch's resume locks while it publishes their pointers
//! ([`Locked`]).

use std::time::Duration;

use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::operation::Lane;

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
///
/// The locking statement must not change what the claim's gates read (`run_at`, `status`,
/// pauses): a claim tests its gates on the last committed row before it waits for a lock, so
/// a row made due under the lock is skipped as not due, its pointer dropped, and the mark
/// then hides it from the sweep. And it must lock only rows due now, for the same reason.
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
            -- A paused operation is published when its pause is lifted.
            AND paused_by IS NULL AND NOT agentq_paused(tenant_id, kind, lane, schedule_id, id)
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
            AND paused_by IS NULL AND NOT agentq_paused(tenant_id, kind, lane, schedule_id, id)
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
