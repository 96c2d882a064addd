//! Running one claimed operation: replay its journal, call the job function, and settle the
//! outcome with one fenced statement ([`settle`] is the one place that maps an outcome to a

//! transition; what a failure leads to is `agentq_core::state::failure::after_failure`).
//! [`Shared`] is what the operations a worker runs share with it.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use agentq_core::db::settle::{FailTo, HandBack};
use agentq_core::db::{self, claim::Claimed, steps::StepWrite};
use agentq_core::metrics;
use agentq_core::operation::OperationId;
use agentq_core::retry;
use agentq_core::state::failure::{Failure, To, after_failure};
use agentq_core::state::{ErrorClass, Status, StepStatus};
use futures_util::FutureExt;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::context::{JobRun, OperationInfo, Services};
use crate::error::{Engine, JobError, Stop};
use crate::lease::Leases;
use crate::served::ServedKinds;
use crate::versions::Versions;

/// Everything a running operation shares with its worker.
pub(crate) struct Shared {
    /// What its job's context uses: the pool, the model gate, the journal writer.
    pub(crate) services: Arc<Services>,
    pub(crate) kinds: ServedKinds,
    /// What the claim statement takes from this worker, by the versions it runs.
    pub(crate) versions: Versions,
    pub(crate) leases: Leases,
    /// Fair shares of this worker's slots between tenants.
    pub(crate) shares: crate::share::Shares,
    /// Journals kept from this worker's runs for their operations' next runs here.
    pub(crate) journals: crate::journal_cache::JournalCache,
}

impl Shared {
    /// agentq's database.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.services.pool
    }
}

