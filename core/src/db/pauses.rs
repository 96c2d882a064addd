//! SQL of operator pauses (`pauses`): hold an operation, or every operation of a scope (a
//! tenant, a kind, a lane, a schedule, any combination; none: the whole deployment), and lift
//! the hold.
//!
//! Invariants kept here:
//! - A pause marks the operations it holds (`paused_by`) under their row locks, in the
//!   statement that records it: a claim racing it either committed first (the operation is then
//!   running, marked too, and its worker's heartbeat stops it at the next step boundary) or
//!   re-reads the row and sees the mark. Operations born after the pause are held by the
//!   claim's `agentq_paused` test (`db::claim`).
//! - Resuming never starts what another pause still holds: the marks move to the next pause
//!   that matches, and only unheld queued operations are re-dispatched.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::state::idle_sql;

/// What a pause holds: every column that is set must match (none set: everything).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct Scope {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// `interactive` or `batch`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule_id: Option<Uuid>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub op_id: Option<Uuid>,
}

impl Scope {
    /// Whether it names nothing: the whole deployment (drain mode).
    pub fn is_everything(&self) -> bool {
        *self == Scope::default()
    }
}

/// A pause in force.
#[derive(Clone, Debug, FromRow)]
pub struct Pause {
    pub id: Uuid,
    pub tenant_id: Option<String>,
    pub kind: Option<String>,
    pub lane: Option<String>,
    pub schedule_id: Option<Uuid>,
    pub op_id: Option<Uuid>,
    pub reason: String,
    pub paused_by: String,
    pub paused_at: DateTime<Utc>,
}

impl Pause {
    /// What it holds.
    pub fn scope(&self) -> Scope {
        Scope {
            tenant: self.tenant_id.clone(),
            kind: self.kind.clone(),
            lane: self.lane.clone(),
            schedule_id: self.schedule_id,
            op_id: self.op_id,
        }
    }
}

const COLUMNS: &str = "id, tenant_id, kind, lane, schedule_id, op_id, reason, paused_by, paused_at";

/// Operations of a scope, by status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct Counts {
    pub queued: i64,
    pub sleeping: i64,
    pub waiting: i64,
    /// Running now: each stops at its next step boundary.
    pub running: i64,
}

impl Counts {
    fn from_rows(rows: &[(String, i64)]) -> Self {
        let mut c = Counts::default();
        for (status, n) in rows {
            match status.as_str() {
                "queued" => c.queued += n,
                "sleeping" => c.sleeping += n,
                "waiting" => c.waiting += n,
                "running" => c.running += n,
                _ => {}
            }
        }
        c
    }
}

/// `o`'s match of the scope bound as `$1`…`$5` (tenant, kind, lane, schedule, operation).
macro_rules! in_scope {
    () => {
        "($1::text IS NULL OR o.tenant_id = $1) AND ($2::text IS NULL OR o.kind = $2)
         AND ($3::text IS NULL OR o.lane = $3) AND ($4::uuid IS NULL OR o.schedule_id = $4)
         AND ($5::uuid IS NULL OR o.id = $5)"
    };
}

fn bind_scope<'q, O>(
    q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    s: &'q Scope,
) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
    q.bind(s.tenant.as_deref())
        .bind(s.kind.as_deref())
        .bind(s.lane.as_deref())
        .bind(s.schedule_id)
        .bind(s.op_id)
}

