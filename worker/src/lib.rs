//! agentq-worker: consume pointers, claim operations, and run job functions with a journal.
//!
//! Invariants kept here: no job function is called before its claim (`running`,
//! new epoch, lease) has committed; every write after the claim is fenced by the epoch; no
//! transaction or pooled connection is held across a job's model or tool calls; a delivery is
//! acked right after the claim commits, never held for the length of a job.
//!
//! The runtime (`claim`, `executor`, `lease`, [`gate`]; the journal and completion writers are
//! `agentq_core::group_commit`'s) runs operations; `context` is the backend of the SDK's
//! [`JobContext`] handle (`agentq-sdk`, re-exported here: [`JobContext`], [`Tool`],
//! [`TypedTool`], [`JobError`], the [`model`] types). A deployment registers its kinds, tools
//! and state in a [`Registry`], and tests them with the replay tester ([`testing`]).
//! agentq's built-in kinds (the `agentq-kinds` crate) use this public API, and the engine's pool
//! as the state [`EnginePool`].

mod breaker;
mod claim;
pub mod context;
mod executor;
pub mod gate;
mod grants;
mod journal_cache;
mod lease;
pub mod limiter;
mod limits;
pub mod openai;
pub mod remote;
mod remote_memory;
pub mod served;
mod share;
mod slot;
pub mod testing;
mod versions;

use std::sync::Arc;
use std::time::Duration;

use agentq_core::broker::{self, Consumer, Names};
use agentq_core::operation::Lane;
use agentq_core::origins::Origins;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The SDK a kind is written with (`agentq-sdk`), re-exported: the worker is its backend.
pub use agentq_sdk::{
    ChildOutcome, JobContext, JobError, KindOptions, LocalModel, ModelClient, ModelRequest,
    ModelResponse, OperationInfo, Reconciled, Registry, Replay, SignalOutcome, Tool, ToolContext,
    TypedTool, agent, async_trait, error, model, registry, tool,
};
pub use served::{ServedKinds, Serves};

/// The engine's pool on agentq's own database, which the worker gives its runs as state
/// (`ctx.state::<EnginePool>()`) for agentq's built-in kinds and tools: their tables, the
/// stores an admin registered. Not for a deployment's kinds: give yours its own pool or client
/// with [`Registry::provide`]. What the built-in kinds keep to when they use it:
/// - Nothing written here is fenced by the claim's epoch or journaled: a run whose lease was
///   lost may still be finishing a step. Read and write only inside a step, and make each
///   write idempotent (keyed by the step's idempotency key or the operation id).
/// - It reaches every tenant's data and all of agentq's tables: scope every statement to
///   [`OperationInfo::tenant`], take a table or a path only from what an operator registered
///   (never from the input), and never write the tables operations run on.
/// - The pool is shared with the worker's claims, journal writes and heartbeats: use a
///   connection for a statement or a short transaction, never across a model call, a tool
///   call or a sleep.
#[doc(hidden)]
#[derive(Clone)]
pub struct EnginePool(pub PgPool);

use agentq_core::group_commit::GroupCommit;
use claim::Ended;
use context::Services;
use executor::Shared;
use lease::Leases;
use versions::Versions;

/// First delay before reconnecting to the broker; it doubles up to 10 s while connecting fails.
const RECONNECT_FIRST: Duration = Duration::from_millis(200);

/// Worker settings (from [`agentq_core::Config`] in the binary).
#[derive(Clone, Debug)]
pub struct Settings {
    pub amqp_url: String,
    pub namespace: String,
    pub lease_ttl: Duration,
    /// Operations run at once, per lane; 0 → that lane is not consumed.
    pub concurrency_interactive: u16,
    pub concurrency_batch: u16,
    /// How long a shutdown waits for running operations before letting their leases lapse.
    pub shutdown_grace: Duration,
    /// Model-call limits and circuit breaker.
    pub gate: gate::GateSettings,
    /// Origins kinds may call (`AGENTQ_AGENT_HTTP_ALLOW`), handed to them by
    /// [`JobContext::http_allow`].
    pub http_allow: Origins,
    /// The caps a spawn obeys.
    pub job_limits: context::JobLimits,
    /// The most of a lane's slots one tenant runs here while another tenant has work queued
    /// there (`AGENTQ_TENANT_SHARE`, 0 < share ≤ 1; 1: no share).
    pub tenant_share: f64,
    /// How long a tenant past its share pays the slots it owes at its step boundaries before
    /// its operations are stopped mid-step (`AGENTQ_TENANT_SHARE_GRACE_SECS`).
    pub tenant_share_grace: Duration,
}

/// A worker process's engine.
pub struct Worker {
    settings: Settings,
    shared: Arc<Shared>,
}

