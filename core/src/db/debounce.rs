//! SQL of a debounced enqueue: the one statement that makes a key's pending operation or
//! replaces its input (last wins) and pushes its start back, the deliveries folded into it
//! (found again by their dedupe keys), their audit, and the key's started operations (for the
//! conflict policies `skip` and `cancel_running`).
//!
//! A pending operation is one that is `queued` and was never claimed: `debounce_until` (first
//! arrival + max_delay) is set, and leaving `queued` clears it (a trigger), which takes the row
//! out of the partial unique index `operations_debounce_pending`. So a claim racing the
//! statement either committed first (the statement then inserts a new pending operation, and
//! the policy for a running one applies) or waits for the statement's row lock and then reads
//! the new `run_at`, in the future: the claim's `due` gate refuses it.

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use super::Result;
use super::operations::NewOperation;
use crate::state::Status;

/// What to do when the key's operation has already started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnRunning {
    /// Make a new pending operation (debounced itself).
    #[default]
    Queue,
    /// Answer with the started one; nothing new.
    Skip,
    /// Cancel the started one (the operator's cancel flow), then make the new pending one.
    CancelRunning,
}

impl OnRunning {
    /// Every policy, as written.
    pub const NAMES: [&'static str; 3] = ["queue", "skip", "cancel_running"];

    pub fn as_str(self) -> &'static str {
        match self {
            OnRunning::Queue => "queue",
            OnRunning::Skip => "skip",
            OnRunning::CancelRunning => "cancel_running",
        }
    }

    /// The policy named `s`, if any.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "queue" => Some(OnRunning::Queue),
            "skip" => Some(OnRunning::Skip),
            "cancel_running" => Some(OnRunning::CancelRunning),
            _ => None,
        }
    }
}

/// A debounce as checked: the key, the window and the cap, in milliseconds, and the policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub key: String,
    pub window_ms: i64,
    pub max_delay_ms: i64,
    pub on_running: OnRunning,
}

/// What [`enqueue`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// A new pending operation, starting at `run_at`.
    Created {
        id: Uuid,
        epoch: i64,
        run_at: DateTime<Utc>,
    },
    /// The key's pending operation took this input; it starts at `run_at`. It kept its own
    /// options where this arrival asked others (`kept`: their names, as the API's fields).
    Joined {
        id: Uuid,
        run_at: DateTime<Utc>,
        kept: Vec<&'static str>,
    },
    /// The dedupe key was folded into `id` before; the caller compares `input_sha256`.
    Existing {
        id: Uuid,
        status: Status,
        input_sha256: String,
    },
    /// Policy `skip`: the key's operation `id` has started; nothing was written.
    Skipped { id: Uuid, status: Status },
    /// The key's pending operation is of another kind; nothing was written.
    OtherKind { id: Uuid, kind: String },
}

