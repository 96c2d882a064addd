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
    /// Whether a token budget is over it (its own or an ancestor's, its batch's or its tree's,
    /// its tenant's) as the claim committed: a run with none checks no budget before its model calls, unless a budget
    /// is born apart from its operation later (`db::budgets::newest_born_apart`).
    pub budgeted: bool,
    /// The database's clock at the claim.
    pub claimed_at: DateTime<Utc>,
    /// The key its model calls count against (`rate_limits` of scope `key`).
    pub rate_key: Option<String>,
}

/// Operation `o` is the oldest unfinished operation of its ordering key, or has none: the
/// claim's `ordering_key` gate, and what [`others_claimable`] asks of waiting work.
macro_rules! first_of_its_ordering_key {
    () => {
        concat!(
            "(o.ordering_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM operations p
                 WHERE p.tenant_id = o.tenant_id AND p.ordering_key = o.ordering_key
                   AND p.status NOT IN ",
            terminal_sql!(),
            "
                   AND (p.created_at, p.id) < (o.created_at, o.id)))"
        )
    };
}

/// The gates the claim statement ([`claim_operations`]) applies, in order, each named by a
/// `-- gate: <name>` comment above its condition there (a test checks that every condition of
/// the statement has such a comment, or a `-- not a gate:` one, and that this list is theirs).
/// `agentq why` explains an operation by the first of these that holds it
/// (`agentq_app::why`, whose test checks it has an answer for each).
pub const CLAIM_GATES: &[&str] = &[
    "status",
    "due",
    "paused",
    "version",
    "ordering_key",
    "batch",
    "concurrency_key",
];

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
            SELECT id, tenant_id, kind, lane, schedule_id, kind_version, ordering_key,
                   concurrency_key, concurrency_limit, created_at, batch_id
              FROM operations
             -- not a gate: the pointers' operations
             WHERE id = ANY($1)
             -- gate: status (only a queued operation starts)
               AND COALESCE(status, '') IN ",
        from_sql!(CLAIM),
        "
             -- gate: due (not before its run_at: a retry's backoff, a breaker's park)
               AND run_at <= now()
             -- gate: paused. An operator's pause marked it (under this lock, so a claim that
             -- waited for the pause's lock reads the mark), or holds its scope since it was born.
               AND (paused_by IS NULL
                    AND NOT agentq_paused(tenant_id, kind, lane, schedule_id, id))
             ORDER BY id
               FOR UPDATE
         ), startable AS (
            SELECT o.* FROM locked o
             -- gate: version. Only a worker that runs the operation's version (or, for one not
             -- run yet, the newest live version of its kind) may claim it.
             WHERE ",
        super::versions::runnable_sql!(),
        "
               -- gate: ordering_key. Only the oldest unfinished operation of its key may start.
               AND ",
        first_of_its_ordering_key!(),
        "
               -- gate: batch. A paused or cancelled batch starts nothing; resuming
               -- re-dispatches its queue.
               AND NOT in_stopped_batch(o.batch_id)
         ), counters AS (
            -- Concurrency keys: lock the batch's counters (after its operations, in key order,
            -- like every other statement that takes both) and read how many run now.
            SELECT c.tenant_id, c.key, c.running, c.lim FROM concurrency_keys c
             -- not a gate: the counters of the keys of what passed the gates above
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
             -- gate: concurrency_key. At most the key's limit run at once.
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
          -- not a gate: what was admitted
          WHERE o.id = admitted.id
      RETURNING o.id, o.tenant_id, o.kind, o.kind_version, o.upgrade_through, o.input,
                o.epoch, o.attempt, o.max_attempts, o.restarts, o.deadline, o.request_id,
                o.traceparent,
                EXISTS (SELECT 1 FROM operation_steps s WHERE s.op_id = o.id) AS has_journal,
                EXISTS (SELECT 1 FROM budgets b
                         WHERE b.op_id = ANY(o.ancestors || o.id)
                            OR b.batch_id = COALESCE(o.batch_id, o.tree_batch_id)
                            OR b.tenant_scope = o.tenant_id) AS budgeted,
                now() AS claimed_at, o.rate_key"
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

