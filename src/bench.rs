//! `agentq bench`: end-to-end throughput and latency of `echo` operations in a throwaway
//! database and namespace, so it never touches real data and cleans up after itself.
//!
//! Enqueue is one operation per call (the webhook path), from `--producers` concurrent callers.
//! Start latency is creation → first step started; done latency is creation → finished.
//! `commits_per_job` is the database's committed transactions during the run (minus the
//! benchmark's own progress polls) divided by the number of jobs.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentq_core::broker::{self, Names};
use agentq_core::{Config, db};
use agentq_producer::EnqueueRequest;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::cli::{BenchArgs, Scenario};
use crate::commands::{self, Refused};

pub async fn run(mut config: Config, args: BenchArgs) -> anyhow::Result<()> {
    if args.jobs == 0 || args.producers == 0 || args.concurrency == 0 {
        return Err(Refused("--jobs, --producers and --concurrency must be above 0".into()).into());
    }
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    config.database_url = db::with_database(&config.database_url, &format!("agentq_bench_{tag}"))?;
    config.namespace = format!("agentq-bench-{tag}");
    db::migrate(&config.database_url)
        .await
        .context("creating the benchmark database")?;
    let outcome = match args.scenario {
        Scenario::Throughput => measure(&config, &args).await.map(|r| print_report(&r)),
        Scenario::Timers => crate::bench_scenarios::timers(&config, &args).await,
        Scenario::Waiting => crate::bench_scenarios::waiting(&config, &args).await,
        Scenario::Http => crate::bench_http::http(&config, &args).await,
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

struct Report {
    jobs: usize,
    lane: String,
    concurrency: u16,
    producers: usize,
    workers: String,
    elapsed: Duration,
    enqueue_elapsed: Duration,
    start: Percentiles,
    done: Percentiles,
    commits_per_job: f64,
    max_rss_kib: u64,
    /// Peak RSS of the worker processes (with `--workers`).
    worker_peak_rss_kib: Option<u64>,
    /// With `--model-latency-ms`: the fake provider's peak concurrent calls, and all calls.
    model: Option<(usize, usize)>,
}

#[derive(Default)]
pub(crate) struct Percentiles {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
}

pub(crate) fn percentiles(mut ms: Vec<f64>) -> Percentiles {
    if ms.is_empty() {
        return Percentiles::default();
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    Percentiles {
        p50: at(0.50),
        p99: at(0.99),
    }
}

async fn measure(config: &Config, args: &BenchArgs) -> anyhow::Result<Report> {
    // With a model latency, every call goes to a fake provider that answers after it.
    let fake = match args.model_latency_ms {
        Some(ms) => Some(crate::bench_model::LatencyModel::start(Duration::from_millis(ms)).await?),
        None => None,
    };
    let mut config = config.clone();
    if let Some(f) = &fake {
        config.model_base_url = Some(f.url.clone());
        config.model_concurrency = usize::from(args.concurrency);
        config.model_tenant_concurrency = usize::from(args.concurrency);
        config.model_first_byte_secs = config
            .model_first_byte_secs
            .max(args.model_latency_ms.unwrap_or(0) / 1000 + 60);
    }
    let config = &config;
    let pool = commands::connect(config).await?;
    let shutdown = CancellationToken::new();

    // Workers: in-process by default, or separate processes.
    let mut children = Vec::new();
    let mut engines = Vec::new();
    if let Some(n) = args.workers {
        let exe = std::env::current_exe().context("finding the agentq executable")?;
        for _ in 0..n {
            let child = tokio::process::Command::new(&exe)
                .arg("worker")
                .arg("--concurrency")
                .arg(args.concurrency.to_string())
                .env("DATABASE_URL", &config.database_url)
                .env("AMQP_URL", &config.amqp_url)
                .env("AGENTQ_NAMESPACE", &config.namespace)
                .env(
                    "AGENTQ_MODEL_CONCURRENCY",
                    config.model_concurrency.to_string(),
                )
                .env(
                    "AGENTQ_MODEL_TENANT_CONCURRENCY",
                    config.model_tenant_concurrency.to_string(),
                )
                .env(
                    "AGENTQ_MODEL_FIRST_BYTE_SECS",
                    config.model_first_byte_secs.to_string(),
                )
                .envs(
                    config
                        .model_base_url
                        .as_ref()
                        .map(|u| ("AGENTQ_MODEL_BASE_URL", u.clone())),
                )
                .env("RUST_LOG", "warn")
                .kill_on_drop(true)
                .spawn()
                .context("starting a worker process")?;
            children.push(child);
        }
    } else {
        let worker = commands::worker(config, pool.clone(), Some(args.concurrency))?;
        engines.push(tokio::spawn(worker.run(shutdown.clone())));
    }
    let scheduler = commands::scheduler(config, pool.clone());
    engines.push(tokio::spawn(scheduler.run(shutdown.clone())));

    let (producer, dispatcher) = commands::producer(config, pool.clone(), "bench");
    // Open the broker link (and declare the topology) before the clock starts.
    dispatcher
        .with_connection(async |_| Ok(()))
        .await
        .context("connecting to RabbitMQ")?;

    let commits_before = db::commit_count(&pool).await?;
    let polls = AtomicUsize::new(0);
    let bar = ProgressBar::new(args.jobs as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>9} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message("enqueue");

    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut enqueuers = Vec::new();
    for _ in 0..args.producers {
        let producer = producer.clone();
        let next = next.clone();
        let bar = bar.clone();
        let (jobs, lane) = (args.jobs, args.lane);
        enqueuers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= jobs {
                    return anyhow::Ok(());
                }
                producer
                    .enqueue(EnqueueRequest {
                        tenant: "bench".into(),
                        kind: "echo".into(),
                        input: json!({ "text": format!("document {i}") }),
                        lane,
                        ..EnqueueRequest::default()
                    })
                    .await?;
                bar.inc(1);
            }
        }));
    }
    for e in enqueuers {
        e.await??;
    }
    let enqueue_elapsed = started.elapsed();

    bar.set_position(0);
    bar.set_message("succeeded");
    let deadline = Duration::from_secs(args.timeout_secs);
    let finished = commands::poll_until(deadline, Duration::from_millis(20), || async {
        polls.fetch_add(1, Ordering::Relaxed);
        let counts = db::count_by_status(&pool).await.ok()?;
        let done: i64 = counts
            .iter()
            .filter(|(s, _)| s == "succeeded")
            .map(|(_, n)| n)
            .sum();
        bar.set_position(done as u64);
        (done as usize >= args.jobs).then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    if finished.is_none() {
        let counts = db::count_by_status(&pool).await.unwrap_or_default();
        anyhow::bail!("not all operations succeeded within {deadline:?}: {counts:?}");
    }

    shutdown.cancel();
    for e in engines {
        let _ = e.await;
    }
    dispatcher.close().await;
    // The workers' own peak memory (separate processes), before they go.
    let worker_peak_rss_kib = children
        .iter()
        .filter_map(|c| c.id())
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("VmHWM:"))
                        .and_then(|l| l.split_whitespace().nth(1))
                        .and_then(|n| n.parse::<u64>().ok())
                })
                .unwrap_or(0)
        })
        .max();
    for mut c in children {
        let _ = c.kill().await;
    }
    // Backends flush their statistics when they exit: close every connection, then count.
    let timings = db::finished_timings(&pool).await?;
    pool.close().await;
    let pool = commands::connect(config).await?;
    let commits_after = db::commit_count(&pool).await?;
    pool.close().await;
    let own = polls.load(Ordering::Relaxed) as i64 + 2;
    let commits = (commits_after - commits_before - own).max(0);

    let ms = |a: chrono::DateTime<chrono::Utc>, b: chrono::DateTime<chrono::Utc>| {
        (b - a).num_microseconds().unwrap_or(0) as f64 / 1000.0
    };
    Ok(Report {
        jobs: args.jobs,
        lane: args.lane.to_string(),
        concurrency: args.concurrency,
        producers: args.producers,
        workers: args
            .workers
            .map(|n| format!("{n} processes"))
            .unwrap_or_else(|| "in-process".into()),
        elapsed,
        enqueue_elapsed,
        start: percentiles(timings.iter().map(|(c, s, _)| ms(*c, *s)).collect()),
        done: percentiles(timings.iter().map(|(c, _, f)| ms(*c, *f)).collect()),
        commits_per_job: commits as f64 / args.jobs as f64,
        max_rss_kib: max_rss_kib(),
        worker_peak_rss_kib,
        model: fake.as_ref().map(|f| {
            (
                f.counters.peak.load(std::sync::atomic::Ordering::SeqCst),
                f.counters
                    .requests
                    .load(std::sync::atomic::Ordering::SeqCst),
            )
        }),
    })
}

