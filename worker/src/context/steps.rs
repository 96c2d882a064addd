//! Steps: [`JobContext::step`], [`JobContext::deferred_step`], model and tool calls, `now`
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
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::JobContext;
use super::journal::{StepSpec, diverged, recorded_as};
use crate::error::{Engine, JobError};
use crate::model::{ModelRequest, ModelResponse};
use crate::tool::{Reconciled, Replay, Tool, ToolContext, TypedTool};

/// Asks a tool whether a call with this idempotency key already happened.
pub(crate) type Reconcile<'a> =
    Box<dyn FnOnce(String) -> BoxFuture<'a, Result<Reconciled, JobError>> + Send + 'a>;

impl JobContext {
    /// A safe step: `f` runs here, once per completed journal entry; a replay returns its
    /// recorded output instead. Safe means running it again after a crash is harmless (a read,
    /// a computation, an idempotent write). Its row is committed before the next step of the
    /// operation starts (or with the outcome).
    ///
    /// ```no_run
    /// # async fn f(ctx: agentq_worker::JobContext) -> Result<(), agentq_worker::JobError> {
    /// let words = ctx.step("count", || async { Ok("a b c".split(' ').count()) }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn step<T, F, Fut>(&self, name: &str, f: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
    {
        let spec = StepSpec::new(name, StepKind::Custom, Replay::Safe);
        self.run_step_with(
            spec,
            None,
            |_key| async move { f().await.map(|v| (v, None)) },
        )
        .await
    }

