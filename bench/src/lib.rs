//! agentq-bench: `agentq bench`. Every scenario runs in a throwaway database and broker
//! namespace, so it never touches real data, and deletes both afterwards (unless `--keep`).
//! The scenarios are in `jobs` (e2e, batch, steps, inflight), `scenarios` (timers, waiting),
//! `http`, `durable` and `remote` (a Python service's kind against the same kind in Rust); what they share (processes, commit counting, percentiles, the
//! report) in `common`; the latency-only model provider in `model`; the rows and reads
//! written straight in SQL in `fixtures`.
//!
//! API boundary: [`run`], with the scenario's [`Args`] and a [`Deployment`]: the
//! configuration, the registry, and the [`Wiring`] through which the `agentq` crate builds
//! the producer, the scheduler and the application layer exactly as its other subcommands
//! do. The worker and scheduler processes of a run are this executable's own `worker` and
//! `scheduler` subcommands. A refusal of the arguments is a [`Refused`] error.

mod common;
mod durable;
mod fixtures;
mod http;
mod jobs;
mod model;
mod remote;
mod scenarios;

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use agentq_core::broker::{self, Names};
use agentq_core::dispatch::Dispatcher;
use agentq_core::operation::Lane;
use agentq_core::{Config, db};
use agentq_producer::Producer;
use agentq_worker::ServedKinds;
use anyhow::Context;
use sqlx::PgPool;

/// How the bench builds agentq's parts: implemented by the `agentq` crate with the builders
/// its subcommands use, so a benchmark measures the parts as they are deployed.
#[async_trait::async_trait]
pub trait Wiring: Send + Sync {
    /// A pool on `config`'s database (an error says what to check).
    async fn connect(&self, config: &Config) -> anyhow::Result<PgPool>;
    /// A producer of the deployment's kinds, and its dispatcher (close it when done).
    fn producer(
        &self,
        deployment: &Deployment,
        pool: PgPool,
        role: &str,
    ) -> (Producer, Arc<Dispatcher>);
    /// A scheduler of the deployment.
    fn scheduler(&self, deployment: &Deployment, pool: PgPool) -> agentq_scheduler::Scheduler;
    /// The application layer over `pool` (close its dispatcher when done).
    fn app(&self, deployment: &Deployment, pool: PgPool, role: &str) -> agentq_app::App;
}

/// What a benchmark runs against: the configuration (it reads as one), the kinds the
/// deployment serves, and how to build its parts. Scenarios change the configuration of their copy (a
/// database of their own, a model provider, shorter leases) before building anything.
#[derive(Clone)]
pub struct Deployment {
    pub config: Config,
    pub kinds: ServedKinds,
    pub wiring: Arc<dyn Wiring>,
}

impl Deref for Deployment {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.config
    }
}

impl DerefMut for Deployment {
    fn deref_mut(&mut self) -> &mut Config {
        &mut self.config
    }
}

impl Deployment {
    async fn connect(&self) -> anyhow::Result<PgPool> {
        self.wiring.connect(&self.config).await
    }

    fn producer(&self, pool: PgPool, role: &str) -> (Producer, Arc<Dispatcher>) {
        self.wiring.producer(self, pool, role)
    }

    fn scheduler(&self, pool: PgPool) -> agentq_scheduler::Scheduler {
        self.wiring.scheduler(self, pool)
    }

    fn app(&self, pool: PgPool, role: &str) -> agentq_app::App {
        self.wiring.app(self, pool, role)
    }
}

/// A refusal of the arguments: the message says what was wrong (the command line exits 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// What `agentq bench` measures (the command line's `--scenario`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scenario {
    E2e,
    Batch,
    Steps,
    DurableSteps,
    Inflight,
    Timers,
    Waiting,
    Http,
    Remote,
}

/// The knobs of a run, as the command line's flags of `agentq bench` give them (their help
/// there says which scenario reads which).
#[derive(Clone, Debug)]
pub struct Args {
    pub scenario: Scenario,
    pub sleepers: i64,
    pub due_per_sec: i64,
    pub due_secs: i64,
    pub join_parents: i64,
    pub join_children: i64,
    pub waiting: usize,
    pub jobs: usize,
    pub steps: usize,
    pub kills: usize,
    pub model_latency_ms: Option<u64>,
    /// With a fake provider: model calls in flight per worker and per tenant (else the
    /// deployment's `AGENTQ_MODEL_CONCURRENCY`, `auto` by default).
    pub model_calls: Option<u16>,
    /// With a fake provider: it answers this many calls at once and refuses more with a 503.
    pub model_capacity: Option<usize>,
    /// e2e, batch: every operation names rate key `bench`, limited to this many tokens a
    /// minute.
    pub rate_limit_tokens: Option<i64>,
    pub concurrency: u16,
    pub lane: Lane,
    pub producers: usize,
    pub workers: Option<usize>,
    pub keep: bool,
    pub connections: usize,
    pub duration_secs: u64,
    pub timeout_secs: u64,
}