/// Makes `op` the pending operation of `spec.key` in its tenant, or folds it into the one
/// pending now (its input and request ids replaced, its `run_at` pushed to now + window but not
/// past first arrival + max_delay), audited as `debounce` by `actor`; with `op.dedupe_key`,
/// a repeat of a delivery folded before finds its operation. Policy `skip` answers with the
/// key's started operation when there is one and no pending one took the input. Never
/// publishes: the pending operation is not due before its `run_at`, and the dispatch sweeper
/// publishes it once it is.
pub async fn enqueue(
    pool: &PgPool,
    op: &NewOperation,
    spec: &Spec,
    actor: &str,
) -> Result<Outcome> {
    let mut tx = pool.begin().await?;
    if let Some(found) = delivered(&mut tx, &op.tenant, op.dedupe_key.as_deref()).await? {
        return Ok(found);
    }
    if spec.on_running == OnRunning::Skip
        && !pending_exists(&mut tx, &op.tenant, &spec.key).await?
        && let Some((id, status)) = started(&mut tx, &op.tenant, &spec.key, None)
            .await?
            .into_iter()
            .next()
    {
        audit(&mut tx, actor, "debounce_skip", id, status, spec, None).await?;
        tx.commit().await?;
        return Ok(Outcome::Skipped { id, status });
    }
    // One statement: a claim that took the pending row first took it out of the index (this
    // inserts a new one); otherwise the row is locked here and any claim reads the new run_at.
    let row = sqlx::query_as::<_, (Uuid, i64, bool, DateTime<Utc>, String)>(
        "WITH upserted AS (
            INSERT INTO operations (id, tenant_id, kind, lane, concurrency_limit, input,
                                    input_sha256, ordering_key, max_attempts, run_at, deadline,
                                    request_id, traceparent, concurrency_key, debounce_key,
                                    debounce_until, rate_key)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9,
                    now() + make_interval(secs => $15 / 1000.0), $10, $11, $12, $13, $14,
                    now() + make_interval(secs => $16 / 1000.0), $21)
            ON CONFLICT (tenant_id, debounce_key) WHERE status = 'queued' AND debounce_until IS NOT NULL
            DO UPDATE SET input = EXCLUDED.input, input_sha256 = EXCLUDED.input_sha256,
                          request_id = EXCLUDED.request_id, traceparent = EXCLUDED.traceparent,
                          run_at = LEAST(now() + make_interval(secs => $15 / 1000.0),
                                         operations.debounce_until),
                          -- Nothing was published for it; the sweeper publishes it when due
                          -- (a pointer it sent before this push claims nothing). `updated_at`
                          -- is left alone: the sweeper's grace after it is for a producer's own
                          -- publish, and moving it on with every arrival would hold back an
                          -- operation already at its max_delay for as long as arrivals come.
                          dispatched_at = NULL
                    WHERE operations.kind = EXCLUDED.kind
            RETURNING id, epoch, (xmax = 0) AS inserted, run_at, kind, tenant_id
         ), budget AS (
            -- A new operation's budget in the same statement, as an ordinary enqueue's.
            INSERT INTO budgets (id, tenant_id, op_id, measure, limit_tokens, timeout_secs,
                                 born_apart)
            SELECT $17, tenant_id, id, $18, $19, $20, false FROM upserted
             WHERE inserted AND $19::bigint IS NOT NULL
         )
         SELECT id, epoch, inserted, run_at, kind FROM upserted",
    )
    .bind(op.id.0)
    .bind(&op.tenant)
    .bind(&op.kind)
    .bind(op.lane.as_str())
    .bind(op.concurrency_limit)
    .bind(&op.input)
    .bind(&op.input_sha256)
    .bind(&op.ordering_key)
    .bind(op.max_attempts)
    .bind(op.deadline)
    .bind(&op.request_id)
    .bind(&op.traceparent)
    .bind(&op.concurrency_key)
    .bind(&spec.key)
    .bind(spec.window_ms as f64)
    .bind(spec.max_delay_ms as f64)
    .bind(Uuid::new_v4());
    let (measure, tokens, timeout_secs) = super::operations::budget_columns(op.budget);
    let row = row
        .bind(measure)
        .bind(tokens)
        .bind(timeout_secs)
        .bind(&op.rate_key)
        .fetch_optional(&mut *tx)
        .await?;
    let Some((id, epoch, inserted, run_at, _)) = row else {
        // The pending row is of another kind (DO UPDATE's WHERE refused it).
        let (id, kind): (Uuid, String) = sqlx::query_as(
            "SELECT id, kind FROM operations
              WHERE tenant_id = $1 AND debounce_key = $2
                AND status = 'queued' AND debounce_until IS NOT NULL",
        )
        .bind(&op.tenant)
        .bind(&spec.key)
        .fetch_one(&mut *tx)
        .await?;
        return Ok(Outcome::OtherKind { id, kind });
    };
    if inserted && spec.on_running == OnRunning::Skip {
        // The pending one was claimed while this statement ran: a fresh read sees it started.
        if let Some((running, status)) = started(&mut tx, &op.tenant, &spec.key, Some(id))
            .await?
            .into_iter()
            .next()
        {
            tx.rollback().await?;
            let mut tx = pool.begin().await?;
            audit(&mut tx, actor, "debounce_skip", running, status, spec, None).await?;
            tx.commit().await?;
            return Ok(Outcome::Skipped {
                id: running,
                status,
            });
        }
    }
    if let Some(key) = &op.dedupe_key {
        let recorded: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO debounced_deliveries (tenant_id, dedupe_key, op_id, input_sha256)
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING op_id",
        )
        .bind(&op.tenant)
        .bind(key)
        .bind(id)
        .bind(&op.input_sha256)
        .fetch_optional(&mut *tx)
        .await?;
        if recorded.is_none() {
            // The same delivery, sent twice at once: the other one committed first.
            tx.rollback().await?;
            let mut conn = pool.acquire().await?;
            return delivered(&mut conn, &op.tenant, Some(key))
                .await?
                .ok_or_else(|| sqlx::Error::RowNotFound.into());
        }
    }
    if inserted {
        tx.commit().await?;
        return Ok(Outcome::Created { id, epoch, run_at });
    }
    let queued = Status::Queued;
    audit(&mut tx, actor, "debounce", id, queued, spec, Some(run_at)).await?;
    let kept = kept_options(&mut tx, id, op).await?;
    tx.commit().await?;
    Ok(Outcome::Joined { id, run_at, kept })
}

