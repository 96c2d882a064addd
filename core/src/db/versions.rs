//! SQL of versioned kinds: the versions live workers run (`workers`), the operations a worker
//! refused for their version and pulls back (`version_parked`), an upgrade's rebase of the
//! journal, operators' upgrades, and the report behind `agentq versions`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::operation::Lane;
use crate::state::{Status, idle_sql};

/// Whether an operation of kind `o.kind` at `o.kind_version` is one the caller may claim: a
/// pinned one if the caller runs its version (`$2` kinds, `$3` versions), an unpinned one if
/// its kind is among those the caller pins new operations of (`$4` kinds; `$5` their versions).
macro_rules! runnable_sql {
    () => {
        "(CASE WHEN o.kind_version IS NULL THEN o.kind = ANY($4::text[])
               ELSE EXISTS (SELECT 1 FROM unnest($2::text[], $3::text[]) AS r(kind, version)
                             WHERE r.kind = o.kind AND r.version = o.kind_version) END)"
    };
}
pub(crate) use runnable_sql;

/// What a worker may claim: the `(kind, version)` pairs it runs, and for new operations the
/// version it pins per kind (only kinds whose newest live version it runs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Runnable {
    runs_kinds: Vec<String>,
    runs_versions: Vec<String>,
    pin_kinds: Vec<String>,
    pin_versions: Vec<String>,
}

impl Runnable {
    /// Runs every pair of `runs`; pins new operations of each kind of `pins` to its version.
    pub fn new<'a>(
        runs: impl IntoIterator<Item = (&'a str, &'a str)>,
        pins: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        let (runs_kinds, runs_versions) = runs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .unzip();
        let (pin_kinds, pin_versions) = pins
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .unzip();
        Self {
            runs_kinds,
            runs_versions,
            pin_kinds,
            pin_versions,
        }
    }

    /// Runs and pins `kinds` at the default version: a worker of one version per kind.
    pub fn at_default(kinds: &[&str]) -> Self {
        let pairs: Vec<(&str, &str)> = kinds
            .iter()
            .map(|k| (*k, crate::version::DEFAULT))
            .collect();
        Self::new(pairs.clone(), pairs)
    }

    /// Binds `$2`–`$5` of [`runnable_sql!`].
    pub(crate) fn bind<'q, O>(
        &'q self,
        q: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        q.bind(&self.runs_kinds)
            .bind(&self.runs_versions)
            .bind(&self.pin_kinds)
            .bind(&self.pin_versions)
    }
}

/// Records that worker `owner` is alive for `ttl` and runs `pairs`; returns the
/// `(kind, version)` pairs every other live worker runs.
pub async fn register_worker(
    pool: &PgPool,
    owner: &str,
    pairs: &[(String, String)],
    ttl: std::time::Duration,
) -> Result<Vec<(String, String)>> {
    let (kinds, versions): (Vec<&str>, Vec<&str>) =
        pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())).unzip();
    let rows = sqlx::query_as(
        "WITH me AS (
            INSERT INTO workers (owner, kinds, versions, live_until)
            VALUES ($1, $2, $3, now() + make_interval(secs => $4))
            ON CONFLICT (owner) DO UPDATE
               SET kinds = EXCLUDED.kinds, versions = EXCLUDED.versions, seen_at = now(),
                   live_until = EXCLUDED.live_until
         )
         SELECT DISTINCT v.kind, v.version
           FROM workers w, unnest(w.kinds, w.versions) AS v(kind, version)
          WHERE w.live_until > now() AND w.owner <> $1",
    )
    .bind(owner)
    .bind(&kinds)
    .bind(&versions)
    .bind(ttl.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Removes worker `owner` (it stopped).
pub async fn deregister_worker(pool: &PgPool, owner: &str) -> Result<()> {
    sqlx::query("DELETE FROM workers WHERE owner = $1")
        .bind(owner)
        .execute(pool)
        .await?;
    Ok(())
}

/// Deletes the rows of workers dead for more than a day (retention).
pub async fn prune_workers(pool: &PgPool) -> Result<u64> {
    let n = sqlx::query("DELETE FROM workers WHERE live_until < now() - interval '1 day'")
        .execute(pool)
        .await?
        .rows_affected();
    Ok(n)
}

/// Among pointers that claimed nothing (`ids`), parks the queued operations the caller may not
/// run for their version (it acks their pointers; a worker that runs the version pulls them
/// with [`parked_for`]) and finds the ids that name no operation at all. Returns
/// `(id, parked)`: `parked` false means unknown.
pub async fn park_refused(
    pool: &PgPool,
    ids: &[Uuid],
    runnable: &Runnable,
) -> Result<Vec<(Uuid, bool)>> {
    let q = sqlx::query_as(concat!(
        "WITH parked AS (
            UPDATE operations o SET version_parked = true
             WHERE o.id = ANY($1) AND o.status = 'queued' AND NOT o.version_parked
               AND NOT ",
        runnable_sql!(),
        "
         RETURNING o.id
         )
         SELECT id, true FROM parked
         UNION ALL
         SELECT u.id, false FROM unnest($1::uuid[]) AS u(id)
          WHERE NOT EXISTS (SELECT 1 FROM operations o WHERE o.id = u.id)"
    ))
    .bind(ids);
    Ok(runnable.bind(q).fetch_all(pool).await?)
}

