//! SQL of schedules (`schedules`, and `operations.schedule_id`): add, list, find, pause,
//! resume, delete (each change audited in `operator_actions`), and the scheduler's firing pass.
//!
//! Firing exactly once: [`fire_due`] locks due schedules `FOR UPDATE SKIP LOCKED`, inserts one
//! operation per tick it fires with the dedupe key [`crate::schedule::firing_key`], and moves
//! the schedule's `next_tick` on, all in one transaction. Another scheduler skips the locked
//! rows and finds them advanced once the lock is released; were a tick inserted twice anyway,
//! the unique `(tenant_id, dedupe_key)` index makes the second insert find the first.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::{Result, dispatch::Dispatch, operations::Inserted, operations::NewOperation};
use crate::operation::{Lane, OperationId, input_sha256};
use crate::schedule::{self, Spec};
use crate::state::{Overlap, terminal_sql};

/// A schedule as stored and shown (never its input, which stays in the table; `next_tick` is
/// shown as the next firings, `agentq_app::schedules::ScheduleView`).
#[derive(Clone, Debug, FromRow, Serialize, schemars::JsonSchema)]
#[schemars(rename = "StoredSchedule")]
pub struct Schedule {
    pub schedule_id: Uuid,
    pub tenant: String,
    pub name: String,
    pub kind: String,
    #[sqlx(try_from = "String")]
    pub lane: Lane,
    pub max_attempts: i32,
    /// Its cron expression, or null for an interval
    pub cron: Option<String>,
    /// The IANA zone its cron expression is read in
    pub time_zone: Option<String>,
    /// Its interval, or null for a cron expression
    pub interval_secs: Option<i64>,
    pub overlap: Overlap,
    pub catchup_window_secs: i64,
    pub paused: bool,
    /// The next tick not handled yet.
    #[serde(skip)]
    pub next_tick: Option<DateTime<Utc>>,
    /// `buffer_one`: the tick waiting for the previous firing to end
    pub buffered_tick: Option<DateTime<Utc>>,
    /// The latest tick fired, and its operation
    pub last_tick: Option<DateTime<Utc>>,
    pub last_op_id: Option<Uuid>,
    /// Operations fired
    pub fired: i64,
    /// Ticks not fired because the previous firing was unfinished
    pub skipped_overlap: i64,
    /// Ticks older than the catch-up window when a scheduler got to them
    pub skipped_missed: i64,
    /// Ticks not fired because the tenant had its cap of unfinished operations
    pub skipped_capacity: i64,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The token budget each firing's operation is born with (none: no budget).
    pub budget_tokens: Option<i64>,
    /// Which tokens it counts: `input`, `output` or `total`.
    pub budget_measure: Option<String>,
}

const COLUMNS: &str = "id AS schedule_id, tenant_id AS tenant, name, kind, lane, max_attempts, cron, time_zone, interval_secs, overlap, catchup_secs AS catchup_window_secs,
    paused, next_tick, buffered_tick, last_tick, last_op_id, fired, skipped_overlap,
    skipped_missed, skipped_capacity, created_by, created_at, updated_at, budget_tokens,
    budget_measure";

/// What [`create`] stores: a checked operation to fire copies of, and when.
pub struct NewSchedule<'a> {
    pub id: Uuid,
    pub name: &'a str,
    /// The operation as an enqueue would insert it (tenant, kind, input, lane,
    /// attempts); each firing inserts a copy with its own id and dedupe key.
    pub op: &'a NewOperation,
    pub spec: &'a Spec,
    pub overlap: Overlap,
    pub catchup_secs: i64,
    pub paused: bool,
}

/// The database's clock: ticks are compared with it, whichever process asks.
async fn now(tx: &mut sqlx::PgConnection) -> Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT now()").fetch_one(tx).await?)
}

/// Stores a schedule (its first tick the spec's first after now), audited as `schedule_add`;
/// `None` when its tenant already has a schedule of that name.
/// How many schedules `tenant` has.
pub async fn count_of(pool: &PgPool, tenant: &str) -> Result<i64> {
    let n = sqlx::query_scalar("SELECT count(*) FROM schedules WHERE tenant_id = $1")
        .bind(tenant)
        .fetch_one(pool)
        .await?;
    Ok(n)
}

