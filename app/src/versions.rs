//! Versions of kinds as operators see and move them: the report behind `agentq versions` and
//! the console's versions page (unfinished operations per kind, version and status; the live
//! workers of each version; what waits for a version nobody runs), and the upgrade of an
//! operation to another version (one at a time; the CLI's bulk form calls [`upgrade`] per
//! selected operation, at its rate, after its dry run).

use std::collections::BTreeMap;

pub use agentq_core::db::versions::UpgradeFilter;
use agentq_core::db::versions::{self, LiveWorker, Upgradable, UpgradeError, Upgraded};
use agentq_core::state::Status;
use agentq_core::version;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::{App, AppError, Caller, Result, Role};

/// Unfinished operations of one version of a kind.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema, PartialEq)]
pub struct VersionLine {
    /// `None`: operations not run yet (their first claim pins them).
    pub version: Option<String>,
    /// Live workers that run it.
    pub live_workers: usize,
    /// Unfinished operations by status (`queued`, `running`, `sleeping`, `waiting`), and
    /// `dead` ones with an open dead letter.
    pub statuses: BTreeMap<String, i64>,
    /// Queued operations a worker refused because it does not run this version.
    pub parked: i64,
    /// When the longest-waiting unfinished operation (not running) became or becomes due.
    pub oldest_waiting_since: Option<DateTime<Utc>>,
    /// When the oldest unfinished one was created.
    pub oldest_created_at: Option<DateTime<Utc>>,
    /// Operations wait on it and no live worker runs it (for the not-run-yet line: no live
    /// worker runs the kind at all): they wait until one does or an operator upgrades them.
    pub unserved: bool,
    /// No unfinished operation runs on it: its code may be deleted.
    pub retirable: bool,
}

/// The statuses a versions report counts, in the order the CLI and the console show them.
pub const STATUSES: [&str; 5] = ["queued", "running", "sleeping", "waiting", "dead"];

impl VersionLine {
    /// Its counts of [`STATUSES`], in that order.
    pub fn counts(&self) -> [i64; 5] {
        STATUSES.map(|s| self.statuses.get(s).copied().unwrap_or(0))
    }
}

/// The versions of one kind.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema, PartialEq)]
pub struct KindVersions {
    pub kind: String,
    /// The newest version a live worker runs: what new operations are pinned to.
    pub newest_live: Option<String>,
    /// Newest first; the not-yet-pinned line last.
    pub versions: Vec<VersionLine>,
}

/// What `agentq versions` prints.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Report {
    pub kinds: Vec<KindVersions>,
    pub workers: Vec<LiveWorker>,
}

/// The versions report, within the caller's tenant (the live workers are every tenant's) and
/// `kind` (`None`: all kinds).
pub async fn report(app: &App, caller: &Caller, kind: Option<&str>) -> Result<Report> {
    caller.require(Role::Operator)?;
    let counts = versions::report(&app.pool, caller.scope(), kind).await?;
    let workers = versions::live_workers(&app.pool).await?;
    let mut kinds: BTreeMap<String, BTreeMap<Option<String>, VersionLine>> = BTreeMap::new();
    let line = |version: Option<String>| VersionLine {
        version,
        live_workers: 0,
        statuses: BTreeMap::new(),
        parked: 0,
        oldest_waiting_since: None,
        oldest_created_at: None,
        unserved: false,
        retirable: true,
    };
    for w in &workers {
        for (k, v) in w.kinds.iter().zip(&w.versions) {
            if kind.is_some_and(|wanted| wanted != k) {
                continue;
            }
            let versions = kinds.entry(k.clone()).or_default();
            let l = versions
                .entry(Some(v.clone()))
                .or_insert_with(|| line(Some(v.clone())));
            l.live_workers += 1;
        }
    }
    for c in counts {
        let versions = kinds.entry(c.kind.clone()).or_default();
        let l = versions
            .entry(c.version.clone())
            .or_insert_with(|| line(c.version.clone()));
        *l.statuses.entry(c.status.clone()).or_default() += c.count;
        l.parked += c.parked;
        l.retirable = false;
        l.oldest_created_at = Some(
            l.oldest_created_at
                .map_or(c.oldest_created_at, |t| t.min(c.oldest_created_at)),
        );
        if c.status != "running" {
            l.oldest_waiting_since = Some(
                l.oldest_waiting_since
                    .map_or(c.oldest_run_at, |t| t.min(c.oldest_run_at)),
            );
        }
    }
    let kinds = kinds
        .into_iter()
        .map(|(kind, by_version)| {
            let newest_live = version::newest(
                by_version
                    .values()
                    .filter(|l| l.live_workers > 0)
                    .filter_map(|l| l.version.as_deref()),
            )
            .map(str::to_string);
            // Operations not run yet wait only if no live worker runs the kind at all.
            let kind_served = by_version.values().any(|l| l.live_workers > 0);
            let mut versions: Vec<VersionLine> = by_version
                .into_values()
                .map(|mut l| {
                    let served = match l.version {
                        Some(_) => l.live_workers > 0,
                        None => kind_served,
                    };
                    l.unserved = !served && !l.retirable;
                    l
                })
                .collect();
            versions.sort_by(|a, b| match (&a.version, &b.version) {
                (Some(a), Some(b)) => version::compare(b, a),
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, None) => std::cmp::Ordering::Equal,
            });
            KindVersions {
                kind,
                newest_live,
                versions,
            }
        })
        .collect();
    Ok(Report { kinds, workers })
}