/// Up to `limit` due operations of `lane` that a worker refused for their version and that the
/// caller may run, oldest due first: the caller claims them like pointers.
pub async fn parked_for(
    pool: &PgPool,
    lane: Lane,
    runnable: &Runnable,
    limit: i64,
) -> Result<Vec<Uuid>> {
    let q = sqlx::query_as(concat!(
        "SELECT o.id FROM operations o
          WHERE o.version_parked AND o.lane = $1 AND o.status = 'queued' AND o.run_at <= now()
            AND o.paused_by IS NULL
            AND NOT agentq_paused(o.tenant_id, o.kind, o.lane, o.schedule_id, o.id)
            AND ",
        runnable_sql!(),
        "
          ORDER BY o.run_at
          LIMIT $6"
    ))
    .bind(lane.as_str());
    let rows: Vec<(Uuid,)> = runnable.bind(q).bind(limit).fetch_all(pool).await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// An upgraded operation's run found its code asking for another step than the journal
/// recorded at `seq`, at or before the upgrade's last position: moves the journal from `seq`
/// on to `operation_steps_superseded` (kept for the audit trail) and ends the upgrade, fenced
/// by `epoch`. Returns false when the run no longer holds the operation.
pub async fn rebase(pool: &PgPool, op_id: Uuid, epoch: i64, seq: i32) -> Result<bool> {
    let row: Option<(Uuid,)> = sqlx::query_as(
        "WITH op AS (
            SELECT id, kind_version FROM operations
             WHERE id = $1 AND epoch = $2 AND status = 'running' AND upgrade_through >= $3
               FOR UPDATE
         ), moved AS (
            DELETE FROM operation_steps s USING op
             WHERE s.op_id = op.id AND s.seq >= $3
         RETURNING s.*
         ), kept AS (
            INSERT INTO operation_steps_superseded
                   (op_id, seq, name, kind, status, output, error, epoch, started_at,
                    completed_at, to_version)
            SELECT m.op_id, m.seq, m.name, m.kind, m.status, m.output, m.error, m.epoch,
                   m.started_at, m.completed_at, op.kind_version
              FROM moved m, op
         ), archived AS (
            -- A moved row's event stays in the operation's event log.
            INSERT INTO operation_events (op_id, seq, at, type, data)
            SELECT m.op_id, m.event_id, m.event_at, 'step',
                   agentq_step_event_data(m.seq, m.name, m.kind, m.status, m.output)
              FROM moved m WHERE m.event_id IS NOT NULL
         )
         UPDATE operations o SET upgrade_through = NULL FROM op WHERE o.id = op.id
     RETURNING o.id",
    )
    .bind(op_id)
    .bind(epoch)
    .bind(seq)
    .fetch_optional(pool)
    .await?;
    Ok(row.is_some())
}

