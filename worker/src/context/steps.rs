//! Steps: a kind's own (`JobRun::own_step`, the SDK handle's `step`, `unsafe_step` and
//! `deferred_step`), model and tool calls, `now`
//! and `uuid`, and the one runner they all go through. The runner asks
//! `state::replay::resume` what the journal's record at the step's position means (return
//! the recorded output, run, reconcile an unsafe call whose outcome was lost, or fail
//! closed), makes an unsafe step's `started` row durable before its call, and records how
//! the step ended.

use std::future::Future;
use std::time::Instant;

use agentq_core::metrics;
use agentq_core::operation::step_idempotency_key;
use agentq_core::state::replay::{Resume, resume};
use agentq_core::state::{StepKind, StepStatus};
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::JobRun;
use super::journal::{StepSpec, diverged, recorded_as};
use agentq_sdk::context::{Reconcile, Step};
use agentq_sdk::error::{Engine, JobError};
use agentq_sdk::model::{ModelRequest, ModelResponse};
use agentq_sdk::tool::{Reconciled, Replay, Tool, ToolContext};

impl JobRun {
    /// A step of the kind's own (the SDK handle's `step`, `unsafe_step`, `deferred_step`, a
    /// remote kind's custom and unsafe steps): `Some` recorded output, or `None` when its
    /// body ran now (the handle kept what it returned).
    pub(crate) async fn own_step(&self, step: Step<'_, '_>) -> Result<Option<Value>, JobError> {
        let Step {
            name,
            replay,
            deferred,
            reconcile,
            body,
        } = step;
        let spec = StepSpec {
            deferred,
            ..StepSpec::new(name, StepKind::Custom, replay)
        };
        let unsafe_step = replay == Replay::Unsafe;
        let own = self
            .run_step_with(spec, reconcile, |key| async move {
                if unsafe_step {
                    self.effect_begins(&key, name, replay)?;
                }
                let output = body(key.clone()).await?;
                if unsafe_step {
                    self.inner.services.store.effect_happened(&key, &output);
                }
                Ok((Own::Ran(output), None))
            })
            .await?;
        Ok(match own {
            Own::Ran(_) => None,
            Own::Recorded(v) => Some(v),
        })
    }

    /// The replay tester's watch on a step's body about to run (a tool call, an unsafe
    /// closure): it records the effect's timeline and finds an effect made twice.
    fn effect_begins(&self, key: &str, name: &str, replay: Replay) -> Result<(), JobError> {
        self.inner.services.store.effect_begins(key, name, replay)
    }

