//! `agentq bench --scenario e2e|batch|steps|inflight`: operations through the whole system, with
//! the worker and the scheduler as child processes of the bench (their own memory, their own
//! database sessions) and the producers in the bench process.
//!
//! Timings come from the database: created → first step started (`start`), created → finished
//! (`done`). `commits/job` is `pg_stat_database.xact_commit` over the run, minus the bench's own
//! progress queries, divided by the jobs; it includes the scheduler's passes during the run.

use crate::Deployment;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use agentq_core::config::CallLimit;
use agentq_core::db;
use agentq_producer::EnqueueRequest;
use anyhow::Context;
use chrono::{DateTime, Utc};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

use crate::Args;
use crate::common::{Percentiles, Proc, Report, commits_now, percentiles, stop_all};
use crate::fixtures;
use crate::model::LatencyModel;

/// Operations per `enqueue_many` call in the `batch` scenario.
const BATCH_CHUNK: usize = 1000;
/// Model latency of `inflight` when `--model-latency-ms` is not given.
const INFLIGHT_LATENCY_MS: u64 = 2000;

/// How the operations reach the database.
#[derive(Clone, Copy)]
pub(crate) enum Enqueue {
    /// `--producers` concurrent callers, one `enqueue` each, with the workers already running.
    OneByOne,
    /// `enqueue_many` in chunks of [`BATCH_CHUNK`] with no worker running; then the workers
    /// start and drain the backlog.
    Batched,
}

