//! `agentq why OP`: what an operation is doing now, or the one gate that holds it, with its
//! evidence. One answer for the command line, `GET /v1/operations/{id}/why` and the console.
//!
//! A queued operation is explained by the first gate that holds it, in the order the claim
//! applies them (`agentq_core::db::claim::CLAIM_GATES`: due, version, ordering key, batch,
//! concurrency key), then the fair share a worker applies before claiming, else it is ready.
//! A new gate is one [`Reason`] variant, its evidence query in `core/src/db/why.rs`, and one
//! line in `queued`; the test below fails while a gate of the claim has no variant.

use agentq_core::db::{self, why as facts};
use agentq_core::operation::{JOIN_WAIT, Lane, OperationId};
use agentq_core::state::{ErrorClass, Status};
use agentq_core::version;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::operations::not_found;
use crate::{App, Caller, Result, Role};

mod text;
pub use text::describe;

/// Why an operation is where it is.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Why {
    pub op_id: OperationId,
    pub status: Status,
    /// One line: what it does now, or what holds it.
    pub headline: String,
    /// The facts behind the headline, one per line.
    pub evidence: Vec<String>,
    /// The same answer, typed (`reason` names the variant).
    pub detail: Reason,
}

/// What an operation is doing, or the one gate that holds it. Serialized with `reason` naming
/// the variant.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Reason {
    /// A worker runs it (a caller who is not an admin sees a worker as `worker-<its process
    /// suffix>`, never its host).
    Running {
        worker: Option<String>,
        since: Option<DateTime<Utc>>,
        attempt: i32,
        max_attempts: i32,
        lease_until: Option<DateTime<Utc>>,
    },
    /// It finished: nothing holds it, nothing runs it again unless an operator acts.
    Finished {
        status: Status,
        at: Option<DateTime<Utc>>,
        error_class: Option<String>,
        error_message: Option<String>,
    },
    /// A durable sleep (`ctx.sleep`): the scheduler queues it at `until`.
    Sleeping { until: DateTime<Utc> },
    /// Waiting for a signal; `pending` signals of that name were sent and not yet consumed
    /// (the scheduler's next pass wakes it with them).
    WaitingForSignal {
        signal: String,
        timeout_at: DateTime<Utc>,
        pending: i64,
    },
    /// Waiting for a token budget (`scope`: its own, or its tenant's for the period): a model
    /// call it refused was never sent; a raise queues it again, else at `timeout_at` it is dead
    /// (`budget_exceeded`, its own budget) or runs again (the tenant's next period).
    WaitingForBudget {
        scope: String,
        limit_tokens: i64,
        spent_tokens: i64,
        held_tokens: i64,
        measure: String,
        timeout_at: DateTime<Utc>,
    },
    /// Parked by a rate limit whose window had no room for its next model call (not sent):
    /// the scheduler wakes it shortly before `reopens_at`, and its next run reserves again.
    WaitingForRateLimit {
        /// `model`, `tenant` or `key`.
        scope: String,
        /// The limit: a model or provider host, a tenant, or `tenant:key`.
        limit: String,
        reopens_at: DateTime<Utc>,
        /// Tokens reserved or used in the limit's current window, and its cap (if it caps tokens).
        window_tokens: i64,
        max_tokens: Option<i64>,
        window_requests: i64,
        max_requests: Option<i64>,
        window_secs: i32,
    },
    /// Waiting on a join: its children still unfinished (of `children` joined).
    WaitingForChildren {
        children: usize,
        unfinished: Vec<Child>,
    },
    /// Not due: a failed attempt's retry waits until `retry_at`.
    NotDue {
        retry_at: DateTime<Utc>,
        error_class: Option<String>,
        error_message: Option<String>,
    },
    /// Not due: a debounced operation pending on its key; a newer arrival of the key before
    /// `starts_at` replaces its input and pushes its start back, never past `latest`.
    Debouncing {
        debounce_key: String,
        starts_at: DateTime<Utc>,
        latest: DateTime<Utc>,
        /// Arrivals folded into it so far (each replaced its input).
        joined: i64,
    },
    /// Not due: the model circuit breaker of the worker that ran it was open, so it was parked
    /// (its attempt given back) until `retry_at`; the breaker may close at `may_close_at`.
    BreakerOpen {
        provider: String,
        may_close_at: DateTime<Utc>,
        retry_at: DateTime<Utc>,
    },
    /// Not due: its remote kind's `service` could not be reached (`detail`: what happened), so
    /// it was parked (its attempt given back) until `retry_at`, when it calls the service again.
    ServiceDown {
        service: String,
        detail: String,
        retry_at: DateTime<Utc>,
    },
    /// An operator's pause holds it (`agentq pause`): the pause, who made it, when and why.
    Paused { pause: crate::pauses::PauseView },
    /// No live worker runs its version: the `pinned` one, or (not run yet) any of its kind.
    Version {
        kind: String,
        pinned: Option<String>,
        /// The newest version a live worker runs of its kind (what an unpinned one gets).
        newest_live: Option<String>,
        /// The live workers running its kind, each with the versions of it they run.
        workers: Vec<WorkerVersions>,
        /// A worker that got its pointer refused it for its version.
        version_parked: bool,
    },
    /// An older unfinished operation of its ordering key goes first.
    OrderingKey { key: String, holder: Holder },
    /// Its concurrency key is at its limit.
    ConcurrencyKey {
        key: String,
        running: i32,
        limit: i32,
        /// Queued operations of the key that start before it (oldest first).
        ahead: i64,
    },
    /// Its batch is paused or cancelled.
    Batch {
        batch_id: Uuid,
        batch_status: String,
        /// Who paused it and why, as recorded.
        paused_reason: Option<String>,
    },
    /// Held for fair shares: its tenant was at its share of a worker's slots in the lane while
    /// another tenant had work queued; a worker with room for the tenant takes it.
    TenantShare {
        tenant: String,
        lane: Lane,
        /// The tenant's operations running in the lane now.
        running_in_lane: i64,
        /// Whether another tenant has work queued in the lane now.
        others_queued: bool,
        /// The share of a worker's lane slots a tenant keeps while another waits
        /// (`AGENTQ_TENANT_SHARE` as the answering process reads it; a worker may be set
        /// otherwise).
        share: Option<f64>,
    },
    /// Nothing holds it: it waits for its pointer (not yet dispatched) or for a free slot.
    Ready {
        lane: Lane,
        dispatched: bool,
        /// Due, queued operations of the lane older than it (at most 10,000 are counted): of
        /// its own tenant, for a caller who is not an admin.
        queued_ahead: i64,
        /// Live workers running its kind (every worker consumes both lanes).
        live_workers: usize,
    },
}

