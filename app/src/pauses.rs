//! Operator pauses: hold live work without cancelling it or filling the DLQ. One operation, or
//! every operation of a kind, a tenant, a lane or a schedule (any combination), or the whole
//! deployment (drain mode). A paused operation is not claimed; a running one stops at its next
//! step boundary and goes back to the queue with its journal, its attempt given back. Resuming
//! re-dispatches what the pause held. Both are audited with a reason; a pause has a dry run.

use agentq_core::db::names::Named;
use agentq_core::db::pauses::{self, Made, Pause};
pub use agentq_core::db::pauses::{Counts, Scope};
use agentq_core::operation::{Lane, OperationId};
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::page::{self, Page, check_limit};
use crate::{App, AppError, Caller, Result, Role};

/// The longest reason kept.
const MAX_REASON: usize = 1000;
/// Operations re-dispatched per statement when a pause is lifted.
const CHUNK: i64 = 1000;

/// What to pause or resume, as a person names it. Every field set narrows it; none (with
/// `everything`) is the whole deployment, or for a non-admin its whole tenant.
#[derive(Clone, Debug, Default, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// One operation.
    pub op_id: Option<Uuid>,
    /// Every operation of a tenant (an admin's; a non-admin's pauses are its own tenant's).
    pub tenant: Option<String>,
    /// Every operation of a kind.
    pub kind: Option<String>,
    /// Every operation of a lane.
    pub lane: Option<Lane>,
    /// Every operation a schedule fired: the schedule's id or its name.
    pub schedule: Option<String>,
    /// Nothing named: everything the caller may pause (must be said, so that a forgotten
    /// filter never drains a deployment).
    #[serde(default)]
    pub everything: bool,
}

/// A pause as asked for: what, why, and whether only to count (`POST /v1/pauses`).
#[derive(Clone, Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    pub scope: Target,
    /// Why (required; kept in the audit trail).
    pub reason: String,
    /// Count what it would hold and change nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// A pause as shown.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "Pause")]
pub struct PauseView {
    pub pause_id: Uuid,
    /// What it holds (no field: the whole deployment).
    pub scope: Scope,
    pub reason: String,
    pub paused_by: String,
    pub paused_at: DateTime<Utc>,
}

impl PauseView {
    /// The pause `p` as shown.
    pub fn of(p: &Pause) -> Self {
        Self {
            pause_id: p.id,
            scope: p.scope(),
            reason: p.reason.clone(),
            paused_by: p.paused_by.clone(),
            paused_at: p.paused_at,
        }
    }

    /// What it holds, in words (`kind "triage" of tenant "acme"`, `the whole deployment`).
    pub fn describe(&self) -> String {
        describe(&self.scope)
    }
}

/// `scope` in words.
pub fn describe(scope: &Scope) -> String {
    let mut parts = Vec::new();
    if let Some(op) = scope.op_id {
        parts.push(format!("operation {op}"));
    }
    if let Some(k) = &scope.kind {
        parts.push(format!("kind {k:?}"));
    }
    if let Some(l) = &scope.lane {
        parts.push(format!("lane {l}"));
    }
    if let Some(s) = scope.schedule_id {
        parts.push(format!("schedule {s}"));
    }
    match (&scope.tenant, parts.is_empty()) {
        (None, true) => "the whole deployment".to_string(),
        (Some(t), true) => format!("tenant {t:?}"),
        (Some(t), false) if scope.op_id.is_none() => {
            format!("{} of tenant {t:?}", parts.join(", "))
        }
        _ => parts.join(", "),
    }
}

/// What a pause did, or (dry run) would do.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "Paused")]
pub struct Paused {
    /// The pause made (or the one already in force for that scope); none on a dry run.
    pub pause: Option<PauseView>,
    /// Whether it was made now (false: it was in force already, nothing changed).
    pub created: bool,
    pub dry_run: bool,
    /// What it holds: idle operations are held at once, running ones stop at their next step.
    pub operations: Counts,
}

