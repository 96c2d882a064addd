//! The job context: the handle a kind's function receives ([`JobContext`]), and the one
//! interface under it ([`Backend`]).
//!
//! The handle is a thin value: every call turns into a call of its backend, with the step's
//! closures boxed and its output as JSON. Two backends exist: the worker's, which runs the
//! operation over PostgreSQL (the claim, lane slots, the model gate, budgets and rate limits,
//! the group-committed journal), and the replay tester's, the same runner over a journal in
//! memory. Kinds never see which one they have.
//!
//! Execution is replay. Every `ctx` call takes the next position in the operation's journal;
//! if the journal has a completed entry there, the recorded output is returned without doing
//! the work.
//!
//! What is durable when (the worker's backend):
//! - every finished step (model and tool calls, [`JobContext::step`] and
//!   [`JobContext::unsafe_step`], `now`, `uuid`, a reconciled outcome) is committed to the
//!   journal before the next step of its operation starts; the last one commits with the
//!   operation's outcome. A crash costs at most the step that was running, plus a step that
//!   had returned but whose operation had not yet started another (job code between two
//!   steps: keep it short);
//! - an unsafe step runs only after its `started` row has committed;
//! - the one opt-in exception is [`JobContext::deferred_step`], for work that is cheap to
//!   redo: its row waits for the next durable write, and a crash before then runs it again.

use std::future::Future;
use std::sync::Arc;

use agentq_core::origins::Origins;
use agentq_core::state::StepStatus;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Engine, JobError};
use crate::info::OperationInfo;
use crate::model::{ModelRequest, ModelResponse};
use crate::provided::Provided;
use crate::tool::{Reconciled, Replay, Tool, TypedTool};

/// The longest a sleep or a wait may last: 100 years. Longer ones (a duration typed with too
/// many digits) are refused: their wake time would overflow, or fall past what PostgreSQL
/// stores.
pub const MAX_PARK: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

/// Checks a sleep's or wait's length against [`MAX_PARK`]; the error names `field` and the
/// limit. Kinds call it on their inputs so a producer's too-long duration is refused at
/// enqueue.
pub fn check_park(field: &str, d: std::time::Duration) -> Result<(), String> {
    check_park_length(d).map_err(|e| format!("{field}: {e}"))
}

/// [`check_park`] for a caller that names the field itself (a decoder whose errors carry
/// their place).
pub fn check_park_length(d: std::time::Duration) -> Result<(), String> {
    if d > MAX_PARK {
        return Err(format!(
            "{} s is longer than the longest sleep or wait, 100 years ({} s)",
            d.as_secs(),
            MAX_PARK.as_secs()
        ));
    }
    Ok(())
}

/// The wake time `d` from now, or a non-retryable error naming `what` past [`MAX_PARK`].
#[doc(hidden)]
pub fn wake_after(what: &str, d: std::time::Duration) -> Result<DateTime<Utc>, JobError> {
    check_park(what, d).map_err(JobError::NonRetryable)?;
    // Within MAX_PARK both conversions and the sum are in range.
    Ok(Utc::now() + chrono::Duration::from_std(d).unwrap_or_default())
}

/// How a wait for a signal ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SignalOutcome {
    /// The signal arrived in time.
    Received {
        payload: Value,
        sent_by: Option<String>,
    },
    /// The timeout passed first.
    TimedOut,
}

impl SignalOutcome {
    /// The outcome a wait step's journaled output records.
    #[doc(hidden)]
    pub fn from_journal(output: &Value) -> Self {
        if output.get("timed_out").and_then(Value::as_bool) == Some(true) {
            SignalOutcome::TimedOut
        } else {
            SignalOutcome::Received {
                payload: output.get("payload").cloned().unwrap_or(Value::Null),
                sent_by: output
                    .get("sent_by")
                    .and_then(Value::as_str)
                    .map(str::to_string),
            }
        }
    }
}

/// How a child operation ended, as [`JobContext::join`] returns it (and journals it).
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct ChildOutcome {
    pub op_id: uuid::Uuid,
    pub kind: String,
    /// `succeeded`, `dead`, `cancelled` or `discarded`.
    pub status: agentq_core::state::Status,
    /// What it returned, if it succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why it failed (its error class and message), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_class: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
}

impl ChildOutcome {
    /// Whether the child succeeded.
    pub fn succeeded(&self) -> bool {
        self.status == agentq_core::state::Status::Succeeded
    }
}