/// A child a join waits for.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Child {
    pub id: Uuid,
    pub status: Status,
}

/// The operation that holds another's ordering key.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Holder {
    pub id: Uuid,
    pub status: Status,
    /// The worker running it, if it runs.
    pub worker: Option<String>,
    /// Since when it runs (if it runs) or last changed.
    pub since: DateTime<Utc>,
}

/// A live worker and the versions of one kind it runs.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct WorkerVersions {
    pub worker: String,
    pub versions: Vec<String>,
}

/// A worker as a non-admin sees it: the random suffix its process name ends with
/// (`host-pid-3f2a1c` → `worker-3f2a1c`), so two answers about one worker agree without naming
/// the deployment's hosts.
fn unnamed(owner: &str) -> String {
    let suffix = owner.rsplit('-').next().unwrap_or(owner);
    format!("worker-{suffix}")
}

impl Reason {
    /// Leaves the deployment's host names out of the answer (for a caller who is not an admin).
    fn hide_hosts(&mut self) {
        match self {
            Reason::Running { worker, .. } => *worker = worker.as_deref().map(unnamed),
            Reason::OrderingKey { holder, .. } => {
                holder.worker = holder.worker.as_deref().map(unnamed)
            }
            Reason::Version { workers, .. } => {
                for w in workers {
                    w.worker = unnamed(&w.worker);
                }
            }
            _ => {}
        }
    }

