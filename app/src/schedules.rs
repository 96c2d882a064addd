//! Schedules: a tenant's kind and input, fired as an ordinary operation at every tick of a cron
//! expression in an IANA time zone or of a fixed interval, by the scheduler
//! (`db::schedules::fire_due`). Adding one checks everything, the input against its kind as an
//! enqueue does included, before anything is written. Add, pause, resume and delete are an
//! operator's acts in the schedule's tenant (another tenant's schedule is not found), audited.

use agentq_core::db::schedules::{self, Toggled};
use agentq_core::operation::Lane;
use agentq_core::schedule::{self as ticks, Spec};
use agentq_core::state::Overlap;
use agentq_producer::EnqueueRequest;
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::operations::refused_enqueue;
use crate::{App, AppError, Caller, Result, Role};

/// A stored schedule, as a [`ScheduleView`] carries it.
pub use agentq_core::db::schedules::Schedule;

/// How many upcoming firings a view lists.
pub const NEXT_FIRINGS: usize = 5;

/// Most schedules a list returns.
pub const LIST_LIMIT: i64 = 1000;

/// A new schedule, as `agentq schedules add` and `POST /v1/schedules` take it.
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "CreateSchedule")]
pub struct NewSchedule {
    /// Unique in its tenant: 1-128 letters, digits, `_`, `-`, `.` or `:`, not a UUID;
    /// accepted wherever the schedule's id is
    pub name: String,
    /// A job kind this deployment runs
    pub kind: String,
    /// The input of every firing, checked against the kind now (≤ 1 MiB)
    pub input: Value,
    /// Only for admin tokens; others add schedules in their own tenant
    pub tenant: Option<String>,
    /// A cron expression: five fields (minute hour day-of-month month day-of-week), or six
    /// with seconds first; an optional year last. Give it or `interval_secs`.
    pub cron: Option<String>,
    /// The IANA time zone the cron expression is read in (default UTC)
    pub time_zone: Option<String>,
    /// Fire every this many seconds (1 s to a year), at the multiples since the Unix epoch
    pub interval_secs: Option<i64>,
    /// A tick while the previous firing's operation is unfinished: `skip` (the default),
    /// `buffer_one` or `allow`
    pub overlap: Option<Overlap>,
    /// After downtime, ticks at most this old still fire; older ones are skipped and counted
    /// (1 s to a year; default 3600)
    pub catchup_window_secs: Option<i64>,
    /// `interactive` unless said otherwise
    pub lane: Option<Lane>,
    #[schemars(range(min = 1, max = 1000))]
    pub max_attempts: Option<i32>,
    /// Add it paused (it fires once resumed)
    #[serde(default)]
    pub paused: bool,
    /// A token budget each firing's operation is born with
    pub budget: Option<crate::budgets::BudgetRequest>,
}

/// A schedule as every front end shows it (never its input), with its next firings.
#[derive(Clone, Debug, Serialize, JsonSchema)]
#[schemars(rename = "Schedule")]
pub struct ScheduleView {
    #[serde(flatten)]
    pub schedule: Schedule,
    /// The next ticks it fires at (none while paused, or when no tick is left)
    pub next_firings: Vec<DateTime<Utc>>,
}

impl ScheduleView {
    /// How it fires, in a few words: `cron "0 9 * * *" (Europe/Berlin)` or `every 60 s`.
    pub fn when(&self) -> String {
        let s = &self.schedule;
        match (&s.cron, &s.time_zone, s.interval_secs) {
            (Some(c), Some(z), _) => format!("cron {c:?} ({z})"),
            (_, _, Some(secs)) => format!("every {secs} s"),
            _ => "never".into(),
        }
    }
}

/// The view of a stored schedule, with its next firings.
pub fn view(s: Schedule) -> ScheduleView {
    let next_firings = match (s.paused, s.next_tick) {
        (false, Some(next)) => {
            Spec::stored(s.cron.as_deref(), s.time_zone.as_deref(), s.interval_secs)
                .map(|spec| spec.upcoming(next, NEXT_FIRINGS))
                .unwrap_or_default()
        }
        _ => Vec::new(),
    };
    ScheduleView {
        schedule: s,
        next_firings,
    }
}

/// When `new` fires, checked.
fn spec(new: &NewSchedule) -> Result<Spec> {
    match (&new.cron, new.interval_secs) {
        (Some(expr), None) => {
            let zone = new.time_zone.as_deref().unwrap_or("UTC");
            Spec::cron(expr, zone, Utc::now()).map_err(|e| {
                let field = if e.starts_with("unknown time zone") {
                    "/time_zone"
                } else {
                    "/cron"
                };
                AppError::invalid(field, e)
            })
        }
        (None, Some(secs)) => {
            if new.time_zone.is_some() {
                return Err(AppError::invalid(
                    "/time_zone",
                    "a time zone goes with a cron expression; an interval needs none",
                ));
            }
            Spec::interval(secs).map_err(|e| AppError::invalid("/interval_secs", e))
        }
        _ => Err(AppError::invalid(
            "/cron",
            "give either a cron expression (cron, with time_zone) or an interval \
             (interval_secs), not both or neither",
        )),
    }
}