/// Runs `op` to its next resting state. The lease is released when this returns.
pub(crate) async fn execute(
    shared: Arc<Shared>,
    op: Claimed,
    slot: Arc<crate::slot::LaneSlot>,
    stop: CancellationToken,
    cancel: CancellationToken,
    yielding: Arc<crate::share::Yield>,
) {
    let (id, epoch, kind) = (op.id, op.epoch, op.kind.clone());
    let started = std::time::Instant::now();
    // Every log line about this attempt carries the operation and the request that made it.
    let span = tracing::info_span!(
        "operation",
        op_id = %op.id,
        tenant = %op.tenant_id,
        kind = %op.kind,
        version = %op.kind_version,
        attempt = op.attempt,
        epoch = op.epoch,
        request_id = op.request_id.as_deref().unwrap_or("-"),
        outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    // Part of the trace of the request (or webhook delivery) that created the operation.
    agentq_core::telemetry::set_parent(&span, op.traceparent.as_deref());
    tracing::Instrument::instrument(run(&shared, op, slot, stop, cancel, yielding), span).await;
    metrics::ATTEMPT_DURATION.observe(&[&kind], started.elapsed().as_secs_f64());
    shared.leases.release(id, epoch);
}

async fn run(
    shared: &Arc<Shared>,
    op: Claimed,
    slot: Arc<crate::slot::LaneSlot>,
    stop: CancellationToken,
    cancel: CancellationToken,
    yielding: Arc<crate::share::Yield>,
) {
    let journal = match shared.journals.load(shared.pool(), &op).await {
        Ok(j) => j,
        Err(e) => {
            // Without the journal nothing may run; the lease lapses and the reaper retries.
            tracing::error!(op_id = %op.id, error = %e, "loading the journal failed");
            return;
        }
    };
    let info = OperationInfo {
        op_id: OperationId(op.id),
        tenant: op.tenant_id.clone(),
        kind: op.kind.clone(),
        version: op.kind_version.clone(),
        attempt: op.attempt,
        epoch: op.epoch,
        deadline: op.deadline,
    };
    let ctx = JobRun::new(
        info,
        shared.services.clone(),
        journal,
        crate::context::ClaimFacts {
            upgrade_through: op.upgrade_through,
            budgeted: op.budgeted,
            claimed_at: op.claimed_at,
            rate_key: op.rate_key.clone(),
            slot: Some(slot),
        },
        stop.clone(),
        cancel.clone(),
        yielding,
    );
    let outcome = match shared.kinds.handler(&op.kind, &op.kind_version) {
        _ if op.deadline.is_some_and(|d| d <= chrono::Utc::now()) => Err(JobError::from(
            Engine::DeadlineExceeded(op.deadline.expect("checked just above")),
        )),
        // A remote kind's service removed since this worker claimed it (its snapshot is read
        // every few seconds): retried, since registering it again makes it runnable.
        None if !shared.kinds.is_own_kind(&op.kind) => Err(JobError::retryable(format!(
            "no service serves version {:?} of kind {:?} now (`agentq services list`)",
            op.kind_version, op.kind
        ))),
        None => Err(JobError::NonRetryable(format!(
            "no worker here runs version {:?} of kind {:?}",
            op.kind_version, op.kind
        ))),
        Some(handler) => {
            let job = AssertUnwindSafe(handler.call(ctx.clone(), op.input.clone())).catch_unwind();
            // A cancel or a deadline stops the job where it is, mid-step if need be: its future
            // is dropped at its next await, and an unsafe step in flight is journaled `unknown`
            // (`JobRun::take_pending`), to be reconciled if the operation ever runs again.
            tokio::select! {
                biased;
                _ = stop.cancelled() => Err(JobError::from(Engine::LeaseLost)),
                _ = cancel.cancelled() => Err(interrupted(op.deadline)),
                d = deadline_passes(op.deadline) => Err(JobError::from(Engine::DeadlineExceeded(d))),
                r = job => r.unwrap_or_else(|panic| Err(JobError::from(Engine::Panicked(panic_message(&panic))))),
            }
        }
    };
    record_outcome(&outcome);
    if outcome.as_ref().is_err_and(JobError::is_suspended) && ctx.take_budget_pause() {
        hand_back(shared, &op, &ctx, HandBack::Pause).await;
        return;
    }
    if outcome.as_ref().is_err_and(JobError::is_lease_lost) {
        let why = if shared.leases.paused(op.id, op.epoch) {
            Some(HandBack::Pause)
        } else if shared.leases.yielded(op.id, op.epoch) {
            Some(HandBack::Share)
        } else {
            None
        };
        if let Some(why) = why {
            hand_back(shared, &op, &ctx, why).await;
            return;
        }
    }
    settle(shared, &op, &ctx, outcome).await;
}

/// Hands a stopped run back to the queue ([`HandBack`]: fenced by its epoch and this worker's
/// lease, its attempt given back), with its finished steps not yet written: a step-boundary
/// stop leaves the last one pending, and neither a pause nor a share cuts an unsafe call, so
/// none is in flight.
async fn hand_back(shared: &Shared, op: &Claimed, ctx: &JobRun, why: HandBack) {
    shared.leases.settling(op.id, op.epoch);
    let (steps, _) = ctx.take_pending();
    let (pool, owner) = (shared.pool(), shared.leases.owner());
    let written = db::settle::hand_back(pool, owner, op.id, op.epoch, &steps, why);
    match (db::within(written).await, why) {
        (Ok(true), HandBack::Pause) => {
            tracing::info!(op_id = %op.id, "paused at a step boundary; back in the queue")
        }
        (Ok(true), HandBack::Share) => {
            tracing::info!(op_id = %op.id, "gave its slot back to other tenants; held")
        }
        (Ok(false), _) => {}
        (Err(e), _) => {
            tracing::warn!(op_id = %op.id, error = %e, "handing a stopped operation back failed; its lease will lapse")
        }
    }
}

/// Why a running job was told to stop: its deadline, if that has passed (the scheduler flags
/// running operations past their deadline), else a cancel.
fn interrupted(deadline: Option<chrono::DateTime<chrono::Utc>>) -> JobError {
    match deadline {
        Some(d) if d <= chrono::Utc::now() => JobError::from(Engine::DeadlineExceeded(d)),
        _ => JobError::from(Engine::Cancelled),
    }
}

/// Resolves when `deadline` passes (never without one).
async fn deadline_passes(
    deadline: Option<chrono::DateTime<chrono::Utc>>,
) -> chrono::DateTime<chrono::Utc> {
    match deadline {
        Some(d) => {
            let left = (d - chrono::Utc::now()).to_std().unwrap_or_default();
            tokio::time::sleep(left).await;
            d
        }
        None => std::future::pending().await,
    }
}

/// Notes how the attempt ended on the operation span (a class, never an error message).
fn record_outcome(outcome: &Result<Value, JobError>) {
    let span = tracing::Span::current();
    match outcome {
        Ok(_) => span.record("outcome", "succeeded"),
        Err(
            e @ (JobError::Stopped(Stop(Engine::Suspended))
            | JobError::Stopped(Stop(Engine::Cancelled))),
        ) => span.record("outcome", e.class()),
        Err(e) => span
            .record("outcome", e.class())
            .record("otel.status_code", "error"),
    };
}

/// Writes a job's outcome as its database transition: the one place mapping an outcome to a
/// transition. What a failure leads to is decided by
/// [`agentq_core::state::failure::after_failure`]; this gathers its facts and writes its answer.
async fn settle(shared: &Shared, op: &Claimed, ctx: &JobRun, outcome: Result<Value, JobError>) {
    let (steps, failed_step) = ctx.take_pending();
    shared.leases.settling(op.id, op.epoch);
    // What the metrics count once the transition is written.
    let mut finished: Option<Labels> = None;
    let written = match &outcome {
        Ok(result) => {
            finished = Some((Status::Succeeded.as_str(), None));
            let completion = db::settle::RunWrite::Complete(db::settle::Completion {
                id: op.id,
                epoch: op.epoch,
                result: result.clone(),
                steps,
            });
            // Through the journal's writer: a success shares its statement with other
            // operations' steps.
            shared
                .services
                .journal
                .write(shared.pool(), completion)
                .await
                .map_err(|unwritten| unwritten.error)
        }
        Err(JobError::Stopped(Stop(Engine::Suspended))) => match ctx.take_suspend() {
            Some((run_at, waiting_for)) => {
                db::within(db::timers::suspend_operation(
                    shared.pool(),
                    op.id,
                    op.epoch,
                    run_at,
                    waiting_for.as_deref(),
                    &steps,
                ))
                .await
            }
            None => {
                // A job returned Suspended without parking through ctx: a bug in the job.

                let bug = JobError::NonRetryable(
                    "the job returned Suspended without a ctx.sleep or ctx.wait_for_signal".into(),
                );
                let (written, labels) =
                    fail(shared, op, &bug, Failure::NonRetryable, failed_step, &steps).await;
                finished = Some(labels);
                written
            }
        },
        Err(e) => match e.failure() {
            // The lease was lost (the heartbeat found out, or a fenced write was refused): this
            // worker writes nothing more for the operation.
            None => {
                // The heartbeat logs what it finds; a refused write is logged here.
                if ctx.write_was_refused() {
                    tracing::warn!(op_id = %op.id, epoch = op.epoch, "lease lost: a fenced write was refused; stopping the operation");
                }
                return;
            }
            Some(failure) => {
                let (written, labels) = fail(shared, op, e, failure, failed_step, &steps).await;
                finished = Some(labels);
                written
            }
        },
    };
    if let (Ok(true), Some((outcome, failure))) = (&written, finished) {
        if !matches!(outcome, "retry" | "parked") {
            // Ended: nothing will replay its journal again here.
            shared.journals.forget(op.id);
        }
        metrics::OPERATIONS_FINISHED.inc(&[&op.kind, outcome]);
        if let Some(class) = failure {
            metrics::OPERATION_FAILURES.inc(&[&op.kind, class.as_str()]);
        }
    }
    match written {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(op_id = %op.id, "lease lost before the outcome was written; discarded")
        }
        Err(e) => tracing::error!(
            op_id = %op.id, error = %e,
            "writing the outcome failed; the lease will lapse and the operation rerun"
        ),
    }
}