    /// The gate of the claim statement (a name of `CLAIM_GATES`) this answer explains; `None`
    /// for what no claim gate decides (running, finished, the worker's fair share, ready).
    pub fn claim_gate(&self) -> Option<&'static str> {
        match self {
            Reason::Sleeping { .. }
            | Reason::WaitingForSignal { .. }
            | Reason::WaitingForBudget { .. }
            | Reason::WaitingForRateLimit { .. }
            | Reason::WaitingForChildren { .. } => Some("status"),
            Reason::NotDue { .. }
            | Reason::BreakerOpen { .. }
            | Reason::ServiceDown { .. }
            | Reason::Debouncing { .. } => Some("due"),
            Reason::Paused { .. } => Some("paused"),
            Reason::Version { .. } => Some("version"),
            Reason::OrderingKey { .. } => Some("ordering_key"),
            Reason::Batch { .. } => Some("batch"),
            Reason::ConcurrencyKey { .. } => Some("concurrency_key"),
            Reason::Running { .. }
            | Reason::Finished { .. }
            | Reason::TenantShare { .. }
            | Reason::Ready { .. } => None,
        }
    }
}

/// Why `op` (in the caller's tenant) is where it is. A producer may ask about its own
/// operations: the answer shows no input, output or payload.
pub async fn why(app: &App, caller: &Caller, op: OperationId) -> Result<Why> {
    caller.require(Role::Producer)?;
    let row = facts::row(&app.pool, op.0, caller.scope())
        .await?
        .ok_or_else(|| not_found(op))?;
    let mut detail = reason(app, &row, caller.scope()).await?;
    // Only a caller who sees every tenant sees the deployment's hosts.
    if !caller.sees_every_tenant() {
        detail.hide_hosts();
    }
    let (headline, evidence) = describe(&detail);
    Ok(Why {
        op_id: op,
        status: row.status,
        headline,
        evidence,
        detail,
    })
}

/// Why `row` is where it is; counts of other operations are of `tenant`'s only, when given.
async fn reason(app: &App, row: &facts::Row, tenant: Option<&str>) -> Result<Reason> {
    let pool = &app.pool;
    Ok(match row.status {
        Status::Running => Reason::Running {
            worker: row.lease_owner.clone(),
            since: facts::running_since(pool, row.id).await?,
            attempt: row.attempt,
            max_attempts: row.max_attempts,
            lease_until: row.lease_expires_at,
        },
        Status::Sleeping => Reason::Sleeping { until: row.run_at },
        Status::Waiting if row.waiting_for.as_deref() == Some(JOIN_WAIT) => {
            let joined = row.joining.clone().unwrap_or_default();
            let unfinished = facts::unfinished(pool, &joined).await?;
            Reason::WaitingForChildren {
                children: joined.len(),
                unfinished: unfinished
                    .into_iter()
                    .map(|(id, status)| Child { id, status })
                    .collect(),
            }
        }
        Status::Waiting
            if row.waiting_for.as_deref() == Some(agentq_core::db::budgets::WAITING_FOR) =>
        {
            // The budget that refused: the one that says so (its own first, then an
            // ancestor's), else its own, else its tree's batch's (a child of a document).
            let budgets = agentq_core::db::budgets::over(pool, row.id).await?;
            let refused = budgets
                .iter()
                .filter(|b| b.scope != "batch")
                .find(|b| b.exceeded_at.is_some())
                .or_else(|| budgets.iter().find(|b| b.scope == "operation"))
                .or_else(|| budgets.iter().find(|b| b.exceeded_at.is_some()));
            Reason::WaitingForBudget {
                scope: refused.map_or_else(|| "operation".into(), |b| b.scope.clone()),
                limit_tokens: refused.map_or(0, |b| b.limit_tokens),
                spent_tokens: refused.map_or(0, |b| b.spent_tokens),
                held_tokens: refused.map_or(0, |b| b.held_tokens),
                measure: refused.map_or_else(|| "total".into(), |b| b.measure.clone()),
                timeout_at: row.run_at,
            }
        }
        Status::Waiting
            if let Some((scope, limit, reopens_at)) = row
                .waiting_for
                .as_deref()
                .and_then(agentq_core::db::rate_limits::parse_waiting_for) =>
        {
            let id = row
                .waiting_for
                .as_deref()
                .and_then(agentq_core::db::rate_limits::parked_on);
            let now = agentq_core::db::rate_limits::list(pool, None).await?;
            let view = now.iter().find(|l| Some(l.id) == id);
            Reason::WaitingForRateLimit {
                scope,
                limit,
                reopens_at,
                window_tokens: view.map_or(0, |l| l.window_tokens),
                max_tokens: view.and_then(|l| l.max_tokens),
                window_requests: view.map_or(0, |l| l.window_requests),
                max_requests: view.and_then(|l| l.max_requests),
                window_secs: view.map_or(0, |l| l.window_secs),
            }
        }
        Status::Waiting => {
            let signal = row.waiting_for.clone().unwrap_or_default();
            Reason::WaitingForSignal {
                pending: facts::pending_signals(pool, row.id, &signal).await?,
                signal,
                timeout_at: row.run_at,
            }
        }
        Status::Queued => queued(app, row, tenant).await?,
        status => Reason::Finished {
            status,
            at: row.finished_at,
            error_class: row.error_class.clone(),
            error_message: row.error_message.clone(),
        },
    })
}