pub async fn create(pool: &PgPool, s: &NewSchedule<'_>, actor: &str) -> Result<Option<Schedule>> {
    let mut tx = pool.begin().await?;
    let next = s.spec.next_after(now(&mut tx).await?);
    let created: Option<Schedule> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO schedules (id, tenant_id, name, kind, input, lane, max_attempts,
                                cron, time_zone, interval_secs, overlap, catchup_secs, paused,
                                next_tick, created_by, budget_tokens, budget_measure,
                                budget_timeout_secs)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
                 $18)
         ON CONFLICT (tenant_id, name) DO NOTHING
         RETURNING {COLUMNS}"
    )))
    .bind(s.id)
    .bind(&s.op.tenant)
    .bind(s.name)
    .bind(&s.op.kind)
    .bind(&s.op.input)
    .bind(s.op.lane.as_str())
    .bind(s.op.max_attempts)
    .bind(s.spec.cron_expr())
    .bind(s.spec.zone_name())
    .bind(s.spec.interval_secs())
    .bind(s.overlap)
    .bind(s.catchup_secs)
    .bind(s.paused)
    .bind(next)
    .bind(actor)
    .bind(s.op.budget.map(|b| b.tokens))
    .bind(s.op.budget.map(|b| b.measure.as_str()))
    .bind(s.op.budget.map(|b| b.timeout_secs))
    .fetch_optional(&mut *tx)
    .await?;
    let Some(created) = created else {
        return Ok(None);
    };
    super::access::audit(&mut tx, actor, "schedule_add", details(&created)).await?;
    tx.commit().await?;
    Ok(Some(created))
}

/// What the audit trail keeps of a schedule (never its input).
fn details(s: &Schedule) -> Value {
    json!({
        "schedule_id": s.schedule_id, "tenant": s.tenant, "name": s.name, "kind": s.kind,
        "cron": s.cron, "time_zone": s.time_zone, "interval_secs": s.interval_secs,
        "overlap": s.overlap, "catchup_window_secs": s.catchup_window_secs, "paused": s.paused,
    })
}

/// The schedules of `tenant` (all for `None`), by tenant and name.
pub async fn list(pool: &PgPool, tenant: Option<&str>, limit: i64) -> Result<Vec<Schedule>> {
    let rows = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM schedules WHERE $1::text IS NULL OR tenant_id = $1
          ORDER BY tenant_id, name LIMIT $2"
    )))
    .bind(tenant)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// One schedule; with `tenant`, another tenant's id is not found.
pub async fn find(pool: &PgPool, id: Uuid, tenant: Option<&str>) -> Result<Option<Schedule>> {
    let row = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM schedules WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)"
    )))
    .bind(id)
    .bind(tenant)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// What [`set_paused`] did.
#[derive(Debug)]
pub enum Toggled {
    /// Changed (audited).
    Now(Schedule),
    /// It was already so: nothing changed.
    Already(Schedule),
    NotFound,
}

/// Pauses a schedule (nothing fires; a buffered tick is dropped) or resumes it (it fires
/// again from the first tick after now: ticks while paused are not fired). Audited as
/// `schedule_pause` / `schedule_resume`.
pub async fn set_paused(
    pool: &PgPool,
    id: Uuid,
    tenant: Option<&str>,
    paused: bool,
    actor: &str,
) -> Result<Toggled> {
    let mut tx = pool.begin().await?;
    // Waits for a firing pass holding the row: its ticks are fired or not, never half.
    let found: Option<Schedule> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM schedules
          WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2) FOR UPDATE"
    )))
    .bind(id)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(found) = found else {
        return Ok(Toggled::NotFound);
    };
    if found.paused == paused {
        return Ok(Toggled::Already(found));
    }
    let next = if paused {
        found.next_tick
    } else {
        let spec = Spec::stored(
            found.cron.as_deref(),
            found.time_zone.as_deref(),
            found.interval_secs,
        )
        .map_err(|e| sqlx::Error::Decode(e.into()))?;
        spec.next_after(now(&mut tx).await?)
    };
    let changed: Schedule = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE schedules SET paused = $2, next_tick = $3, buffered_tick = NULL, updated_at = now()
          WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(paused)
    .bind(next)
    .fetch_one(&mut *tx)
    .await?;
    let action = if paused {
        "schedule_pause"
    } else {
        "schedule_resume"
    };
    super::access::audit(&mut tx, actor, action, details(&changed)).await?;
    tx.commit().await?;
    Ok(Toggled::Now(changed))
}

