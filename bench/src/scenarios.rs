//! `agentq bench --scenario timers|waiting`: the scheduler at scale and the cost of waiting,
//! with the scheduler and the worker as child processes of the bench.

use crate::Deployment;
use std::time::{Duration, Instant};

use agentq_core::broker::{self, Names};
use agentq_core::db;
use agentq_core::operation::Lane;
use agentq_producer::EnqueueRequest;
use chrono::Utc;
use indicatif::ProgressBar;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::Args;
use crate::common::{Proc, Report, commits_now, percentiles, stop_all};
use crate::fixtures;

/// 1M sleepers far in the future, then `due_per_sec` coming due each second for `due_secs`:
/// wake lag (due → queued and dispatched), idle CPU of the scheduler, and the due-query plan.
pub async fn timers(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let pool = config.connect().await?;
    eprintln!("inserting {} sleepers…", args.sleepers);
    let far = Utc::now() + chrono::Duration::days(30);
    fixtures::insert_sleepers(&pool, args.sleepers, far, 1.0).await?;

    let join_reads = if args.join_parents > 0 {
        eprintln!(
            "inserting {} parents parked on joins over {} children each…",
            args.join_parents, args.join_children
        );
        fixtures::insert_join_parents(&pool, args.join_parents, args.join_children).await?;
        // Warm, then time: the read as it is, and as it was before join counts.
        fixtures::time_join_reads(&pool).await?;
        Some(fixtures::time_join_reads(&pool).await?)
    } else {
        None
    };
    let scheduler = Proc::spawn(config, "scheduler", &[])?;

    // Idle: nothing due. Let it settle, then measure its CPU over 5 s.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu0, t0) = (scheduler.cpu_seconds(), Instant::now());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle_cpu_pct = (scheduler.cpu_seconds() - cpu0) / t0.elapsed().as_secs_f64() * 100.0;
    let scheduler_idle_rss = scheduler.rss_kib().0;
    let plan = db::timers::explain_wake_due(&pool).await?;

    let due = args.due_per_sec * args.due_secs;
    let first_due = Utc::now() + chrono::Duration::seconds(3);
    eprintln!("inserting {due} operations due over {} s…", args.due_secs);
    fixtures::insert_sleepers(&pool, due, first_due, 1000.0 / args.due_per_sec as f64).await?;
    let commits_before = db::commit_count(&pool).await?;
    // Sample the lane queue's depth: the i-th pointer (in due order) was in the queue by the
    // first sample whose depth exceeds i, which gives due → published without instrumenting
    // the scheduler.
    let conn = broker::connect(&config.amqp_url, "bench").await?;
    let names = Names::new(&config.namespace);
    let bar = ProgressBar::new(due as u64);
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut samples: Vec<(chrono::DateTime<Utc>, u32)> = Vec::new();
    loop {
        let depth = broker::queue_depth(&conn, &names, Lane::Interactive).await?;
        samples.push((Utc::now(), depth));
        bar.set_position(u64::from(depth));
        if i64::from(depth) >= due {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {depth} of {due} published in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bar.finish_and_clear();
    let _ = conn.close(200, "bench done".into()).await;
    let spacing = 1000.0 / args.due_per_sec as f64;
    let mut published_lags = Vec::with_capacity(due as usize);
    let mut k = 0;
    for i in 0..due {
        while k < samples.len() && i64::from(samples[k].1) <= i {
            k += 1;
        }
        let due_at =
            first_due + chrono::Duration::microseconds((i as f64 * spacing * 1000.0) as i64);
        let at = samples.get(k).map_or(samples[samples.len() - 1].0, |s| s.0);
        published_lags.push((at - due_at).num_microseconds().unwrap_or(0) as f64 / 1000.0);
    }
    let published = percentiles(published_lags);
    let lags = fixtures::wake_lags(&pool, first_due - chrono::Duration::milliseconds(1)).await?;
    let lag = percentiles(lags.clone());
    let max_lag = lags.iter().copied().fold(0.0, f64::max);
    let early = lags.iter().filter(|l| **l < 0.0).count();
    let all_published_at = samples[samples.len() - 1].0;
    let (peaks, polls) = stop_all(&pool, vec![scheduler]).await;
    pool.close().await;
    // Own queries: the commit count, the wake lags, the wait for sessions, a fresh session.
    let commits = commits_now(config).await? - commits_before - (polls as i64 + 3);
    let span_s = ((all_published_at - first_due).num_milliseconds() as f64 / 1000.0).max(0.001);

    let mut r = Report::new(
        "timers",
        format!(
            "agentq bench timers: {} sleepers, {} due/s for {} s, one scheduler process",
            args.sleepers, args.due_per_sec, args.due_secs
        ),
    );
    r.val("sleepers", "sleepers", json!(args.sleepers))
        .val("due/s offered", "due_per_s", json!(args.due_per_sec))
        .val("due s", "due_secs", json!(args.due_secs))
        .num(
            "timers published/s (first due → all in the queue)",
            "published_per_s",
            due as f64 / span_s,
            0,
        )
        .num(
            "wake lag p50 ms (due → queued)",
            "wake_lag_p50_ms",
            lag.p50,
            1,
        )
        .num("wake lag p99 ms", "wake_lag_p99_ms", lag.p99, 1)
        .num("wake lag max ms", "wake_lag_max_ms", max_lag, 1)
        .num(
            "publish lag p50 ms (due → in the queue)",
            "publish_lag_p50_ms",
            published.p50,
            1,
        )
        .num(
            "publish lag p99 ms (±20 ms sampling)",
            "publish_lag_p99_ms",
            published.p99,
            1,
        )
        .val("woken early", "woken_early", json!(early))
        .num(
            "commits/timer",
            "commits_per_timer",
            commits.max(0) as f64 / due as f64,
            3,
        )
        .num(
            "scheduler CPU % while idle",
            "idle_cpu_pct",
            idle_cpu_pct,
            2,
        )
        .val(
            "scheduler idle RSS KiB",
            "scheduler_idle_rss_kib",
            json!(scheduler_idle_rss),
        )
        .val(
            "due-timer query uses an index",
            "plan_uses_index",
            json!(plan.contains("Index Scan")),
        )
        .rss(&peaks);
    if let Some((count, scan)) = join_reads {
        r.val("join parents", "join_parents", json!(args.join_parents))
            .val(
                "children per join",
                "join_children",
                json!(args.join_children),
            )
            .num("join sweep read ms (counts, now)", "join_read_ms", count, 1)
            .num(
                "join sweep read ms (each child checked, before)",
                "join_read_scan_ms",
                scan,
                1,
            );
    }
    println!("  due-timer query plan:");
    for line in plan.lines() {
        println!("    {line}");
    }
    r.print();
    Ok(())
}

/// A worker process's memory with 0 and with `waiting` operations waiting for approval.
pub async fn waiting(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let pool = config.connect().await?;
    let worker = Proc::spawn(config, "worker", &[])?;
    let shutdown = CancellationToken::new();
    let scheduler = config.scheduler(pool.clone());
    let running = tokio::spawn(scheduler.run(shutdown.clone()));
    let (producer, dispatcher) = config.producer(pool.clone(), "bench");
    // Warm the worker up with one operation, so "0 waiting" is a worker that has run something.
    let warm = producer
        .enqueue(EnqueueRequest {
            tenant: "bench".into(),
            kind: "echo".into(),
            input: json!({ "text": "warm up" }),
            ..Default::default()
        })
        .await?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    while db::operations::find_operation(&pool, warm.op_id, None)
        .await?
        .map(|v| v.status)
        != Some(agentq_core::Status::Succeeded)
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the warm-up operation did not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (idle_rss, _) = worker.rss_kib();

    eprintln!(
        "enqueueing {} operations that wait for approval…",
        args.waiting
    );
    let bar = ProgressBar::new(args.waiting as u64);
    let program = json!({ "steps": [{ "wait_signal": "approval", "timeout_ms": 86_400_000u64 }] });
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (producer, next, bar, program, n) = (
            producer.clone(),
            next.clone(),
            bar.clone(),
            program.clone(),
            args.waiting,
        );
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                producer
                    .enqueue(EnqueueRequest {
                        tenant: "bench".into(),
                        kind: "script".into(),
                        input: program.clone(),
                        lane: agentq_core::Lane::Batch,
                        ..Default::default()
                    })
                    .await?;
                bar.inc(1);
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    bar.finish_and_clear();
    loop {
        let n = fixtures::count_status(&pool, "waiting").await?;
        if n as usize >= args.waiting {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "only {n} waiting in time");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (waiting_rss, peak_rss) = worker.rss_kib();
    worker.stop().await;
    shutdown.cancel();
    let _ = running.await;
    dispatcher.close().await;
    pool.close().await;
    println!("agentq bench waiting: worker process memory");
    println!("  {:<32} {:>9}", "RSS KiB, 0 waiting", idle_rss);
    println!(
        "  {:<32} {:>9}",
        format!("RSS KiB, {} waiting", args.waiting),
        waiting_rss
    );
    println!("  {:<32} {:>9}", "peak RSS KiB (while claiming)", peak_rss);
    println!(
        "{}",
        json!({ "scenario": "waiting", "waiting": args.waiting, "worker_rss_kib_idle": idle_rss,
                "worker_rss_kib_waiting": waiting_rss, "worker_peak_rss_kib": peak_rss })
    );
    Ok(())
}