impl Worker {
    /// A worker running `kinds` (the deployment's registry and the registered services'
    /// kinds) with `model`.
    pub fn new(
        settings: Settings,
        pool: PgPool,
        kinds: impl Into<ServedKinds>,
        model: Arc<dyn ModelClient>,
    ) -> Self {
        let kinds = kinds.into();
        let owner = format!(
            "{}-{}-{}",
            hostname(),
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        let leases = Leases::new(owner, settings.lease_ttl);
        let versions = {
            let kinds = kinds.clone();
            Versions::new(Box::new(move || kinds.versions()))
        };
        let model = Arc::new(gate::ModelGate::new(model, settings.gate.clone()));
        let http_allow = Arc::new(settings.http_allow.clone());
        let (amqp_url, names) = (
            settings.amqp_url.clone(),
            agentq_core::broker::Names::new(&settings.namespace),
        );
        let job_limits = settings.job_limits;
        let shares = share::Shares::new(
            settings.tenant_share,
            usize::from(settings.concurrency_interactive),
            usize::from(settings.concurrency_batch),
            settings.tenant_share_grace,
        );
        let check_child: context::ChildCheck = {
            let kinds = kinds.clone();
            Box::new(move |kind, input| kinds.requires_or_why(kind, input))
        };
        let tools = kinds.registry().tool_map();
        // The deployment's own state, and the engine's pool for the built-in kinds.
        let mut provided = kinds.registry().provided();
        provided.insert(EnginePool(pool.clone()));
        Self {
            settings,
            shared: Arc::new(Shared {
                services: Arc::new(Services {
                    call_limits: Arc::new(limits::CallLimits::new(pool.clone())),
                    pool,
                    http_allow,
                    model,
                    journal: GroupCommit::new(),
                    check_child,
                    tools,
                    provided,
                    children: std::sync::OnceLock::new(),
                    amqp_url,
                    names,
                    limits: job_limits,
                    counts: Default::default(),
                    remote_memory: Arc::new(remote_memory::Memory::new(
                        job_limits.remote_journal_memory,
                    )),
                    store: Arc::new(context::store::Postgres),
                }),
                kinds,
                versions,
                leases,
                shares,
                journals: journal_cache::JournalCache::new(job_limits.journal_cache_memory),
            }),
        }
    }

    /// The lease owner name this worker writes into claimed rows.
    pub fn owner(&self) -> &str {
        self.shared.leases.owner()
    }

    /// Marked by each successful lease heartbeat (every `lease_ttl / 3`); stale after a whole
    /// lease period without one, when the worker stops its operations itself. Its metrics
    /// endpoint's `GET /healthz` answers from it.
    pub fn progress(&self) -> Arc<agentq_core::health::Progress> {
        self.shared.leases.progress()
    }

    /// Runs until `shutdown`: consumes both lanes (reconnecting to the broker when it fails),
    /// heartbeats leases, and on shutdown stops consuming and waits up to the grace period for
    /// running operations.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let tasks = TaskTracker::new();
        // Leases are renewed until the drain below ends, not until SIGTERM: a drain longer than
        // the rest of a lease must not let the reaper count it as a crash.
        let heartbeat = {
            let shared = self.shared.clone();
            let stop = CancellationToken::new();
            let pool = shared.pool().clone();
            tokio::spawn(async move { shared.leases.run_heartbeat(pool, stop).await })
        };
        let journal = {
            let shared = self.shared.clone();
            tokio::spawn(async move { shared.services.journal.run(shared.pool().clone()).await })
        };
        // Say which versions this worker runs before claiming anything, then keep saying it;
        // the registration is removed once the drain below is over.
        let registration = CancellationToken::new();
        let versions = {
            let shared = self.shared.clone();
            let (pool, owner, ttl) = (
                shared.pool().clone(),
                self.owner().to_string(),
                self.settings.lease_ttl,
            );
            if let Err(e) = shared.versions.refresh(&pool, &owner, ttl).await {
                tracing::warn!(error = %e, "registering the worker's versions failed; retrying with the heartbeat");
            }
            let stop = registration.clone();
            let remote = shared.kinds.remote().clone();
            tokio::spawn(async move { shared.versions.run(pool, owner, ttl, stop, remote).await })
        };
        tracing::info!(owner = %self.owner(), "worker started");
        let names = Names::new(&self.settings.namespace);
        let lanes: Vec<(Lane, u16)> = [
            (Lane::Interactive, self.settings.concurrency_interactive),
            (Lane::Batch, self.settings.concurrency_batch),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
        let slots: Vec<Arc<Semaphore>> = lanes
            .iter()
            .map(|(_, n)| Arc::new(Semaphore::new(usize::from(*n))))
            .collect();

        // Operations a worker refused for their version, taken back by this one if it runs it;
        // operations held for fair shares, started when this worker has room for them.
        let pulls: Vec<_> = lanes
            .iter()
            .zip(&slots)
            .flat_map(|((lane, _), slots)| {
                let pull = claim::Pull {
                    shared: self.shared.clone(),
                    lane: *lane,
                    slots: slots.clone(),
                    tasks: tasks.clone(),
                    shutdown: shutdown.clone(),
                };
                [
                    tokio::spawn(claim::pull_parked(pull.clone())),
                    tokio::spawn(claim::pull_held(pull)),
                ]
            })
            .collect();

        let mut backoff = RECONNECT_FIRST;
        while !shutdown.is_cancelled() {
            let mut opened = false;
            match self
                .consume(&names, &lanes, &slots, &tasks, &shutdown, &mut opened)
                .await
            {
                Ok(()) => break,
                Err(e) => {
                    // A session that was up starts a fresh backoff: one broker restart should not
                    // make the next one cost the longest delay.
                    if opened {
                        backoff = RECONNECT_FIRST;
                    }
                    tracing::warn!(error = %e, "broker connection lost; reconnecting in {backoff:?}");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }

        for pull in pulls {
            let _ = pull.await;
        }
        tasks.close();
        let running = self.shared.leases.len();
        if running > 0 {
            tracing::info!(running, grace = ?self.settings.shutdown_grace, "waiting for running operations");
        }
        if tokio::time::timeout(self.settings.shutdown_grace, tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.shared.leases.len(),
                "grace period over; stopping and releasing the rest"
            );
            heartbeat.abort();
            self.shared.leases.release_all(self.shared.pool()).await;
            // Let the stopped jobs observe their tokens before the runtime goes away.
            let _ = tokio::time::timeout(Duration::from_secs(1), tasks.wait()).await;
        }
        heartbeat.abort();
        registration.cancel();
        let _ = versions.await;
        // Every execution has had its writes answered: nothing is waiting on the writers.
        journal.abort();
        // Spawned children's dispatch marks still queued are written (unwritten ones are only
        // published again by the sweeper: a harmless duplicate).
        if let Some(children) = self.shared.services.children.get() {
            children.close().await;
        }
        Ok(())
    }

    /// One broker session: connect, consume every lane until shutdown (Ok) or a failure (Err).
    /// Sets `opened` once every lane consumes.
    async fn consume(
        &self,
        names: &Names,
        lanes: &[(Lane, u16)],
        slots: &[Arc<Semaphore>],
        tasks: &TaskTracker,
        shutdown: &CancellationToken,
        opened: &mut bool,
    ) -> anyhow::Result<()> {
        let conn = broker::connect(&self.settings.amqp_url, "worker").await?;
        // Every step of setting a session up has a deadline: a connection that went silent
        // midway is given up and the next attempt opens a new one.
        let bounded = |what: &'static str| {
            move |_| anyhow::anyhow!("rabbitmq did not answer within {SESSION_STEP:?} ({what})")
        };
        tokio::time::timeout(SESSION_STEP, broker::declare_topology(&conn, names))
            .await
            .map_err(bounded("declaring the topology"))??;
        let session = shutdown.child_token();
        let mut loops = Vec::new();
        for ((lane, n), slots) in lanes.iter().zip(slots) {
            let tag = format!("{}-{}", self.owner(), lane);
            let consumer =
                tokio::time::timeout(SESSION_STEP, Consumer::open(&conn, names, *lane, *n, &tag))
                    .await
                    .map_err(bounded("opening a consumer"))??;
            loops.push(tokio::spawn(claim::consume_lane(
                self.shared.clone(),
                consumer,
                *lane,
                slots.clone(),
                tasks.clone(),
                session.clone(),
            )));
        }
        *opened = true;
        let mut result = Ok(());
        let mut loops: futures_util::stream::FuturesUnordered<_> = loops.into_iter().collect();
        while let Some(ended) = futures_util::StreamExt::next(&mut loops).await {
            let broken = match ended {
                Ok(Ended::Shutdown) => None,
                Ok(Ended::Broken(reason)) => Some(reason),
                Err(join) => Some(format!("lane task failed: {join}")),
            };
            if let Some(reason) = broken {
                // One lane failing ends the session for all: reconnect them together.
                session.cancel();
                result = Err(anyhow::anyhow!(reason));
            }
        }
        // A close nobody answers (the connection went silent) must not hold the reconnect.
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            conn.close(200, "worker stopping".into()),
        )
        .await;
        result
    }
}

/// Deadline of each step of setting a broker session up (declaring, opening a consumer).
const SESSION_STEP: Duration = Duration::from_secs(10);

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".into())
}