/// The first gate that holds a queued operation, in the claim's order, then the share.
async fn queued(app: &App, row: &facts::Row, tenant: Option<&str>) -> Result<Reason> {
    if row.not_due {
        if let (Some(key), Some(latest)) = (&row.debounce_key, row.debounce_until) {
            let (_, joined) = db::debounce::folded(&app.pool, row.id).await?;
            return Ok(Reason::Debouncing {
                debounce_key: key.clone(),
                starts_at: row.run_at,
                latest,
                joined,
            });
        }
        return Ok(not_due(row));
    }
    if let Some(pause) = crate::pauses::holding(app, OperationId(row.id)).await? {
        return Ok(Reason::Paused { pause });
    }
    if let Some(held) = version_gate(app, row).await? {
        return Ok(held);
    }
    if let Some(held) = ordering_gate(app, row).await? {
        return Ok(held);
    }
    if let Some(held) = batch_gate(app, row).await? {
        return Ok(held);
    }
    if let Some(held) = concurrency_gate(app, row).await? {
        return Ok(held);
    }
    let lane = row.lane.parse::<Lane>().unwrap_or(Lane::Interactive);
    if row.share_held {
        return Ok(Reason::TenantShare {
            tenant: row.tenant_id.clone(),
            lane,
            running_in_lane: facts::running_in_lane(&app.pool, &row.tenant_id, lane).await?,
            others_queued: db::claim::others_queued(&app.pool, lane, &row.tenant_id).await?,
            share: app.settings.tenant_share,
        });
    }
    let workers = db::versions::live_workers(&app.pool).await?;
    Ok(Reason::Ready {
        lane,
        dispatched: row.dispatched_at.is_some(),
        queued_ahead: facts::queued_ahead(&app.pool, lane, row.created_at, row.id, tenant).await?,
        live_workers: workers
            .iter()
            .filter(|w| w.kinds.contains(&row.kind))
            .count(),
    })
}

fn not_due(row: &facts::Row) -> Reason {
    // A park's message (class `overloaded`): an open model breaker's, or a down service's.
    let parked = row
        .error_message
        .as_deref()
        .filter(|_| row.error_class.as_deref() == Some(ErrorClass::Overloaded.as_str()));
    let breaker = parked.and_then(agentq_core::retry::breaker_parked_until);
    let down = parked.and_then(agentq_core::retry::service_parked_of);
    match (breaker, down) {
        (Some((provider, may_close_at)), _) => Reason::BreakerOpen {
            provider,
            may_close_at,
            retry_at: row.run_at,
        },
        (None, Some((service, detail))) => Reason::ServiceDown {
            service,
            detail,
            retry_at: row.run_at,
        },
        (None, None) => Reason::NotDue {
            retry_at: row.run_at,
            error_class: row.error_class.clone(),
            error_message: row.error_message.clone(),
        },
    }
}

