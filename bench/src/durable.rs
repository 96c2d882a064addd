//! `agentq bench --scenario durable-steps`: what it costs to make every step durable before the
//! next one starts, and what that buys when a worker is killed.
//!
//! 1. `--jobs` `script` operations of `--steps` no-op steps (`work_ms: 0`, the default
//!    durability), enqueued in bulk, then drained by the workers: durable steps/s (first claim →
//!    last finish), commits per step (the run's commits minus the enqueue's), and step latency
//!    (one completed step to the next in the same operation, the wait for the previous step's
//!    commit included).
//! 2. The same with model steps answered after `--model-latency-ms` (default 50).
//! 3. Crash cost: `agent` operations of five turns (four `kv_put` calls) against the latency
//!    provider, with the worker SIGKILLed `--kills` times spread over the run and restarted at
//!    once: model calls sent, journaled, sent again per kill, and sent again although already
//!    journaled (checked against the journal as each repeated call arrives; must be 0).

use crate::Deployment;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use agentq_core::config::CallLimit;
use agentq_core::db;
use agentq_producer::EnqueueRequest;
use anyhow::Context;
use chrono::Utc;
use serde_json::{Value, json};

use crate::Args;
use crate::common::{Percentiles, Proc, Report, percentiles, stop_all};
use crate::fixtures;
use crate::jobs::{Enqueue, Measured, bar, run_jobs};
use crate::model::LatencyModel;

/// Model latency of phase 2 when `--model-latency-ms` is not given.
const MODEL_LATENCY_MS: u64 = 50;
/// Turns of each agent in the crash-cost phase.
const AGENT_TURNS: usize = 5;
/// Most steps per operation (a longer program is one input too large to be useful here).
pub(crate) const MAX_STEPS: usize = 1000;
/// Agents in the crash-cost phase.
const AGENTS: usize = 200;

/// One phase's figures.
struct Phase {
    measured: Measured,
    latency: Percentiles,
}

impl Phase {
    fn steps(&self, k: usize) -> f64 {
        (self.measured.jobs * k) as f64
    }
    fn steps_per_s(&self, k: usize) -> f64 {
        self.steps(k) / self.measured.drain().as_secs_f64()
    }
    /// The drain's commits (the run's minus the enqueue's) per step.
    fn commits_per_step(&self, k: usize) -> f64 {
        let m = &self.measured;
        let per_job = m.commits_per_job - m.enqueue_commits_per_job.unwrap_or(0.0);
        per_job * m.jobs as f64 / self.steps(k)
    }
}

async fn phase(
    config: &Deployment,
    args: &Args,
    step: Value,
    model_latency_ms: Option<u64>,
) -> anyhow::Result<Phase> {
    let input = json!({ "steps": vec![step; args.steps] });
    let since = Utc::now();
    let measured = run_jobs(
        config,
        args,
        "script",
        Arc::new(move |_| input.clone()),
        Enqueue::Batched,
        model_latency_ms,
    )
    .await?;
    let pool = config.connect().await?;
    let intervals = fixtures::step_intervals(&pool, since).await?;
    pool.close().await;
    Ok(Phase {
        measured,
        latency: percentiles(intervals),
    })
}

/// What the crash-cost phase counted.
struct CrashCost {
    kills: usize,
    sent: usize,
    journaled: i64,
    resent_journaled: usize,
}