    /// Calls the model as a replay-safe step, through the worker's gate (its breaker, limits
    /// and budgets); token usage is journaled with it.
    pub(crate) async fn model(
        &self,
        name: &str,
        request: ModelRequest,
    ) -> Result<ModelResponse, JobError> {
        let model = self.inner.services.model.clone();
        let kind = self.inner.info.kind.clone();
        let spec = StepSpec::new(name, StepKind::Model, Replay::Safe);
        let ctx = self.clone();
        self.run_step_with(spec, None, |_key| async move {
            // Its estimate is held against the operation's budgets and reserved in its rate
            // limits before it is sent; a refusal stops the run here, with nothing journaled
            // for this step.
            let (holds, slots) = ctx.hold_call(&request).await?;
            let retry_in_step = JobRun::retry_in_step(&holds);
            // The call's span names the model and how it ended; never the prompt or the answer.
            let span = tracing::info_span!(
                "model_call",
                otel.kind = "client",
                model = request.model.as_deref().unwrap_or("default"),
                outcome = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            // Admitted by the gate: the lane slot is lent to another operation while the call
            // is in flight (`crate::slot`), and taken again once the call has given back all it
            // held: its call slots, and its budget holds and rate reservations, which others
            // may wait for while holding a lane slot.
            let slot = ctx.inner.claim.slot.as_ref();
            if let Some(slot) = slot {
                slot.release();
            }
            let send = model.send(slots, &kind, &request, retry_in_step);
            let called = tracing::Instrument::instrument(send, span.clone()).await;
            ctx.settle_call(holds, &called).await;
            if let Some(slot) = slot {
                slot.reacquire().await;
            }
            match &called {
                Ok(_) => span.record("outcome", "ok"),
                Err(e) => span
                    .record("outcome", e.class())
                    .record("otel.status_code", "error"),
            };
            let resp = called?;
            let usage = serde_json::to_value(resp.usage).ok();
            Ok((resp, usage))
        })
        .await
    }

    /// A tool call as a step with the tool's replay policy; `report_errors`: a non-retryable
    /// error of the tool is the step's recorded output (`{"error": …}`), for the agent loop.
    pub(crate) async fn tool_step(
        &self,
        tool: &dyn Tool,
        args: Value,
        report_errors: bool,
    ) -> Result<Value, JobError> {
        let recover_args = args.clone();
        self.run_step_with(
            StepSpec::new(tool.name(), StepKind::Tool, tool.replay()),
            Some(Box::new(move |key: String| {
                Box::pin(async move {
                    tool.reconcile(&self.tool_context(&key), &recover_args)
                        .await
                })
            })),
            |key| async move {
                // The call's span names the tool and how it ended; never its arguments or result.
                let span = tracing::info_span!(
                    "tool_call",
                    tool = tool.name(),
                    outcome = tracing::field::Empty,
                    otel.status_code = tracing::field::Empty,
                );
                self.effect_begins(&key, tool.name(), tool.replay())?;
                let called = tracing::Instrument::instrument(
                    tool.call(&self.tool_context(&key), &args),
                    span.clone(),
                )
                .await;
                if let Ok(output) = &called {
                    self.inner.services.store.effect_happened(&key, output);
                }
                match &called {
                    Ok(_) => span.record("outcome", "ok"),
                    Err(e) => span
                        .record("outcome", e.class())
                        .record("otel.status_code", "error"),
                };
                match called {
                    Ok(v) => Ok((v, None)),
                    Err(JobError::NonRetryable(e)) if report_errors => {
                        Ok((serde_json::json!({ "error": e }), None))
                    }
                    Err(e) => Err(e),
                }
            },
        )
        .await
    }

    /// What a tool call of this operation knows: the step's key, the operation, the worker's
    /// pool and origins.
    fn tool_context<'a>(&'a self, key: &'a str) -> ToolContext<'a> {
        ToolContext::new(
            &self.inner.info,
            key,
            &self.inner.services.http_allow,
            &self.inner.services.provided,
        )
    }

    /// The current time, journaled so a replay sees the same value.
    pub(crate) async fn now(&self) -> Result<DateTime<Utc>, JobError> {
        let spec = StepSpec::new("now", StepKind::Now, Replay::Safe);
        self.run_step_with(spec, None, |_| async { Ok((Utc::now(), None)) })
            .await
    }

    /// A random UUID, journaled so a replay sees the same value.
    pub(crate) async fn uuid(&self) -> Result<uuid::Uuid, JobError> {
        let spec = StepSpec::new("uuid", StepKind::Now, Replay::Safe);
        self.run_step_with(spec, None, |_| async { Ok((uuid::Uuid::new_v4(), None)) })
            .await
    }

    /// Runs the step `spec` at the next journal position, inside its span: what the journal
    /// recorded there decides whether it runs at all ([`JobRun::resume_step`]); if it
    /// runs, [`JobRun::begin_step`] makes what must be durable before it durable, `f` does
    /// its work (given the step's idempotency key), and [`JobRun::end_step`] records how
    /// it ended.
    pub(super) async fn run_step_with<'a, T, F, Fut>(
        &self,
        spec: StepSpec<'_>,
        reconcile: Option<Reconcile<'a>>,
        f: F,
    ) -> Result<T, JobError>
    where
        T: StepOutput,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<(T, Option<serde_json::Value>), JobError>>,
    {
        self.check_running()?;
        let seq = self.next_position();
        let key = step_idempotency_key(self.inner.info.op_id, seq, spec.name);
        // The step's span names it, never its arguments or its output.
        let span = tracing::info_span!(
            "step",
            otel.name = %format_args!("step {}", spec.name),
            step = spec.name,
            seq,
            kind = spec.kind.as_str(),
            replay = spec.replay.as_str(),
            replayed = false,
            otel.status_code = tracing::field::Empty,
        );
        let body = async move {
            let fresh = match self.resume_step(seq, &key, spec, reconcile).await? {
                Resumed::Recorded(value) => return Ok(value),
                Resumed::Run { fresh } => fresh,
            };
            let started_at = self.begin_step(seq, &key, spec, fresh).await?;
            let ran = Instant::now();
            let outcome = f(key.clone()).await;
            metrics::STEP_DURATION.observe(&[spec.kind.as_str()], ran.elapsed().as_secs_f64());
            self.end_step(seq, &key, spec, started_at, outcome)
        };
        tracing::Instrument::instrument(body, span).await
    }

