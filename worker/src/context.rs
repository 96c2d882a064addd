//! The job context: the API a job function uses to do durable work.
//!
//! Execution is replay. Every `ctx` call takes the next sequence number; if the journal has a
//! completed entry for it, the recorded output is returned without doing the work.
//!
//! What is durable when:
//! - every finished step (model and tool calls, [`JobContext::step`] of either replay policy,
//!   `now`, `uuid`, a reconciled outcome) is committed to the journal before the next step of
//!   its operation starts; the last one commits with the operation's outcome. A crash costs at
//!   most the step that was running, plus a step that had returned but whose operation had not
//!   yet started another (job code between two steps: keep it short);
//! - an unsafe step runs only after its `started` row has committed;
//! - the one opt-in exception is [`JobContext::deferred_step`], for work that is cheap to redo:
//!   its row waits for the next durable write (or [`DEFERRED_FLUSH_AFTER`]), and a crash before
//!   then runs it again.
//!
//! Journal writes go through the worker's group commit (`group_commit.rs`): the rows of every
//! operation that finished a step meanwhile share one fenced statement, and each step waits for
//! its own commit. Every write is fenced by the claim's epoch; a lost lease turns into
//! [`JobError::LeaseLost`].

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentq_core::db::{self, JournalEntry, StepWrite};
use agentq_core::dispatch::{Dispatcher, Target};
use agentq_core::metrics;
use agentq_core::operation::step_idempotency_key;

use agentq_core::origins::Origins;
use agentq_core::state::replay::{Recorded, Resume, resume};
use agentq_core::state::{StepKind, StepStatus};

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::JobError;
use crate::gate::ModelGate;
use crate::group_commit::GroupCommit;
pub use crate::info::OperationInfo;
use crate::model::{ModelRequest, ModelResponse};
use crate::tool::{Reconciled, Replay, Tool, ToolContext};

/// Asks a tool whether a call with this idempotency key already happened.
type Reconcile<'a> =
    Box<dyn FnOnce(String) -> BoxFuture<'a, Result<Reconciled, JobError>> + Send + 'a>;

/// Deferred steps' rows older than this are written at the next step boundary even when no
/// durable write is due, so a long run of deferred steps does not lose much work to a crash.
pub const DEFERRED_FLUSH_AFTER: Duration = Duration::from_secs(5);
/// Deferred steps' rows held at most; past this many they are written at the next boundary.
pub const DEFERRED_MAX_ROWS: usize = 64;

/// The longest a sleep or a wait may last: 100 years. Longer ones (a duration typed with too
/// many digits) are refused: their wake time would overflow, or fall past what PostgreSQL
/// stores.
pub const MAX_PARK: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

/// Checks a sleep's or wait's length against [`MAX_PARK`]; the error names `field` and the
/// limit. Kinds call it on their inputs so a producer's too-long duration is refused at
/// enqueue.
pub fn check_park(field: &str, d: std::time::Duration) -> Result<(), String> {
    if d > MAX_PARK {
        return Err(format!(
            "{field}: {} s is longer than the longest sleep or wait, 100 years ({} s)",
            d.as_secs(),
            MAX_PARK.as_secs()
        ));
    }
    Ok(())
}

/// The wake time `d` from now, or a non-retryable error past [`MAX_PARK`].
fn wake_after(what: &str, d: std::time::Duration) -> Result<DateTime<Utc>, JobError> {
    check_park(what, d).map_err(JobError::NonRetryable)?;
    // Within MAX_PARK both conversions and the sum are in range.
    Ok(Utc::now() + chrono::Duration::from_std(d).unwrap_or_default())
}

/// What a step is, for the journal and its span.
#[derive(Clone, Copy)]
struct StepSpec<'a> {
    name: &'a str,
    kind: StepKind,
    replay: Replay,
    /// Written with the next durable write instead of before the next step starts.
    deferred: bool,
}

impl<'a> StepSpec<'a> {
    fn new(name: &'a str, kind: StepKind, replay: Replay) -> Self {
        Self {
            name,
            kind,
            replay,
            deferred: false,
        }
    }

    /// The journal row of this step at `seq` with `status`, nothing recorded yet.
    fn row(&self, seq: i32, key: &str, status: StepStatus, started_at: DateTime<Utc>) -> StepWrite {
        StepWrite {
            seq,
            name: self.name.to_string(),
            kind: self.kind,
            replay: self.replay,
            idempotency_key: key.to_string(),
            status,
            output: None,
            error: None,
            started_at,
            completed_at: None,
            usage: None,
            wake_at: None,
        }
    }
}

/// The journal's entry at `seq`: the journal is in seq order (as loaded, and as a rebase
/// leaves it), so a lookup is a binary search, and a replay of n steps costs O(n log n), not
/// O(n²).
fn entry_at(journal: &[JournalEntry], seq: i32) -> Option<&JournalEntry> {
    journal
        .binary_search_by_key(&seq, |e| e.seq)
        .ok()
        .map(|i| &journal[i])
}

/// The bytes a journal row's output and error take as JSON, counted without building the text.
fn row_bytes(output: Option<&Value>, error: Option<&str>) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    if let Some(v) = output {
        // Writing a `Value` to a sink that never fails cannot fail.
        let _ = serde_json::to_writer(&mut count, v);
    }
    count.0 + error.map_or(0, |e| e.len() as u64)
}

/// A journal entry as the replay decision sees it, for the step `name` of `kind` asked now.
fn recorded_as(entry: &JournalEntry, name: &str, kind: StepKind) -> Recorded {
    Recorded {
        status: entry.status,
        replay: entry.replay,
        same_step: entry.name == name && entry.kind == kind,
    }
}

