//! SQL of token budgets (`budgets`, `budget_holds`): a budget on an operation or on a batch,
//! the hold every model call under one takes before it is sent, its charge when it returns, and
//! an operator's raise.
//!
//! Invariants kept here:
//! - A call is sent only after its estimate is held against every budget over its operation,
//!   in one transaction that locks those budget rows: concurrent calls of one batch cannot
//!   together pass its limit by more than the estimates' error.
//! - Spent plus held never shrinks except by a raise: a call's hold is replaced by its reported
//!   usage (or kept as its estimate when none was reported), and a hold left by a crashed run is
//!   charged, never dropped.
//! - A refused call changes nothing but the budget's `exceeded_at` (and, for a batch budget,
//!   the batch's status: paused, audited as `budget`).

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use super::dispatch::Dispatch;
use crate::state::transition::{batch, from_sql, to_sql};

/// What an operation waiting for its budget is stored as waiting for (`waiting_for`).
/// In parentheses, as `(children)` is: never a signal's name.
macro_rules! waiting_for {
    () => {
        "(budget)"
    };
}

/// Which tokens a budget counts.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Measure {
    /// Prompt tokens.
    Input,
    /// Completion tokens.
    Output,
    /// Both.
    Total,
}

impl Measure {
    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Measure::Input => "input",
            Measure::Output => "output",
            Measure::Total => "total",
        }
    }

    /// Parses a stored or typed name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "input" => Measure::Input,
            "output" => Measure::Output,
            "total" => Measure::Total,
            _ => return None,
        })
    }

    /// The tokens of a call with `input` prompt and `output` completion tokens it counts.
    pub fn of(self, input: i64, output: i64) -> i64 {
        match self {
            Measure::Input => input,
            Measure::Output => output,
            Measure::Total => input.saturating_add(output),
        }
    }
}

/// A budget as set: how many tokens of which measure, and how long an operation it refused
/// waits for a raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    pub tokens: i64,
    pub measure: Measure,
    pub timeout_secs: i32,
}

/// How long an operation its own budget refused waits for a raise, unless said: a day.
pub const DEFAULT_TIMEOUT_SECS: i32 = 86_400;
/// The largest budget and the longest timeout a budget may have.
pub const MAX_TOKENS: i64 = 1_000_000_000_000;
pub const MAX_TIMEOUT_SECS: i32 = 30 * 86_400;

/// Refuses a budget out of range: `(field, message)`, as the API names the field.
pub fn check(spec: &Spec) -> std::result::Result<(), (&'static str, String)> {
    if !(1..=MAX_TOKENS).contains(&spec.tokens) {
        return Err((
            "/budget/tokens",
            format!("a budget is 1 to {MAX_TOKENS} tokens (got {})", spec.tokens),
        ));
    }
    if !(1..=MAX_TIMEOUT_SECS).contains(&spec.timeout_secs) {
        return Err((
            "/budget/timeout_secs",
            format!(
                "a budget's timeout is 1 s to {MAX_TIMEOUT_SECS} s (30 days) (got {})",
                spec.timeout_secs
            ),
        ));
    }
    Ok(())
}

/// What a budget is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    Operation(Uuid),
    Batch(Uuid),
    /// The tenant's own operations, per period of this many seconds.
    Tenant {
        period_secs: i32,
    },
}