/// Deletes a schedule (audited as `schedule_delete`); its operations stay, with its id.
pub async fn delete(
    pool: &PgPool,
    id: Uuid,
    tenant: Option<&str>,
    actor: &str,
) -> Result<Option<Schedule>> {
    let mut tx = pool.begin().await?;
    let gone: Option<Schedule> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "DELETE FROM schedules WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2)
          RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(gone) = gone else {
        return Ok(None);
    };
    super::access::audit(&mut tx, actor, "schedule_delete", details(&gone)).await?;
    tx.commit().await?;
    Ok(Some(gone))
}

#[derive(FromRow)]
struct Due {
    id: Uuid,
    tenant_id: String,
    kind: String,
    input: Value,
    #[sqlx(try_from = "String")]
    lane: Lane,
    max_attempts: i32,
    cron: Option<String>,
    time_zone: Option<String>,
    interval_secs: Option<i64>,
    overlap: Overlap,
    catchup_secs: i64,
    next_tick: Option<DateTime<Utc>>,
    buffered_tick: Option<DateTime<Utc>>,
    previous_running: bool,
    now: DateTime<Utc>,
    budget_tokens: Option<i64>,
    budget_measure: Option<String>,
    budget_timeout_secs: Option<i32>,
}

/// What one pass did with one schedule.
#[derive(Clone, Debug)]
pub struct Fired {
    pub schedule_id: Uuid,
    pub kind: String,
    /// The operations created, to publish (committed: a lost publish is the sweeper's).
    pub created: Vec<Dispatch>,
    /// Ticks not fired because the previous firing was unfinished.
    pub skipped_overlap: i64,
    /// Ticks older than the catch-up window.
    pub missed: i64,
    /// Ticks not fired because the tenant had its cap of unfinished operations.
    pub skipped_capacity: i64,
}