/// Operations of one tenant's queue in a lane that [`others_claimable`] looks at, found by the
/// index `operations_unfinished`: a tenant whose first this many are all held by a gate counts
/// as having nothing to start (what it queued behind its own gates hides only its own work).
const CLAIMABLE_SAMPLE: i64 = 64;
/// Tenants [`others_claimable`] visits at most.
const CLAIMABLE_TENANTS: i64 = 256;

/// How many operations of tenants other than `tenant` wait in `lane` that a worker could start
/// now, up to `most`: queued, due, their pointer out, not parked for a version nor held for a
/// share, and through every gate of the claim that does not depend on the worker (no pause
/// holds them, their batch is not stopped, each is the first unfinished of its ordering key,
/// its concurrency key is under its limit). Visits the waiting tenants one index probe at a
/// time and looks at a bounded sample of each one's queue, so the answer costs the same
/// whatever any tenant has queued behind its gates.
pub async fn others_claimable(pool: &PgPool, lane: Lane, tenant: &str, most: i64) -> Result<i64> {
    let found: i64 = sqlx::query_scalar(concat!(
        // Two walks, the tenants before `$2` and those after, each step one index probe
        // bounded on both sides: a walk that skipped `$2` with `<>` would read every one of
        // its queued rows, once a second, however long its backlog.
        "WITH RECURSIVE below(t, n) AS (
            (SELECT tenant_id, 1 FROM operations
              WHERE lane = $1 AND status = 'queued' AND tenant_id < $2
              ORDER BY tenant_id LIMIT 1)
            UNION ALL
            SELECT (SELECT o.tenant_id FROM operations o
                     WHERE o.lane = $1 AND o.status = 'queued'
                       AND o.tenant_id > w.t AND o.tenant_id < $2
                     ORDER BY o.tenant_id LIMIT 1), w.n + 1
              FROM below w WHERE w.t IS NOT NULL AND w.n < $5
         ), above(t, n) AS (
            (SELECT tenant_id, 1 FROM operations
              WHERE lane = $1 AND status = 'queued' AND tenant_id > $2
              ORDER BY tenant_id LIMIT 1)
            UNION ALL
            SELECT (SELECT o.tenant_id FROM operations o
                     WHERE o.lane = $1 AND o.status = 'queued' AND o.tenant_id > w.t
                     ORDER BY o.tenant_id LIMIT 1), w.n + 1
              FROM above w WHERE w.t IS NOT NULL AND w.n < $5
         ), tenants(t) AS (
            (SELECT t FROM below WHERE t IS NOT NULL
             UNION ALL
             SELECT t FROM above WHERE t IS NOT NULL)
            LIMIT $5
         )
         SELECT count(*) FROM (
            SELECT 1 FROM tenants w
             CROSS JOIN LATERAL (
                -- The tenant as a range of one, not `=`: the planner then estimates a few
                -- hundred rows and reads the index; with `=` it divides the queue evenly among
                -- the tenants and scans the table for a small tenant's 64 beside a large one.
                SELECT o.* FROM operations o
                 WHERE o.lane = $1 AND o.status = 'queued'
                   AND o.tenant_id >= w.t AND o.tenant_id <= w.t
                 LIMIT $4) o
             WHERE o.run_at <= now() AND o.dispatched_at IS NOT NULL
               AND NOT o.version_parked AND NOT o.share_held
               AND o.paused_by IS NULL
               AND NOT agentq_paused(o.tenant_id, o.kind, o.lane, o.schedule_id, o.id)
               AND NOT in_stopped_batch(o.batch_id)
               AND ",
        first_of_its_ordering_key!(),
        "
               AND (o.concurrency_key IS NULL OR NOT EXISTS (
                       SELECT 1 FROM concurrency_keys c
                        WHERE c.tenant_id = o.tenant_id AND c.key = o.concurrency_key
                          AND c.running >= COALESCE(c.lim, o.concurrency_limit)))
             LIMIT $3) waiting"
    ))
    .bind(lane.as_str())
    .bind(tenant)
    .bind(most)
    .bind(CLAIMABLE_SAMPLE)
    .bind(CLAIMABLE_TENANTS)
    .fetch_one(pool)
    .await?;
    Ok(found)
}