/// A budget as shown (`agentq status`, `why`, the API).
#[derive(Clone, Debug, PartialEq, FromRow, serde::Serialize, schemars::JsonSchema)]
pub struct BudgetView {
    #[serde(skip)]
    pub id: Uuid,
    /// `operation`, `ancestor` (an operation's budget over the operation asked about: a parent's
    /// or one further up its tree), `batch` or `tenant`.
    pub scope: String,
    /// The operation whose budget it is (scopes `operation` and `ancestor`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub op_id: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<Uuid>,
    /// `input`, `output` or `total`.
    pub measure: String,
    pub limit_tokens: i64,
    /// Charged: reported usage, or the estimate of calls that reported none.
    pub spent_tokens: i64,
    /// Held by calls in flight (or cut short by a crash, until charged).
    pub held_tokens: i64,
    /// Calls charged by their estimate.
    pub estimated_calls: i32,
    pub timeout_secs: i32,
    /// When it first refused a call since it was set or raised.
    pub exceeded_at: Option<DateTime<Utc>>,
    /// An operator let the next refused call through.
    pub allow_once: bool,
    /// A tenant's budget: the length of its period, and when the current one ends (its
    /// spend starts again then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_secs: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_ends: Option<DateTime<Utc>>,
}

impl BudgetView {
    /// As seen from operation `op`: another operation's budget over it is its ancestor's.
    fn seen_from(mut self, op: Uuid) -> Self {
        if self.scope == "operation" && self.op_id != Some(op) {
            self.scope = "ancestor".into();
        }
        self
    }
}

const VIEW: &str = "b.id,
     CASE WHEN b.op_id IS NOT NULL THEN 'operation'
          WHEN b.batch_id IS NOT NULL THEN 'batch' ELSE 'tenant' END AS scope,
     b.op_id,
     b.batch_id, b.measure, b.limit_tokens, b.spent_tokens,
     COALESCE((SELECT sum(h.tokens) FROM budget_holds h WHERE h.budget_id = b.id), 0)::bigint
         AS held_tokens,
     b.estimated_calls, b.timeout_secs, b.exceeded_at, b.allow_once, b.period_secs,
     b.period_start + b.period_secs * interval '1 second' AS period_ends";

/// The budgets over operation `op` (`$1`): its own and its ancestors' (a spawn's child is
/// covered by every budget over its tree above it), its batch's or its tree's batch's, its
/// tenant's.
const OVER: &str =
    "b.op_id = ANY((SELECT o.ancestors || o.id FROM operations o WHERE o.id = $1)::uuid[])
     OR b.batch_id = (SELECT COALESCE(batch_id, tree_batch_id) FROM operations WHERE id = $1)
     OR b.tenant_scope = (SELECT tenant_id FROM operations WHERE id = $1)";

/// Whether any budget is over operation `op` (its claim answered this already; a worker asks
/// again only when a budget was born apart from its operation since: [`newest_born_apart`]).
pub async fn any_over(pool: &PgPool, op: Uuid) -> Result<bool> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT EXISTS (SELECT 1 FROM budgets b WHERE {OVER})"
    )))
    .bind(op)
    .fetch_one(pool)
    .await?)
}

/// When the newest budget set apart from its operation's enqueue (`agentq budget set`, a
/// batch's, a tenant's) was born, and the database's clock now: a claim before that birth may
/// not have seen it.
pub async fn newest_born_apart(pool: &PgPool) -> Result<(Option<DateTime<Utc>>, DateTime<Utc>)> {
    Ok(
        sqlx::query_as("SELECT (SELECT max(created_at) FROM budgets WHERE born_apart), now()")
            .fetch_one(pool)
            .await?,
    )
}

/// The budgets over operation `op`: its own, its ancestors', its batch's (or its tree's),
/// its tenant's; an ancestor's is of scope `ancestor`.
pub async fn over(pool: &PgPool, op: Uuid) -> Result<Vec<BudgetView>> {
    let budgets: Vec<BudgetView> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM budgets b WHERE {OVER}
          ORDER BY b.op_id IS DISTINCT FROM $1, b.op_id IS NULL, b.batch_id IS NULL"
    )))
    .bind(op)
    .fetch_all(pool)
    .await?;
    Ok(budgets.into_iter().map(|b| b.seen_from(op)).collect())
}

/// The budget per period of tenant `tenant`, if it has one.
pub async fn of_tenant(pool: &PgPool, tenant: &str) -> Result<Option<BudgetView>> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM budgets b WHERE b.tenant_scope = $1"
    )))
    .bind(tenant)
    .fetch_optional(pool)
    .await?)
}