/// The error of a job asking for another step than its journal recorded at `seq`.
fn diverged(seq: i32, entry: Option<&JournalEntry>, name: &str, kind: StepKind) -> JobError {
    let (was, was_kind) = entry.map_or(("?", "?"), |e| (e.name.as_str(), e.kind.as_str()));
    JobError::Nondeterminism(format!(
        "step {seq} was recorded as {was:?} ({was_kind}) but the job now asks for {name:?} ({kind})"
    ))
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
    fn from_journal(output: &Value) -> Self {
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

/// Test hook (`AGENTQ_TEST_SPAWN_PAUSE_MS`): how long a spawn waits after storing its child
/// and before its step is journaled, so a crash test can kill a worker in that window.
fn spawn_pause() -> Option<Duration> {
    static PAUSE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *PAUSE.get_or_init(|| {
        std::env::var("AGENTQ_TEST_SPAWN_PAUSE_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map(Duration::from_millis)
    })
}

/// The caps a job's steps obey (`AGENTQ_MAX_CHILDREN`, `AGENTQ_TENANT_MAX_UNFINISHED`,
/// `AGENTQ_JOURNAL_MAX_STEPS`, `AGENTQ_JOURNAL_MAX_BYTES`).
#[derive(Clone, Copy, Debug)]
pub struct JobLimits {
    /// Children one operation may spawn.
    pub max_children: i64,
    /// Unfinished operations a tenant may have; a spawn past it waits.
    pub tenant_max_unfinished: i64,
    /// Journal rows one operation may record: the step at this position fails the operation.
    pub journal_max_steps: i64,
    /// Bytes of step outputs and errors (as JSON) one journal may hold: once past it, the next
    /// step fails the operation.
    pub journal_max_bytes: i64,
}

impl Default for JobLimits {
    fn default() -> Self {
        Self {
            max_children: 10_000,
            tenant_max_unfinished: 100_000,
            journal_max_steps: 10_000,
            journal_max_bytes: 64 << 20,
        }
    }
}

/// Checks a child's kind and input before it is spawned (the worker's registry), returning
/// what the input requires beyond its shape, as an enqueue's check does.
pub(crate) type ChildCheck =
    Box<dyn Fn(&str, &Value) -> Result<agentq_core::operation::Requires, String> + Send + Sync>;

struct State {
    /// The journal as loaded at claim time, indexed by seq.
    journal: Vec<JournalEntry>,
    next_seq: i32,
    /// Rows not yet written, and since when the oldest has waited.
    pending: Vec<StepWrite>,
    pending_since: Option<Instant>,
    /// A pending row must be durable before the next step starts (every row but a
    /// [`JobContext::deferred_step`]'s).
    pending_durable: bool,
    /// The step that failed, if the job fails.
    failed_step: Option<i32>,
    /// Idempotency key of the step running now.
    current_key: Option<String>,
    /// Set when the job parks itself: wake time, and the signal waited for.
    suspend: Option<(DateTime<Utc>, Option<String>)>,
    /// Set by an operator's upgrade: where the code first asks for another step than the
    /// journal recorded at or before this position, the journal is rebased there.
    upgrade_through: Option<i32>,
    /// The `unknown` row of the unsafe step whose call is in flight: written if the run is
    /// stopped in the middle of it (a cancel, a deadline), since its effect may have happened.
    in_flight: Option<StepWrite>,
    /// Bytes of the journal's outputs and errors as JSON: as loaded, plus every row pushed
    /// since (an estimate from above: a row replaced before its write is counted twice).
    journal_bytes: u64,
}

/// What every job's context shares with its worker: only what steps use (the context never
/// sees the registry, the leases or the completion writer).
pub(crate) struct Services {
    /// agentq's database: the journal's waits, and [`JobContext::pool`].
    pub(crate) pool: PgPool,
    /// Handed to kinds by [`JobContext::http_allow`].
    pub(crate) http_allow: Arc<Origins>,
    /// Model calls, within the worker's limits and circuit breaker.
    pub(crate) model: Arc<ModelGate>,
    /// Writes finished steps (and unsafe starts), many operations per statement.
    pub(crate) journal: GroupCommit<db::StepBatch>,
    /// Whether a child's kind and input fit (`ctx.spawn`).
    pub(crate) check_child: ChildCheck,
    /// The deployment's registered tools ([`JobContext::registered_tool`]).
    pub(crate) tools: std::collections::BTreeMap<String, Arc<dyn Tool>>,
    /// Publishes spawned children's pointers; opened on the first spawn.
    pub(crate) children: std::sync::OnceLock<Dispatcher>,
    /// Where `children` connects to.
    pub(crate) amqp_url: String,
    pub(crate) names: agentq_core::broker::Names,
    /// The caps a spawn obeys.
    pub(crate) limits: JobLimits,
    /// Tenants' counts of unfinished operations, as the spawn cap reads them.
    pub(crate) counts: std::sync::Mutex<std::collections::HashMap<String, (Instant, i64)>>,
    /// Set only by the replay tester ([`crate::testing`]): the journal, waits and children live
    /// in memory there instead of PostgreSQL, and it watches every step and tool call.
    pub(crate) memory: Option<Arc<dyn crate::store::Store>>,
}

impl Services {
    /// Checks a child as an enqueue checks an operation: its kind, its input against the kind
    /// and its size, and the stores the input names (the parent's tenant must have them). A
    /// kind that runs only for webhook deliveries cannot be a child. A misfit is
    /// non-retryable; an unreachable database is not.
    async fn check_spawn(&self, tenant: &str, kind: &str, input: &Value) -> Result<(), JobError> {
        let refuse =
            |why: String| JobError::NonRetryable(format!("spawning a {kind:?} child: {why}"));
        let requires = (self.check_child)(kind, input).map_err(refuse)?;
        if requires.webhook_only {
            return Err(refuse(
                "the kind runs only for the deliveries of a webhook source".into(),
            ));
        }
        agentq_core::operation::check_input_size(input).map_err(refuse)?;
        if self.memory.is_none() {
            self.check_tenant_cap(tenant).await?;
        }
        if !requires.stores.is_empty() && self.memory.is_none() {
            let refusal = db::within(async {
                let mut conn = self.pool.acquire().await?;
                db::stores::refusal(&mut conn, tenant, &requires.stores).await
            })
            .await
            .map_err(|e| JobError::retryable(format!("checking a child's stores: {e}")))?;
            if let Some(why) = refusal {
                return Err(refuse(why));
            }
        }
        Ok(())
    }

    /// A spawn is an operation born: past its tenant's cap of unfinished operations the spawn
    /// waits (the parent parks as overloaded, its attempt given back, and tries again later).
    /// The count is at most a second old.
    async fn check_tenant_cap(&self, tenant: &str) -> Result<(), JobError> {
        let cap = self.limits.tenant_max_unfinished;
        let cached = {
            let counts = self.counts.lock().expect("counts lock");
            counts
                .get(tenant)
                .filter(|(at, _)| at.elapsed() < Duration::from_secs(1))
                .map(|(_, n)| *n)
        };
        let count = match cached {
            Some(n) => n,
            None => {
                let n = db::within(db::unfinished_count(&self.pool, tenant, cap))
                    .await
                    .map_err(|e| {
                        JobError::retryable(format!("counting the tenant's operations: {e}"))
                    })?;
                self.counts
                    .lock()
                    .expect("counts lock")
                    .insert(tenant.to_string(), (Instant::now(), n));
                n
            }
        };
        if count >= cap {
            return Err(JobError::Overloaded {
                message: format!(
                    "tenant {tenant:?} has {cap} or more unfinished operations, its cap \
                     (AGENTQ_TENANT_MAX_UNFINISHED): the spawn waits for some to finish"
                ),
                not_before: Some(Utc::now() + chrono::Duration::seconds(5)),
            });
        }
        Ok(())
    }

    /// Publishes a new child's pointer; if that fails the dispatch sweeper publishes it.
    async fn dispatch_child(&self, child: db::Dispatch) {
        let dispatcher = self.children.get_or_init(|| {
            Dispatcher::new(
                self.pool.clone(),
                &self.amqp_url,
                self.names.clone(),
                "worker",
            )
        });
        if let Err(e) = dispatcher.dispatch(&Target::from(child)).await {
            tracing::warn!(error = %e, "publishing a child's pointer failed; the dispatch sweeper will");
        }
    }
}

struct Inner {
    info: OperationInfo,
    services: Arc<Services>,
    state: Mutex<State>,
    lost: AtomicBool,
    stop: CancellationToken,
    /// Fired by the heartbeat when the operation must stop (a cancel, a passed deadline).
    cancel: CancellationToken,
    /// Set when fair shares ask it to give its slot back (`crate::share::Yield`).
    yielding: Arc<crate::share::Yield>,
}

/// The handle a job function receives. Cheap to clone; all clones share one journal cursor.
///
/// Every call is a step of the operation's journal: on a restart the function runs again from
/// the top and each completed step returns its recorded output instead of running again (see
/// the module docs for what is durable when).
///
/// ```
/// use std::time::Duration;
///
/// use agentq_worker::model::ModelRequest;
/// use agentq_worker::testing::{ModelScript, Tester};
/// use agentq_worker::{JobContext, JobError, ModelResponse, Registry, Replay, SignalOutcome};
///
/// #[derive(serde::Deserialize, schemars::JsonSchema)]
/// struct Review {
///     doc: String,
/// }
///
/// async fn review(ctx: JobContext, input: Review) -> Result<String, JobError> {
///     // A model call: journaled with its token usage, never repeated once recorded.
///     let summary = ctx.model("summarize", ModelRequest::user(input.doc)).await?;
///     // Pure work worth keeping: a replay-safe step.
///     let words = ctx
///         .step("count", Replay::Safe, |_key| async { Ok(summary.content.split_whitespace().count()) })
///         .await?;
///     // Park until a human answers (holding no worker), at most a day.
///     match ctx.wait_for_signal("approval", Duration::from_secs(86_400)).await? {
///         SignalOutcome::Received { payload, .. } if payload["approved"] == true => {
///             Ok(format!("approved: {words} words"))
///         }
///         _ => Err(JobError::NonRetryable("not approved".into())),
///     }
/// }
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let mut registry = Registry::new();
/// registry.register("review", review);
/// let report = Tester::new(&registry, "review", serde_json::json!({ "doc": "a long text" }))
///     .model(ModelScript::replies([ModelResponse::text("short text")]))
///     .signal("approval", serde_json::json!({ "approved": true }))
///     .run()
///     .await;
/// report.assert_ok();
/// assert_eq!(report.output(), Some(&serde_json::json!("approved: 2 words")));
/// # });
/// ```
#[derive(Clone)]
pub struct JobContext {
    inner: Arc<Inner>,
}

impl JobContext {
    pub(crate) fn new(
        info: OperationInfo,
        services: Arc<Services>,
        journal: Vec<JournalEntry>,
        upgrade_through: Option<i32>,
        stop: CancellationToken,
        cancel: CancellationToken,
        yielding: Arc<crate::share::Yield>,
    ) -> Self {
        let mut journal = journal;
        // Loaded in seq order; sorting again costs a pass and keeps `entry_at` correct for any caller.
        journal.sort_by_key(|e| e.seq);
        let journal_bytes = journal
            .iter()
            .map(|e| row_bytes(e.output.as_ref(), e.error.as_deref()))
            .sum();
        Self {
            inner: Arc::new(Inner {
                info,
                services,
                state: Mutex::new(State {
                    journal,
                    next_seq: 0,
                    pending: Vec::new(),
                    pending_since: None,
                    pending_durable: false,
                    failed_step: None,
                    current_key: None,
                    suspend: None,
                    upgrade_through,
                    in_flight: None,
                    journal_bytes,
                }),
                lost: AtomicBool::new(false),
                stop,
                cancel,
                yielding,
            }),
        }
    }

    /// The operation being run.
    pub fn info(&self) -> &OperationInfo {
        &self.inner.info
    }

    /// The worker's pool on agentq's PostgreSQL database, for a kind's own data: tables the
    /// kind keeps (the built-in `ledger` and `kv` tools' tables) and the stores an admin
    /// registered for the operation's tenant (`agentq_core::db::stores`, as `doc_migration`
    /// resolves them), through functions of `agentq_core::db`, which take a pool.
    ///
    /// The context journals and fences its own writes; what a kind does through this pool is
    /// the kind's to keep safe:
    /// - Nothing written here is fenced by the claim's epoch or journaled: a run whose lease
    ///   was lost may still be finishing a step. Read and write only inside a step
    ///   ([`JobContext::step`] or a [`Tool`]), so a replay returns the recorded output instead of
    ///   doing it again, and make each write idempotent (keyed by the step's idempotency key or
    ///   the operation id) for the run that repeats it after a crash.
    /// - It reaches every tenant's data and all of agentq's tables: scope every statement to
    ///   [`OperationInfo::tenant`], take a table or a path only from what an operator
    ///   registered (never from the input), and never write the tables operations run on
    ///   (`operations`, `operation_steps`, `signals`, `dead_letters`, …): only the worker's
    ///   runtime writes those, fenced by the epoch.
    /// - The pool is shared with the worker's claims, journal writes and heartbeats: use a
    ///   connection for a statement or a short transaction, never across a model call, a tool
    ///   call or a sleep.
    pub fn pool(&self) -> &PgPool {
        &self.inner.services.pool
    }

    /// The origins the operator allows outbound calls to (`AGENTQ_AGENT_HTTP_ALLOW`). The
    /// worker makes no HTTP call for a kind, so it cannot enforce the list: a kind that calls
    /// out checks every URL with [`Origins::check`] before connecting (the built-in `http_get`
    /// tool and `triage`'s callback do, through `agentq_kinds::outbound`, which also connects
    /// only to the addresses it checked).
    pub fn http_allow(&self) -> Arc<Origins> {
        self.inner.services.http_allow.clone()
    }

    /// The tool the deployment registered as `name`
    /// ([`Registry::register_tool`](crate::Registry::register_tool)), to call with
    /// [`JobContext::tool`]. `None` when this worker's binary registers no such tool: fail the
    /// operation as non-retryable, naming it (the built-in `agent` kind does).
    pub fn registered_tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.inner.services.tools.get(name).cloned()
    }

    /// The idempotency key of the step running now (`None` outside a step): stable across
    /// retries and crashes, so a tool can pass it downstream to make its effect happen once.
    /// The step closure also receives it as its argument.
    pub fn idempotency_key(&self) -> Option<String> {
        self.state().current_key.clone()
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
        let seq = self.state().next_seq;
        self.recorded(seq)
            .filter(|e| e.status != StepStatus::Failed)
            .map(|e| (e.name, e.status))
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
        let mut st = self.state();
        let seq = st.next_seq;
        let recorded = entry_at(&st.journal, seq).is_some_and(|e| e.status != StepStatus::Failed);
        if recorded {
            st.next_seq += 1;
        }
        recorded
    }

    /// Runs a journaled step. On replay a completed step returns its recorded output. Its row
    /// is committed before the next step of the operation starts (or with the outcome).
    pub async fn step<T, F, Fut>(&self, name: &str, replay: Replay, f: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
    {
        let spec = StepSpec::new(name, StepKind::Custom, replay);
        self.run_step_with(
            spec,
            None,
            |key| async move { f(key).await.map(|v| (v, None)) },
        )
        .await
    }

    /// A replay-safe step whose journal row is **not** made durable before the next step: it
    /// is written with the operation's next durable write (the next ordinary step, a sleep or
    /// wait, the outcome), or at a step boundary once deferred rows have waited
    /// [`DEFERRED_FLUSH_AFTER`] or number [`DEFERRED_MAX_ROWS`]. What a crash costs: every
    /// deferred step finished since that write runs again on recovery. Use it only for work
    /// that is cheap and safe to redo (parsing, pure computation, an idempotent local read),
    /// never for a model or tool call: those always go through [`JobContext::model`] and
    /// [`JobContext::tool`], which are durable.
    pub async fn deferred_step<T, F, Fut>(&self, name: &str, f: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
    {
        let spec = StepSpec {
            deferred: true,
            ..StepSpec::new(name, StepKind::Custom, Replay::Safe)
        };
        self.run_step_with(
            spec,
            None,
            |key| async move { f(key).await.map(|v| (v, None)) },
        )
        .await
    }

    /// Calls the model as a replay-safe step; token usage is journaled with it.
    pub async fn model(
        &self,
        name: &str,
        request: ModelRequest,
    ) -> Result<ModelResponse, JobError> {
        let model = self.inner.services.model.clone();
        let (tenant, kind) = (self.inner.info.tenant.clone(), self.inner.info.kind.clone());
        let spec = StepSpec::new(name, StepKind::Model, Replay::Safe);
        self.run_step_with(spec, None, |_key| async move {
            // The call's span names the model and how it ended; never the prompt or the answer.
            let span = tracing::info_span!(
                "model_call",
                otel.kind = "client",
                model = request.model.as_deref().unwrap_or("default"),
                outcome = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            let called =
                tracing::Instrument::instrument(model.call(&tenant, &kind, &request), span.clone())
                    .await;
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

    /// Calls a tool as a step with the tool's replay policy. If a crash left an unsafe call's
    /// outcome unknown, recovery asks [`Tool::reconcile`] before deciding anything.
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
                if let Some(memory) = &self.inner.services.memory {
                    memory.tool_called(&key, tool.name(), tool.replay())?;
                }
                let called = tracing::Instrument::instrument(
                    tool.call(&self.tool_context(&key), &args),
                    span.clone(),
                )
                .await;
                if let (Some(memory), Ok(output)) = (&self.inner.services.memory, &called) {
                    memory.tool_done(&key, output);
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
        ToolContext {
            info: &self.inner.info,
            key,
            pool: &self.inner.services.pool,
            http_allow: &self.inner.services.http_allow,
        }
    }

    /// A durable sleep: the operation parks as `sleeping`, the worker lets go of it, and the
    /// scheduler wakes it after `duration` (measured from the first execution, journaled).
    pub async fn sleep(&self, duration: std::time::Duration) -> Result<(), JobError> {
        let until = wake_after("sleep", duration)?;
        self.sleep_until(until).await
    }

    /// A durable sleep until `until` (journaled at first execution; replay after the wake-up
    /// returns at once).
    pub async fn sleep_until(&self, until: DateTime<Utc>) -> Result<(), JobError> {
        let (seq, key) = self.begin_park("sleep", StepKind::Sleep).await?;
        let wake_at = match self.recorded(seq) {
            Some(e) if e.status == StepStatus::Completed => return Ok(()),
            Some(e) => e.wake_at.unwrap_or(until),
            None => until,
        };
        let mut row = self.park_row(seq, "sleep", StepKind::Sleep, key, wake_at);
        if Utc::now() >= wake_at {
            row.status = StepStatus::Completed;
            row.completed_at = Some(Utc::now());
            self.push(row, true);
            return Ok(());
        }
        self.push(row, true);
        self.state().suspend = Some((wake_at, None));
        Err(JobError::Suspended)
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
        let step = format!("signal:{name}");
        let (seq, key) = self.begin_park(&step, StepKind::Signal).await?;
        let deadline = match self.recorded(seq) {
            Some(e) if e.status == StepStatus::Completed => {
                return Ok(SignalOutcome::from_journal(
                    &e.output.unwrap_or(Value::Null),
                ));
            }
            Some(e) => e.wake_at.unwrap_or_else(Utc::now),
            None => {
                let deadline = wake_after(&format!("wait for {name:?}"), timeout)?;
                // The wait step must exist before it can be resolved.
                self.push(
                    self.park_row(seq, &step, StepKind::Signal, key.clone(), deadline),
                    true,
                );
                self.flush().await?;
                deadline
            }
        };
        let info = &self.inner.info;
        let resolved = match &self.inner.services.memory {
            Some(memory) => memory.resolve_wait(seq, name, deadline),
            None => db::within(db::timers::resolve_wait(
                &self.inner.services.pool,
                info.op_id.0,
                info.epoch,
                seq,
                name,
                deadline,
            ))
            .await
            .map_err(|e| JobError::retryable(format!("resolving a wait: {e}")))?,
        };
        match resolved {
            db::timers::Wait::Resolved(output) => Ok(SignalOutcome::from_journal(&output)),
            db::timers::Wait::LeaseLost => {
                self.inner.lost.store(true, Ordering::Release);
                Err(JobError::LeaseLost)
            }
            db::timers::Wait::Pending => {
                self.state().suspend = Some((deadline, Some(name.to_string())));
                Err(JobError::Suspended)
            }
        }
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
        let name = format!("spawn:{kind}");
        let spec = StepSpec::new(&name, StepKind::Spawn, Replay::Safe);
        let services = self.inner.services.clone();
        let parent = self.inner.info.op_id.0;
        let tenant = &self.inner.info.tenant;
        self.run_step_with(spec, None, |key| async move {
            services.check_spawn(tenant, kind, &input).await?;
            if let Some(memory) = &services.memory {
                return Ok((memory.spawn(&key, kind, &input), None));
            }
            let sha = agentq_core::operation::input_sha256(&input);
            let spawned = db::within(db::children::spawn(
                &services.pool,
                parent,
                &format!("child:{key}"),
                kind,
                &input,
                &sha,
                services.limits.max_children,
            ))
            .await
            .map_err(|e| JobError::retryable(format!("spawning a child: {e}")))?;
            match spawned {
                db::children::Spawned::Created(child) => {
                    let id = child.id;
                    services.dispatch_child(child).await;
                    if let Some(pause) = spawn_pause() {
                        // Test hook: hold the child stored but the step unjournaled.
                        tokio::time::sleep(pause).await;
                    }
                    Ok((id, None))
                }
                db::children::Spawned::Existing(id) => Ok((id, None)),
                db::children::Spawned::NoParent => Err(JobError::LeaseLost),
                db::children::Spawned::Capped(n) => Err(JobError::NonRetryable(format!(
                    "this operation has spawned {n} children, the most one operation may \
                     (AGENTQ_MAX_CHILDREN); spawn fewer, or from the children themselves"
                ))),
                db::children::Spawned::KindNotAllowed => Err(JobError::NonRetryable(format!(
                    "spawning a {kind:?} child: tenant {tenant:?} may not create operations of \
                     that kind (an admin's list, `agentq tenants kinds {tenant}`)"
                ))),
            }
        })
        .await
    }

    /// Waits until every one of `children` (ids [`JobContext::spawn`] returned) has finished
    /// and returns how each ended, in the order given: a child that died or was cancelled is
    /// an outcome to handle, not an error of this operation. While any is unfinished the
    /// operation parks as `waiting` (holding no worker, like a wait for a signal) and the
    /// scheduler queues it once they all are. Journaled: a replay returns the same outcomes.
    pub async fn join(&self, children: &[uuid::Uuid]) -> Result<Vec<ChildOutcome>, JobError> {
        let mut ids: Vec<uuid::Uuid> = Vec::with_capacity(children.len());
        for c in children {
            if !ids.contains(c) {
                ids.push(*c);
            }
        }
        let (seq, key) = self.begin_park("join", StepKind::Join).await?;
        let decode = |output: Option<Value>| {
            serde_json::from_value::<Vec<ChildOutcome>>(output.unwrap_or(Value::Array(vec![])))
                .map_err(|e| {
                    JobError::Nondeterminism(format!(
                        "step {seq} (join) recorded an output of another shape: {e}"
                    ))
                })
        };
        // A join parks with no timeout of its own (an operation deadline still applies).
        let until = Utc::now() + chrono::Duration::from_std(MAX_PARK).unwrap_or_default();
        match self.recorded(seq) {
            Some(e) if e.status == StepStatus::Completed => return decode(e.output),
            Some(_) => {}
            None if ids.is_empty() => {
                let mut row = self.park_row(seq, "join", StepKind::Join, key, until);
                row.status = StepStatus::Completed;
                row.output = Some(Value::Array(vec![]));
                row.completed_at = Some(Utc::now());
                self.push(row, true);
                return Ok(Vec::new());
            }
            None => {
                // The join step must exist before it can be resolved.
                self.push(self.park_row(seq, "join", StepKind::Join, key, until), true);
                self.flush().await?;
            }
        }
        let info = &self.inner.info;
        let resolved = match &self.inner.services.memory {
            Some(memory) => memory.resolve_join(seq, &ids),
            None => db::within(db::children::resolve_join(
                &self.inner.services.pool,
                info.op_id.0,
                info.epoch,
                seq,
                &ids,
            ))
            .await
            .map_err(|e| JobError::retryable(format!("resolving a join: {e}")))?,
        };
        match resolved {
            db::children::Join::Resolved(output) => decode(Some(output)),
            db::children::Join::Pending => {
                self.state().suspend =
                    Some((until, Some(agentq_core::operation::JOIN_WAIT.to_string())));
                Err(JobError::Suspended)
            }
            db::children::Join::NotChildren(strangers) => Err(JobError::NonRetryable(format!(
                "join named operations that are not this operation's children: {strangers:?}"
            ))),
            db::children::Join::LeaseLost => {
                self.inner.lost.store(true, Ordering::Release);
                Err(JobError::LeaseLost)
            }
        }
    }

    /// Takes the next seq for a sleep or wait, checking the journal agrees on what it is.
    async fn begin_park(&self, name: &str, kind: StepKind) -> Result<(i32, String), JobError> {
        self.check_running()?;
        let seq = self.next_position();
        let entry = self.recorded(seq);
        // A park has no tool to reconcile with; only divergence matters here, the rest is the
        // park's own (a recorded wake time, a resolved wait).
        if resume(entry.as_ref().map(|e| recorded_as(e, name, kind)), false) == Resume::Diverged {
            self.rebase_or_diverge(seq, entry.as_ref(), name, kind)
                .await?;
        }
        if entry.is_none() {
            self.check_journal_room(seq, name)?;
        }
        if let Some(memory) = &self.inner.services.memory
            && entry.is_none()
        {
            memory.step_runs(seq, name, kind, Replay::Safe)?;
        }
        Ok((seq, step_idempotency_key(self.inner.info.op_id, seq, name)))
    }

    /// Takes the next journal position for a step, passing over patch markers there: a
    /// [`JobContext::patched`] call that was removed from the code (its old path deleted once
    /// no operation needed it) leaves its marker behind, and nothing asks for it.
    fn next_position(&self) -> i32 {
        let mut st = self.state();
        loop {
            let seq = st.next_seq;
            st.next_seq += 1;
            let marker = entry_at(&st.journal, seq)
                .is_some_and(|e| e.kind == StepKind::Patch && e.status == StepStatus::Completed);
            if !marker {
                return seq;
            }
        }
    }

    /// The code asks for another step at `seq` than the journal recorded. After an operator's
    /// upgrade that covers `seq`, the journal from `seq` on was recorded by the old version:
    /// it is moved out of the journal (kept in `operation_steps_superseded`) in one fenced
    /// statement and the step runs anew. Otherwise the run fails as `nondeterminism`.
    async fn rebase_or_diverge(
        &self,
        seq: i32,
        entry: Option<&JournalEntry>,
        name: &str,
        kind: StepKind,
    ) -> Result<(), JobError> {
        let covered = self.state().upgrade_through.is_some_and(|t| seq <= t);
        if !covered {
            return Err(diverged(seq, entry, name, kind));
        }
        let info = &self.inner.info;
        let rebased = db::within(db::versions::rebase(
            &self.inner.services.pool,
            info.op_id.0,
            info.epoch,
            seq,
        ))
        .await
        .map_err(|e| JobError::retryable(format!("rebasing the journal: {e}")))?;
        if !rebased {
            self.inner.lost.store(true, Ordering::Release);
            return Err(JobError::LeaseLost);
        }
        tracing::info!(
            op_id = %info.op_id,
            seq,
            version = %info.version,
            "upgraded: the journal from this step on was recorded by another version; running it anew"
        );
        let mut st = self.state();
        st.journal.retain(|e| e.seq < seq);
        st.upgrade_through = None;
        Ok(())
    }

    /// Whether this run may take the code path of the change `change_id` (the Temporal idea,
    /// in agentq's journal). Put a change to a kind's steps that operations already running
    /// must not see behind it, without bumping the kind's version:
    ///
    /// ```ignore
    /// if ctx.patched("fetch-before-review")? {
    ///     ctx.step("fetch", Replay::Safe, |_| fetch()).await?;
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
        self.check_running()?;
        let first_execution_at = {
            let mut st = self.state();
            let mut seq = st.next_seq;
            loop {
                let entry = entry_at(&st.journal, seq).filter(|e| e.status != StepStatus::Failed);
                match entry {
                    // Recorded by code that had the patch.
                    Some(e) if e.kind == StepKind::Patch && e.name == change_id => {
                        st.next_seq = seq + 1;
                        return Ok(true);
                    }
                    // Another patch's marker, its call removed or moved: look past it.
                    Some(e) if e.kind == StepKind::Patch => seq += 1,
                    // Recorded before the patch: the old path, nothing taken.
                    Some(_) => return Ok(false),
                    None => {
                        st.next_seq = seq + 1;
                        break seq;
                    }
                }
            }
        };
        let seq = first_execution_at;
        let key = step_idempotency_key(self.inner.info.op_id, seq, change_id);
        let spec = StepSpec::new(change_id, StepKind::Patch, Replay::Safe);
        let mut row = spec.row(seq, &key, StepStatus::Completed, Utc::now());
        row.output = Some(Value::Bool(true));
        row.completed_at = Some(Utc::now());
        // It rides the next durable write: a crash before that finds no marker here and
        // returns true again, as nothing of the new path can have been recorded.
        self.push(row, false);
        Ok(true)
    }

    fn park_row(
        &self,
        seq: i32,
        name: &str,
        kind: StepKind,
        key: String,
        wake_at: DateTime<Utc>,
    ) -> StepWrite {
        let mut row =
            StepSpec::new(name, kind, Replay::Safe).row(seq, &key, StepStatus::Started, Utc::now());
        row.wake_at = Some(wake_at);
        row
    }

    /// Whether a fenced write of this run was refused (another claim took the operation).
    pub(crate) fn write_was_refused(&self) -> bool {
        self.inner.lost.load(Ordering::Acquire)
    }

    /// The wake time and awaited signal if the job parked itself.
    pub(crate) fn take_suspend(&self) -> Option<(DateTime<Utc>, Option<String>)> {
        self.state().suspend.take()
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

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().expect("job context state lock")
    }

    async fn run_step_with<'a, T, F, Fut>(
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
        let body = self.run_step_at(seq, key, spec, reconcile, f);
        tracing::Instrument::instrument(body, span).await
    }

    /// The body of [`JobContext::run_step_with`], inside the step's span.
    async fn run_step_at<'a, T, F, Fut>(
        &self,
        seq: i32,
        key: String,
        spec: StepSpec<'_>,
        reconcile: Option<Reconcile<'a>>,
        f: F,
    ) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<(T, Option<serde_json::Value>), JobError>>,
    {
        let StepSpec {
            name,
            kind,
            replay,
            deferred,
        } = spec;
        // What the journal recorded at this position decides whether the step runs at all
        // (`state::replay::resume`); a reconcile's answer decides it for an unsafe step whose
        // outcome was lost.
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
                return serde_json::from_value(out).map_err(|e| {
                    JobError::Nondeterminism(format!(
                        "step {seq} ({name}) recorded an output of another shape: {e}"
                    ))
                });
            }
            (Resume::Reconcile, Some(ask)) => {
                if let Some(memory) = &self.inner.services.memory {
                    memory.before_reconcile()?;
                }
                Some(ask(key.clone()).await?)
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
                let mut done = spec.row(seq, &key, StepStatus::Completed, Utc::now());
                done.output = Some(output);
                done.completed_at = Some(Utc::now());
                self.push(done, true);
                return Ok(value);
            }
            Some(Reconciled::NotHappened) => {
                tracing::info!(op_id = %self.inner.info.op_id, seq, "reconciled: the effect did not happen; running it");
            }
            Some(Reconciled::Unsupported) => {
                // Fail closed: mark the step unknown, keep its key for a human.
                let mut unknown = spec.row(seq, &key, StepStatus::Unknown, Utc::now());
                unknown.error = Some("outcome lost in a crash; not re-run".into());
                self.push(unknown, true);
                self.state().failed_step = Some(seq);
                return Err(JobError::UnknownSideEffect {
                    seq,
                    name: name.to_string(),
                    key,
                });
            }
        }

        if entry.is_none() {
            self.check_journal_room(seq, name)?;
        }
        if let Some(memory) = &self.inner.services.memory {
            memory.step_runs(seq, name, kind, replay)?;
        }
        let started_at = Utc::now();
        let row = |status| spec.row(seq, &key, status, started_at);

        // Every step finished before this one is durable before it starts; an unsafe step's
        // `started` row too, in the same write. An unsafe step does not begin once the run was
        // asked to give its slot back; once begun, its call is never cut for that.
        if replay == Replay::Unsafe {
            if !self.inner.yielding.begin_unsafe() {
                return Err(JobError::LeaseLost);
            }
            self.push(row(StepStatus::Started), true);
            if let Err(e) = self.flush().await {
                self.inner.yielding.end_unsafe();
                return Err(e);
            }
        } else if self.flush_due() {
            self.flush().await?;
        }

        {
            let mut st = self.state();
            st.current_key = Some(key.clone());
            if replay == Replay::Unsafe {
                let mut unknown = row(StepStatus::Unknown);
                unknown.error = Some("stopped during its call (a cancel or a deadline); its effect may have happened".into());
                st.in_flight = Some(unknown);
            }
        }
        let ran = Instant::now();
        let outcome = f(key.clone()).await;
        metrics::STEP_DURATION.observe(&[kind.as_str()], ran.elapsed().as_secs_f64());
        {
            let mut st = self.state();
            st.current_key = None;
            st.in_flight = None;
        }
        if replay == Replay::Unsafe {
            self.inner.yielding.end_unsafe();
        }
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
                if !matches!(e, JobError::Suspended) {
                    tracing::Span::current().record("otel.status_code", "error");
                }
                if replay == Replay::Unsafe && e.outcome_unknown() {
                    // The effect may have happened: never run it blindly again. The next
                    // attempt reconciles, or fails closed (the `started` branch above).
                    let mut unknown = row(StepStatus::Unknown);
                    unknown.error = Some(format!("outcome unknown: {e}"));
                    self.push(unknown, true);
                    self.state().failed_step = Some(seq);
                } else if !matches!(e, JobError::LeaseLost) {
                    let mut failed = row(StepStatus::Failed);
                    failed.error = Some(e.to_string());
                    failed.completed_at = Some(Utc::now());
                    self.push(failed, !deferred);
                    self.state().failed_step = Some(seq);
                }
                Err(e)
            }
        }
    }

    /// Refuses a step at `seq` that is not in the journal yet once the journal is full
    /// (`AGENTQ_JOURNAL_MAX_STEPS` rows, or more than `AGENTQ_JOURNAL_MAX_BYTES` of outputs):
    /// the operation fails as non-retryable, with nothing of the step run.
    fn check_journal_room(&self, seq: i32, name: &str) -> Result<(), JobError> {
        let limits = &self.inner.services.limits;
        if i64::from(seq) >= limits.journal_max_steps {
            return Err(JobError::NonRetryable(format!(
                "journal limit: step {seq} ({name:?}) was not run: one operation records at most \
                 {} steps (AGENTQ_JOURNAL_MAX_STEPS); split the work into child operations \
                 (ctx.spawn), or raise the cap",
                limits.journal_max_steps
            )));
        }
        let bytes = self.state().journal_bytes;
        if bytes > limits.journal_max_bytes as u64 {
            return Err(JobError::NonRetryable(format!(
                "journal limit: step {seq} ({name:?}) was not run: the journal's outputs take \
                 {bytes} bytes, more than the {} one operation may hold \
                 (AGENTQ_JOURNAL_MAX_BYTES); return smaller step outputs (keep large data in a \
                 store and journal its key), or raise the cap",
                limits.journal_max_bytes
            )));
        }
        Ok(())
    }

    fn recorded(&self, seq: i32) -> Option<JournalEntry> {
        let st = self.state();
        entry_at(&st.journal, seq).cloned()
    }

    /// Holds `row` for the next write; `durable`: it must commit before the next step starts.
    fn push(&self, row: StepWrite, durable: bool) {
        let mut st = self.state();
        st.journal_bytes += row_bytes(row.output.as_ref(), row.error.as_deref());
        // A later row for the same seq replaces the earlier one (started → completed).
        st.pending.retain(|r| r.seq != row.seq);
        st.pending.push(row);
        st.pending_since.get_or_insert_with(Instant::now);
        st.pending_durable |= durable;
    }

    /// Whether the pending rows must be written before the next step starts: any row but a
    /// deferred step's, or deferred rows that waited too long or grew too many.
    fn flush_due(&self) -> bool {
        let st = self.state();
        st.pending_durable
            || st.pending.len() >= DEFERRED_MAX_ROWS
            || st
                .pending_since
                .is_some_and(|t| t.elapsed() >= DEFERRED_FLUSH_AFTER)
    }

    fn check_running(&self) -> Result<(), JobError> {
        if self.inner.lost.load(Ordering::Acquire)
            || self.inner.stop.is_cancelled()
            || self.inner.yielding.requested()
        {
            return Err(JobError::LeaseLost);
        }
        if let Some(deadline) = self.inner.info.deadline
            && Utc::now() >= deadline
        {
            return Err(JobError::DeadlineExceeded(deadline));
        }
        if self.inner.cancel.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        Ok(())
    }

    /// Writes the pending rows in one fenced statement.
    async fn flush(&self) -> Result<(), JobError> {
        // Taken, not copied: rows pushed meanwhile (by a clone of this context) stay pending.
        let (rows, durable) = {
            let mut st = self.state();
            if st.pending.is_empty() {
                return Ok(());
            }
            st.pending_since = None;
            let durable = std::mem::replace(&mut st.pending_durable, false);
            (std::mem::take(&mut st.pending), durable)
        };
        let info = &self.inner.info;
        let services = &self.inner.services;
        let write = db::StepBatch {
            id: info.op_id.0,
            epoch: info.epoch,
            steps: rows,
        };
        if let Some(memory) = &services.memory {
            memory.write(write.steps);
            return Ok(());
        }
        let asked = Instant::now();
        match services.journal.write(&services.pool, write).await {
            Ok(true) => {
                metrics::JOURNAL_COMMIT_DURATION.observe(&[], asked.elapsed().as_secs_f64());
                Ok(())
            }
            Ok(false) => {
                self.inner.lost.store(true, Ordering::Release);
                Err(JobError::LeaseLost)
            }
            Err(unwritten) => {
                // Not written: the rows go back, before any pushed meanwhile (a newer row for
                // the same seq wins), so the failure's statement writes them.
                let mut st = self.state();
                let newer: Vec<StepWrite> = std::mem::take(&mut st.pending);
                let mut rows = unwritten.write.steps;
                rows.retain(|r| !newer.iter().any(|n| n.seq == r.seq));
                rows.extend(newer);
                st.pending = rows;
                st.pending_since.get_or_insert_with(Instant::now);
                st.pending_durable |= durable;
                Err(JobError::retryable(format!(
                    "writing the journal: {}",
                    unwritten.error
                )))
            }
        }
    }

    /// The rows to write with the final transition, and the step that failed (if any). A run
    /// stopped during an unsafe step's call adds that step as `unknown`: the next run of the
    /// operation (an operator's retry) reconciles it, as after a crash, never runs it blindly.
    pub(crate) fn take_pending(&self) -> (Vec<StepWrite>, Option<i32>) {
        let mut st = self.state();
        st.pending_since = None;
        st.pending_durable = false;
        if let Some(unknown) = st.in_flight.take() {
            st.failed_step = Some(unknown.seq);
            st.pending.retain(|r| r.seq != unknown.seq);
            st.pending.push(unknown);
        }
        (std::mem::take(&mut st.pending), st.failed_step)
    }
}