/// What one run of operations measured.
pub(crate) struct Measured {
    pub(crate) jobs: usize,
    /// First enqueue → last operation finished.
    pub(crate) elapsed: Duration,
    enqueue_elapsed: Duration,
    /// (created, first step started, finished) of each measured operation.
    timings: Vec<(DateTime<Utc>, DateTime<Utc>, DateTime<Utc>)>,
    /// Commits per job: all of them, and (batched) those of the enqueue alone.
    pub(crate) commits_per_job: f64,
    pub(crate) enqueue_commits_per_job: Option<f64>,
    /// The first worker's RSS after one operation, with nothing running (one-by-one only).
    worker_idle_rss_kib: Option<u64>,
    peaks: Vec<(&'static str, u64)>,
    /// With a latency model: peak calls in flight, all calls, calls refused past its capacity.
    model: Option<(usize, usize, usize)>,
}

impl Measured {
    fn ms(a: DateTime<Utc>, b: DateTime<Utc>) -> f64 {
        (b - a).num_microseconds().unwrap_or(0) as f64 / 1000.0
    }
    fn start(&self) -> Percentiles {
        percentiles(
            self.timings
                .iter()
                .map(|(c, s, _)| Self::ms(*c, *s))
                .collect(),
        )
    }
    fn done(&self) -> Percentiles {
        percentiles(
            self.timings
                .iter()
                .map(|(c, _, f)| Self::ms(*c, *f))
                .collect(),
        )
    }
    /// First step started → finished: the run of one operation, without its queueing.
    pub(crate) fn run_ms(&self) -> Vec<f64> {
        self.timings
            .iter()
            .map(|(_, s, f)| Self::ms(*s, *f))
            .collect()
    }
    /// First step started (≈ first claim) → last finished, over all operations.
    pub(crate) fn drain(&self) -> Duration {
        let first = self.timings.iter().map(|t| t.1).min();
        let last = self.timings.iter().map(|t| t.2).max();
        match (first, last) {
            (Some(a), Some(b)) => (b - a).to_std().unwrap_or_default(),
            _ => Duration::ZERO,
        }
    }
    pub(crate) fn report_common(&self, r: &mut Report) {
        let (start, done) = (self.start(), self.done());
        r.num(
            "start p50 ms (created → running)",
            "start_p50_ms",
            start.p50,
            1,
        )
        .num("start p99 ms", "start_p99_ms", start.p99, 1)
        .num(
            "done p50 ms (created → finished)",
            "done_p50_ms",
            done.p50,
            1,
        )
        .num("done p99 ms", "done_p99_ms", done.p99, 1)
        .num("commits/job", "commits_per_job", self.commits_per_job, 2);
        if let Some((peak, calls, refused)) = self.model {
            r.val(
                "model calls in flight (peak)",
                "model_peak_concurrency",
                json!(peak),
            )
            .val("model calls", "model_calls", json!(calls))
            .val("model calls refused (503)", "model_refused", json!(refused));
        }
        if let Some(idle) = self.worker_idle_rss_kib {
            r.val("worker idle RSS KiB", "worker_idle_rss_kib", json!(idle));
        }
        r.num("elapsed s", "elapsed_s", self.elapsed.as_secs_f64(), 2);
        r.rss(&self.peaks);
    }
}

pub(crate) fn bar(len: usize, msg: &'static str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>9} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
}

/// Runs `jobs` operations of `kind` (input `input(i)`) through child-process workers and a
/// scheduler, and measures them.
pub(crate) async fn run_jobs(
    config: &Deployment,
    args: &Args,
    kind: &str,
    input: Arc<dyn Fn(usize) -> Value + Send + Sync>,
    enqueue: Enqueue,
    model_latency_ms: Option<u64>,
) -> anyhow::Result<Measured> {
    let fake = match model_latency_ms {
        Some(ms) => {
            Some(LatencyModel::with_capacity(Duration::from_millis(ms), args.model_capacity).await?)
        }
        None => None,
    };
    let mut config = config.clone();
    if let Some(f) = &fake {
        config.model_base_url = Some(f.url.clone());
        if let Some(calls) = args.model_calls.map(usize::from) {
            config.model_concurrency = CallLimit::Fixed(calls);
            config.model_tenant_concurrency = Some(calls);
        }
        config.model_first_byte_secs = config
            .model_first_byte_secs
            .max(model_latency_ms.unwrap_or(0) / 1000 + 60);
    }
    let config = &config;
    let workers = args.workers.unwrap_or(1);
    let deadline = Duration::from_secs(args.timeout_secs);
    let pool = config.connect().await?;
    // The bench's own queries on `pool` (not part of any job's cost).
    let own = AtomicUsize::new(0);
    let succeeded = async || {
        own.fetch_add(1, Ordering::Relaxed);
        let n = fixtures::count_status(&pool, "succeeded").await.ok()?;
        Some(n as usize)
    };
    // Every operation names rate key `bench`, under a limit of `--rate-limit-tokens` per minute
    // (set before any worker starts; a limit nobody is near measures what a limit costs).
    let rate_key = match args.rate_limit_tokens {
        Some(tokens) => {
            let spec = db::rate_limits::Spec {
                scope: db::rate_limits::Scope::Key,
                name: "bench".into(),
                tenant: "bench".into(),
                window_secs: 60,
                max_tokens: Some(tokens),
                max_requests: None,
            };
            db::rate_limits::set(&pool, &spec, "bench", None).await?;
            Some("bench".to_string())
        }
        None => None,
    };
    let mut procs = vec![Proc::spawn(config, "scheduler", &[])?];
    let mut worker_idle_rss_kib = None;
    // Operations that succeeded before this run (an earlier phase of the scenario) and the
    // warm-up: not part of this run's count.
    let mut warm = succeeded().await.unwrap_or(0);
    if matches!(enqueue, Enqueue::OneByOne) {
        for _ in 0..workers {
            procs.push(Proc::worker(config, args.concurrency)?);
        }
    }
    // The producer has a pool of its own, closed after the enqueue so its commits are counted.
    let ppool = config.connect().await?;
    let (producer, dispatcher) = config.producer(ppool.clone(), "bench");
    dispatcher
        .with_connection(async |_| Ok(()))
        .await
        .context("connecting to RabbitMQ")?;
    if matches!(enqueue, Enqueue::OneByOne) {
        // One operation first: the workers are consuming, and "idle" is a worker that has run
        // something.
        producer
            .enqueue(EnqueueRequest {
                tenant: "bench".into(),
                kind: "echo".into(),
                input: json!({ "text": "warm up" }),
                rate_key: rate_key.clone(),
                ..EnqueueRequest::default()
            })
            .await?;
        warm += 1;
        crate::poll_until(deadline, Duration::from_millis(20), || async {
            (succeeded().await? >= warm).then_some(())
        })
        .await
        .context("the warm-up operation did not finish")?;
        worker_idle_rss_kib = procs.get(1).map(|w| w.rss_kib().0);
    }

    let commits_before = db::commit_count(&pool).await?;
    let t0 = Utc::now();
    let started = Instant::now();
    let progress = bar(args.jobs, "enqueue");
    match enqueue {
        Enqueue::OneByOne => {
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = Vec::new();
            for _ in 0..args.producers {
                let (producer, next, progress, input) = (
                    producer.clone(),
                    next.clone(),
                    progress.clone(),
                    input.clone(),
                );
                let (jobs, lane, kind) = (args.jobs, args.lane, kind.to_string());
                let rate_key = rate_key.clone();
                tasks.push(tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= jobs {
                            return anyhow::Ok(());
                        }
                        producer
                            .enqueue(EnqueueRequest {
                                tenant: "bench".into(),
                                kind: kind.clone(),
                                input: input(i),
                                lane,
                                rate_key: rate_key.clone(),
                                ..EnqueueRequest::default()
                            })
                            .await?;
                        progress.inc(1);
                    }
                }));
            }
            for t in tasks {
                t.await??;
            }
        }
        Enqueue::Batched => {
            for from in (0..args.jobs).step_by(BATCH_CHUNK) {
                let to = (from + BATCH_CHUNK).min(args.jobs);
                let reqs = (from..to)
                    .map(|i| EnqueueRequest {
                        tenant: "bench".into(),
                        kind: kind.to_string(),
                        input: input(i),
                        lane: args.lane,
                        rate_key: rate_key.clone(),
                        ..EnqueueRequest::default()
                    })
                    .collect();
                let bulk = producer.enqueue_many(reqs).await?;
                anyhow::ensure!(
                    bulk.refused.is_empty(),
                    "enqueue refused: {:?}",
                    bulk.refused.first()
                );
                progress.inc((to - from) as u64);
            }
        }
    }
    let enqueue_elapsed = started.elapsed();
    dispatcher.close().await;
    ppool.close().await;
    let enqueue_commits = match enqueue {
        Enqueue::OneByOne => None,
        Enqueue::Batched => {
            // Every pointer is published and marked: the drain starts from a full queue.
            crate::poll_until(deadline, Duration::from_millis(20), || async {
                own.fetch_add(1, Ordering::Relaxed);
                (fixtures::count_unmarked(&pool).await.ok()? == 0).then_some(())
            })
            .await
            .context("the enqueued operations were not all marked dispatched")?;
            own.fetch_add(1, Ordering::Relaxed);
            let n = db::commit_count(&pool).await?;
            for _ in 0..workers {
                procs.push(Proc::worker(config, args.concurrency)?);
            }
            Some(n - commits_before)
        }
    };

    progress.set_position(0);
    progress.set_message("succeeded");
    // Polled every 500 ms: each poll counts the finished operations, a query that competes with
    // the workload for the database (at 20 ms it took a sixth of PostgreSQL's statement time
    // during workload B, and at 100 ms still 1.2-1.6 s of the 20 s of statement time, 14 ms a
    // count once the table holds 25,000 operations); the run's end is read from the operations
    // themselves below, so the poll's period changes no figure.
    let finished = crate::poll_until(deadline, Duration::from_millis(500), || async {
        let done = succeeded().await?.saturating_sub(warm);
        progress.set_position(done as u64);
        (done >= args.jobs).then_some(())
    })
    .await;
    let polled = started.elapsed();
    progress.finish_and_clear();
    if finished.is_none() {
        let counts = db::operations::count_by_status(&pool)
            .await
            .unwrap_or_default();
        anyhow::bail!("not all operations succeeded within {deadline:?}: {counts:?}");
    }
    let model = fake.as_ref().map(|f| {
        (
            f.counters.peak.load(Ordering::SeqCst),
            f.counters.requests.load(Ordering::SeqCst),
            f.counters.refused.load(Ordering::SeqCst),
        )
    });
    let (peaks, polls) = stop_all(&pool, procs).await;
    let timings: Vec<_> = db::operations::finished_timings(&pool)
        .await?
        .into_iter()
        .filter(|(c, _, _)| *c >= t0)
        .collect();
    // First enqueue → the last operation's `finished_at` (the database's clock, on this host):
    // exact, whatever the poll's period.
    let elapsed = timings
        .iter()
        .map(|t| t.2)
        .max()
        .and_then(|last| (last - t0).to_std().ok())
        .unwrap_or(polled);
    pool.close().await;
    let commits_after = commits_now(config).await?;
    // Own queries: progress polls, the timings, the final count on a fresh session.
    let own = (own.load(Ordering::Relaxed) + polls + 2) as i64;
    let commits = (commits_after - commits_before - own).max(0);
    Ok(Measured {
        jobs: args.jobs,
        elapsed,
        enqueue_elapsed,
        timings,
        commits_per_job: commits as f64 / args.jobs as f64,
        enqueue_commits_per_job: enqueue_commits.map(|n| n as f64 / args.jobs as f64),
        worker_idle_rss_kib,
        peaks,
        model,
    })
}