async fn cleanup(config: &Config) {
    if let Err(e) = db::drop_database(&config.database_url).await {
        eprintln!("warning: dropping the benchmark database: {e}");
    }
    match broker::connect(&config.amqp_url, "bench-cleanup").await {
        Ok(conn) => {
            if let Err(e) = broker::delete_topology(&conn, &Names::new(&config.namespace)).await {
                eprintln!("warning: deleting the benchmark namespace: {e}");
            }
        }
        Err(e) => eprintln!("warning: deleting the benchmark namespace: {e}"),
    }
}

/// Peak resident memory of this process (the in-process worker included), from /proc.
pub(crate) fn max_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

fn print_report(r: &Report) {
    let secs = r.elapsed.as_secs_f64();
    let jobs_per_s = r.jobs as f64 / secs;
    let enqueue_per_s = r.jobs as f64 / r.enqueue_elapsed.as_secs_f64();
    println!(
        "agentq bench: {} echo operations, lane {}, concurrency {}, {} producers, workers {}",
        r.jobs, r.lane, r.concurrency, r.producers, r.workers
    );
    println!("  {:<22} {:>10.0}", "jobs/s (end to end)", jobs_per_s);
    println!("  {:<22} {:>10.0}", "enqueue/s", enqueue_per_s);
    println!("  {:<22} {:>10.1}", "start p50 ms", r.start.p50);
    println!("  {:<22} {:>10.1}", "start p99 ms", r.start.p99);
    println!("  {:<22} {:>10.1}", "done p50 ms", r.done.p50);
    println!("  {:<22} {:>10.1}", "done p99 ms", r.done.p99);
    println!("  {:<22} {:>10.2}", "commits/job", r.commits_per_job);
    println!("  {:<22} {:>10.1}", "elapsed s", secs);
    println!("  {:<22} {:>10}", "max RSS KiB", r.max_rss_kib);
    if let Some(w) = r.worker_peak_rss_kib {
        println!("  {:<22} {:>10}", "worker peak RSS KiB", w);
    }
    if let Some((peak, calls)) = r.model {
        println!("  {:<22} {:>10}", "model calls in flight", peak);
        println!("  {:<22} {:>10}", "model calls", calls);
    }
    let mut line = json!({
        "jobs": r.jobs,
        "lane": r.lane,
        "concurrency": r.concurrency,
        "producers": r.producers,
        "workers": r.workers,
        "elapsed_s": (secs * 1000.0).round() / 1000.0,
        "jobs_per_s": jobs_per_s.round(),
        "enqueue_per_s": enqueue_per_s.round(),
        "start_p50_ms": r.start.p50,
        "start_p99_ms": r.start.p99,
        "done_p50_ms": r.done.p50,
        "done_p99_ms": r.done.p99,
        "commits_per_job": (r.commits_per_job * 100.0).round() / 100.0,
        "max_rss_kib": r.max_rss_kib,
    });
    if let Some(w) = r.worker_peak_rss_kib {
        line["worker_peak_rss_kib"] = json!(w);
    }
    if let Some((peak, calls)) = r.model {
        line["model_peak_concurrency"] = json!(peak);
        line["model_calls"] = json!(calls);
    }
    println!("{line}");
}