    /// An unsafe step: an effect that must never happen twice (a payment, an email). `f(key)`
    /// runs at most once per journal entry, `key` being the step's idempotency key (the same
    /// on every attempt and after every crash: pass it to the outside system). Its `started`
    /// row is durable before `f` runs. If a crash leaves the step's outcome unknown, agentq
    /// asks `reconcile(key)` instead of running it again: `Ok(None)` says the effect did not
    /// happen (the step runs now), `Ok(Some(output))` that it did (`output` is journaled as the
    /// step's). Return [`JobError::no_effect`] from `f` when the effect certainly did not
    /// happen (refused before acting); any other transient error leaves the outcome unknown.
    ///
    /// ```no_run
    /// # async fn pay(key: &str) -> Result<u64, agentq_worker::JobError> { Ok(1) }
    /// # async fn find_payment(key: &str) -> Result<Option<u64>, agentq_worker::JobError> { Ok(None) }
    /// # async fn f(ctx: agentq_worker::JobContext) -> Result<(), agentq_worker::JobError> {
    /// let payment = ctx
    ///     .unsafe_step("pay", |key| async move { pay(&key).await },
    ///                  |key| async move { find_payment(&key).await })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn unsafe_step<T, F, Fut, R, RFut>(
        &self,
        name: &str,
        f: F,
        reconcile: R,
    ) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
        R: FnOnce(String) -> RFut + Send,
        RFut: Future<Output = Result<Option<T>, JobError>> + Send,
    {
        let ask: Reconcile<'_> = Box::new(move |key: String| {
            Box::pin(async move {
                match reconcile(key).await? {
                    None => Ok(Reconciled::NotHappened),
                    Some(output) => Reconciled::happened(output),
                }
            })
        });
        self.unsafe_step_with(name, Some(ask), f).await
    }

    /// The replay tester's watch on a step's body about to run (a tool call, an unsafe
    /// closure): it records the effect's timeline and finds an effect made twice.
    fn effect_begins(&self, key: &str, name: &str, replay: Replay) -> Result<(), JobError> {
        self.inner.services.store.effect_begins(key, name, replay)
    }

    /// The replay tester's watch on a step's body that returned `output`.
    fn effect_happened<T: Serialize>(&self, key: &str, output: &T) {
        let store = &self.inner.services.store;
        store.effect_happened(key, &serde_json::to_value(output).unwrap_or_default());
    }

    /// A safe step whose journal row is **not** made durable before the next step: it
    /// is written with the operation's next durable write (the next ordinary step, a sleep or
    /// wait, the outcome), or at a step boundary once deferred rows have waited
    /// [`DEFERRED_FLUSH_AFTER`](super::DEFERRED_FLUSH_AFTER) or number [`DEFERRED_MAX_ROWS`](super::DEFERRED_MAX_ROWS). What a crash costs: every
    /// deferred step finished since that write runs again on recovery. Use it only for work
    /// that is cheap and safe to redo (parsing, pure computation, an idempotent local read),
    /// never for a model or tool call: those always go through [`JobContext::model`] and
    /// [`JobContext::call`], which are durable.
    pub async fn deferred_step<T, F, Fut>(&self, name: &str, f: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
    {
        let spec = StepSpec {
            deferred: true,
            ..StepSpec::new(name, StepKind::Custom, Replay::Safe)
        };
        self.run_step_with(
            spec,
            None,
            |_key| async move { f().await.map(|v| (v, None)) },
        )
        .await
    }

    /// Calls the model as a replay-safe step, through the worker's gate (its breaker, limits
    /// and budgets); token usage is journaled with it. `request` is a [`ModelRequest`], or a
    /// prompt (a `String` or `&str`: one user message).
    pub async fn model(
        &self,
        name: &str,
        request: impl Into<ModelRequest>,
    ) -> Result<ModelResponse, JobError> {
        let request = request.into();
        let model = self.inner.services.model.clone();
        let kind = self.inner.info.kind.clone();
        let spec = StepSpec::new(name, StepKind::Model, Replay::Safe);
        let ctx = self.clone();
        self.run_step_with(spec, None, |_key| async move {
            // Its estimate is held against the operation's budgets and reserved in its rate
            // limits before it is sent; a refusal stops the run here, with nothing journaled
            // for this step.
            let (holds, slots) = ctx.hold_call(&request).await?;
            let retry_in_step = JobContext::retry_in_step(&holds);
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

    /// Calls a typed tool as a step named after it, with its replay policy: a safe tool as
    /// [`JobContext::step`], an unsafe one as [`JobContext::unsafe_step`] with the tool's
    /// [`TypedTool::reconcile`]. `args` must be what the code would pass again on a replay.
    pub async fn call<T: TypedTool>(&self, tool: &T, args: T::Args) -> Result<T::Output, JobError> {
        let args = serde_json::to_value(&args).map_err(|e| {
            JobError::NonRetryable(format!(
                "the arguments of tool {:?} are not JSON: {e}",
                T::NAME
            ))
        })?;
        let output = self.tool(tool, args).await?;
        serde_json::from_value(output).map_err(|e| {
            JobError::from(Engine::Nondeterminism(format!(
                "tool {:?} recorded an output of another shape: {e}",
                T::NAME
            )))
        })
    }

    /// Calls a tool over JSON values (one the model chose, or one found by name with
    /// [`JobContext::registered_tool`]) as a step with the tool's replay policy. If a crash left
    /// an unsafe call's outcome unknown, recovery asks [`Tool::reconcile`] before deciding
    /// anything.
    pub async fn tool(&self, tool: &dyn Tool, args: Value) -> Result<Value, JobError> {
        self.tool_step(tool, args, false).await
    }

    /// Like [`JobContext::tool`], but a non-retryable error of the tool is the step's recorded
    /// output (`{"error": …}`) rather than a failure: the agent loop reports it to the model, and
    /// a replay returns the same report without calling the tool again.
    pub(crate) async fn tool_reporting_errors(
        &self,
        tool: &dyn Tool,
        args: Value,
    ) -> Result<Value, JobError> {
        self.tool_step(tool, args, true).await
    }

    async fn tool_step(
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
                    self.effect_happened(&key, output);
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

    /// An unsafe step whose reconcile may be missing: [`JobContext::unsafe_step`]'s, and a
    /// remote kind's (`crate::remote`), whose service runs the effect and answers whether it
    /// happened. The same runner as [`JobContext::tool`]: `started` is durable before `f`
    /// runs, a crash that lost its outcome asks `reconcile` (or fails closed without one).
    pub(crate) async fn unsafe_step_with<'a, T, F, Fut>(
        &self,
        name: &str,
        reconcile: Option<Reconcile<'a>>,
        f: F,
    ) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
    {
        let spec = StepSpec::new(name, StepKind::Custom, Replay::Unsafe);
        self.run_step_with(spec, reconcile, |key| async move {
            self.effect_begins(&key, name, Replay::Unsafe)?;
            let output = f(key.clone()).await?;
            self.effect_happened(&key, &output);
            Ok((output, None))
        })
        .await
    }

    /// What a tool call of this operation knows: the step's key, the operation, the worker's
    /// pool and origins.
    fn tool_context<'a>(&'a self, key: &'a str) -> ToolContext<'a> {
        ToolContext {
            info: &self.inner.info,
            key,
            pool: &self.inner.services.pool,
            http_allow: &self.inner.services.http_allow,
            provided: &self.inner.services.provided,
        }
    }

    /// The current time, journaled so a replay sees the same value.
    pub async fn now(&self) -> Result<DateTime<Utc>, JobError> {
        let spec = StepSpec::new("now", StepKind::Now, Replay::Safe);
        self.run_step_with(spec, None, |_| async { Ok((Utc::now(), None)) })
            .await
    }

    /// A random UUID, journaled so a replay sees the same value.
    pub async fn uuid(&self) -> Result<uuid::Uuid, JobError> {
        let spec = StepSpec::new("uuid", StepKind::Now, Replay::Safe);
        self.run_step_with(spec, None, |_| async { Ok((uuid::Uuid::new_v4(), None)) })
            .await
    }

    /// Runs the step `spec` at the next journal position, inside its span: what the journal
    /// recorded there decides whether it runs at all ([`JobContext::resume_step`]); if it
    /// runs, [`JobContext::begin_step`] makes what must be durable before it durable, `f` does
    /// its work (given the step's idempotency key), and [`JobContext::end_step`] records how
    /// it ended.
    pub(super) async fn run_step_with<'a, T, F, Fut>(
        &self,
        spec: StepSpec<'_>,
        reconcile: Option<Reconcile<'a>>,
        f: F,
    ) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
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
        T: DeserializeOwned,
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
                return serde_json::from_value(out)
                    .map(Resumed::Recorded)
                    .map_err(|e| {
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
                let value: T = serde_json::from_value(output.clone()).map_err(|e| {
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
        T: Serialize,
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
                let output = serde_json::to_value(&value).map_err(|e| {
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

/// What the journal's record at a step's position decided ([`JobContext::resume_step`]).
enum Resumed<T> {
    /// The step's output, recorded by an earlier run (or found by a reconcile): it does not run.
    Recorded(T),
    /// The step runs; `fresh`: nothing is recorded at its position yet.
    Run { fresh: bool },
}