fn echo(i: usize) -> Value {
    json!({ "text": format!("document {i}") })
}

/// `e2e` (alias `throughput`): one-by-one enqueue from concurrent producers, `echo`, end to end.
pub async fn e2e(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let m = run_jobs(
        config,
        args,
        "echo",
        Arc::new(echo),
        Enqueue::OneByOne,
        args.model_latency_ms,
    )
    .await?;
    let mut r = Report::new(
        "e2e",
        format!(
            "agentq bench e2e: {} echo operations, lane {}, {} producers, {} worker process(es) × concurrency {}",
            m.jobs,
            args.lane,
            args.producers,
            args.workers.unwrap_or(1),
            args.concurrency
        ),
    );
    if let Some(tokens) = args.rate_limit_tokens {
        r.val(
            "rate limit (key bench, tokens a minute)",
            "rate_limit_tokens",
            json!(tokens),
        );
    }
    r.val("jobs", "jobs", json!(m.jobs))
        .num(
            "jobs/s (end to end)",
            "jobs_per_s",
            m.jobs as f64 / m.elapsed.as_secs_f64(),
            0,
        )
        .num(
            "enqueue/s",
            "enqueue_per_s",
            m.jobs as f64 / m.enqueue_elapsed.as_secs_f64(),
            0,
        );
    m.report_common(&mut r);
    r.print();
    Ok(())
}