/// An outcome as the metrics count it: the `outcome` label of `agentq_operations_finished_total`,
/// and the class counted by `agentq_operation_failures_total` (none for a success or a cancel).
type Labels = (&'static str, Option<ErrorClass>);

/// Ends an attempt that failed with `e` (of kind `failure`): gathers the facts (the attempt,
/// an `unknown` step among the rows to write), asks the failure decision, and writes its answer
/// with the rows. Returns what was written and its metric labels.
async fn fail(
    shared: &Shared,
    op: &Claimed,
    e: &JobError,
    failure: Failure,
    failed_step: Option<i32>,
    steps: &[StepWrite],
) -> (db::Result<bool>, Labels) {
    let unknown = steps.iter().find(|s| s.status == StepStatus::Unknown);
    let next = after_failure(failure, op.attempt, op.max_attempts, unknown.is_some());
    let (to, outcome, message) = match next.to {
        To::Retry { not_before } => (
            FailTo::Retry {
                run_at: retry::next_run_at(op.attempt, not_before),
                count_attempt: true,
            },
            "retry",
            e.to_string(),
        ),
        To::Park { not_before } => (
            FailTo::Retry {
                run_at: retry::overloaded_run_at(op.attempt, not_before),
                count_attempt: false,
            },
            "parked",
            e.to_string(),
        ),
        To::Dead { unknown_step } => {
            // No attempt is left to reconcile the unsafe step whose outcome this one lost:
            // the operator gets the step and its key, not just "retries exhausted".
            let message = match unknown.filter(|_| unknown_step) {
                Some(s) => JobError::from(Engine::UnknownSideEffect {
                    seq: s.seq,
                    name: s.name.clone(),
                    key: s.idempotency_key.clone(),
                })
                .to_string(),
                None => e.to_string(),
            };
            (FailTo::Dead, Status::Dead.as_str(), message)
        }
        To::Cancelled => (FailTo::Cancelled, Status::Cancelled.as_str(), e.to_string()),
    };
    let class = next.class;
    tracing::info!(op_id = %op.id, class = class.as_str(), attempt = op.attempt, "operation attempt failed");
    let written = db::within(db::settle::fail_operation(
        shared.pool(),
        op.id,
        op.epoch,
        class,
        &message,
        to,
        failed_step,
        steps,
    ))
    .await;
    let failed = (next.to != To::Cancelled).then_some(class);
    (written, (outcome, failed))
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