/// Checks a version a person typed.
pub fn parse_version(field: &'static str, s: &str) -> Result<String> {
    let s = s.trim();
    version::check(s).map_err(|e| AppError::malformed(field, e))?;
    Ok(s.to_string())
}

/// Refuses `to` for `kind` unless a live worker runs it: an operation moved to a version
/// nobody runs would only wait.
pub async fn require_live(app: &App, kind: &str, to: &str) -> Result<()> {
    let workers = versions::live_workers(&app.pool).await?;
    let served = workers.iter().any(|w| {
        w.kinds
            .iter()
            .zip(&w.versions)
            .any(|(k, v)| k == kind && v == to)
    });
    if served {
        return Ok(());
    }
    Err(AppError::Conflict(format!(
        "no live worker runs version {to:?} of kind {kind:?}: deploy a worker with it first \
         (`agentq versions --kind {kind}` lists the versions live workers run)"
    )))
}

/// The operations an upgrade selects in the caller's scope (at most `max`), oldest first.
pub async fn select(
    app: &App,
    caller: &Caller,
    mut filter: UpgradeFilter,
    max: i64,
) -> Result<Vec<Upgradable>> {
    caller.require(Role::Operator)?;
    if let Some(status) = &filter.status
        && !Status::IDLE.iter().any(|s| s.as_str() == status.as_str())
    {
        return Err(AppError::malformed(
            "status",
            format!("{status:?}: an upgrade selects queued, sleeping or waiting operations"),
        ));
    }
    filter.tenant = caller.tenant_filter(filter.tenant.as_deref())?;
    Ok(versions::select_upgradable(&app.pool, &filter, max).await?)
}

/// Moves operation `id` (queued, sleeping or waiting, in the caller's scope) to version `to`
/// of its kind, audited with the caller and `reason`. Its next run replays its journal on
/// `to`; where that version first asks for another step than the journal recorded, the rest
/// of the journal is set aside (kept for the audit) and runs anew on `to`. Completed steps
/// before that point are never repeated.
pub async fn upgrade(
    app: &App,
    caller: &Caller,
    id: Uuid,
    to: &str,
    reason: Option<&str>,
) -> Result<Upgraded> {
    caller.require(Role::Operator)?;
    let to = parse_version("to", to)?;
    let op = agentq_core::db::operations::find_operation(
        &app.pool,
        agentq_core::operation::OperationId(id),
        caller.scope(),
    )
    .await?
    .ok_or_else(|| AppError::NotFound(format!("no operation {id}")))?;
    let what = format!("; operation {id} was not moved to version {to:?}");
    crate::tenants::check_kind_now(app, &op.tenant, &op.kind, &what).await?;
    require_live(app, &op.kind, &to).await?;
    let reason = reason.map(str::trim).filter(|r| !r.is_empty());
    versions::upgrade(&app.pool, id, caller.scope(), &to, &caller.actor, reason)
        .await
        .map_err(|e| match e {
            UpgradeError::NotFound(id) => AppError::NotFound(format!("no operation {id}")),
            refused @ UpgradeError::NotUpgradable { .. } => AppError::Conflict(refused.to_string()),
            UpgradeError::Db(e) => AppError::Db(e),
        })
}
