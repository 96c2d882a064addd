//! `agentq bench`: the command line's side of the benchmarks, which live in the `agentq-bench`
//! crate. Its flags (`cli::BenchArgs`) become the bench's arguments, and the builders of
//! [`crate::wiring`] are handed over so a benchmark builds its producer, scheduler and API as
//! every subcommand does; the bench's refusals exit 2 like any other.

use std::sync::Arc;

use agentq_bench::Scenario as Measured;
use agentq_core::Config;
use agentq_core::dispatch::Dispatcher;
use agentq_producer::Producer;
use sqlx::PgPool;

use crate::cli::{BenchArgs, Scenario};
use crate::wiring::{self, Deployment};

/// Runs the scenario `args` names against `config`'s servers.
pub async fn run(config: Deployment, args: BenchArgs) -> anyhow::Result<()> {
    let deployment = agentq_bench::Deployment {
        config: config.config,
        kinds: config.kinds,
        wiring: Arc::new(Builders),
    };
    agentq_bench::run(deployment, arguments(args))
        .await
        .map_err(|e| match e.downcast::<agentq_bench::Refused>() {
            Ok(refused) => wiring::refuse(refused.0),
            Err(e) => e,
        })
}

/// The command line's flags as the bench's arguments.
fn arguments(a: BenchArgs) -> agentq_bench::Args {
    agentq_bench::Args {
        scenario: match a.scenario {
            Scenario::E2e => Measured::E2e,
            Scenario::Batch => Measured::Batch,
            Scenario::Steps => Measured::Steps,
            Scenario::DurableSteps => Measured::DurableSteps,
            Scenario::Inflight => Measured::Inflight,
            Scenario::Timers => Measured::Timers,
            Scenario::Waiting => Measured::Waiting,
            Scenario::Http => Measured::Http,
            Scenario::Remote => Measured::Remote,
        },
        sleepers: a.sleepers,
        due_per_sec: a.due_per_sec,
        due_secs: a.due_secs,
        join_parents: a.join_parents,
        join_children: a.join_children,
        waiting: a.waiting,
        jobs: a.jobs,
        steps: a.steps,
        kills: a.kills,
        model_latency_ms: a.model_latency_ms,
        model_calls: a.model_calls,
        model_capacity: a.model_capacity.map(|c| c as usize),
        rate_limit_tokens: a.rate_limit_tokens,
        concurrency: a.concurrency,
        lane: a.lane,
        producers: a.producers,
        workers: a.workers,
        keep: a.keep,
        connections: a.connections,
        duration_secs: a.duration_secs,
        timeout_secs: a.timeout_secs,
    }
}

/// The bench's [`agentq_bench::Wiring`]: the builders of [`crate::wiring`].
struct Builders;

/// The command line's deployment of the bench's (its configuration as the scenario changed it).
fn deployment(d: &agentq_bench::Deployment) -> Deployment {
    Deployment {
        config: d.config.clone(),
        kinds: d.kinds.clone(),
    }
}

#[async_trait::async_trait]
impl agentq_bench::Wiring for Builders {
    async fn connect(&self, config: &Config) -> anyhow::Result<PgPool> {
        wiring::connect(config).await
    }

    fn producer(
        &self,
        d: &agentq_bench::Deployment,
        pool: PgPool,
        role: &str,
    ) -> (Producer, Arc<Dispatcher>) {
        wiring::producer(&deployment(d), pool, role)
    }

    fn scheduler(&self, d: &agentq_bench::Deployment, pool: PgPool) -> agentq_scheduler::Scheduler {
        wiring::scheduler(&deployment(d), pool)
    }

    fn app(&self, d: &agentq_bench::Deployment, pool: PgPool, role: &str) -> agentq_app::App {
        wiring::app(&deployment(d), pool, role)
    }
}