/// One firing pass: up to `limit` due schedules (a tick due, or a buffered one), each locked
/// `FOR UPDATE SKIP LOCKED`, planned by [`schedule::plan`] (at most `max_fire` firings each)
/// and applied in one transaction: an operation per fired tick (dedupe key
/// [`schedule::firing_key`], `schedule_id` set), then the schedule's next tick, buffered tick,
/// latest firing and counters. Returns what changed, for the caller to publish after the commit.
///
/// A schedule whose tenant has `tenant_max_unfinished` unfinished operations fires nothing: its
/// due ticks are counted as `skipped_capacity` and it moves on, like an overlap skip. Each
/// tenant is counted once per pass, plus what the pass fires for it.
pub async fn fire_due(
    pool: &PgPool,
    limit: i64,
    max_fire: usize,
    tenant_max_unfinished: i64,
) -> Result<Vec<Fired>> {
    let mut tx = pool.begin().await?;
    let mut unfinished: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    let due: Vec<Due> = sqlx::query_as(concat!(
        "SELECT s.id, s.tenant_id, s.kind, s.input, s.lane, s.max_attempts, s.cron,
                s.budget_tokens, s.budget_measure, s.budget_timeout_secs,
                s.time_zone, s.interval_secs, s.overlap, s.catchup_secs, s.next_tick,
                s.buffered_tick, now() AS now,
                EXISTS (SELECT 1 FROM operations o
                         WHERE o.id = s.last_op_id AND o.status NOT IN ",
        terminal_sql!(),
        ") AS previous_running
           FROM schedules s
          WHERE NOT s.paused AND (s.next_tick <= now() OR s.buffered_tick IS NOT NULL)
          ORDER BY s.next_tick
          LIMIT $1
          FOR UPDATE OF s SKIP LOCKED"
    ))
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let mut out = Vec::new();
    for d in due {
        let spec = match Spec::stored(d.cron.as_deref(), d.time_zone.as_deref(), d.interval_secs) {
            Ok(spec) => spec,
            Err(e) => {
                tracing::warn!(schedule_id = %d.id, error = %e, "a stored schedule cannot be read; not firing it");
                continue;
            }
        };
        let state = schedule::State {
            next_tick: d.next_tick,
            buffered: d.buffered_tick,
            previous_running: d.previous_running,
        };
        let plan = schedule::plan(&spec, d.overlap, d.catchup_secs, state, d.now, max_fire);
        if plan.is_idle(&state) {
            continue;
        }
        let lane = d.lane;
        let sha = input_sha256(&d.input);
        let budget = match (
            d.budget_tokens,
            d.budget_measure.as_deref(),
            d.budget_timeout_secs,
        ) {
            (Some(tokens), Some(measure), Some(timeout_secs)) => Some(super::budgets::Spec {
                tokens,
                measure: super::budgets::Measure::parse(measure)
                    .unwrap_or(super::budgets::Measure::Total),
                timeout_secs,
            }),
            _ => None,
        };
        let (mut created, mut last) = (Vec::new(), None);
        let count = match unfinished.get(&d.tenant_id) {
            Some(n) => *n,
            None => {
                let n: i64 = sqlx::query_scalar(concat!(
                    "SELECT count(*) FROM (SELECT 1 FROM operations ",
                    super::operations::unfinished_of_tenant!(),
                    " LIMIT $2) q"
                ))
                .bind(&d.tenant_id)
                .bind(tenant_max_unfinished.saturating_add(1))
                .fetch_one(&mut *tx)
                .await?;
                n
            }
        };
        let room = (tenant_max_unfinished - count).max(0) as usize;
        let skipped_capacity = plan.fire.len().saturating_sub(room) as i64;
        for tick in plan.fire.iter().take(room) {
            let op = NewOperation {
                id: OperationId::new(),
                tenant: d.tenant_id.clone(),
                kind: d.kind.clone(),
                lane,
                input: d.input.clone(),
                input_sha256: sha.clone(),
                dedupe_key: Some(schedule::firing_key(d.id, *tick)),
                ordering_key: None,
                concurrency_key: None,
                concurrency_limit: None,
                rate_key: None,
                batch_id: None,
                max_attempts: d.max_attempts,
                run_at: None,
                deadline: None,
                request_id: None,
                traceparent: None,
                schedule_id: Some(d.id),
                parent_id: None,
                budget,
            };
            match super::operations::insert_operation(&mut tx, &op).await? {
                Inserted::Created { id, epoch } => {
                    *unfinished.entry(d.tenant_id.clone()).or_insert(count) += 1;
                    created.push(Dispatch {
                        id: id.0,
                        tenant_id: op.tenant,
                        kind: op.kind,
                        lane: lane.as_str().to_string(),
                        epoch,
                        traceparent: None,
                    });
                    last = Some((*tick, id.0));
                }
                // Fired before (never by a live scheduler: the row is locked); it stays one.
                Inserted::Existing { id, .. } => last = Some((*tick, id.0)),
            }
        }
        sqlx::query(
            "UPDATE schedules
                SET next_tick = $2, buffered_tick = $3,
                    last_tick = COALESCE($4, last_tick), last_op_id = COALESCE($5, last_op_id),
                    fired = fired + $6, skipped_overlap = skipped_overlap + $7,
                    skipped_missed = skipped_missed + $8,
                    skipped_capacity = skipped_capacity + $9, updated_at = now()
              WHERE id = $1",
        )
        .bind(d.id)
        .bind(plan.next_tick)
        .bind(plan.buffered)
        .bind(last.map(|(t, _)| t))
        .bind(last.map(|(_, id)| id))
        .bind(created.len() as i64)
        .bind(plan.skipped_overlap)
        .bind(plan.missed)
        .bind(skipped_capacity)
        .execute(&mut *tx)
        .await?;
        unfinished.entry(d.tenant_id.clone()).or_insert(count);
        out.push(Fired {
            schedule_id: d.id,
            kind: d.kind,
            created,
            skipped_overlap: plan.skipped_overlap,
            missed: plan.missed,
            skipped_capacity,
        });
    }
    tx.commit().await?;
    Ok(out)
}
