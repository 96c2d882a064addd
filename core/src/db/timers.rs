//! SQL of durable sleeps and waits (parking, deciding a wait, waking) and of deadlines.
//! Signals are `db::signals`, an operator's cancel `db::cancel`, retention `db::retention`.
//!
//! Suspending is one fenced statement (journal rows + status + wake time), so an operation is
//! either still running or parked with something due to wake it. Every scheduler sweep takes
//! its rows with `FOR UPDATE SKIP LOCKED` and moves them in the same statement, so any number of
//! schedulers can run without firing anything twice.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use super::dispatch::Dispatch;
use super::steps::{StepWrite, bind_journal, journal_cte};
use crate::state::terminal_sql;
use crate::state::transition::{from_sql, to_sql};

/// The CTE `step` completing a parked step (a wait, a join) with `decided.output` once it is
/// decided, fenced by `lease` (the operation held at epoch `$2`); the step is `$3`.
macro_rules! park_decided_cte {
    () => {
        "step AS (
            UPDATE operation_steps st
               SET status = 'completed', output = decided.output, completed_at = now(), epoch = $2
              FROM decided, lease
             WHERE st.op_id = lease.id AND st.seq = $3 AND st.status = 'started'
               AND decided.output IS NOT NULL
         RETURNING st.output
         )"
    };
}
pub(crate) use park_decided_cte;

/// Parks a running operation: `sleeping` until `run_at`, or `waiting` for the signal
/// `waiting_for` until `run_at` (its timeout). Pending journal rows are written in the same
/// statement. Returns false when the lease was lost.
pub async fn suspend_operation(
    pool: &PgPool,
    id: Uuid,
    epoch: i64,
    run_at: DateTime<Utc>,
    waiting_for: Option<&str>,
    steps: &[StepWrite],
) -> Result<bool> {
    let done: Option<Uuid> = bind_journal(
        sqlx::query_scalar(concat!(
            "WITH parked AS (
                UPDATE operations
                   SET status = CASE WHEN $16::text IS NULL THEN ",
            to_sql!(PARK_SLEEP),
            " ELSE ",
            to_sql!(PARK_WAIT),
            " END,
                       waiting_for = $16, run_at = $15, dispatched_at = NULL, updated_at = now(),
                       lease_owner = NULL, lease_expires_at = NULL
                 WHERE id = $14 AND epoch = $13 AND status IN ",
            from_sql!(PARK_SLEEP),
            "
             RETURNING id
             ), ",
            journal_cte!("parked"),
            " SELECT id FROM parked"
        )),
        steps,
        epoch,
        id,
    )
    .bind(run_at)
    .bind(waiting_for)
    .fetch_optional(pool)
    .await?;
    Ok(done.is_some())
}

/// How a wait ended, as journaled in the wait step's output.
#[derive(Clone, Debug, PartialEq)]
pub enum WaitResolution {
    /// The signal arrived before the timeout.
    Signal {
        payload: Value,
        sent_by: Option<String>,
    },
    /// The timeout passed first.
    TimedOut,
}

/// Decides a wait, once: the wait step `seq` (status `started`) completes with the signal
/// `name` if one was received no later than `deadline`, else with a timeout if `deadline` has
/// passed; otherwise nothing changes (`Ok(None)`). Consuming the signal and completing the
/// step are one fenced statement, so a signal and a timeout that race resolve exactly once.
/// See [`Wait`] for the answers.
pub async fn resolve_wait(
    pool: &PgPool,
    id: Uuid,
    epoch: i64,
    seq: i32,
    name: &str,
    deadline: DateTime<Utc>,
) -> Result<Wait> {
    let row: (bool, Option<Value>) = sqlx::query_as(concat!(
        "WITH lease AS (
            SELECT id FROM operations WHERE id = $1 AND epoch = $2 AND status = 'running'
               FOR SHARE
         ), sig AS (
            UPDATE signals s SET consumed_at = now()
              FROM lease
             WHERE s.op_id = lease.id AND s.name = $4 AND s.consumed_at IS NULL
               AND s.received_at <= $5
         RETURNING s.payload, s.sent_by, s.received_at
         ), decided AS (
            SELECT CASE
                     WHEN EXISTS (SELECT 1 FROM sig) THEN
                       (SELECT jsonb_build_object('signal', $4::text, 'payload', payload,
                                                  'sent_by', sent_by, 'received_at', received_at)
                          FROM sig)
                     WHEN now() >= $5 THEN jsonb_build_object('timed_out', true, 'signal', $4::text)
                   END AS output
         ), ",
        park_decided_cte!(),
        "
         SELECT EXISTS (SELECT 1 FROM lease), (SELECT output FROM step)"
    ))
    .bind(id)
    .bind(epoch)
    .bind(seq)
    .bind(name)
    .bind(deadline)
    .fetch_one(pool)
    .await?;
    Ok(match row {
        (false, _) => Wait::LeaseLost,
        (true, None) => Wait::Pending,
        (true, Some(output)) => Wait::Resolved(output),
    })
}