/// `batch`: `enqueue_many` in chunks of 1,000, then the workers drain the backlog (each
/// operation's model call answered by a fake provider after `--model-latency-ms`, if given).
pub async fn batch(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let m = run_jobs(
        config,
        args,
        "echo",
        Arc::new(echo),
        Enqueue::Batched,
        args.model_latency_ms,
    )
    .await?;
    let drain = m.drain().as_secs_f64();
    let run = percentiles(m.run_ms());
    let mut r = Report::new(
        "batch",
        format!(
            "agentq bench batch: {} echo operations enqueued {} per call, then drained by {} worker process(es) × concurrency {}",
            m.jobs,
            BATCH_CHUNK,
            args.workers.unwrap_or(1),
            args.concurrency
        ),
    );
    r.val("jobs", "jobs", json!(m.jobs))
        .num(
            "drained jobs/s (first claim → last finish)",
            "drain_jobs_per_s",
            m.jobs as f64 / drain,
            0,
        )
        .num(
            "enqueue/s (batched)",
            "enqueue_per_s",
            m.jobs as f64 / m.enqueue_elapsed.as_secs_f64(),
            0,
        )
        .num("drain s", "drain_s", drain, 2)
        .num("run p50 ms (running → finished)", "run_p50_ms", run.p50, 1)
        .num("run p99 ms", "run_p99_ms", run.p99, 1)
        .num(
            "enqueue commits/job",
            "enqueue_commits_per_job",
            m.enqueue_commits_per_job.unwrap_or(0.0),
            3,
        );
    m.report_common(&mut r);
    r.print();
    Ok(())
}