/// The budget of batch `batch`, if it has one.
pub async fn of_batch(pool: &PgPool, batch: Uuid) -> Result<Option<BudgetView>> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM budgets b WHERE b.batch_id = $1"
    )))
    .bind(batch)
    .fetch_optional(pool)
    .await?)
}

/// Sets the budget on `on` (of `tenant`), or raises (or lowers) the one it has: its limit,
/// measure and timeout replaced, its refusal forgotten. Audited with `actor` and `reason`.
pub async fn set(
    pool: &PgPool,
    tenant: &str,
    on: On,
    spec: Spec,
    actor: &str,
    reason: Option<&str>,
) -> Result<BudgetView> {
    let (op, batch_id, period) = match on {
        On::Operation(id) => (Some(id), None, None),
        On::Batch(id) => (None, Some(id), None),
        On::Tenant { period_secs } => (None, None, Some(period_secs)),
    };
    let arbiter = match on {
        On::Operation(_) => "(op_id) WHERE op_id IS NOT NULL",
        On::Batch(_) => "(batch_id) WHERE batch_id IS NOT NULL",
        On::Tenant { .. } => "(tenant_scope) WHERE tenant_scope IS NOT NULL",
    };
    let mut tx = pool.begin().await?;
    // A tenant's periods are aligned to multiples of their length since the Unix epoch.
    let id: Uuid = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO budgets (id, tenant_id, op_id, batch_id, measure, limit_tokens, timeout_secs,
                              tenant_scope, period_secs, period_start)
         VALUES ($1, $2, $3, $4, $5, $6, $7,
                 CASE WHEN $8::int IS NOT NULL THEN $2 END, $8,
                 to_timestamp(floor(extract(epoch FROM now()) / $8) * $8))
         ON CONFLICT {arbiter}
         DO UPDATE SET measure = EXCLUDED.measure, limit_tokens = EXCLUDED.limit_tokens,
                       timeout_secs = EXCLUDED.timeout_secs, exceeded_at = NULL,
                       period_secs = EXCLUDED.period_secs, period_start = EXCLUDED.period_start,
                       updated_at = now()
         RETURNING id"
    )))
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(op)
    .bind(batch_id)
    .bind(spec.measure.as_str())
    .bind(spec.tokens)
    .bind(spec.timeout_secs)
    .bind(period)
    .fetch_one(&mut *tx)
    .await?;
    audit(&mut tx, actor, "budget_set", op, batch_id, reason, spec).await?;
    let view = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM budgets b WHERE b.id = $1"
    )))
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(view)
}

async fn audit(
    tx: &mut sqlx::PgConnection,
    actor: &str,
    action: &str,
    op: Option<Uuid>,
    batch_id: Option<Uuid>,
    reason: Option<&str>,
    spec: Spec,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, reason, details)
         VALUES ($1, $2, $3, $4, jsonb_build_object('batch_id', $5::uuid, 'limit_tokens', $6::bigint,
                                                    'measure', $7::text))",
    )
    .bind(actor)
    .bind(action)
    .bind(op)
    .bind(reason)
    .bind(batch_id)
    .bind(spec.tokens)
    .bind(spec.measure.as_str())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Lets operation `op`'s next call that its own budget refuses through, once (an operator's