/// The options of the pending operation `id` that differ from what the joining arrival `op`
/// asked (a join replaces only the input): by their API fields' names.
async fn kept_options(
    tx: &mut sqlx::PgConnection,
    id: Uuid,
    op: &NewOperation,
) -> Result<Vec<&'static str>> {
    #[allow(clippy::type_complexity)]
    let row: (
        String,
        Option<DateTime<Utc>>,
        Option<String>,
        i32,
        Option<String>,
        Option<String>,
        Option<i32>,
        Option<(String, i64, i32)>,
    ) = sqlx::query_as(
        "SELECT o.lane, o.deadline, o.rate_key, o.max_attempts, o.ordering_key,
                o.concurrency_key, o.concurrency_limit,
                (SELECT ROW(b.measure, b.limit_tokens, b.timeout_secs) FROM budgets b
                  WHERE b.op_id = o.id)
           FROM operations o WHERE o.id = $1",
    )
    .bind(id)
    .fetch_one(tx)
    .await?;
    let (measure, tokens, timeout) = super::operations::budget_columns(op.budget);
    let asked_budget = tokens.map(|t| (measure.to_string(), t, timeout));
    let mut kept = Vec::new();
    for (differs, name) in [
        (row.0 != op.lane.as_str(), "lane"),
        (row.1 != op.deadline, "deadline"),
        (row.2 != op.rate_key, "rate_key"),
        (row.3 != op.max_attempts, "max_attempts"),
        (row.4 != op.ordering_key, "ordering_key"),
        (row.5 != op.concurrency_key, "concurrency_key"),
        (row.6 != op.concurrency_limit, "concurrency_limit"),
        (row.7 != asked_budget, "budget"),
    ] {
        if differs {
            kept.push(name);
        }
    }
    Ok(kept)
}

/// The operation a delivery with `dedupe_key` was folded into, or an ordinary enqueue with
/// that key made, if any.
async fn delivered(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    dedupe_key: Option<&str>,
) -> Result<Option<Outcome>> {
    let Some(key) = dedupe_key else {
        return Ok(None);
    };
    let row: Option<(Uuid, Status, String)> = sqlx::query_as(
        "SELECT d.op_id, o.status, d.input_sha256
           FROM debounced_deliveries d JOIN operations o ON o.id = d.op_id
          WHERE d.tenant_id = $1 AND d.dedupe_key = $2
         UNION ALL
         SELECT id, status, input_sha256 FROM operations WHERE tenant_id = $1 AND dedupe_key = $2
         LIMIT 1",
    )
    .bind(tenant)
    .bind(key)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(row.map(|(id, status, input_sha256)| Outcome::Existing {
        id,
        status,
        input_sha256,
    }))
}

/// Whether the key has a pending operation now (an arrival would join it: no new operation).
pub async fn has_pending(pool: &PgPool, tenant: &str, key: &str) -> Result<bool> {
    let mut conn = pool.acquire().await?;
    pending_exists(&mut conn, tenant, key).await
}

async fn pending_exists(conn: &mut sqlx::PgConnection, tenant: &str, key: &str) -> Result<bool> {
    let exists = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM operations
                         WHERE tenant_id = $1 AND debounce_key = $2
                           AND status = 'queued' AND debounce_until IS NOT NULL)",
    )
    .bind(tenant)
    .bind(key)
    .fetch_one(&mut *conn)
    .await?;
    Ok(exists)
}

/// The key's operations that have started and not finished (newest first), but `except`.
async fn started(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    key: &str,
    except: Option<Uuid>,
) -> Result<Vec<(Uuid, Status)>> {
    let rows = sqlx::query_as(
        "SELECT id, status FROM operations
          WHERE tenant_id = $1 AND debounce_key = $2 AND debounce_until IS NULL
            AND status IN ('queued', 'running', 'sleeping', 'waiting')
            AND id IS DISTINCT FROM $3
          ORDER BY created_at DESC, id DESC",
    )
    .bind(tenant)
    .bind(key)
    .bind(except)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows)
}

/// The key's started, unfinished operations other than `except` (the new pending one): what
/// the policy `cancel_running` cancels.
pub async fn started_of_key(
    pool: &PgPool,
    tenant: &str,
    key: &str,
    except: Uuid,
) -> Result<Vec<Uuid>> {
    let mut conn = pool.acquire().await?;
    Ok(started(&mut conn, tenant, key, Some(except))
        .await?
        .into_iter()
        .map(|(id, _)| id)
        .collect())
}

/// One row of the audit trail for a delivery folded into (or skipped for) `op`. Never the
/// input: the key, the window, the policy and the new start.
async fn audit(
    conn: &mut sqlx::PgConnection,
    actor: &str,
    action: &str,
    op: Uuid,
    status: Status,
    spec: &Spec,
    run_at: Option<DateTime<Utc>>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, status_before, status_after, details)
         VALUES ($1, $2, $3, $4, $4, $5)",
    )
    .bind(actor)
    .bind(action)
    .bind(op)
    .bind(status)
    .bind(serde_json::json!({
        "debounce_key": spec.key,
        "window_ms": spec.window_ms,
        "max_delay_ms": spec.max_delay_ms,
        "on_running": spec.on_running.as_str(),
        "run_at": run_at,
    }))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// How many deliveries were folded into `op` (its audit rows), and its debounce key.
pub async fn folded(pool: &PgPool, op: Uuid) -> Result<(Option<String>, i64)> {
    let row = sqlx::query_as(
        "SELECT o.debounce_key,
                (SELECT count(*) FROM operator_actions a
                  WHERE a.op_id = o.id AND a.action = 'debounce')
           FROM operations o WHERE o.id = $1",
    )
    .bind(op)
    .fetch_optional(pool)
    .await?;
    Ok(row.unwrap_or((None, 0)))
}