/// How many unfinished operations `scope` holds now, by status (a dry run: nothing written).
pub async fn count(pool: &PgPool, scope: &Scope) -> Result<Counts> {
    let rows: Vec<(String, i64)> = bind_scope(
        sqlx::query_as(concat!(
            "SELECT o.status, count(*) FROM operations o
              WHERE (o.status IN ",
            idle_sql!(),
            " OR o.status = 'running') AND ",
            in_scope!(),
            " GROUP BY o.status"
        )),
        scope,
    )
    .fetch_all(pool)
    .await?;
    Ok(Counts::from_rows(&rows))
}

/// What [`pause`] did.
#[derive(Debug)]
pub enum Made {
    /// The pause (made now, or `created: false`: the one already in force for exactly that
    /// scope) and what it marked, by status.
    Paused {
        pause: Box<Pause>,
        created: bool,
        counts: Counts,
    },
    /// The scope's tenant (or, for a scope without one, the deployment) has `have` pauses, the
    /// most it may: nothing was written.
    Capped { have: i64 },
}

/// Pauses `scope` (audited as `pause`): records the pause, or finds the one already in force
/// for exactly that scope, and marks every unfinished operation it holds. A new pause is
/// refused ([`Made::Capped`]) when the scope's tenant already has `cap` pauses (those without
/// a tenant count together, as the deployment's); pauses of one tenant are made one at a time,
/// so concurrent ones never pass the cap.
pub async fn pause(
    pool: &PgPool,
    scope: &Scope,
    reason: &str,
    actor: &str,
    cap: i64,
) -> Result<Made> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended('agentq_pauses:' || COALESCE($1, ''), 0))",
    )
    .bind(scope.tenant.as_deref())
    .execute(&mut *tx)
    .await?;
    let have: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pauses WHERE tenant_id IS NOT DISTINCT FROM $1")
            .bind(scope.tenant.as_deref())
            .fetch_one(&mut *tx)
            .await?;
    if have >= cap && find_scope_in(&mut tx, scope).await?.is_none() {
        return Ok(Made::Capped { have });
    }
    let made: Option<Pause> = bind_scope(
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "INSERT INTO pauses (id, tenant_id, kind, lane, schedule_id, op_id, reason, paused_by)
             VALUES ($6, $1, $2, $3, $4, $5, $7, $8)
             ON CONFLICT DO NOTHING RETURNING {COLUMNS}"
        ))),
        scope,
    )
    .bind(Uuid::new_v4())
    .bind(reason)
    .bind(actor)
    .fetch_optional(&mut *tx)
    .await?;
    let (pause, created) = match made {
        Some(p) => (p, true),
        None => {
            let existing = find_scope_in(&mut tx, scope)
                .await?
                .ok_or(sqlx::Error::RowNotFound)?;
            (existing, false)
        }
    };
    let rows: Vec<(String, i64)> = bind_scope(
        sqlx::query_as(concat!(
            "WITH locked AS (
                -- Locked in id order, like the claim, the journal, the completion and the
                -- heartbeat, which lock many operations at once: in scan order the mark
                -- deadlocked with them.
                SELECT o.id FROM operations o
                 WHERE o.paused_by IS NULL AND (o.status IN ",
            idle_sql!(),
            " OR o.status = 'running') AND ",
            in_scope!(),
            "
                 ORDER BY o.id
                   FOR NO KEY UPDATE
             ), marked AS (
                UPDATE operations o SET paused_by = $6 FROM locked l
                 WHERE o.id = l.id AND o.paused_by IS NULL AND (o.status IN ",
            idle_sql!(),
            " OR o.status = 'running')
                 RETURNING o.status)
             SELECT status, count(*) FROM marked GROUP BY status"
        )),
        scope,
    )
    .bind(pause.id)
    .fetch_all(&mut *tx)
    .await?;
    let counts = Counts::from_rows(&rows);
    if created {
        audit(&mut tx, actor, "pause", &pause, Some(reason), counts).await?;
    }
    tx.commit().await?;
    Ok(Made::Paused {
        pause: Box::new(pause),
        created,
        counts,
    })
}

/// The pause in force for exactly `scope`, if any.
pub async fn find_scope(pool: &PgPool, scope: &Scope) -> Result<Option<Pause>> {
    let mut conn = pool.acquire().await?;
    find_scope_in(&mut conn, scope).await
}

async fn find_scope_in(conn: &mut sqlx::PgConnection, scope: &Scope) -> Result<Option<Pause>> {
    let row = bind_scope(
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM pauses
              WHERE tenant_id IS NOT DISTINCT FROM $1 AND kind IS NOT DISTINCT FROM $2
                AND lane IS NOT DISTINCT FROM $3
                AND schedule_id IS NOT DISTINCT FROM $4
                AND op_id IS NOT DISTINCT FROM $5"
        ))),
        scope,
    )
    .fetch_optional(conn)
    .await?;
    Ok(row)
}

