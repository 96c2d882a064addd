//! `agentq bench`: every scenario runs in a throwaway database and broker namespace, so it never
//! touches real data, and deletes both afterwards (unless `--keep`). The scenarios are in
//! `bench_jobs`, `bench_scenarios`, `bench_http` and `bench_durable`; what they share
//! (processes, commit counting, percentiles, the report) in `bench_common`.

use crate::wiring::Deployment;
use agentq_core::broker::{self, Names};
use agentq_core::db;
use anyhow::Context;

use crate::cli::{BenchArgs, Scenario};
use crate::wiring::Refused;

pub async fn run(mut config: Deployment, args: BenchArgs) -> anyhow::Result<()> {
    if args.jobs == 0 || args.producers == 0 || args.concurrency == 0 || args.workers == Some(0) {
        return Err(Refused(
            "--jobs, --producers, --concurrency and --workers must be above 0".into(),
        )
        .into());
    }
    let max_steps = crate::bench_durable::MAX_STEPS;
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
        .filter(|k| config.registry.newest(k).is_none())
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
    let outcome = match args.scenario {
        Scenario::E2e => crate::bench_jobs::e2e(&config, &args).await,
        Scenario::Batch => crate::bench_jobs::batch(&config, &args).await,
        Scenario::Steps => crate::bench_jobs::steps(&config, &args).await,
        Scenario::Inflight => crate::bench_jobs::inflight(&config, &args).await,
        Scenario::Timers => crate::bench_scenarios::timers(&config, &args).await,
        Scenario::Waiting => crate::bench_scenarios::waiting(&config, &args).await,
        Scenario::Http => crate::bench_http::http(&config, &args).await,
        Scenario::DurableSteps => crate::bench_durable::durable_steps(&config, &args).await,
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