/// The answer of [`resolve_wait`].
#[derive(Clone, Debug, PartialEq)]
pub enum Wait {
    /// Decided; the wait step's journaled output.
    Resolved(Value),
    /// No signal yet and the timeout has not passed.
    Pending,
    /// This worker no longer holds the operation.
    LeaseLost,
}

/// Wakes up to `limit` sleeping or waiting operations that are due (wake time or timeout), and
/// waiting ones whose signal has arrived (a signal that raced the wait's start) or whose joined
/// children have all finished: back to
/// `queued` with `dispatched_at` NULL: the caller publishes their pointers and marks them
/// dispatched after the broker confirms (`Dispatcher::dispatch`), as a producer does. If the
/// caller dies in between, the dispatch sweeper publishes them once the grace period after
/// `updated_at` has passed (a wake taking them as dispatched before publishing left them
/// without a pointer until the broker's queue ran empty). The attempt counter is given back
/// (the claim counts it again): a wake-up is not a new attempt.
pub async fn wake_due(pool: &PgPool, limit: i64) -> Result<Vec<Woken>> {
    let rows = sqlx::query_as(concat!(
        "WITH timed AS (
            SELECT id FROM operations
             WHERE status IN ",
        from_sql!(WAKE),
        " AND run_at <= now()
             ORDER BY run_at
             LIMIT $1
               FOR UPDATE SKIP LOCKED
         ), signalled AS (
            SELECT o.id FROM operations o
              JOIN signals s ON s.op_id = o.id AND s.name = o.waiting_for AND s.consumed_at IS NULL
             WHERE o.status = 'waiting'
             LIMIT $1
               FOR UPDATE OF o SKIP LOCKED
         ), joined AS (
            -- Parents parked on ctx.join whose joined children have all finished: their count
            -- (`join_pending`, kept by a trigger) with the ends it could not count itself
            -- (`join_deltas`, appended while another transaction held the parent) is zero. The
            -- partial index operations_joining holds only parked parents; no child is read.
            SELECT o.id FROM operations o
             WHERE o.status = 'waiting' AND o.waiting_for = '(children)'
               AND (o.join_pending + COALESCE((SELECT sum(d.delta) FROM join_deltas d
                                                WHERE d.parent_id = o.id
                                                  AND d.child_id = ANY(o.joining)), 0) <= 0
                    -- A parent whose join was decided before counts existed (migration 18).
                    OR (o.join_pending IS NULL
                        AND NOT EXISTS (SELECT 1 FROM operations c
                                         WHERE c.id = ANY(o.joining) AND c.status NOT IN ",
        terminal_sql!(),
        ")))
             LIMIT $1
               FOR UPDATE OF o SKIP LOCKED
         ), due AS (
            SELECT id FROM timed UNION SELECT id FROM signalled UNION SELECT id FROM joined
         )
         UPDATE operations o
            SET status = ",
        to_sql!(WAKE),
        ", waiting_for = NULL, attempt = o.attempt - 1,
                -- A signal can wake a wait before its timeout: it may run now.
                run_at = LEAST(o.run_at, now()),
                -- Published and marked by this scheduler; the sweeper's grace period starts now.
                dispatched_at = NULL, updated_at = clock_timestamp()
           FROM due
          WHERE o.id = due.id AND o.status IN ",
        from_sql!(WAKE),
        "
      RETURNING o.id, o.tenant_id, o.kind, o.lane, o.epoch, o.run_at AS due_at,
                o.updated_at AS woken_at"
    ))
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// An operation [`wake_due`] moved back to `queued`.
#[derive(Clone, Debug, FromRow)]
pub struct Woken {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub lane: String,
    pub epoch: i64,
    /// When it was due.
    pub due_at: DateTime<Utc>,
    /// When it was woken.
    pub woken_at: DateTime<Utc>,
}

impl From<&Woken> for Dispatch {
    fn from(w: &Woken) -> Self {
        Dispatch {
            id: w.id,
            tenant_id: w.tenant_id.clone(),
            kind: w.kind.clone(),
            lane: w.lane.clone(),
            epoch: w.epoch,
            traceparent: None,
        }
    }
}

/// The plan of the due-timer query (reported by `agentq bench --scenario timers`).
pub async fn explain_wake_due(pool: &PgPool) -> Result<String> {
    let lines: Vec<String> = sqlx::query_scalar(concat!(
        "EXPLAIN SELECT id FROM operations
          WHERE status IN ",
        from_sql!(WAKE),
        " AND run_at <= now()
          ORDER BY run_at LIMIT 500 FOR UPDATE SKIP LOCKED"
    ))
    .fetch_all(pool)
    .await?;
    Ok(lines.join("\n"))
}

/// Moves up to `limit` queued, sleeping or waiting operations past their deadline to `dead`
/// (`deadline_exceeded`, with a dead letter). Running ones are stopped by their worker at the
/// next step boundary. Returns their ids and kinds.
pub async fn expire_deadlines(pool: &PgPool, limit: i64) -> Result<Vec<(Uuid, String)>> {
    let rows = sqlx::query_as(EXPIRE_DEADLINES)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(rows)
}

/// The deadline sweep: `$1` how many rows at most. Its outcome is what
/// [`crate::state::failure::after_failure`] decides for `DeadlineExceeded` (a test checks).
const EXPIRE_DEADLINES: &str = concat!(
    "WITH expired AS (
            SELECT id FROM operations
             WHERE deadline < now() AND status IN ",
    from_sql!(EXPIRE),
    "
             ORDER BY deadline
             LIMIT $1
               FOR UPDATE SKIP LOCKED
         ), dead AS (
            UPDATE operations o
               SET status = ",
    to_sql!(EXPIRE),
    ", error_class = 'deadline_exceeded',
                   error_message = format('deadline %s passed while the operation was %s', o.deadline, o.status),
                   finished_at = now(), updated_at = now(), waiting_for = NULL
              FROM expired
             WHERE o.id = expired.id
         RETURNING o.id, o.tenant_id, o.kind, o.attempt, o.error_message
         ), letters AS (
            INSERT INTO dead_letters (id, op_id, tenant_id, kind, class, reason, attempts)
            SELECT gen_random_uuid(), id, tenant_id, kind, 'deadline_exceeded', error_message, attempt
              FROM dead
            ON CONFLICT (op_id) WHERE status = 'open' DO NOTHING
         )
         SELECT id, kind FROM dead"
);

/// Asks the workers of up to `limit` running operations past their deadline to stop them
/// (`cancel_requested`: the next heartbeat interrupts the job, which ends it as
/// `deadline_exceeded` because the deadline has passed). A worker stops them at the deadline by
/// itself; this covers one whose timer did not (a clock set back, a stalled process), and its
/// heartbeat stops them within a third of a lease. Returns how many it flagged. Reads the
/// running operations through the reaper's index (at most one per worker slot).
pub async fn stop_running_past_deadline(pool: &PgPool, limit: i64) -> Result<u64> {
    let n = sqlx::query(
        "UPDATE operations SET cancel_requested = true
          WHERE id IN (SELECT id FROM operations
                        WHERE status = 'running' AND lease_expires_at IS NOT NULL
                          AND deadline < now() AND NOT cancel_requested
                        LIMIT $1
                          FOR UPDATE SKIP LOCKED)",
    )
    .bind(limit)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::can_transition;
    use crate::state::failure::{Failure, after_failure};

    /// The deadline sweep ends an operation as the failure decision ends a running one whose
    /// deadline passed.
    #[test]
    fn the_deadline_sql_mirrors_the_failure_decision() {
        let next = after_failure(Failure::DeadlineExceeded, 1, 5, false);
        let (status, class) = (next.to.status(), next.class);
        for expected in [
            format!("SET status = '{status}', error_class = '{class}',"),
            format!("SELECT gen_random_uuid(), id, tenant_id, kind, '{class}', error_message"),
        ] {
            assert!(
                EXPIRE_DEADLINES.contains(&expected),
                "the deadline sweep lacks {expected:?}"
            );
        }
        assert_eq!(status, crate::state::transition::EXPIRE.to);
        for &from in crate::state::transition::EXPIRE.from {
            assert!(can_transition(from, status));
        }
    }
}