/// Lifts the pause `id` (audited as `resume`): deletes it and moves the marks of what it held
/// to the next pause that holds them, if any. Returns the pause and how many operations it
/// freed; `None` when no such pause exists (nothing changed).
pub async fn resume(
    pool: &PgPool,
    id: Uuid,
    actor: &str,
    reason: Option<&str>,
) -> Result<Option<(Pause, Counts)>> {
    let mut tx = pool.begin().await?;
    let gone: Option<Pause> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "DELETE FROM pauses WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(pause) = gone else {
        return Ok(None);
    };
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "WITH moved AS (
            UPDATE operations o
               SET paused_by = (SELECT p.id FROM pauses p
                                 WHERE (p.tenant_id = o.tenant_id OR p.tenant_id IS NULL)
                                   AND agentq_pause_holds(p, o.tenant_id, o.kind, o.lane,
                                                          o.schedule_id, o.id)
                                 ORDER BY p.paused_at, p.id LIMIT 1)
             WHERE o.paused_by = $1
         RETURNING o.status, o.paused_by)
         SELECT status, count(*) FROM moved WHERE paused_by IS NULL GROUP BY status",
    )
    .bind(id)
    .fetch_all(&mut *tx)
    .await?;
    let freed = Counts::from_rows(&rows);
    audit(&mut tx, actor, "resume", &pause, reason, freed).await?;
    tx.commit().await?;
    Ok(Some((pause, freed)))
}

/// Locks up to `limit` due, queued operations of `scope` that no pause holds now and whose
/// pointer was not sent since `cutoff` (a claim refused it while it was paused, or a sweep
/// skipped it), for the caller to publish and then mark ([`super::dispatch::Locked`]). One
/// not due yet (a retry's delay) is left to the dispatch sweep: published now, a claim would
/// drop its pointer and the mark would hide it from the sweep.
pub async fn lock_freed(
    pool: &PgPool,
    scope: &Scope,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> Result<super::dispatch::Locked> {
    let query = bind_scope(
        sqlx::query_as(concat!(
            "SELECT o.id, o.tenant_id, o.kind, o.lane, o.epoch, o.traceparent FROM operations o
              WHERE o.status = 'queued' AND o.run_at <= now() AND o.paused_by IS NULL AND ",
            in_scope!(),
            " AND (o.dispatched_at IS NULL OR o.dispatched_at < $6)
                AND NOT o.version_parked AND NOT o.share_held
                AND NOT in_stopped_batch(o.batch_id)
                AND NOT agentq_paused(o.tenant_id, o.kind, o.lane, o.schedule_id, o.id)
              ORDER BY o.id
              LIMIT $7
              FOR UPDATE SKIP LOCKED"
        )),
        scope,
    )
    .bind(cutoff)
    .bind(limit);
    super::dispatch::Locked::lock(pool, query).await
}

/// A page of the pauses in force, oldest first: of every tenant, or (`tenant`) those that
/// name that tenant; up to `limit` after `after` (the `(paused_at, id)` of the previous page's
/// last).
pub async fn list(
    pool: &PgPool,
    tenant: Option<&str>,
    after: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<Pause>> {
    let (at, id) = after.unzip();
    let rows = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM pauses
          WHERE ($1::text IS NULL OR tenant_id = $1)
            AND ($2::timestamptz IS NULL OR (paused_at, id) > ($2, $3))
          ORDER BY paused_at, id
          LIMIT $4"
    )))
    .bind(tenant)
    .bind(at)
    .bind(id)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The pause `id`, if it exists.
pub async fn find(pool: &PgPool, id: Uuid) -> Result<Option<Pause>> {
    let row = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM pauses WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// The pause that holds operation `op` now (the one that marked it, else the oldest that
/// matches it), if any.
pub async fn holding(pool: &PgPool, op: Uuid) -> Result<Option<Pause>> {
    let row = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH o AS (SELECT * FROM operations WHERE id = $1)
         SELECT {COLUMNS} FROM (
             SELECT p.* FROM o JOIN pauses p ON p.id = o.paused_by
             UNION
             -- Its tenant's pauses and the deployment's only (`pauses_tenant`).
             SELECT p.* FROM o JOIN pauses p
                 ON (p.tenant_id = o.tenant_id OR p.tenant_id IS NULL)
                AND agentq_pause_holds(p, o.tenant_id, o.kind, o.lane, o.schedule_id, o.id)
         ) p
          ORDER BY paused_at, id LIMIT 1"
    )))
    .bind(op)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

async fn audit(
    tx: &mut sqlx::PgConnection,
    actor: &str,
    action: &str,
    pause: &Pause,
    reason: Option<&str>,
    counts: Counts,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, reason, details)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(actor)
    .bind(action)
    .bind(pause.op_id)
    .bind(reason)
    .bind(serde_json::json!({
        "pause_id": pause.id, "scope": pause.scope(), "operations": counts,
    }))
    .execute(tx)
    .await?;
    Ok(())
}