/// `steps`: a `script` of ten safe `work_ms: 0` steps against one of a single step; each
/// 10-step run (running → finished) minus the median 1-step run, over nine, is one sample of a
/// step's cost (the journal row, its key, the replay bookkeeping).
pub async fn steps(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let program = |n: usize| -> Arc<dyn Fn(usize) -> Value + Send + Sync> {
        let steps: Vec<Value> = (0..n).map(|_| json!({ "work_ms": 0 })).collect();
        let input = json!({ "steps": steps });
        Arc::new(move |_| input.clone())
    };
    eprintln!("1-step scripts…");
    let one = run_jobs(config, args, "script", program(1), Enqueue::OneByOne, None).await?;
    eprintln!("10-step scripts…");
    let ten = run_jobs(config, args, "script", program(10), Enqueue::OneByOne, None).await?;
    let (r1, r10) = (percentiles(one.run_ms()), percentiles(ten.run_ms()));
    // Each 10-step run minus the median 1-step run, over the nine extra steps.
    let per_step = percentiles(ten.run_ms().iter().map(|t| (t - r1.p50) / 9.0).collect());
    let mut r = Report::new(
        "steps",
        format!(
            "agentq bench steps: {} scripts of 1 and of 10 safe work_ms:0 steps, {} producers, concurrency {}",
            args.jobs, args.producers, args.concurrency
        ),
    );
    r.val("jobs per phase", "jobs", json!(args.jobs))
        .num(
            "journal ms per safe step, median",
            "step_overhead_p50_ms",
            per_step.p50,
            3,
        )
        .num(
            "journal ms per safe step, p99",
            "step_overhead_p99_ms",
            per_step.p99,
            3,
        )
        .num("1 step: run p50 ms", "one_step_run_p50_ms", r1.p50, 2)
        .num("1 step: run p99 ms", "one_step_run_p99_ms", r1.p99, 2)
        .num("10 steps: run p50 ms", "ten_steps_run_p50_ms", r10.p50, 2)
        .num("10 steps: run p99 ms", "ten_steps_run_p99_ms", r10.p99, 2)
        .num(
            "1 step: jobs/s",
            "one_step_jobs_per_s",
            one.jobs as f64 / one.elapsed.as_secs_f64(),
            0,
        )
        .num(
            "10 steps: jobs/s",
            "jobs_per_s",
            ten.jobs as f64 / ten.elapsed.as_secs_f64(),
            0,
        )
        .num(
            "10 steps: steps/s",
            "steps_per_s",
            10.0 * ten.jobs as f64 / ten.elapsed.as_secs_f64(),
            0,
        )
        .num(
            "1 step: commits/job",
            "one_step_commits_per_job",
            one.commits_per_job,
            2,
        );
    ten.report_common(&mut r);
    r.print();
    Ok(())
}

/// The model calls a worker sends at once with `args`: `--model-calls`, else the deployment's.
fn model_calls(args: &Args, config: &Deployment) -> String {
    args.model_calls
        .map_or(config.model_concurrency, |c| {
            CallLimit::Fixed(usize::from(c))
        })
        .to_string()
}

/// `inflight`: every model call answered by a fake provider after `--model-latency-ms`: how
/// many operations a worker keeps in flight, and what they cost in memory.
pub async fn inflight(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let latency = args.model_latency_ms.unwrap_or(INFLIGHT_LATENCY_MS);
    let m = run_jobs(
        config,
        args,
        "echo",
        Arc::new(echo),
        Enqueue::OneByOne,
        Some(latency),
    )
    .await?;
    let mut r = Report::new(
        "inflight",
        format!(
            "agentq bench inflight: {} echo operations, model latency {latency} ms, {} worker process(es) × concurrency {}, {} model calls at once",
            m.jobs,
            args.workers.unwrap_or(1),
            args.concurrency,
            model_calls(args, config)
        ),
    );
    r.val("jobs", "jobs", json!(m.jobs))
        .val("model latency ms", "model_latency_ms", json!(latency))
        .val(
            "model calls allowed at once",
            "model_concurrency",
            json!(model_calls(args, config)),
        )
        .num(
            "jobs/s (end to end)",
            "jobs_per_s",
            m.jobs as f64 / m.elapsed.as_secs_f64(),
            0,
        );
    m.report_common(&mut r);
    let (peak, _, _) = m.model.unwrap_or_default();
    let worker_peak = m
        .peaks
        .iter()
        .find(|(role, _)| *role == "worker")
        .map(|p| p.1);
    if let (Some(idle), Some(top)) = (m.worker_idle_rss_kib, worker_peak)
        && peak > 0
    {
        r.num(
            "worker KiB per operation in flight",
            "worker_kib_per_inflight",
            top.saturating_sub(idle) as f64 / peak as f64 * args.workers.unwrap_or(1) as f64,
            1,
        );
    }
    r.print();
    Ok(())
}