/// Held when no live worker runs its pinned version (or, unpinned, any version of its kind).
async fn version_gate(app: &App, row: &facts::Row) -> Result<Option<Reason>> {
    let live = db::versions::live_workers(&app.pool).await?;
    let workers: Vec<WorkerVersions> = live
        .iter()
        .filter_map(|w| {
            let versions: Vec<String> = w
                .kinds
                .iter()
                .zip(&w.versions)
                .filter(|(k, _)| **k == row.kind)
                .map(|(_, v)| v.clone())
                .collect();
            (!versions.is_empty()).then(|| WorkerVersions {
                worker: w.owner.clone(),
                versions,
            })
        })
        .collect();
    let runs = |v: &str| workers.iter().any(|w| w.versions.iter().any(|x| x == v));
    let served = match &row.kind_version {
        Some(v) => runs(v),
        None => !workers.is_empty(),
    };
    if served {
        return Ok(None);
    }
    let newest_live = version::newest(
        workers
            .iter()
            .flat_map(|w| w.versions.iter().map(String::as_str)),
    )
    .map(String::from);
    Ok(Some(Reason::Version {
        kind: row.kind.clone(),
        pinned: row.kind_version.clone(),
        newest_live,
        workers,
        version_parked: row.version_parked,
    }))
}

async fn ordering_gate(app: &App, row: &facts::Row) -> Result<Option<Reason>> {
    let Some(key) = &row.ordering_key else {
        return Ok(None);
    };
    let holder =
        facts::ordering_holder(&app.pool, &row.tenant_id, key, row.created_at, row.id).await?;
    let Some(h) = holder else {
        return Ok(None);
    };
    let since = match h.status {
        Status::Running => facts::running_since(&app.pool, h.id).await?,
        _ => None,
    };
    Ok(Some(Reason::OrderingKey {
        key: key.clone(),
        holder: Holder {
            id: h.id,
            status: h.status,
            worker: h.lease_owner,
            since: since.unwrap_or(h.updated_at),
        },
    }))
}

async fn batch_gate(app: &App, row: &facts::Row) -> Result<Option<Reason>> {
    let Some(id) = row.batch_id else {
        return Ok(None);
    };
    let Some(b) = db::batches::find_batch(&app.pool, id, None).await? else {
        return Ok(None);
    };
    let status = b.status.as_str();
    if status != "paused" && status != "cancelled" {
        return Ok(None);
    }
    Ok(Some(Reason::Batch {
        batch_id: id,
        batch_status: status.to_string(),
        paused_reason: b.paused_reason,
    }))
}

async fn concurrency_gate(app: &App, row: &facts::Row) -> Result<Option<Reason>> {
    let Some(key) = &row.concurrency_key else {
        return Ok(None);
    };
    let counted =
        facts::concurrency(&app.pool, &row.tenant_id, key, row.created_at, row.id).await?;
    let Some((running, lim, ahead)) = counted else {
        return Ok(None);
    };
    let limit = lim.or(row.concurrency_limit).unwrap_or(i32::MAX);
    // The claim admits the key's operations oldest first while the key stays under its limit.
    if i64::from(running) + ahead < i64::from(limit) {
        return Ok(None);
    }
    Ok(Some(Reason::ConcurrencyKey {
        key: key.clone(),
        running,
        limit,
        ahead,
    }))
}

