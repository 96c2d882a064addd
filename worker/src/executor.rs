//! Running one claimed operation: replay its journal, call the job function, and settle the
//! outcome with one fenced statement ([`settle`] is the one place that maps an outcome to a
//! transition). [`Shared`] is what the operations a worker runs share with it.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use agentq_core::db::{self, Claimed, FailTo};
use agentq_core::metrics;
use agentq_core::operation::OperationId;
use agentq_core::retry;
use futures_util::FutureExt;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::context::{JobContext, OperationInfo, Services};
use crate::error::JobError;
use crate::group_commit::GroupCommit;
use crate::lease::Leases;
use crate::registry::Registry;

/// Everything a running operation shares with its worker.
pub(crate) struct Shared {
    /// What its job's context uses: the pool, the model gate, the journal writer.
    pub(crate) services: Arc<Services>,
    pub(crate) registry: Registry,
    pub(crate) leases: Leases,
    /// Writes successful attempts, many per statement.
    pub(crate) completer: GroupCommit<db::Completion>,
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
    stop: CancellationToken,
    cancel: Arc<AtomicBool>,
) {
    let (id, epoch, kind) = (op.id, op.epoch, op.kind.clone());
    let started = std::time::Instant::now();
    // Every log line about this attempt carries the operation and the request that made it.
    let span = tracing::info_span!(
        "operation",
        op_id = %op.id,
        tenant = %op.tenant_id,
        kind = %op.kind,
        attempt = op.attempt,
        epoch = op.epoch,
        request_id = op.request_id.as_deref().unwrap_or("-"),
        outcome = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    // Part of the trace of the request (or webhook delivery) that created the operation.
    agentq_core::telemetry::set_parent(&span, op.traceparent.as_deref());
    tracing::Instrument::instrument(run(&shared, op, stop, cancel), span).await;
    metrics::ATTEMPT_DURATION.observe(&[&kind], started.elapsed().as_secs_f64());
    shared.leases.release(id, epoch);
}

async fn run(shared: &Arc<Shared>, op: Claimed, stop: CancellationToken, cancel: Arc<AtomicBool>) {
    let journal = if op.has_journal {
        match db::load_journal(shared.pool(), op.id).await {
            Ok(j) => j,
            Err(e) => {
                // Without the journal nothing may run; the lease lapses and the reaper retries.
                tracing::error!(op_id = %op.id, error = %e, "loading the journal failed");
                return;
            }
        }
    } else {
        Vec::new()
    };
    let info = OperationInfo {
        op_id: OperationId(op.id),
        tenant: op.tenant_id.clone(),
        kind: op.kind.clone(),
        attempt: op.attempt,
        epoch: op.epoch,
        deadline: op.deadline,
    };
    let ctx = JobContext::new(info, shared.services.clone(), journal, stop.clone(), cancel);
    let outcome = match shared.registry.handler(&op.kind) {
        _ if op.deadline.is_some_and(|d| d <= chrono::Utc::now()) => Err(
            JobError::DeadlineExceeded(op.deadline.expect("checked just above")),
        ),
        None => Err(JobError::NonRetryable(format!(
            "no worker here runs kind {:?}",
            op.kind
        ))),
        Some(handler) => {
            let job = AssertUnwindSafe(handler(ctx.clone(), op.input.clone())).catch_unwind();
            tokio::select! {
                biased;
                _ = stop.cancelled() => Err(JobError::LeaseLost),
                r = job => r.unwrap_or_else(|panic| Err(JobError::Panicked(panic_message(&panic)))),
            }
        }
    };
    record_outcome(&outcome);
    settle(shared, &op, &ctx, outcome).await;
}

/// Notes how the attempt ended on the operation span (a class, never an error message).
fn record_outcome(outcome: &Result<Value, JobError>) {
    let span = tracing::Span::current();
    match outcome {
        Ok(_) => span.record("outcome", "succeeded"),
        Err(e @ (JobError::Suspended | JobError::Cancelled)) => span.record("outcome", e.class()),
        Err(e) => span
            .record("outcome", e.class())
            .record("otel.status_code", "error"),
    };
}

/// Maps a job's outcome to its database transition: the one place that decides what a
/// failure class means.
async fn settle(shared: &Shared, op: &Claimed, ctx: &JobContext, outcome: Result<Value, JobError>) {
    let (steps, failed_step) = ctx.take_pending();
    shared.leases.settling(op.id, op.epoch);
    // (outcome, failure class) for the metrics, counted once the transition is written.
    let mut finished: Option<(&'static str, &'static str)> = None;
    let written = match &outcome {
        Ok(result) => {
            finished = Some(("succeeded", ""));
            let completion = db::Completion {
                id: op.id,
                epoch: op.epoch,
                result: result.clone(),
                steps,
            };
            shared
                .completer
                .write(shared.pool(), completion)
                .await
                .map_err(|unwritten| unwritten.error)
        }
        Err(JobError::LeaseLost) => return,
        Err(JobError::Suspended) => match ctx.take_suspend() {
            Some((run_at, waiting_for)) => {
                db::timers::suspend_operation(
                    shared.pool(),
                    op.id,
                    op.epoch,
                    run_at,
                    waiting_for.as_deref(),
                    &steps,
                )
                .await
            }
            None => {
                // A job returned Suspended without parking through ctx: a bug in the job.
                finished = Some(("dead", "non_retryable"));
                db::fail_operation(
                    shared.pool(),
                    op.id,
                    op.epoch,
                    "non_retryable",
                    "the job returned Suspended without a ctx.sleep or ctx.wait_for_signal",
                    FailTo::Dead,
                    failed_step,
                    &steps,
                )
                .await
            }
        },
        Err(e) => {
            let attempts_left = op.attempt < op.max_attempts;
            // No attempt is left to reconcile an unsafe step whose outcome this one lost:
            // the operator gets the step and its key, not just "retries exhausted". (An
            // overloaded provider parks the operation without using an attempt instead.)
            let exhausted = !attempts_left && matches!(e, JobError::Retryable { .. });
            let unknown = steps
                .iter()
                .find(|s| s.status == "unknown")
                .filter(|_| exhausted)
                .map(|s| JobError::UnknownSideEffect {
                    seq: s.seq,
                    name: s.name.clone(),
                    key: s.idempotency_key.clone(),
                });
            let e = unknown.as_ref().unwrap_or(e);
            let (class, to) = match e {
                JobError::Retryable { not_before, .. } if attempts_left => (
                    "retryable",
                    FailTo::Retry {
                        run_at: retry::next_run_at(op.attempt, *not_before),
                        count_attempt: true,
                    },
                ),
                JobError::NoEffect(_) | JobError::Panicked(_) if attempts_left => (
                    "retryable",
                    FailTo::Retry {
                        run_at: retry::next_run_at(op.attempt, None),
                        count_attempt: true,
                    },
                ),
                JobError::Retryable { .. } | JobError::NoEffect(_) | JobError::Panicked(_) => {
                    ("retries_exhausted", FailTo::Dead)
                }
                // Not the operation's fault: park it, harder, without using up an attempt.
                JobError::Overloaded { not_before, .. } => (
                    "overloaded",
                    FailTo::Retry {
                        run_at: retry::overloaded_run_at(op.attempt, *not_before),
                        count_attempt: false,
                    },
                ),
                JobError::Cancelled => ("cancelled", FailTo::Cancelled),
                other => (other.class(), FailTo::Dead),
            };
            finished = Some((
                match to {
                    FailTo::Retry {
                        count_attempt: true,
                        ..
                    } => "retry",
                    FailTo::Retry { .. } => "parked",
                    FailTo::Dead => "dead",
                    FailTo::Cancelled => "cancelled",
                },
                class,
            ));
            tracing::info!(op_id = %op.id, class, attempt = op.attempt, "operation attempt failed");
            db::fail_operation(
                shared.pool(),
                op.id,
                op.epoch,
                class,
                &e.to_string(),
                to,
                failed_step,
                &steps,
            )
            .await
        }
    };
    if let (Ok(true), Some((outcome, class))) = (&written, finished) {
        metrics::OPERATIONS_FINISHED.inc(&[&op.kind, outcome]);
        if !matches!(outcome, "succeeded" | "cancelled") {
            metrics::OPERATION_FAILURES.inc(&[&op.kind, class]);
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

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}
