//! The worker's side of a run: `JobRun`, the backend a kind's [`JobContext`] handle (the
//! SDK's, `agentq_sdk::context`) calls, what it shares with its worker (`Services`,
//! [`JobLimits`]) and the run's state. Its submodules own the parts of the runner:
//! - `backend`: `agentq_sdk::context::Backend` for `JobRun`, the one interface the handle
//!   calls;
//! - `steps`: the one step runner every step goes through (replay, reconcile, unsafe starts,
//!   the step's span), and model and tool calls, `now` / `uuid`;
//! - `journal`: the journal cursor (what is recorded where, `peek_recorded`,
//!   `skip_recorded`), its room checks, and the fenced, group-committed writes;
//! - `park`: sleeps and waits for signals, which park the operation ([`MAX_PARK`]);
//! - `children`: spawn and join, with a spawn's checks;
//! - `store`: the one interface the operation's state is kept through (PostgreSQL in a worker,
//!   memory in the replay tester);
//! - `upgrade`: `patched` and the rebase of an operation an operator upgraded.
//!
//! What is durable when is the SDK's to say (`agentq_sdk::context`). Journal writes go through
//! the worker's group commit (`agentq_core::group_commit`): the rows of every operation that
//! finished a step meanwhile share one fenced statement, and each step waits for its own
//! commit. Every write is fenced by the claim's epoch; a lost lease turns into
//! [`JobError::Stopped`] (the lease was lost).

mod backend;
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

use crate::gate::ModelGate;
use agentq_core::group_commit::GroupCommit;
use agentq_sdk::error::{Engine, JobError};
use agentq_sdk::tool::Tool;

pub use agentq_sdk::OperationInfo;
pub use agentq_sdk::context::{
    ChildOutcome, JobContext, MAX_PARK, SignalOutcome, check_park, check_park_length,
};
pub(crate) use journal::row_bytes;
pub use journal::{DEFERRED_FLUSH_AFTER, DEFERRED_MAX_ROWS};

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
    /// A pending row must be durable before the next step starts (every row but a deferred
    /// step's).
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
    /// agentq's database: the journal's waits (the built-in kinds have it as state,
    /// [`EnginePool`](crate::EnginePool)).
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
    pub(crate) provided: agentq_sdk::provided::Provided,
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

/// One run of an operation, as the worker (or the replay tester) runs it: the backend of the
/// [`JobContext`] its kind's function receives (`JobRun::handle`). Cheap to clone; all clones
/// share one journal cursor.
#[derive(Clone)]
pub(crate) struct JobRun {
    inner: Arc<Inner>,
}

impl JobRun {
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

    /// The handle the kind's function receives, over this run.
    pub(crate) fn handle(&self) -> JobContext {
        JobContext::new(Arc::new(self.clone()))
    }

    /// The operation being run.
    pub(crate) fn info(&self) -> &OperationInfo {
        &self.inner.info
    }

    /// The idempotency key of the step running now (`None` outside a step).
    pub(crate) fn idempotency_key(&self) -> Option<String> {
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