/// Whether a tenant other than `tenant` has an operation waiting in `lane` that a worker could
/// start now ([`others_claimable`]).
pub async fn others_queued(pool: &PgPool, lane: Lane, tenant: &str) -> Result<bool> {
    Ok(others_claimable(pool, lane, tenant, 1).await? > 0)
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

#[cfg(test)]
mod tests {
    use super::CLAIM_GATES;

    /// The SQL text of `claim_operations`'s statement as written in this file: its string
    /// literals joined (what its macros add, a status set and the version test, is left out).
    fn claim_sql() -> String {
        let src = include_str!("claim.rs");
        let start = src
            .find("pub async fn claim_operations(")
            .expect("claim_operations");
        let body = &src[start..];
        let body = &body[..body.find("\n}\n").expect("its end")];
        let mut out = String::new();
        let mut inside = false;
        let mut chars = body.chars();
        while let Some(c) = chars.next() {
            match (inside, c) {
                (false, '"') => inside = true,
                (true, '"') => {
                    inside = false;
                    out.push(' ');
                }
                (true, '\\') => {
                    chars.next();
                }
                (true, c) => out.push(c),
                _ => {}
            }
        }
        out
    }

    /// The markers (`gate: x`, or `not a gate`) and the conditions (`WHERE`, `AND`) of `sql`
    /// at the top level of the statement or of one of its CTEs, in order, up to `RETURNING`.
    fn markers_and_conditions(sql: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut depth = 0i32;
        for line in sql.lines() {
            let (code, comment) = match line.find("--") {
                Some(i) => (&line[..i], Some(line[i + 2..].trim())),
                None => (line, None),
            };
            if code.contains("RETURNING") {
                break;
            }
            let mut quoted = false;
            let mut word = String::new();
            for c in code.chars().chain([' ']) {
                if c == '\'' {
                    quoted = !quoted;
                }
                if quoted {
                    continue;
                }
                if c.is_ascii_alphanumeric() || c == '_' {
                    word.push(c);
                    continue;
                }
                if (word == "WHERE" || word == "AND") && depth <= 1 {
                    out.push(word.clone());
                }
                word.clear();
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
            }
            if let Some(c) = comment {
                if let Some(gate) = c.strip_prefix("gate: ") {
                    let name: String = gate
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    out.push(format!("gate: {name}"));
                } else if c.starts_with("not a gate") {
                    out.push("not a gate".into());
                }
            }
        }
        out
    }

    /// Every condition of the claim statement is a named gate (or says it is none), and the
    /// named gates are [`CLAIM_GATES`], in order: a condition added to the claim without a
    /// name, or a name missing from the list that `agentq why` answers for, fails here.
    #[test]
    fn every_condition_of_the_claim_is_a_gate_in_claim_gates() {
        let items = markers_and_conditions(&claim_sql());
        let mut gates = Vec::new();
        let mut named = false;
        for item in &items {
            if let Some(gate) = item.strip_prefix("gate: ") {
                gates.push(gate.to_string());
                named = true;
            } else if item == "not a gate" {
                named = true;
            } else {
                assert!(
                    named,
                    "a condition of the claim statement has no `-- gate: <name>` (or \
                     `-- not a gate: …`) comment above it: {items:?}"
                );
                named = false;
            }
        }
        assert_eq!(
            gates, CLAIM_GATES,
            "the claim's gates, in the statement's order"
        );
    }

    #[test]
    fn an_unnamed_condition_is_seen() {
        let sql = "WITH a AS (SELECT 1 FROM t\n -- gate: x\n WHERE x\n AND y)\n UPDATE t";
        assert_eq!(
            markers_and_conditions(sql),
            ["gate: x", "WHERE", "AND"],
            "the AND after the named WHERE has no name of its own"
        );
        let nested =
            "WITH a AS (SELECT 1 FROM t\n -- gate: x\n WHERE EXISTS (SELECT 1 WHERE z AND w))";
        assert_eq!(markers_and_conditions(nested), ["gate: x", "WHERE"]);
    }
}