/// A step's body: given the step's idempotency key, its output as JSON.
#[doc(hidden)]
pub type Body<'a> = Box<dyn FnOnce(String) -> BoxFuture<'a, Result<Value, JobError>> + Send + 'a>;

/// Asks whether the unsafe call with this idempotency key already happened.
#[doc(hidden)]
pub type Reconcile<'a> =
    Box<dyn FnOnce(String) -> BoxFuture<'a, Result<Reconciled, JobError>> + Send + 'a>;

/// A step of a kind's own ([`JobContext::step`], [`JobContext::unsafe_step`],
/// [`JobContext::deferred_step`]), as its backend runs it.
#[doc(hidden)]
pub struct Step<'r, 'b> {
    pub name: &'b str,
    /// `Unsafe`: its `started` row is durable before `body` runs, and a crash that lost its
    /// outcome asks `reconcile` (or fails closed without one).
    pub replay: Replay,
    /// Its row may wait for the operation's next durable write.
    pub deferred: bool,
    pub reconcile: Option<Reconcile<'r>>,
    pub body: Body<'b>,
}

/// What a [`JobContext`] asks of the run under it: journal a step, call the model through
/// the gate, guard a tool call, park and wait, spawn and join. The worker implements it over
/// PostgreSQL, the replay tester over memory; a kind never calls it.
#[doc(hidden)]
#[async_trait]
pub trait Backend: Send + Sync {
    /// The operation being run.
    fn info(&self) -> &OperationInfo;
    /// The origins outbound calls may reach.
    fn http_allow(&self) -> Arc<Origins>;
    /// The deployment's own state.
    fn provided(&self) -> &Provided;
    /// The deployment's tool registered as `name`.
    fn registered_tool(&self, name: &str) -> Option<Arc<dyn Tool>>;
    /// The idempotency key of the step running now.
    fn idempotency_key(&self) -> Option<String>;
    /// See [`JobContext::peek_recorded`].
    fn peek_recorded(&self) -> Option<(String, StepStatus)>;
    /// See [`JobContext::skip_recorded`].
    fn skip_recorded(&self) -> bool;
    /// See [`JobContext::patched`].
    fn patched(&self, change_id: &str) -> Result<bool, JobError>;

    /// Runs `step` at the next journal position: its recorded output (`Some`), or `None`
    /// when its body ran now (the body kept what it returned).
    async fn step<'r, 'b>(&'b self, step: Step<'r, 'b>) -> Result<Option<Value>, JobError>;
    /// A model call as a replay-safe step.
    async fn model(&self, name: &str, request: ModelRequest) -> Result<ModelResponse, JobError>;
    /// A tool call as a step with the tool's replay policy; `report_errors`: a non-retryable
    /// error of the tool is the step's output (`{"error": …}`), for the agent loop.
    async fn tool<'a>(
        &'a self,
        tool: &'a dyn Tool,
        args: Value,
        report_errors: bool,
    ) -> Result<Value, JobError>;
    /// The current time, journaled.
    async fn now(&self) -> Result<DateTime<Utc>, JobError>;
    /// A random UUID, journaled.
    async fn uuid(&self) -> Result<uuid::Uuid, JobError>;
    /// A durable sleep until `until`.
    async fn sleep_until(&self, until: DateTime<Utc>) -> Result<(), JobError>;
    /// A wait for the signal `name`.
    async fn wait_for_signal(
        &self,
        name: &str,
        timeout: std::time::Duration,
        about: Value,
    ) -> Result<SignalOutcome, JobError>;
    /// A child operation stored.
    async fn spawn(&self, kind: &str, input: Value) -> Result<uuid::Uuid, JobError>;
    /// A wait for children.
    async fn join(&self, children: &[uuid::Uuid]) -> Result<Vec<ChildOutcome>, JobError>;
}