/// Adds a schedule; nothing is written unless everything is right.
pub async fn add(app: &App, caller: &Caller, new: NewSchedule) -> Result<ScheduleView> {
    caller.require(Role::Operator)?;
    let tenant = caller.tenant_for_write(new.tenant.as_deref())?;
    crate::names::check(&new.name, "schedule", "/name")?;
    let spec = spec(&new)?;
    crate::tenants::check_kind(app, &tenant, &new.kind).await?;
    let gap_field = if new.cron.is_some() {
        "/cron"
    } else {
        "/interval_secs"
    };
    crate::capacity::check_schedules(
        app,
        &tenant,
        spec.shortest_gap(chrono::Utc::now()),
        gap_field,
    )
    .await?;
    let catchup = ticks::check_catchup(
        new.catchup_window_secs
            .unwrap_or(ticks::DEFAULT_CATCHUP_SECS),
    )
    .map_err(|e| AppError::invalid("/catchup_window_secs", e))?;
    // Checked as an enqueue is (tenant, kind, input, stores, limits); kept as the operation
    // every firing copies.
    let op = {
        let mut conn = app.pool.acquire().await?;
        app.producer
            .prepare(
                &mut conn,
                EnqueueRequest {
                    tenant,
                    kind: new.kind,
                    input: new.input,
                    lane: new.lane.unwrap_or_default(),
                    max_attempts: new.max_attempts,
                    budget: new.budget.as_ref().map(|b| b.spec()).transpose()?,
                    ..EnqueueRequest::default()
                },
            )
            .await
            .map_err(refused_enqueue)?
    };
    let stored = schedules::NewSchedule {
        id: Uuid::new_v4(),
        name: &new.name,
        op: &op,
        spec: &spec,
        overlap: new.overlap.unwrap_or(Overlap::Skip),
        catchup_secs: catchup,
        paused: new.paused,
    };
    match schedules::create(&app.pool, &stored, &caller.actor).await? {
        Some(s) => Ok(view(s)),
        None => Err(AppError::Conflict(format!(
            "tenant {} already has a schedule named {:?}; delete it first, or choose another name",
            op.tenant, new.name
        ))),
    }
}

/// The schedules the caller may see (an admin may name one tenant), by tenant and name.
pub async fn list(app: &App, caller: &Caller, tenant: Option<&str>) -> Result<Vec<ScheduleView>> {
    caller.require(Role::Operator)?;
    let scope = caller.tenant_filter(tenant)?;
    let rows = schedules::list(&app.pool, scope.as_deref(), LIST_LIMIT).await?;
    Ok(rows.into_iter().map(view).collect())
}

fn not_found(id: Uuid) -> AppError {
    AppError::NotFound(format!("no schedule {id}"))
}

/// The schedule `id` as the caller may see it.
pub async fn find(app: &App, caller: &Caller, id: Uuid) -> Result<ScheduleView> {
    caller.require(Role::Operator)?;
    schedules::find(&app.pool, id, caller.scope())
        .await?
        .map(view)
        .ok_or_else(|| not_found(id))
}

/// Pauses (`true`) or resumes a schedule. Resuming fires from the first tick after now: ticks
/// while paused are not fired.
pub async fn set_paused(
    app: &App,
    caller: &Caller,
    id: Uuid,
    paused: bool,
) -> Result<ScheduleView> {
    caller.require(Role::Operator)?;
    if !paused {
        // A schedule an admin's list paused stays paused until its kind is allowed again.
        let s = find(app, caller, id).await?.schedule;
        let what = format!("; schedule {id} stays paused");
        crate::tenants::check_kind_now(app, &s.tenant, &s.kind, &what).await?;
    }
    match schedules::set_paused(&app.pool, id, caller.scope(), paused, &caller.actor).await? {
        Toggled::Now(s) => Ok(view(s)),
        Toggled::Already(s) => Err(AppError::Conflict(format!(
            "schedule {id} ({}) is already {}; nothing changed",
            s.name,
            if paused { "paused" } else { "active" }
        ))),
        Toggled::NotFound => Err(not_found(id)),
    }
}

/// Deletes a schedule; returns it as it was. Its operations stay.
pub async fn delete(app: &App, caller: &Caller, id: Uuid) -> Result<ScheduleView> {
    caller.require(Role::Operator)?;
    schedules::delete(&app.pool, id, caller.scope(), &caller.actor)
        .await?
        .map(view)
        .ok_or_else(|| not_found(id))
}

/// A control of one schedule, as the API's and the console's buttons name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Pause,
    Resume,
    Delete,
}

impl Control {
    /// What the control did, for a person: `paused`, `resumed`, `deleted`.
    pub fn done(self) -> &'static str {
        match self {
            Control::Pause => "paused",
            Control::Resume => "resumed",
            Control::Delete => "deleted",
        }
    }
}

/// Applies `control` to the schedule `id`: [`set_paused`] or [`delete`].
pub async fn control(
    app: &App,
    caller: &Caller,
    id: Uuid,
    control: Control,
) -> Result<ScheduleView> {
    match control {
        Control::Pause => set_paused(app, caller, id, true).await,
        Control::Resume => set_paused(app, caller, id, false).await,
        Control::Delete => delete(app, caller, id).await,
    }
}