    /// What the journal recorded at `seq` means for the step `spec` asked now
    /// (`state::replay::resume`): its recorded output, or that it runs. A reconcile's answer
    /// decides it for an unsafe step whose outcome was lost (the effect happened: its output is
    /// recorded now; nobody can tell: the step is marked unknown and the run fails closed). A
    /// step asked for differently than recorded fails, unless an operator's upgrade covers the
    /// position: then the journal is rebased there and the step runs.
    async fn resume_step<'a, T>(
        &self,
        seq: i32,
        key: &str,
        spec: StepSpec<'_>,
        reconcile: Option<Reconcile<'a>>,
    ) -> Result<Resumed<T>, JobError>
    where
        T: StepOutput,
    {
        let StepSpec { name, kind, .. } = spec;
        let mut entry = self.recorded(seq);
        let mut decision = resume(
            entry.as_ref().map(|e| recorded_as(e, name, kind)),
            reconcile.is_some(),
        );
        if decision == Resume::Diverged {
            // Fails unless an operator's upgrade covers this position; then nothing is recorded
            // here any more and the step runs.
            self.rebase_or_diverge(seq, entry.as_ref(), name, kind)
                .await?;
            (entry, decision) = (None, Resume::Run);
        }
        let answer = match (decision, reconcile) {
            (Resume::Run, _) => None,
            (Resume::Diverged, _) => return Err(diverged(seq, entry.as_ref(), name, kind)),
            (Resume::UseRecorded, _) => {
                tracing::Span::current().record("replayed", true);
                let out = entry
                    .and_then(|e| e.output)
                    .unwrap_or(serde_json::Value::Null);
                return T::replayed(out).map(Resumed::Recorded).map_err(|e| {
                    JobError::from(Engine::Nondeterminism(format!(
                        "step {seq} ({name}) recorded an output of another shape: {e}"
                    )))
                });
            }
            (Resume::Reconcile, Some(ask)) => {
                let store = &self.inner.services.store;
                store.before_reconcile()?;
                let answer = ask(key.to_string()).await?;
                store.reconciled(seq, name, key, &answer);
                Some(answer)
            }
            // Nobody to ask: fail closed.
            (Resume::FailClosed | Resume::Reconcile, _) => Some(Reconciled::Unsupported),
        };
        match answer {
            None => {}
            Some(Reconciled::Happened(output)) => {
                tracing::info!(op_id = %self.inner.info.op_id, seq, "reconciled: the effect happened");
                let value: T = T::replayed(output.clone()).map_err(|e| {
                    JobError::NonRetryable(format!(
                        "reconcile of step {seq} ({name}) returned an output of another shape: {e}"
                    ))
                })?;
                let mut done = spec.row(seq, key, StepStatus::Completed, Utc::now());
                done.output = Some(output);
                done.usage = Some(agentq_core::operation::reconciled_usage());
                done.completed_at = Some(Utc::now());
                self.push(done, true);
                return Ok(Resumed::Recorded(value));
            }
            Some(Reconciled::NotHappened) => {
                tracing::info!(op_id = %self.inner.info.op_id, seq, "reconciled: the effect did not happen; running it");
            }
            Some(Reconciled::Unsupported) => {
                // Fail closed: mark the step unknown, keep its key for a human.
                let mut unknown = spec.row(seq, key, StepStatus::Unknown, Utc::now());
                unknown.error = Some("outcome lost in a crash; not re-run".into());
                self.push(unknown, true);
                self.run_state().failed_step = Some(seq);
                return Err(JobError::from(Engine::UnknownSideEffect {
                    seq,
                    name: name.to_string(),
                    key: key.to_string(),
                }));
            }
        }
        Ok(Resumed::Run {
            fresh: entry.is_none(),
        })
    }

    /// Before the step `spec` at `seq` runs (`fresh`: nothing is recorded at `seq`): checks the
    /// journal has room for it, and makes every step finished before it durable; an unsafe
    /// step's `started` row too, in the same write. Returns when the step started.
    async fn begin_step(
        &self,
        seq: i32,
        key: &str,
        spec: StepSpec<'_>,
        fresh: bool,
    ) -> Result<DateTime<Utc>, JobError> {
        if fresh {
            self.check_journal_room(seq, spec.name)?;
        }
        self.inner.services.store.step_runs(seq, spec.kind)?;
        let started_at = Utc::now();
        let unsafe_step = spec.replay == Replay::Unsafe;

        // An unsafe step does not begin once the run was asked to give its slot back; once
        // begun, its call is never cut for that.
        if unsafe_step {
            if !self.inner.yielding.begin_unsafe() {
                return Err(JobError::from(Engine::LeaseLost));
            }
            self.push(spec.row(seq, key, StepStatus::Started, started_at), true);
            if let Err(e) = self.flush().await {
                self.inner.yielding.end_unsafe();
                return Err(e);
            }
        } else if self.flush_due() {
            self.flush().await?;
        }

        let mut st = self.run_state();
        st.current_key = Some(key.to_string());
        if unsafe_step {
            let mut unknown = spec.row(seq, key, StepStatus::Unknown, started_at);
            unknown.error = Some(
                "stopped during its call (a cancel or a deadline); its effect may have happened"
                    .into(),
            );
            st.in_flight = Some(unknown);
        }
        self.inner.yielding.step_began();
        Ok(started_at)
    }

    /// After the step `spec` at `seq` (started at `started_at`) ran: records how it ended. An
    /// unsafe step whose outcome is unknown is marked so, to be reconciled, never run blindly.
    fn end_step<T>(
        &self,
        seq: i32,
        key: &str,
        spec: StepSpec<'_>,
        started_at: DateTime<Utc>,
        outcome: Result<(T, Option<serde_json::Value>), JobError>,
    ) -> Result<T, JobError>
    where
        T: StepOutput,
    {
        let StepSpec {
            name,
            replay,
            deferred,
            ..
        } = spec;
        {
            let mut st = self.run_state();
            st.current_key = None;
            st.in_flight = None;
        }
        self.inner.yielding.step_ended();
        if replay == Replay::Unsafe {
            self.inner.yielding.end_unsafe();
        }
        let row = |status| spec.row(seq, key, status, started_at);
        match outcome {
            Ok((value, usage)) => {
                let (output, value) = value.journaled().map_err(|e| {
                    JobError::NonRetryable(format!("step {name:?} output is not serializable: {e}"))
                })?;
                let mut done = row(StepStatus::Completed);
                done.output = Some(output);
                done.usage = usage;
                done.completed_at = Some(Utc::now());
                self.push(done, !deferred);
                Ok(value)
            }
            Err(e) => {
                if !e.is_suspended() {
                    tracing::Span::current().record("otel.status_code", "error");
                }
                if replay == Replay::Unsafe && e.outcome_unknown() {
                    // The effect may have happened: never run it blindly again. The next
                    // attempt reconciles, or fails closed (the `started` branch of
                    // `resume_step`).
                    let mut unknown = row(StepStatus::Unknown);
                    unknown.error = Some(format!("outcome unknown: {e}"));
                    self.push(unknown, true);
                    self.run_state().failed_step = Some(seq);
                } else if !(e.is_lease_lost() || e.is_suspended()) {
                    // (A step body that suspends, a model call a budget refused, was never
                    // sent: nothing is journaled at its position.)
                    let mut failed = row(StepStatus::Failed);
                    failed.error = Some(e.to_string());
                    failed.completed_at = Some(Utc::now());
                    self.push(failed, !deferred);
                    self.run_state().failed_step = Some(seq);
                }
                Err(e)
            }
        }
    }
}

