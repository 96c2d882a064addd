//! The job context: the API a job function uses to do durable work. This module owns the
//! [`JobContext`] handle, what it shares with its worker (`Services`, [`JobLimits`]) and the
//! run's state; its submodules own the parts of the API:
//! - `steps`: [`JobContext::step`], [`JobContext::deferred_step`], model and tool calls,
//!   `now` / `uuid`, and the one step runner they all go through (replay, reconcile, unsafe
//!   starts, the step's span);
//! - `journal`: the journal cursor (what is recorded where, [`JobContext::peek_recorded`],
//!   [`JobContext::skip_recorded`]), its room checks, and the fenced, group-committed writes;
//! - `park`: sleeps and waits for signals, which park the operation ([`MAX_PARK`]);
//! - `children`: [`JobContext::spawn`] and [`JobContext::join`], with a spawn's checks;
//! - `store`: the one interface the operation's state is kept through (PostgreSQL in a worker,
//!   memory in the replay tester);
//! - `upgrade`: [`JobContext::patched`] and the rebase of an operation an operator upgraded.
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
//! Journal writes go through the worker's group commit (`agentq_core::group_commit`): the rows of every
//! operation that finished a step meanwhile share one fenced statement, and each step waits for
//! its own commit. Every write is fenced by the claim's epoch; a lost lease turns into
//! [`JobError::Stopped`] (the lease was lost).

mod budget;
mod children;
mod journal;
mod park;
mod rate;
mod steps;
pub(crate) mod store;
mod upgrade;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use agentq_core::db::{self, steps::JournalEntry, steps::StepWrite};
use agentq_core::dispatch::Dispatcher;
use agentq_core::origins::Origins;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::error::{Engine, JobError};
use crate::gate::ModelGate;
pub use crate::info::OperationInfo;
use crate::tool::Tool;
use agentq_core::group_commit::GroupCommit;

pub use children::ChildOutcome;
pub(crate) use journal::row_bytes;
pub use journal::{DEFERRED_FLUSH_AFTER, DEFERRED_MAX_ROWS};
pub use park::{MAX_PARK, SignalOutcome, check_park, check_park_length};
pub(crate) use steps::Reconcile;

/// The caps a job's steps obey (`AGENTQ_MAX_CHILDREN`, `AGENTQ_MAX_SPAWN_DEPTH`,
/// `AGENTQ_TENANT_MAX_UNFINISHED`,
/// `AGENTQ_JOURNAL_MAX_STEPS`, `AGENTQ_JOURNAL_MAX_BYTES`).
#[derive(Clone, Copy, Debug)]
pub struct JobLimits {
    /// Children one operation may spawn.
    pub max_children: i64,
    /// Spawns below its root a child may be (its ancestors).
    pub max_spawn_depth: i64,
    /// Unfinished operations a tenant may have; a spawn past it waits.
    pub tenant_max_unfinished: i64,
    /// Journal rows one operation may record: the step at this position fails the operation.
    pub journal_max_steps: i64,
    /// Bytes of step outputs and errors (as JSON) one journal may hold: once past it, the next
    /// step fails the operation.
    pub journal_max_bytes: i64,
    /// Bytes the worker's remote runs may hold for their services' journals, all together.
    pub remote_journal_memory: u64,
    /// Bytes of journals the worker keeps from its runs for their operations' next runs here.
    pub journal_cache_memory: u64,
}