/// One line of the versions report: operations of one kind, version and status.
#[derive(Clone, Debug, FromRow, Serialize, schemars::JsonSchema)]
pub struct VersionCount {
    pub kind: String,
    /// `None`: not run yet (pinned by its first claim).
    pub version: Option<String>,
    pub status: String,
    pub count: i64,
    /// Of the queued ones, how many a worker refused and left for one that runs the version.
    pub parked: i64,
    /// The oldest of them by creation.
    pub oldest_created_at: DateTime<Utc>,
    /// When the longest-waiting one (sleeping, waiting or queued) became due or will.
    pub oldest_run_at: DateTime<Utc>,
}

/// Unfinished operations (and dead ones with an open dead letter) per kind, version and status,
/// within `tenant` (`None`: all) and `kind` (`None`: all).
pub async fn report(
    pool: &PgPool,
    tenant: Option<&str>,
    kind: Option<&str>,
) -> Result<Vec<VersionCount>> {
    let rows = sqlx::query_as(
        "SELECT o.kind, o.kind_version AS version, o.status, count(*) AS count,
                count(*) FILTER (WHERE o.version_parked AND o.status = 'queued') AS parked,
                min(o.created_at) AS oldest_created_at, min(o.run_at) AS oldest_run_at
           FROM operations o
          WHERE (o.status IN ('queued', 'running', 'sleeping', 'waiting')
                 OR (o.status = 'dead' AND EXISTS (
                        SELECT 1 FROM dead_letters d WHERE d.op_id = o.id AND d.status = 'open')))
            AND ($1::text IS NULL OR o.tenant_id = $1)
            AND ($2::text IS NULL OR o.kind = $2)
          GROUP BY o.kind, o.kind_version, o.status
          ORDER BY o.kind, o.kind_version, o.status",
    )
    .bind(tenant)
    .bind(kind)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// A live worker and what it runs.
#[derive(Clone, Debug, FromRow, Serialize, schemars::JsonSchema)]
pub struct LiveWorker {
    pub owner: String,
    pub kinds: Vec<String>,
    pub versions: Vec<String>,
    pub started_at: DateTime<Utc>,
    pub seen_at: DateTime<Utc>,
}

impl LiveWorker {
    /// What it runs, as `kind@version`.
    pub fn runs(&self) -> Vec<String> {
        self.kinds
            .iter()
            .zip(&self.versions)
            .map(|(k, v)| format!("{k}@{v}"))
            .collect()
    }
}

/// The live workers, oldest first.
pub async fn live_workers(pool: &PgPool) -> Result<Vec<LiveWorker>> {
    let rows = sqlx::query_as(
        "SELECT owner, kinds, versions, started_at, seen_at FROM workers
          WHERE live_until > now() ORDER BY started_at, owner",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// An operation an upgrade may move, as the operator's selection found it.
#[derive(Clone, Debug, FromRow, Serialize, schemars::JsonSchema)]
pub struct Upgradable {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub version: Option<String>,
    pub status: String,
    /// Journal rows recorded so far.
    pub steps: i64,
}

/// What an upgrade selects: unfinished, not running operations.
#[derive(Clone, Debug, Default)]
pub struct UpgradeFilter {
    pub tenant: Option<String>,
    pub kind: Option<String>,
    /// Only operations on this version (`None`: any).
    pub from_version: Option<String>,
    /// Only operations in this status (queued, sleeping or waiting; `None`: any of them).
    pub status: Option<String>,
    pub ids: Option<Vec<Uuid>>,
}

/// The operations `filter` selects (at most `max`), oldest first.
pub async fn select_upgradable(
    pool: &PgPool,
    filter: &UpgradeFilter,
    max: i64,
) -> Result<Vec<Upgradable>> {
    let rows = sqlx::query_as(concat!(
        "SELECT o.id, o.tenant_id, o.kind, o.kind_version AS version, o.status,
                (SELECT count(*) FROM operation_steps s WHERE s.op_id = o.id) AS steps
           FROM operations o
          WHERE o.status IN ",
        idle_sql!(),
        "
            AND ($1::text IS NULL OR o.tenant_id = $1)
            AND ($2::text IS NULL OR o.kind = $2)
            AND ($3::text IS NULL OR o.kind_version = $3)
            AND ($4::text IS NULL OR o.status = $4)
            AND ($5::uuid[] IS NULL OR o.id = ANY($5))
          ORDER BY o.created_at, o.id
          LIMIT $6"
    ))
    .bind(&filter.tenant)
    .bind(&filter.kind)
    .bind(&filter.from_version)
    .bind(&filter.status)
    .bind(&filter.ids)
    .bind(max)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Why an upgrade changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("no operation {0}")]
    NotFound(Uuid),
    #[error(
        "operation {id} is {status}: only queued, sleeping or waiting operations are upgraded (a running one finishes its run on its version; upgrade it once it parks or fails)"
    )]
    NotUpgradable { id: Uuid, status: String },
    #[error(transparent)]
    Db(#[from] super::Error),
}

impl From<sqlx::Error> for UpgradeError {
    fn from(e: sqlx::Error) -> Self {
        Self::Db(e.into())
    }
}

/// What an upgrade did to one operation.
#[derive(Clone, Debug, FromRow, Serialize, schemars::JsonSchema)]
pub struct Upgraded {
    pub id: Uuid,
    pub kind: String,
    pub from_version: Option<String>,
    pub to_version: String,
    pub status: String,
    /// The last journal position a run on the new version may rebase from (`None`: no journal).
    pub upgrade_through: Option<i32>,
}

/// Moves operation `id` (within `tenant`, `None`: any) to `to_version`, audited with `actor`
/// and `reason` in the same transaction: its next run replays its journal on the new version
/// and, where the code first asks for another step than recorded, runs anew from there.
pub async fn upgrade(
    pool: &PgPool,
    id: Uuid,
    tenant: Option<&str>,
    to_version: &str,
    actor: &str,
    reason: Option<&str>,
) -> std::result::Result<Upgraded, UpgradeError> {
    let mut tx = pool.begin().await?;
    let current: Option<(String, Option<String>)> = sqlx::query_as(
        "SELECT status, kind_version FROM operations
          WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2) FOR UPDATE",
    )
    .bind(id)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    let (status, from_version) = current.ok_or(UpgradeError::NotFound(id))?;
    if !status
        .parse::<Status>()
        .is_ok_and(|s| Status::IDLE.contains(&s))
    {
        return Err(UpgradeError::NotUpgradable { id, status });
    }
    let row: Upgraded = sqlx::query_as(
        "UPDATE operations o
            SET kind_version = $2, updated_at = now(),
                upgrade_through = (SELECT max(seq) FROM operation_steps s WHERE s.op_id = o.id)
          WHERE o.id = $1
      RETURNING o.id, o.kind, $3::text AS from_version, o.kind_version AS to_version, o.status,
                o.upgrade_through",
    )
    .bind(id)
    .bind(to_version)
    .bind(&from_version)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, reason, status_before, status_after, details)
         VALUES ($1, 'upgrade', $2, $3, $4, $4, $5)",
    )
    .bind(actor)
    .bind(id)
    .bind(reason)
    .bind(&status)
    .bind(serde_json::json!({
        "from_version": from_version,
        "to_version": to_version,
        "upgrade_through": row.upgrade_through,
    }))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(row)
}

/// Per kind, the unfinished operations (queued, sleeping, waiting) pinned to a version no live
/// worker runs, and the parked ones not run yet of a kind no live worker runs at all: the
/// gauge behind the `AgentqVersionWithoutWorker` alert.
pub async fn without_live_worker(pool: &PgPool) -> Result<Vec<(String, i64)>> {
    let rows = sqlx::query_as(concat!(
        "SELECT o.kind, count(*) FROM operations o
          WHERE o.status IN ",
        idle_sql!(),
        "
            AND (o.kind_version IS NOT NULL OR o.version_parked)
            AND NOT EXISTS (
                SELECT 1 FROM workers w, unnest(w.kinds, w.versions) AS v(kind, version)
                 WHERE w.live_until > now() AND v.kind = o.kind
                   AND (o.kind_version IS NULL OR v.version = o.kind_version))
          GROUP BY o.kind"
    ))
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