/// What the journal's record at a step's position decided ([`JobRun::resume_step`]).
enum Resumed<T> {
    /// The step's output, recorded by an earlier run (or found by a reconcile): it does not run.
    Recorded(T),
    /// The step runs; `fresh`: nothing is recorded at its position yet.
    Run { fresh: bool },
}

/// A step's output as the runner journals and returns it.
pub(crate) trait StepOutput: Sized {
    /// Its JSON for the journal row, and what the step returns.
    fn journaled(self) -> Result<(Value, Self), serde_json::Error>;
    /// What a replay returns for the JSON recorded.
    fn replayed(recorded: Value) -> Result<Self, serde_json::Error>;
}

/// The steps whose output is a serde value: journaled as its JSON, returned as itself.
macro_rules! serde_outputs {
    ($($t:ty),*) => {$(
        impl StepOutput for $t {
            fn journaled(self) -> Result<(Value, Self), serde_json::Error> {
                Ok((serde_json::to_value(&self)?, self))
            }
            fn replayed(recorded: Value) -> Result<Self, serde_json::Error> {
                serde_json::from_value(recorded)
            }
        }
    )*};
}
serde_outputs!(Value, ModelResponse, uuid::Uuid, DateTime<Utc>);

/// A kind's own step's output: the SDK handle keeps what its body returned, so the JSON the
/// body made moves into the journal row and nothing is copied or decoded again.
pub(crate) enum Own {
    Ran(Value),
    Recorded(Value),
}

impl StepOutput for Own {
    fn journaled(self) -> Result<(Value, Self), serde_json::Error> {
        match self {
            Own::Ran(v) | Own::Recorded(v) => Ok((v, Own::Ran(Value::Null))),
        }
    }
    fn replayed(recorded: Value) -> Result<Self, serde_json::Error> {
        Ok(Own::Recorded(recorded))
    }
}
