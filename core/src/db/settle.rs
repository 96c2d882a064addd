//! SQL of the ends of a run: complete, fail (retry, dead, cancelled), the reaper's recovery of
//! expired leases, and the releases of a shutdown or a fair share. Each is a named transition
//! from `running` (`state::transition`), fenced by the epoch (and the lease owner where a
//! worker hands its run back), with the run's pending journal rows in the same statement.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use super::steps::{
    StepBatch, StepWrite, bind_journal, bind_steps, journal_cte, journal_many_cte, owned_rows,
};
use crate::state::transition::{FAIL_CANCEL, FAIL_DEAD, FAIL_RETRY, from_sql, to_sql};
use crate::state::{ErrorClass, Status};

/// One running operation's success, for [`write_runs`].
#[derive(Clone, Debug)]
pub struct Completion {
    pub id: Uuid,
    pub epoch: i64,
    pub result: Value,
    /// Its pending journal rows.
    pub steps: Vec<StepWrite>,
}

/// What a running operation's worker writes while it holds the lease, many operations per
/// statement ([`write_runs`]): finished steps, or the success with its last rows.
#[derive(Clone, Debug)]
pub enum RunWrite {
    Steps(StepBatch),
    Complete(Completion),
}

impl RunWrite {
    /// The operation written.
    pub fn id(&self) -> Uuid {
        match self {
            Self::Steps(b) => b.id,
            Self::Complete(c) => c.id,
        }
    }

    fn epoch(&self) -> i64 {
        match self {
            Self::Steps(b) => b.epoch,
            Self::Complete(c) => c.epoch,
        }
    }

    /// Its journal rows.
    pub fn steps(&self) -> &[StepWrite] {
        match self {
            Self::Steps(b) => &b.steps,
            Self::Complete(c) => &c.steps,
        }
    }

    /// Its journal rows, taken (from a write that failed, to write them again).
    pub fn into_steps(self) -> Vec<StepWrite> {
        match self {
            Self::Steps(b) => b.steps,
            Self::Complete(c) => c.steps,
        }
    }

    fn result(&self) -> Option<&Value> {
        match self {
            Self::Steps(_) => None,
            Self::Complete(c) => Some(&c.result),
        }
    }
}

/// Writes the journal rows of many running operations, and the successes among them, in one
/// statement (one commit), each fenced by its own epoch and status: an operation no longer
/// `running` at its epoch gets nothing written (its lease was lost: its worker must stop it at
/// once). Returns the ids written. Each operation may appear once.
///
/// Operations are locked in id order, like the claim and the heartbeat, so overlapping
/// statements queue instead of deadlocking; `FOR NO KEY UPDATE`, because each journal row draws
/// its event id here and every writer of an operation's events holds that lock (migration
/// `20261207000001_step_events_from_journal.sql`), and a success changes no key. The journal
/// upsert is `journal_cte!`'s, joined on each row's operation instead of one. The `succeeded`
/// event is served from the operation row (migration
/// `20261208000002_finished_event_from_row.sql`): its id is drawn by the `UPDATE`, which waits
/// for the journal's rows (a scalar subquery over them, evaluated before any row is updated), so
/// the steps' event ids come first, as the deferred status trigger had it.
pub async fn write_runs(pool: &PgPool, batch: &[RunWrite]) -> Result<Vec<Uuid>> {
    let ids: Vec<Uuid> = batch.iter().map(RunWrite::id).collect();
    let epochs: Vec<i64> = batch.iter().map(RunWrite::epoch).collect();
    let results: Vec<Option<&Value>> = batch.iter().map(RunWrite::result).collect();
    let (steps, owners) = owned_rows(batch.iter().map(|w| (w.id(), w.steps())));
    const SQL: &str = concat!(
        "WITH input AS (
            SELECT * FROM unnest($13::uuid[], $14::bigint[], $15::jsonb[]) AS i(id, epoch, result)
         ), lease AS (
            SELECT o.id, o.epoch, i.result FROM operations o JOIN input i ON o.id = i.id
             WHERE o.epoch = i.epoch AND o.status IN ",
        from_sql!(COMPLETE),
        "
             ORDER BY o.id
               FOR NO KEY UPDATE OF o
         ), ",
        journal_many_cte!("lease", "$16", "RETURNING 1"),
        ", done AS (
            UPDATE operations o
               SET status = ",
        to_sql!(COMPLETE),
        ", result = l.result, finished_at = now(), updated_at = now(),
                   lease_owner = NULL, lease_expires_at = NULL,
                   error_class = NULL, error_message = NULL,
                   finished_event_id = nextval('agentq_event_ids'),
                   finished_event_at = clock_timestamp()
              FROM lease l
             WHERE l.result IS NOT NULL
               AND o.id = l.id AND o.epoch = l.epoch AND o.status IN ",
        from_sql!(COMPLETE),
        "
               -- After the journal's rows: their event ids come before this one.
               AND (SELECT count(*) FROM journal) >= 0
         RETURNING o.id
         )
         SELECT id FROM lease WHERE result IS NULL
         UNION ALL
         SELECT id FROM done"
    );
    let written: Vec<Uuid> = bind_steps(sqlx::query_scalar(SQL), steps)
        .bind(&ids)
        .bind(&epochs)
        .bind(&results)
        .bind(&owners)
        .fetch_all(pool)
        .await?;
    Ok(written)
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

/// Why a worker stopped a run to hand it back to the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandBack {
    /// Fair shares: held (`share_held`) for a worker with room for its tenant, which pulls it.
    Share,
    /// An operator's pause, at a step boundary: the claim refuses it until the pause is lifted.
    Pause,
}

/// Hands a running operation this worker stopped back to the queue ([`HandBack`]), its attempt
/// given back and no restart counted: it resumes from its journal. Its finished steps not yet
/// written (`steps`) are written in the same statement. Fenced by the epoch and the lease
/// owner, so a run that finished (or lost its lease) meanwhile is left as it is. Its pointer
/// stays spent while it is held (a pull, or the resume, dispatches it); if the pause that
/// stopped it was lifted meanwhile, the dispatch sweeper publishes it.
pub async fn hand_back(
    pool: &PgPool,
    owner: &str,
    id: Uuid,
    epoch: i64,
    steps: &[StepWrite],
    why: HandBack,
) -> Result<bool> {
    let released: Option<Uuid> = bind_journal(
        sqlx::query_scalar(concat!(
            "WITH released AS (
                UPDATE operations
                   SET status = ",
            to_sql!(HAND_BACK),
            ", run_at = now(), share_held = $16,
                       dispatched_at = CASE
                           WHEN $16 OR paused_by IS NOT NULL
                             OR agentq_paused(tenant_id, kind, lane, schedule_id, id)
                           THEN COALESCE(dispatched_at, now()) END,
                       attempt = GREATEST(attempt - 1, 0),
                       lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
                 WHERE id = $14 AND epoch = $13 AND status IN ",
            from_sql!(HAND_BACK),
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
    .bind(why == HandBack::Share)
    .fetch_optional(pool)
    .await?;
    Ok(released.is_some())
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
