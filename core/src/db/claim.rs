//! SQL of a claim: the claim statement ([`transition::CLAIM`]), lease renewal, and the fair
//! shares' holds of queued operations.
//!
//! Every write after a claim is fenced by `id AND epoch AND status = 'running'`: zero rows
//! updated means the lease was lost and the caller must stop writing for that operation.
//!
//! [`transition::CLAIM`]: crate::state::transition::CLAIM

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::operation::Lane;
use crate::state::terminal_sql;
use crate::state::transition::{from_sql, to_sql};

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
            -- An operator's pause marks the rows it holds under their locks (`paused_by`), so a
            -- claim that waited for one of those locks re-reads the mark here.
            SELECT id, tenant_id, kind, lane, schedule_id, kind_version, ordering_key,
                   concurrency_key, concurrency_limit, created_at, batch_id
              FROM operations
             WHERE id = ANY($1) AND COALESCE(status, '') IN ",
        from_sql!(CLAIM),
        " AND run_at <= now() AND paused_by IS NULL
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
               -- Nor does an operator's pause made after this operation was born.
               AND NOT agentq_paused(o.tenant_id, o.kind, o.lane, o.schedule_id, o.id)
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

/// A lease renewed: the operation, and what its worker must do with it.
#[derive(Clone, Copy, Debug, FromRow)]
pub struct Renewed {
    pub id: Uuid,
    /// A cancel was requested: stop now.
    pub cancel_requested: bool,
    /// An operator paused it: stop at the next step boundary and hand it back.
    pub paused: bool,
}

/// Extends the leases of every operation `owner` runs, in one statement. Returns the ids still
/// held, each with whether a cancel was requested or a pause holds it; an id missing from the
/// answer was lost.
pub async fn renew_leases(
    pool: &PgPool,
    owner: &str,
    held: &[(Uuid, i64)],
    lease_ttl: Duration,
) -> Result<Vec<Renewed>> {
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
      RETURNING o.id, o.cancel_requested,
                o.paused_by IS NOT NULL
                OR agentq_paused(o.tenant_id, o.kind, o.lane, o.schedule_id, o.id) AS paused",
    )
    .bind(owner)
    .bind(&ids)
    .bind(&epochs)
    .bind(lease_ttl.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(rows)
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
                           AND NOT version_parked AND NOT share_held AND paused_by IS NULL)
             OR EXISTS (SELECT 1 FROM operations
                         WHERE lane = $1 AND status = 'queued' AND tenant_id < $2
                           AND run_at <= now() AND dispatched_at IS NOT NULL
                           AND NOT version_parked AND NOT share_held AND paused_by IS NULL)",
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
            AND paused_by IS NULL AND NOT agentq_paused(tenant_id, kind, lane, schedule_id, id)
          ORDER BY created_at, id
          LIMIT $2",
    )
    .bind(lane.as_str())
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