/// Pauses `target` for `reason` (an operator's act, audited), or with `dry_run` counts what it
/// would hold and changes nothing.
pub async fn pause(
    app: &App,
    caller: &Caller,
    target: &Target,
    reason: &str,
    dry_run: bool,
) -> Result<Paused> {
    caller.require(Role::Operator)?;
    let reason = check_reason(reason)?;
    let scope = scope_of(app, caller, target).await?;
    if dry_run {
        let operations = pauses::count(&app.pool, &scope).await?;
        return Ok(Paused {
            pause: None,
            created: false,
            dry_run: true,
            operations,
        });
    }
    let cap = app.settings.limits.tenant_max_pauses;
    let (pause, created, operations) =
        match pauses::pause(&app.pool, &scope, reason, &caller.actor, cap).await? {
            Made::Paused {
                pause,
                created,
                counts,
            } => (*pause, created, counts),
            Made::Capped { have } => {
                let whose = match &scope.tenant {
                    Some(t) => format!("tenant {t:?}"),
                    None => "the deployment (pauses naming no tenant)".to_string(),
                };
                return Err(AppError::Busy {
                    message: format!(
                        "{whose} has {have} pauses in force and may have at most {cap} \
                         (AGENTQ_TENANT_MAX_PAUSES): resume one first, or pause a wider \
                         scope (a kind, a lane, the tenant) instead of many narrow ones"
                    ),
                    retry_after_secs: 0,
                });
            }
        };
    Ok(Paused {
        pause: Some(PauseView::of(&pause)),
        created,
        dry_run: false,
        operations,
    })
}

impl Paused {
    /// What it did, in words (the CLI's line and the console's message).
    pub fn summary(&self) -> String {
        match (&self.pause, self.dry_run) {
            (_, true) => format!("dry run: would hold {}", counts(&self.operations)),
            (Some(p), false) if self.created => format!(
                "paused {} (pause {}): holds {}",
                p.describe(),
                p.pause_id,
                counts(&self.operations)
            ),
            (Some(p), false) => format!(
                "{} was already paused (pause {}, by {} at {}: {}); nothing changed",
                p.describe(),
                p.pause_id,
                p.paused_by,
                p.paused_at.to_rfc3339(),
                p.reason
            ),
            (None, false) => "nothing paused".to_string(),
        }
    }
}

/// `c` in words.
fn counts(c: &Counts) -> String {
    format!(
        "{} queued, {} sleeping, {} waiting, {} running (each stops at its next step boundary)",
        c.queued, c.sleeping, c.waiting, c.running
    )
}

/// What lifting a pause did.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "Resumed")]
pub struct Resumed {
    pub pause: PauseView,
    /// Operations it held that no other pause holds now, by status.
    pub freed: Counts,
    /// Queued operations whose pointers were published again.
    pub redispatched: usize,
}

impl Resumed {
    /// What it did, in words (the CLI's line and the console's message).
    pub fn summary(&self) -> String {
        format!(
            "resumed {} (pause {}): freed {}; {} re-dispatched",
            self.pause.describe(),
            self.pause.pause_id,
            counts(&self.freed),
            self.redispatched
        )
    }
}

/// Lifts the pause `id` (an operator's act, audited) and re-dispatches the queued operations
/// it held that nothing else holds.
pub async fn resume(app: &App, caller: &Caller, id: Uuid, reason: Option<&str>) -> Result<Resumed> {
    caller.require(Role::Operator)?;
    let reason = reason.map(check_reason).transpose()?;
    let pause = find(app, caller, id).await?;
    let (pause, freed) = pauses::resume(&app.pool, pause.pause_id, &caller.actor, reason)
        .await?
        .ok_or_else(|| not_found(id))?;
    let redispatched = redispatch(app, &pause.scope()).await?;
    Ok(Resumed {
        pause: PauseView::of(&pause),
        freed,
        redispatched,
    })
}

/// Lifts the pause whose scope is exactly `target`'s ([`resume`]).
pub async fn resume_target(
    app: &App,
    caller: &Caller,
    target: &Target,
    reason: Option<&str>,
) -> Result<Resumed> {
    caller.require(Role::Operator)?;
    let scope = scope_of(app, caller, target).await?;
    match pauses::find_scope(&app.pool, &scope).await? {
        Some(p) => resume(app, caller, p.id, reason).await,
        None => {
            let holding = match scope.op_id {
                Some(op) => pauses::holding(&app.pool, op).await?,
                None => None,
            };
            Err(AppError::Conflict(match holding {
                Some(p) => format!(
                    "{} is not paused by itself: pause {} ({}) holds it; resume that one",
                    describe(&scope),
                    p.id,
                    describe(&p.scope())
                ),
                None => format!("{} is not paused", describe(&scope)),
            }))
        }
    }
}