/// "resume once"). Audited. False when it has no budget.
pub async fn allow_once(
    pool: &PgPool,
    op: Uuid,
    actor: &str,
    reason: Option<&str>,
) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let spec: Option<(String, i64)> = sqlx::query_as(
        "UPDATE budgets SET allow_once = true, updated_at = now() WHERE op_id = $1
         RETURNING measure, limit_tokens",
    )
    .bind(op)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((measure, tokens)) = spec else {
        return Ok(false);
    };
    let spec = Spec {
        tokens,
        measure: Measure::parse(&measure).unwrap_or(Measure::Total),
        timeout_secs: 0,
    };
    audit(
        &mut tx,
        actor,
        "budget_allow_once",
        Some(op),
        None,
        reason,
        spec,
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// The statement that queues again the operations `$1` names (by the condition `$which`) that
/// wait for a budget: its attempt given back (the claim counts it again), as a wake does;
/// returns what to publish.
macro_rules! lift_sql {
    ($which:literal) => {
        concat!(
            "UPDATE operations SET status = ",
            to_sql!(BUDGET),
            ", waiting_for = NULL, attempt = attempt - 1, run_at = now(), dispatched_at = NULL,
                  updated_at = clock_timestamp()
              WHERE ",
            $which,
            " AND status IN ",
            from_sql!(BUDGET),
            " AND waiting_for = '",
            waiting_for!(),
            "'
              RETURNING id, tenant_id, kind, lane, epoch, NULL::text AS traceparent"
        )
    };
}

/// Queues operation `op` again if it waits for a budget (status `waiting`, `(budget)`), and
/// every operation below it in its tree that does (its budget is over them): after a raise or
/// an allow-once. Their dispatch is the caller's: what to publish, when they were woken (one
/// that another budget still refuses parks again).
pub async fn lift(pool: &PgPool, op: Uuid) -> Result<Vec<Dispatch>> {
    Ok(sqlx::query_as(lift_sql!("$1 = ANY(ancestors || id)"))
        .bind(op)
        .fetch_all(pool)
        .await?)
}

/// Queues again every operation of `tenant` that waits for a budget (after its tenant budget
/// was raised), as [`lift`] does one; what to publish.
pub async fn lift_tenant(pool: &PgPool, tenant: &str) -> Result<Vec<Dispatch>> {
    Ok(sqlx::query_as(lift_sql!("tenant_id = $1"))
        .bind(tenant)
        .fetch_all(pool)
        .await?)
}

/// Queues again the children of batch `batch`'s documents that wait for a budget (after the
/// batch's budget was raised; its documents resume with the batch), as [`lift`] does one.
pub async fn lift_tree_batch(pool: &PgPool, batch: Uuid) -> Result<Vec<Dispatch>> {
    Ok(sqlx::query_as(lift_sql!("tree_batch_id = $1"))
        .bind(batch)
        .fetch_all(pool)
        .await?)
}

/// What [`reserve`] decided for one model call.
#[derive(Clone, Debug, PartialEq)]
pub enum Reserved {
    /// No budget is over the operation: nothing was held.
    Unbudgeted,
    /// Held against every budget over it (`call_id` names the holds for [`charge`]).
    Held { call_id: Uuid },
    /// The operation's own budget refused it; it first did at `exceeded_at`, and waits for a
    /// raise until `exceeded_at + timeout_secs`.
    Operation {
        budget: Box<BudgetView>,
        needed: i64,
        exceeded_at: DateTime<Utc>,
    },
    /// The tokens spent leave room for it but those held by calls in flight do not: it may
    /// fit once they are charged. Nothing was held.
    Busy,
    /// Its tenant's budget for this period refused it: it may run when the period ends.
    Tenant {
        budget: Box<BudgetView>,
        needed: i64,
        period_ends: DateTime<Utc>,
    },
    /// Its batch's budget refused it; the batch is paused (by this call or an earlier one).
    Batch {
        budget: Box<BudgetView>,
        needed: i64,
    },
    /// The operation is no longer this attempt's to run.
    LeaseLost,
}

/// Holds a call's estimate (`input` prompt and `output` completion tokens) against every
/// budget over operation `op` at `epoch`, or says which refused it. A hold an earlier epoch
/// left (a crashed call) is charged first.
pub async fn reserve(
    pool: &PgPool,
    op: Uuid,
    epoch: i64,
    input: i64,
    output: i64,
) -> Result<Reserved> {
    let mut tx = pool.begin().await?;
    // Running, and whether it is a batch's document (else a batch's budget over it is its
    // tree's, over a child of a document).
    let document: Option<bool> = sqlx::query_scalar(
        "SELECT batch_id IS NOT NULL FROM operations
          WHERE id = $1 AND epoch = $2 AND status = 'running'
            FOR SHARE",
    )
    .bind(op)
    .bind(epoch)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(document) = document else {
        return Ok(Reserved::LeaseLost);
    };
    // The budget rows locked first, in a statement of their own: the statements after it
    // take their snapshots once the lock is held (READ COMMITTED), so they see every hold and
    // charge committed by the transactions this one waited for.
    let locked: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT b.id FROM budgets b WHERE {OVER} ORDER BY b.id FOR UPDATE"
    )))
    .bind(op)
    .fetch_all(&mut *tx)
    .await?;
    if locked.is_empty() {
        return Ok(Reserved::Unbudgeted);
    }
    // A tenant's budget whose period ended starts a new one: nothing spent, no refusal.
    sqlx::query(
        "UPDATE budgets
            SET spent_tokens = 0, estimated_calls = 0, exceeded_at = NULL, updated_at = now(),
                period_start = period_start
                    + floor(extract(epoch FROM now() - period_start) / period_secs)
                      * period_secs * interval '1 second'
          WHERE id = ANY($1) AND tenant_scope IS NOT NULL
            AND now() >= period_start + period_secs * interval '1 second'",
    )
    .bind(&locked)
    .execute(&mut *tx)
    .await?;
    // Crashed calls' holds become spent, at their estimate.
    sqlx::query(
        "WITH stale AS (
            DELETE FROM budget_holds WHERE op_id = $1 AND epoch < $2
            RETURNING budget_id, call_id, tokens)
         UPDATE budgets b SET spent_tokens = spent_tokens + s.tokens,
                              estimated_calls = estimated_calls + s.calls, updated_at = now()
           FROM (SELECT budget_id, sum(tokens)::bigint AS tokens, count(*)::int AS calls
                   FROM stale GROUP BY budget_id) s
          WHERE b.id = s.budget_id",
    )
    .bind(op)
    .bind(epoch)
    .execute(&mut *tx)
    .await?;
    let budgets: Vec<BudgetView> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VIEW} FROM budgets b WHERE b.id = ANY($1)
          ORDER BY b.batch_id IS NULL, b.tenant_scope IS NULL"
    )))
    .bind(&locked)
    .fetch_all(&mut *tx)
    .await?;
    let budgets: Vec<BudgetView> = budgets.into_iter().map(|b| b.seen_from(op)).collect();
    // The batch's first: a spent batch stops every one of its operations, not just this one;
    // then the tenant's (its operations wait for the next period), then the operation's own.
    // A call that the spent tokens leave room for, but the holds of calls in flight do not,
    // waits for those to be charged (most use less than their estimate).
    let mut busy = false;
    for b in &budgets {
        let measure = Measure::parse(&b.measure).unwrap_or(Measure::Total);
        let needed = measure.of(input, output);
        if b.spent_tokens + b.held_tokens + needed <= b.limit_tokens {
            continue;
        }
        if b.spent_tokens + needed <= b.limit_tokens {
            busy = true;
            continue;
        }
        if b.scope == "batch" {
            let batch = b.batch_id.expect("a batch budget names its batch");
            pause_batch(&mut tx, batch, b, needed).await?;
            if document {
                tx.commit().await?;
                return Ok(Reserved::Batch {
                    budget: Box::new(b.clone()),
                    needed,
                });
            }
            // A child of a document: the batch's documents stop with the batch, and the child
            // waits for the budget as for its own (a raise of the batch's queues it again).
        }
        if b.scope == "tenant" {
            sqlx::query(
                "UPDATE budgets SET exceeded_at = COALESCE(exceeded_at, now()), updated_at = now()
                  WHERE id = $1",
            )
            .bind(b.id)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Reserved::Tenant {
                budget: Box::new(b.clone()),
                needed,
                period_ends: b.period_ends.expect("a tenant's budget has a period"),
            });
        }
        if b.allow_once {
            sqlx::query("UPDATE budgets SET allow_once = false, updated_at = now() WHERE id = $1")
                .bind(b.id)
                .execute(&mut *tx)
                .await?;
            continue;
        }
        let exceeded_at: DateTime<Utc> = sqlx::query_scalar(
            "UPDATE budgets SET exceeded_at = COALESCE(exceeded_at, now()), updated_at = now()
              WHERE id = $1 RETURNING exceeded_at",
        )
        .bind(b.id)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        return Ok(Reserved::Operation {
            budget: Box::new(b.clone()),
            needed,
            exceeded_at,
        });
    }
    if busy {
        tx.commit().await?;
        return Ok(Reserved::Busy);
    }
    let call_id = Uuid::new_v4();
    for b in &budgets {
        let measure = Measure::parse(&b.measure).unwrap_or(Measure::Total);
        sqlx::query(
            "INSERT INTO budget_holds (call_id, budget_id, op_id, epoch, tokens)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(call_id)
        .bind(b.id)
        .bind(op)
        .bind(epoch)
        .bind(measure.of(input, output))
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(Reserved::Held { call_id })
}

/// Pauses batch `batch` because its budget `b` cannot cover a call of `needed` tokens
/// (`batch::AUTO_PAUSE`, audited as `budget`); nothing if it is no longer running.
async fn pause_batch(
    tx: &mut sqlx::PgConnection,
    batch: Uuid,
    b: &BudgetView,
    needed: i64,
) -> Result<()> {
    let t = batch::AUTO_PAUSE;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH paused AS (
            UPDATE batches b
               SET status = {to}, updated_at = now(),
                   paused_reason = format('budget spent: %s of %s %s tokens (%s held), a call needs %s',
                                          $2::bigint, $3::bigint, $4::text, $5::bigint, $6::bigint),
                   {clock}
             WHERE b.id = $1 AND b.status IN {from}
            RETURNING b.id, b.paused_reason)
         INSERT INTO operator_actions (actor, action, reason, status_before, status_after, details)
         SELECT 'budget', 'batch_paused', paused_reason, 'running', 'paused',
                jsonb_build_object('batch_id', id)
           FROM paused",
        from = t.from_sql(),
        to = t.to_sql(),
        clock = super::batches::clock(t.to),
    )))
    .bind(batch)
    .bind(b.spent_tokens)
    .bind(b.limit_tokens)
    .bind(&b.measure)
    .bind(b.held_tokens)
    .bind(needed)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Charges call `call_id` what it used (`input` prompt and `output` completion tokens, as the
/// provider reported them) in place of its holds; `None`: no usage was reported, and the
/// holds' estimates are charged (counted in `estimated_calls`). A call that failed before the
/// provider answered is charged nothing (`Some((0, 0))`).
pub async fn charge(pool: &PgPool, call_id: Uuid, used: Option<(i64, i64)>) -> Result<()> {
    sqlx::query(
        "WITH h AS (DELETE FROM budget_holds WHERE call_id = $1 RETURNING budget_id, tokens)
         UPDATE budgets b
            SET spent_tokens = spent_tokens + CASE
                    WHEN $2::bigint IS NULL THEN h.tokens
                    WHEN b.measure = 'input' THEN $2
                    WHEN b.measure = 'output' THEN $3
                    ELSE $2 + $3 END,
                estimated_calls = estimated_calls + CASE WHEN $2::bigint IS NULL THEN 1 ELSE 0 END,
                updated_at = now()
           FROM h WHERE b.id = h.budget_id",
    )
    .bind(call_id)
    .bind(used.map(|u| u.0))
    .bind(used.map(|u| u.1))
    .execute(pool)
    .await?;
    Ok(())
}

/// What an operation waiting for its budget is stored as waiting for (`waiting_for`).
pub const WAITING_FOR: &str = waiting_for!();