/// Runs one scenario in a throwaway database and namespace of `config`'s servers, prints its
/// report, and deletes both (unless `args.keep`).
pub async fn run(mut config: Deployment, args: Args) -> anyhow::Result<()> {
    if args.jobs == 0 || args.producers == 0 || args.concurrency == 0 || args.workers == Some(0) {
        return Err(Refused(
            "--jobs, --producers, --concurrency and --workers must be above 0".into(),
        )
        .into());
    }
    let max_steps = durable::MAX_STEPS;
    if args.scenario == Scenario::Remote && !(1..=10_000).contains(&args.steps) {
        return Err(Refused(format!(
            "--steps must be between 1 and 10000 (got {}): it is the steps of each operation",
            args.steps
        ))
        .into());
    }
    if args.scenario == Scenario::DurableSteps && !(1..=max_steps).contains(&args.steps) {
        return Err(Refused(format!(
            "--steps must be between 1 and {max_steps} (got {}): it is the length of each operation's program",
            args.steps
        ))
        .into());
    }
    // The scenarios run the built-in kinds: a binary whose registry lacks them says so first.
    let missing: Vec<&str> = ["echo", "script", "agent"]
        .into_iter()
        .filter(|k| config.kinds.newest(k).is_none())
        .collect();
    if !missing.is_empty() {
        return Err(Refused(format!(
            "the benchmarks run agentq's built-in kinds, and this binary's registry lacks {}: \
             register them (`agentq::builtin::register_builtin`) or run `agentq bench`",
            missing.join(", ")
        ))
        .into());
    }
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    config.database_url = db::with_database(&config.database_url, &format!("agentq_bench_{tag}"))?;
    config.namespace = format!("agentq-bench-{tag}");
    db::migrate(&config.database_url)
        .await
        .context("creating the benchmark database")?;
    eprintln!(
        "database agentq_bench_{tag}, broker namespace {} (removed when the run ends)",
        config.namespace
    );
    let scenario = async {
        match args.scenario {
            Scenario::E2e => jobs::e2e(&config, &args).await,
            Scenario::Batch => jobs::batch(&config, &args).await,
            Scenario::Steps => jobs::steps(&config, &args).await,
            Scenario::Inflight => jobs::inflight(&config, &args).await,
            Scenario::Timers => scenarios::timers(&config, &args).await,
            Scenario::Waiting => scenarios::waiting(&config, &args).await,
            Scenario::Http => http::http(&config, &args).await,
            Scenario::DurableSteps => durable::durable_steps(&config, &args).await,
            Scenario::Remote => remote::remote(&config, &args).await,
        }
    };
    // Ctrl-C or SIGTERM stops the run where it is (its worker and scheduler processes are
    // spawned kill-on-drop, so they stop with it) and still removes what it created.
    let outcome = tokio::select! {
        outcome = scenario => outcome,
        signal = stop_signal() => Err(anyhow::anyhow!(
            "stopped by {signal}: no figures; the benchmark's database and namespace are removed"
        )),
    };
    if args.keep {
        eprintln!(
            "kept database {} and namespace {}",
            agentq_core::config::redact_url(&config.database_url),
            config.namespace
        );
    } else {
        cleanup(&config).await;
    }
    outcome
}

/// Resolves with the signal's name on SIGINT or SIGTERM (never, if no handler could be set).
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

async fn cleanup(config: &Deployment) {
    if let Err(e) = db::drop_database(&config.database_url).await {
        eprintln!("warning: dropping the benchmark database: {e}");
    }
    match broker::connect(&config.amqp_url, "bench-cleanup").await {
        Ok(conn) => {
            if let Err(e) = broker::delete_topology(&conn, &Names::new(&config.namespace)).await {
                eprintln!("warning: deleting the benchmark namespace: {e}");
            }
            let _ = conn.close(200, "bench cleanup".into()).await;
        }
        Err(e) => eprintln!("warning: deleting the benchmark namespace: {e}"),
    }
}

/// Polls `f` every `every` until it returns `Some`, or `deadline` passes.
async fn poll_until<T, F, Fut>(deadline: Duration, every: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}