/// A page of the pauses in force that the caller may see (a non-admin's: those of its
/// tenant), oldest first: up to `limit` (1–[`MAX_PAGE`](crate::page::MAX_PAGE)) after the cursor `after` of the
/// previous page.
pub async fn list(
    app: &App,
    caller: &Caller,
    tenant: Option<&str>,
    after: Option<&str>,
    limit: i64,
) -> Result<Page<PauseView>> {
    caller.require(Role::Producer)?;
    check_limit(limit)?;
    let after = page::after(after)?;
    let tenant = caller.tenant_filter(tenant)?;
    let rows = pauses::list(&app.pool, tenant.as_deref(), after, limit).await?;
    let items = rows.iter().map(PauseView::of).collect();
    Ok(Page::new(items, limit, |p: &PauseView| {
        (p.paused_at, p.pause_id)
    }))
}

/// The pause `id`, if the caller may see it.
pub async fn find(app: &App, caller: &Caller, id: Uuid) -> Result<PauseView> {
    caller.require(Role::Producer)?;
    let mine = caller.tenant_filter(None)?;
    pauses::find(&app.pool, id)
        .await?
        .filter(|p| mine.is_none() || p.tenant_id == mine)
        .map(|p| PauseView::of(&p))
        .ok_or_else(|| not_found(id))
}

/// The pause that holds operation `op` now, if any (for `why` and the operation's views).
pub async fn holding(app: &App, op: OperationId) -> Result<Option<PauseView>> {
    Ok(pauses::holding(&app.pool, op.0)
        .await?
        .map(|p| PauseView::of(&p)))
}

/// Parses a pause id as typed.
pub fn parse_id(s: &str) -> Result<Uuid> {
    s.trim().parse().map_err(|_| AppError::Malformed {
        field: "pause_id",
        message: format!("{s:?} is not a pause id (a UUID, as `agentq pauses` lists them)"),
    })
}

fn check_reason(reason: &str) -> Result<&str> {
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(AppError::invalid(
            "/reason",
            "say why (a reason is required and kept in the audit trail)",
        ));
    }
    if reason.chars().count() > MAX_REASON {
        return Err(AppError::invalid(
            "/reason",
            format!("the reason is longer than {MAX_REASON} characters; shorten it"),
        ));
    }
    Ok(reason)
}

/// The scope `target` names for this caller: its tenant by the one tenant rule, an operation
/// or schedule only if the caller may see it.
async fn scope_of(app: &App, caller: &Caller, target: &Target) -> Result<Scope> {
    let named = target.op_id.is_some()
        || target.tenant.is_some()
        || target.kind.is_some()
        || target.lane.is_some()
        || target.schedule.is_some();
    if named == target.everything {
        return Err(AppError::invalid(
            "/everything",
            if named {
                "name what to pause or say everything, not both"
            } else {
                "name what to pause (an operation, a kind, a tenant, a lane or a schedule), or \
                 say everything to pause all the caller may (drain mode)"
            },
        ));
    }
    if let Some(kind) = &target.kind
        && !app.producer.catalog().has_kind(kind)
    {
        return Err(AppError::invalid(
            "/kind",
            format!(
                "this deployment serves no kind {kind:?}; a pause names one of its kinds: {} \
                 (`agentq kinds`)",
                agentq_core::kinds::names(app.producer.catalog().as_ref())
            ),
        ));
    }
    let mut tenant = caller.tenant_filter(target.tenant.as_deref())?;
    if let Some(op) = target.op_id {
        let found = crate::operations::find(app, caller, OperationId(op)).await?;
        tenant = Some(found.tenant);
    }
    let mut schedule_id = None;
    if let Some(schedule) = &target.schedule {
        let id = crate::names::in_filter(
            app,
            caller,
            Named::Schedule,
            schedule,
            target.tenant.as_deref(),
            "/scope/schedule",
        )
        .await?;
        let found = crate::schedules::find(app, caller, id).await?;
        tenant = tenant.or(Some(found.schedule.tenant));
        schedule_id = Some(id);
    }
    Ok(Scope {
        tenant,
        kind: target.kind.clone(),
        lane: target.lane.map(|l| l.as_str().to_string()),
        schedule_id,
        op_id: target.op_id,
    })
}

/// Publishes again the queued operations of `scope` that no pause holds now.
async fn redispatch(app: &App, scope: &Scope) -> Result<usize> {
    let cutoff = Utc::now();
    app.publish_all(|| async { Ok(pauses::lock_freed(&app.pool, scope, cutoff, CHUNK).await?) })
        .await
}

fn not_found(id: Uuid) -> AppError {
    AppError::NotFound(format!(
        "no pause {id} in force (`agentq pauses` lists them; it may have been resumed)"
    ))
}