async fn crash_cost(config: &Deployment, args: &Args, latency: u64) -> anyhow::Result<CrashCost> {
    let mut config = config.clone();
    // Short leases so a killed worker's operations come back in seconds; every kill may hit
    // the same operation without it being taken for a crash loop.
    config.lease_ttl_secs = 3;
    config.restart_limit = 1000;
    let pool = config.connect().await?;
    let model = LatencyModel::agent(Duration::from_millis(latency), AGENT_TURNS, pool.clone())
        .await
        .context("starting the latency provider")?;
    config.model_base_url = Some(model.url.clone());
    config.model_concurrency = CallLimit::Fixed(usize::from(args.concurrency));
    config.model_tenant_concurrency = Some(usize::from(args.concurrency));
    let config = &config;
    let deadline = Duration::from_secs(args.timeout_secs);

    let (producer, dispatcher) = config.producer(pool.clone(), "bench");
    let reqs = (0..AGENTS)
        .map(|i| EnqueueRequest {
            tenant: "bench".into(),
            kind: "agent".into(),
            input: json!({ "user": format!("agent {i}"), "tools": ["kv_put"], "max_turns": AGENT_TURNS }),
            lane: args.lane,
            ..EnqueueRequest::default()
        })
        .collect();
    let bulk = producer.enqueue_many(reqs).await?;
    anyhow::ensure!(bulk.refused.is_empty(), "enqueue refused");
    dispatcher.close().await;

    let total = AGENTS * AGENT_TURNS;
    // Operations of the earlier phases.
    let before = fixtures::count_status(&pool, "succeeded").await? as usize;
    let mut procs = vec![Proc::spawn(config, "scheduler", &[])?];
    let mut worker = Proc::worker(config, args.concurrency)?;
    let progress = bar(total, "calls");
    let requests = || model.counters.requests.load(Ordering::SeqCst);
    for k in 1..=args.kills {
        // Kills spread evenly over the calls the workload needs.
        let at = total * k / (args.kills + 1);
        crate::poll_until(deadline, Duration::from_millis(5), || async {
            progress.set_position(requests() as u64);
            (requests() >= at).then_some(())
        })
        .await
        .context("the agents stopped calling the model")?;
        worker.stop().await;
        worker = Proc::worker(config, args.concurrency)?;
    }
    procs.push(worker);
    let done = crate::poll_until(deadline, Duration::from_millis(50), || async {
        progress.set_position(requests().min(total) as u64);
        let n = fixtures::count_status(&pool, "succeeded").await.ok()?;
        (n as usize >= before + AGENTS).then_some(())
    })
    .await;
    progress.finish_and_clear();
    if done.is_none() {
        let counts = db::operations::count_by_status(&pool)
            .await
            .unwrap_or_default();
        anyhow::bail!("not all agents succeeded within {deadline:?}: {counts:?}");
    }
    stop_all(&pool, procs).await;
    let journaled = fixtures::journaled_model_calls(&pool, "agent").await?;
    pool.close().await;
    Ok(CrashCost {
        kills: args.kills,
        sent: requests(),
        journaled,
        resent_journaled: model.counters.resent_journaled.load(Ordering::SeqCst),
    })
}

pub async fn durable_steps(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let k = args.steps;
    let latency = args.model_latency_ms.unwrap_or(MODEL_LATENCY_MS);
    eprintln!("no-op steps…");
    let noop = phase(config, args, json!({ "work_ms": 0 }), None).await?;
    eprintln!("model steps ({latency} ms)…");
    let model = phase(config, args, json!({ "model": "step" }), Some(latency)).await?;
    let crash = if args.kills > 0 {
        eprintln!("crash cost: {AGENTS} agents, {} SIGKILLs…", args.kills);
        Some(crash_cost(config, args, latency).await?)
    } else {
        None
    };

    let mut r = Report::new(
        "durable-steps",
        format!(
            "agentq bench durable-steps: {} operations × {k} steps, each durable before the next, {} worker process(es) × concurrency {}",
            args.jobs,
            args.workers.unwrap_or(1),
            args.concurrency
        ),
    );
    r.val("steps per phase", "steps", json!(args.jobs * k))
        .num(
            "no-op: durable steps/s",
            "steps_per_s",
            noop.steps_per_s(k),
            0,
        )
        .num(
            "no-op: commits/step",
            "commits_per_step",
            noop.commits_per_step(k),
            3,
        )
        .num(
            "no-op: step latency p50 ms",
            "step_p50_ms",
            noop.latency.p50,
            2,
        )
        .num(
            "no-op: step latency p99 ms",
            "step_p99_ms",
            noop.latency.p99,
            2,
        )
        .num(
            &format!("model {latency} ms: durable steps/s"),
            "model_steps_per_s",
            model.steps_per_s(k),
            0,
        )
        .num(
            &format!("model {latency} ms: commits/step"),
            "model_commits_per_step",
            model.commits_per_step(k),
            3,
        )
        .num(
            &format!("model {latency} ms: step latency p50 ms"),
            "model_step_p50_ms",
            model.latency.p50,
            2,
        )
        .num(
            &format!("model {latency} ms: step latency p99 ms"),
            "model_step_p99_ms",
            model.latency.p99,
            2,
        );
    if let Some(c) = crash {
        let resent = c.sent as i64 - c.journaled;
        r.val("crash: SIGKILLs", "crash_kills", json!(c.kills))
            .val("crash: model calls sent", "crash_calls_sent", json!(c.sent))
            .val(
                "crash: model calls journaled",
                "crash_calls_journaled",
                json!(c.journaled),
            )
            .num(
                "crash: calls re-sent per SIGKILL",
                "crash_resent_per_kill",
                resent as f64 / c.kills as f64,
                2,
            )
            .val(
                "crash: re-sent though journaled (must be 0)",
                "crash_resent_journaled",
                json!(c.resent_journaled),
            );
    }
    noop.measured.report_common(&mut r);
    r.print();
    Ok(())
}