impl Default for JobLimits {
    fn default() -> Self {
        Self {
            max_children: 10_000,
            max_spawn_depth: 32,
            tenant_max_unfinished: 100_000,
            journal_max_steps: 10_000,
            journal_max_bytes: 64 << 20,
            remote_journal_memory: 256 << 20,
            journal_cache_memory: 64 << 20,
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
    /// Set when its batch's budget refused a model call: the run is handed back.
    budget_pause: bool,
    /// Whether a token budget is over the operation: as its claim found, or a later look.
    budgeted: bool,
    /// The newest birth of a budget set apart (`crate::limits`) that a look found not over it.
    budget_seen: Option<DateTime<Utc>>,
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
/// sees the registry or the leases).
pub(crate) struct Services {
    /// agentq's database: the journal's waits, and [`JobContext::pool`].
    pub(crate) pool: PgPool,
    /// Handed to kinds by [`JobContext::http_allow`].
    pub(crate) http_allow: Arc<Origins>,
    /// Model calls, within the worker's limits and circuit breaker.
    pub(crate) model: Arc<ModelGate>,
    /// Writes finished steps (and unsafe starts) and successes, many operations per statement.
    pub(crate) journal: GroupCommit<db::settle::RunWrite>,
    /// Whether a child's kind and input fit (`ctx.spawn`).
    pub(crate) check_child: ChildCheck,
    /// The deployment's registered tools ([`JobContext::registered_tool`]).
    pub(crate) tools: std::collections::BTreeMap<String, Arc<dyn Tool>>,
    /// The deployment's own state ([`JobContext::state`]).
    pub(crate) provided: crate::provided::Provided,
    /// Publishes spawned children's pointers; opened on the first spawn.
    pub(crate) children: std::sync::OnceLock<Dispatcher>,
    /// Where `children` connects to.
    pub(crate) amqp_url: String,
    pub(crate) names: agentq_core::broker::Names,
    /// The caps a spawn obeys.
    pub(crate) limits: JobLimits,
    /// The worker's budget of bytes for remote kinds' journals (`AGENTQ_REMOTE_JOURNAL_MEMORY`).
    pub(crate) remote_memory: Arc<crate::remote_memory::Memory>,
    /// Tenants' counts of unfinished operations, as the spawn cap reads them.
    pub(crate) counts: std::sync::Mutex<std::collections::HashMap<String, (Instant, i64)>>,
    /// The rate limits, and the newest budget's birth, as this process last read them.
    pub(crate) call_limits: Arc<crate::limits::CallLimits>,
    /// Where the operation's journal, waits and children are kept: PostgreSQL in a worker
    /// (`store::Postgres`), memory in the replay tester ([`crate::testing`]).
    pub(crate) store: Arc<dyn store::Store>,
}

/// What a run's claim said about the operation beyond its [`OperationInfo`]: how far an
/// upgrade covers its journal, and the limits over its model calls.
#[derive(Clone, Debug, Default)]
pub(crate) struct ClaimFacts {
    /// The journal's steps up to this seq were written by the version it was upgraded from.
    pub(crate) upgrade_through: Option<i32>,
    /// A token budget was over the operation when it was claimed.
    pub(crate) budgeted: bool,
    /// The database's clock at the claim.
    pub(crate) claimed_at: DateTime<Utc>,
    /// The key its model calls count against (rate limits of scope `key`).
    pub(crate) rate_key: Option<String>,
    /// The lane slot the claim took, lent back during model calls (`None` in the replay
    /// tester, which has no lanes).
    pub(crate) slot: Option<Arc<crate::slot::LaneSlot>>,
}

struct Inner {
    info: OperationInfo,
    claim: ClaimFacts,
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
/// use agentq_worker::{JobContext, JobError, ModelResponse, Registry, SignalOutcome};
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
///         .step("count", || async { Ok(summary.content.split_whitespace().count()) })
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
        claim: ClaimFacts,
        stop: CancellationToken,
        cancel: CancellationToken,
        yielding: Arc<crate::share::Yield>,
    ) -> Self {
        let mut journal = journal;
        // Loaded in seq order; sorting again costs a pass and keeps `entry_at` correct for any caller.
        journal.sort_by_key(|e| e.seq);
        let (budgeted, upgrade_through) = (claim.budgeted, claim.upgrade_through);
        let journal_bytes = journal
            .iter()
            .map(|e| row_bytes(e.output.as_ref(), e.error.as_deref()))
            .sum();
        Self {
            inner: Arc::new(Inner {
                info,
                claim,
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
                    budget_pause: false,
                    budgeted,
                    budget_seen: None,
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

    /// The engine's pool on agentq's own database, for agentq's built-in kinds and tools
    /// (their tables, the stores an admin registered). Not for a deployment's kinds: give
    /// yours its own pool or client with [`Registry::provide`](crate::Registry::provide) and
    /// read it with [`JobContext::state`]. What the built-in kinds keep to when they use it:
    /// - Nothing written here is fenced by the claim's epoch or journaled: a run whose lease
    ///   was lost may still be finishing a step. Read and write only inside a step, and make
    ///   each write idempotent (keyed by the step's idempotency key or the operation id).
    /// - It reaches every tenant's data and all of agentq's tables: scope every statement to
    ///   [`OperationInfo::tenant`], take a table or a path only from what an operator
    ///   registered (never from the input), and never write the tables operations run on.
    /// - The pool is shared with the worker's claims, journal writes and heartbeats: use a
    ///   connection for a statement or a short transaction, never across a model call, a tool
    ///   call or a sleep.
    #[doc(hidden)]
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

    /// The value of type `T` the deployment gave its registry
    /// ([`Registry::provide`](crate::Registry::provide)): its own database pool, HTTP client or
    /// configuration. An error (non-retryable) if it gave none: propagate it with `?`.
    pub fn state<T: Send + Sync + 'static>(&self) -> Result<&T, JobError> {
        self.inner.services.provided.get::<T>()
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
        self.run_state().current_key.clone()
    }

    /// Whether a fenced write of this run was refused (another claim took the operation).
    pub(crate) fn write_was_refused(&self) -> bool {
        self.inner.lost.load(Ordering::Acquire)
    }

    /// The wake time and awaited signal if the job parked itself.
    pub(crate) fn take_suspend(&self) -> Option<(DateTime<Utc>, Option<String>)> {
        self.run_state().suspend.take()
    }

    /// What the run shares with its worker.
    pub(crate) fn services(&self) -> &Services {
        &self.inner.services
    }

    fn run_state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().expect("job context state lock")
    }

    fn check_running(&self) -> Result<(), JobError> {
        if self.inner.lost.load(Ordering::Acquire)
            || self.inner.stop.is_cancelled()
            || self.inner.yielding.at_boundary()
        {
            return Err(JobError::from(Engine::LeaseLost));
        }
        if let Some(deadline) = self.inner.info.deadline
            && Utc::now() >= deadline
        {
            return Err(JobError::from(Engine::DeadlineExceeded(deadline)));
        }
        if self.inner.cancel.is_cancelled() {
            return Err(JobError::from(Engine::Cancelled));
        }
        Ok(())
    }
}