/// The handle a job function receives. Cheap to clone; all clones share one journal cursor.
///
/// Every call is a step of the operation's journal: on a restart the function runs again from
/// the top and each completed step returns its recorded output instead of running again (see
/// the module docs for what is durable when).
///
/// ```no_run
/// use std::time::Duration;
///
/// use agentq_sdk::{JobContext, JobError, SignalOutcome};
///
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct Review {
///     doc: String,
/// }
///
/// async fn review(ctx: JobContext, input: Review) -> Result<String, JobError> {
///     // A model call: journaled with its token usage, never repeated once recorded.
///     let summary = ctx.model("summarize", input.doc).await?;
///     // Pure work worth keeping: a replay-safe step.
///     let words = ctx
///         .step("count", || async { Ok(summary.content.split_whitespace().count()) })
///         .await?;
///     // Park until a human answers (holding no worker), at most a day.
///     match ctx.wait_for_signal("approval", Duration::from_secs(86_400)).await? {
///         SignalOutcome::Received { payload, .. } if payload["approved"] == true => {
///             Ok(format!("approved: {words} words"))
///         }
///         _ => Err(JobError::non_retryable("not approved")),
///     }
/// }
/// ```
#[derive(Clone)]
pub struct JobContext {
    backend: Arc<dyn Backend>,
}

/// A step's output as JSON, or a non-retryable error naming the step.
fn to_json<T: Serialize>(name: &str, value: &T) -> Result<Value, JobError> {
    serde_json::to_value(value).map_err(|e| {
        JobError::NonRetryable(format!("step {name:?} output is not serializable: {e}"))
    })
}

/// A recorded output read back as the step's type: a misfit means the code changed under the
/// journal.
fn from_recorded<T: DeserializeOwned>(name: &str, value: Value) -> Result<T, JobError> {
    serde_json::from_value(value).map_err(|e| {
        JobError::from(Engine::Nondeterminism(format!(
            "step {name:?} recorded an output of another shape: {e}"
        )))
    })
}

impl JobContext {
    /// The handle over `backend` (made by the worker and the replay tester).
    #[doc(hidden)]
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self { backend }
    }

    /// The operation being run.
    pub fn info(&self) -> &OperationInfo {
        self.backend.info()
    }

    /// The origins the operator allows outbound calls to (`AGENTQ_AGENT_HTTP_ALLOW`). The
    /// worker makes no HTTP call for a kind, so it cannot enforce the list: a kind that calls
    /// out checks every URL with [`Origins::check`] before connecting (the built-in `http_get`
    /// tool and `triage`'s callback do, through `agentq_kinds::outbound`, which also connects
    /// only to the addresses it checked).
    pub fn http_allow(&self) -> Arc<Origins> {
        self.backend.http_allow()
    }

    /// The value of type `T` the deployment gave its registry (`Registry::provide`): its own
    /// database pool, HTTP client or configuration. An error (non-retryable) if it gave none:
    /// propagate it with `?`.
    pub fn state<T: Send + Sync + 'static>(&self) -> Result<&T, JobError> {
        self.backend.provided().get::<T>()
    }

    /// The tool the deployment registered as `name` (`Registry::register_tool`), to call with
    /// [`JobContext::tool`]. `None` when this worker's binary registers no such tool: fail the
    /// operation as non-retryable, naming it (the built-in `agent` kind does).
    pub fn registered_tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.backend.registered_tool(name)
    }

    /// The idempotency key of the step running now (`None` outside a step): stable across
    /// retries and crashes, so a tool can pass it downstream to make its effect happen once.
    /// The step closure also receives it as its argument.
    pub fn idempotency_key(&self) -> Option<String> {
        self.backend.idempotency_key()
    }

    /// Runs a step of the kind's own through the backend; its output as `T`, kept as the body
    /// returned it when the body ran, read back from the journal when it did not.
    async fn own_step<T, F, Fut>(
        &self,
        name: &str,
        replay: Replay,
        deferred: bool,
        reconcile: Option<Reconcile<'_>>,
        f: F,
    ) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(String) -> Fut + Send,
        Fut: Future<Output = Result<T, JobError>> + Send,
    {
        let mut kept: Option<T> = None;
        let slot = &mut kept;
        let body: Body<'_> = Box::new(move |key: String| {
            Box::pin(async move {
                let value = f(key).await?;
                let json = to_json(name, &value)?;
                *slot = Some(value);
                Ok(json)
            })
        });
        let step = Step {
            name,
            replay,
            deferred,
            reconcile,
            body,
        };
        match self.backend.step(step).await? {
            Some(recorded) => from_recorded(name, recorded),
            None => kept
                .ok_or_else(|| JobError::NonRetryable(format!("step {name:?} returned no output"))),
        }
    }

    /// A safe step: `f` runs here, once per completed journal entry; a replay returns its
    /// recorded output instead. Safe means running it again after a crash is harmless (a read,
    /// a computation, an idempotent write). Its row is committed before the next step of the
    /// operation starts (or with the outcome).
    ///
    /// ```no_run
    /// # async fn f(ctx: agentq_sdk::JobContext) -> Result<(), agentq_sdk::JobError> {
    /// let words = ctx.step("count", || async { Ok("a b c".split(' ').count()) }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn step<T, F, Fut>(&self, name: &str, f: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = Result<T, JobError>> + Send,
    {
        self.own_step(name, Replay::Safe, false, None, |_key| f())
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
    /// # async fn pay(key: &str) -> Result<u64, agentq_sdk::JobError> { Ok(1) }
    /// # async fn find_payment(key: &str) -> Result<Option<u64>, agentq_sdk::JobError> { Ok(None) }
    /// # async fn f(ctx: agentq_sdk::JobContext) -> Result<(), agentq_sdk::JobError> {
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
        F: FnOnce(String) -> Fut + Send,
        Fut: Future<Output = Result<T, JobError>> + Send,
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
        self.own_step(name, Replay::Unsafe, false, Some(ask), f)
            .await
    }

    /// A safe step whose journal row is **not** made durable before the next step: it
    /// is written with the operation's next durable write (the next ordinary step, a sleep or
    /// wait, the outcome), or at a step boundary once deferred rows have waited a while or
    /// grown many (the worker's `DEFERRED_FLUSH_AFTER`, `DEFERRED_MAX_ROWS`). What a crash
    /// costs: every deferred step finished since that write runs again on recovery. Use it
    /// only for work that is cheap and safe to redo (parsing, pure computation, an idempotent
    /// local read), never for a model or tool call: those always go through
    /// [`JobContext::model`] and [`JobContext::call`], which are durable.
    pub async fn deferred_step<T, F, Fut>(&self, name: &str, f: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = Result<T, JobError>> + Send,
    {
        self.own_step(name, Replay::Safe, true, None, |_key| f())
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
        self.backend.model(name, request.into()).await
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
        self.backend.tool(tool, args, false).await
    }

    /// Like [`JobContext::tool`], but a non-retryable error of the tool is the step's recorded
    /// output (`{"error": …}`) rather than a failure: the agent loop reports it to the model, and
    /// a replay returns the same report without calling the tool again.
    pub(crate) async fn tool_reporting_errors(
        &self,
        tool: &dyn Tool,
        args: Value,
    ) -> Result<Value, JobError> {
        self.backend.tool(tool, args, true).await
    }

    /// The current time, journaled so a replay sees the same value.
    pub async fn now(&self) -> Result<DateTime<Utc>, JobError> {
        self.backend.now().await
    }

    /// A random UUID, journaled so a replay sees the same value.
    pub async fn uuid(&self) -> Result<uuid::Uuid, JobError> {
        self.backend.uuid().await
    }

    /// A durable sleep: the operation parks as `sleeping`, the worker lets go of it, and the
    /// scheduler wakes it after `duration` (measured from the first execution, journaled).
    pub async fn sleep(&self, duration: std::time::Duration) -> Result<(), JobError> {
        self.backend
            .sleep_until(wake_after("sleep", duration)?)
            .await
    }

    /// A durable sleep until `until` (journaled at first execution; replay after the wake-up
    /// returns at once).
    pub async fn sleep_until(&self, until: DateTime<Utc>) -> Result<(), JobError> {
        self.backend.sleep_until(until).await
    }

    /// Waits for the signal `name` (a human approval, an outside event) for at most `timeout`:
    /// the operation parks as `waiting`, holding no worker. A signal sent before the wait starts
    /// is delivered when it does. A signal and the timeout that race are decided once, in one
    /// write: the signal wins if it was received by the deadline.
    pub async fn wait_for_signal(
        &self,
        name: &str,
        timeout: std::time::Duration,
    ) -> Result<SignalOutcome, JobError> {
        self.backend
            .wait_for_signal(name, timeout, Value::Null)
            .await
    }

    /// [`wait_for_signal`](Self::wait_for_signal), saying what the job needs from whoever
    /// sends the signal: `about` (any JSON, e.g. `{"question": "ship it?", "amount": 120}`) is
    /// journaled with the wait step, in the same write that parks, and shown wherever a person
    /// decides (`agentq status`, `GET /v1/operations/{id}`'s `waiting`, the console's approvals
    /// and operation pages, the wait's event). It is recorded once: a replay of the wait keeps
    /// the first run's `about` whatever this run passes. Keys named in
    /// `AGENTQ_CONSOLE_REDACT` are shown as `[redacted]`; it is never logged. `Value::Null`
    /// says nothing (plain `wait_for_signal`).
    pub async fn wait_for_signal_about(
        &self,
        name: &str,
        timeout: std::time::Duration,
        about: Value,
    ) -> Result<SignalOutcome, JobError> {
        self.backend.wait_for_signal(name, timeout, about).await
    }

    /// Starts a child operation of `kind` with `input` and returns its id, without waiting for
    /// it ([`JobContext::join`] waits). The child belongs to this operation's tenant and takes
    /// its lane, attempt budget and trace; cancelling this operation cancels it.
    ///
    /// Journaled: a replay returns the same child, never a second one. A crash after the child
    /// was stored but before the step was journaled runs the step again, and its dedupe key
    /// (`child:` and the step's idempotency key) finds the child the first run stored.
    /// The kind and input are checked as an enqueue checks them: a misfit fails this
    /// operation (non-retryable), and nothing is stored.
    pub async fn spawn(&self, kind: &str, input: Value) -> Result<uuid::Uuid, JobError> {
        self.backend.spawn(kind, input).await
    }

    /// Waits until every one of `children` (ids [`JobContext::spawn`] returned) has finished
    /// and returns how each ended, in the order given: a child that died or was cancelled is
    /// an outcome to handle, not an error of this operation. While any is unfinished the
    /// operation parks as `waiting` (holding no worker, like a wait for a signal) and the
    /// scheduler queues it once they all are. Journaled: a replay returns the same outcomes.
    pub async fn join(&self, children: &[uuid::Uuid]) -> Result<Vec<ChildOutcome>, JobError> {
        self.backend.join(children).await
    }

    /// The name and status (`completed`, `started`, `unknown`) of the journal's next step if an
    /// earlier run of this operation recorded it and it did not fail; `None` where the journal
    /// ends or the step failed (it will run fresh). Takes no step and writes nothing.
    ///
    /// For a kind that must tell a replayed decision from a fresh one (`doc_migration`: a
    /// failed review recorded by an earlier run means this run is an operator's retry, so it
    /// reviews anew), or that passes over a stale part of its journal with
    /// [`JobContext::skip_recorded`]. It reads the journal as loaded when this run claimed the
    /// operation, at the cursor every clone of this context shares.
    pub fn peek_recorded(&self) -> Option<(String, StepStatus)> {
        self.backend.peek_recorded()
    }

    /// Passes over the journal's next step without replaying or running it, if
    /// [`JobContext::peek_recorded`] finds one there; returns whether it did. Where none is
    /// recorded it does nothing, so the steps that follow never leave a gap in the journal.
    ///
    /// For a kind whose input an operator patched (`agentq dlq retry --patch-input`) so that a
    /// part of its journal no longer applies: it passes over that part and runs it anew under
    /// the next step numbers; the rows passed over stay in the journal as they are. Decide what
    /// to skip only from recorded outputs and the input, so every later replay skips the same
    /// steps (a step asked for where the journal recorded another is `nondeterminism`).
    pub fn skip_recorded(&self) -> bool {
        self.backend.skip_recorded()
    }

    /// Whether this run may take the code path of the change `change_id` (the Temporal idea,
    /// in agentq's journal). Put a change to a kind's steps that operations already running
    /// must not see behind it, without bumping the kind's version:
    ///
    /// ```ignore
    /// if ctx.patched("fetch-before-review")? {
    ///     ctx.step("fetch", || fetch()).await?;
    /// }
    /// ```
    ///
    /// - On a first execution of this point it returns true and records a marker step, so
    ///   every later replay returns true again.
    /// - Replaying a journal recorded before the patch (another step where the marker would
    ///   be) it returns false and takes nothing from the journal: the old path replays what the
    ///   old code recorded. Every later replay reads the same journal and agrees.
    /// - Where the journal ends here (the old code never got this far), this is a first
    ///   execution: true.
    ///
    /// Once `agentq versions` shows no unfinished operation older than the patch, delete the
    /// old path and keep the call, or delete the call too: a marker nothing asks for is passed
    /// over.
    pub fn patched(&self, change_id: &str) -> Result<bool, JobError> {
        self.backend.patched(change_id)
    }
}