/// One answer of each variant, for the tests (this module's, and the API's, which check each
/// against the OpenAPI document). The match below makes a new variant a compile error here
/// until it is listed.
pub fn one_of_each() -> Vec<Reason> {
    let now = Utc::now();
    let all = vec![
        Reason::Running {
            worker: None,
            since: None,
            attempt: 1,
            max_attempts: 3,
            lease_until: None,
        },
        Reason::Finished {
            status: Status::Succeeded,
            at: None,
            error_class: None,
            error_message: None,
        },
        Reason::Sleeping { until: now },
        Reason::WaitingForSignal {
            signal: "s".into(),
            timeout_at: now,
            pending: 0,
        },
        Reason::WaitingForBudget {
            scope: "operation".into(),
            limit_tokens: 3,
            spent_tokens: 2,
            held_tokens: 0,
            measure: "total".into(),
            timeout_at: now,
        },
        Reason::WaitingForRateLimit {
            scope: "key".into(),
            limit: "t1:org-1".into(),
            reopens_at: now,
            window_tokens: 900,
            max_tokens: Some(1000),
            window_requests: 3,
            max_requests: None,
            window_secs: 60,
        },
        Reason::WaitingForChildren {
            children: 1,
            unfinished: vec![],
        },
        Reason::NotDue {
            retry_at: now,
            error_class: None,
            error_message: None,
        },
        Reason::BreakerOpen {
            provider: "p".into(),
            may_close_at: now,
            retry_at: now,
        },
        Reason::ServiceDown {
            service: "billing".into(),
            detail: "connecting to http://127.0.0.1:9 failed: connection refused".into(),
            retry_at: now,
        },
        Reason::Debouncing {
            debounce_key: "k".into(),
            starts_at: now,
            latest: now,
            joined: 2,
        },
        Reason::Paused {
            pause: crate::pauses::PauseView {
                pause_id: Uuid::nil(),
                scope: crate::pauses::Scope::default(),
                reason: "r".into(),
                paused_by: "a".into(),
                paused_at: now,
            },
        },
        Reason::Version {
            kind: "k".into(),
            pinned: None,
            newest_live: None,
            workers: vec![],
            version_parked: false,
        },
        Reason::OrderingKey {
            key: "k".into(),
            holder: Holder {
                id: Uuid::nil(),
                status: Status::Running,
                worker: None,
                since: now,
            },
        },
        Reason::ConcurrencyKey {
            key: "k".into(),
            running: 1,
            limit: 1,
            ahead: 0,
        },
        Reason::Batch {
            batch_id: Uuid::nil(),
            batch_status: "paused".into(),
            paused_reason: None,
        },
        Reason::TenantShare {
            tenant: "t".into(),
            lane: Lane::Interactive,
            running_in_lane: 1,
            others_queued: true,
            share: Some(0.5),
        },
        Reason::Ready {
            lane: Lane::Interactive,
            dispatched: true,
            queued_ahead: 0,
            live_workers: 1,
        },
    ];
    for r in &all {
        match r {
            Reason::Running { .. }
            | Reason::Finished { .. }
            | Reason::Sleeping { .. }
            | Reason::WaitingForSignal { .. }
            | Reason::WaitingForBudget { .. }
            | Reason::WaitingForRateLimit { .. }
            | Reason::WaitingForChildren { .. }
            | Reason::NotDue { .. }
            | Reason::BreakerOpen { .. }
            | Reason::ServiceDown { .. }
            | Reason::Debouncing { .. }
            | Reason::Paused { .. }
            | Reason::Version { .. }
            | Reason::OrderingKey { .. }
            | Reason::ConcurrencyKey { .. }
            | Reason::Batch { .. }
            | Reason::TenantShare { .. }
            | Reason::Ready { .. } => {}
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every gate the claim statement applies (`CLAIM_GATES`, which core's test ties to the
    /// statement's conditions) has an answer here: a gate added to the claim without one fails.
    #[test]
    fn every_gate_of_the_claim_has_a_why() {
        let answers = one_of_each();
        for gate in db::claim::CLAIM_GATES {
            assert!(
                answers.iter().any(|r| r.claim_gate() == Some(gate)),
                "the claim's gate {gate:?} has no `agentq why` answer (a Reason variant whose \
                 claim_gate() is {gate:?})"
            );
        }
        for r in &answers {
            if let Some(gate) = r.claim_gate() {
                assert!(
                    db::claim::CLAIM_GATES.contains(&gate),
                    "{r:?} names a gate the claim does not apply: {gate}"
                );
            }
            let (headline, _) = describe(r);
            assert!(!headline.is_empty());
        }
    }
}
