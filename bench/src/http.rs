//! `agentq bench --scenario http`: `POST /v1/operations` sustained by an in-process load
//! generator over loopback keep-alive connections. It reports requests/s and latency, and
//! checks that every 202 became exactly one stored operation: no duplicate op_id, none missing,
//! and no stored operation that no 202 announced.
//!
//! The API is the shipped router and state, served on `127.0.0.1:0` in this process, so the
//! clients and the server share the CPU (and the figures include both). No worker runs: the
//! operations stay queued, which is what enqueue leaves behind anyway.

use crate::Deployment;
use std::collections::{BTreeMap, HashSet};
use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentq_core::db;
use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::Args;
use crate::Refused;
use crate::common::max_rss_kib;
use crate::fixtures;

/// Load before the clock starts (connections opened, broker link up, caches warm). Its requests
/// are checked like the others but not timed.
const WARM_UP: Duration = Duration::from_secs(1);
/// The tenant of the producer tokens the connections use (one each).
const TENANT: &str = "bench";
/// A request with no answer by then is a transport error (the API abandons its own at 30 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the server may take to stop once the clients are done.
const SERVER_STOP: Duration = Duration::from_secs(10);
/// How long the API's dispatcher may take to mark its last published operations.
const MARK_DRAIN: Duration = Duration::from_secs(60);

/// The part of a 202 answer the check needs.
#[derive(Deserialize)]
struct Accepted {
    op_id: Uuid,
    created: bool,
}

/// What one connection's loop saw.
#[derive(Default)]
struct Tally {
    /// Milliseconds from send to the whole answer read, for requests sent after the warm-up.
    latencies_ms: Vec<f64>,
    /// Answers by status, for requests sent after the warm-up.
    statuses: BTreeMap<u16, u64>,
    /// Requests with no answer (connection error or [`REQUEST_TIMEOUT`]), after the warm-up.
    transport_errors: u64,
    /// The op_id of every 202, warm-up included: each must be one stored operation.
    op_ids: Vec<Uuid>,
    /// 202s whose body did not carry an op_id with `"created": true` (warm-up included).
    malformed: u64,
    /// The first answer to each status other than 202 (and to errors, under 0), to show why.
    samples: BTreeMap<u16, String>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.latencies_ms.extend(other.latencies_ms);
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        self.transport_errors += other.transport_errors;
        self.op_ids.extend(other.op_ids);
        self.malformed += other.malformed;
        for (status, text) in other.samples {
            self.samples.entry(status).or_insert(text);
        }
    }
}

/// When each connection starts timing and when it stops sending.
#[derive(Clone, Copy)]
struct Window {
    timed_from: Instant,
    until: Instant,
}

/// One keep-alive connection's loop: POST echo operations back to back until the window ends.
async fn connection(
    client: reqwest::Client,
    url: Arc<str>,
    auth: HeaderValue,
    c: usize,
    window: Window,
    answered: Arc<AtomicU64>,
) -> Tally {
    let mut tally = Tally::default();
    for i in 0u64.. {
        let sent = Instant::now();
        if sent >= window.until {
            break;
        }
        let body = format!(r#"{{"kind":"echo","input":{{"text":"connection {c} request {i}"}}}}"#);
        let answer = async {
            let response = client
                .post(&*url)
                .header(AUTHORIZATION, auth.clone())
                .header(CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await?;
            let status = response.status().as_u16();
            Ok::<_, reqwest::Error>((status, response.bytes().await?))
        }
        .await;
        let took_ms = sent.elapsed().as_secs_f64() * 1000.0;
        let timed = sent >= window.timed_from;
        let status = answer.as_ref().ok().map(|(s, _)| *s);
        match answer {
            Ok((202, body)) => match serde_json::from_slice::<Accepted>(&body) {
                Ok(a) if a.created => tally.op_ids.push(a.op_id),
                _ => {
                    tally.malformed += 1;
                    tally
                        .samples
                        .entry(202)
                        .or_insert_with(|| String::from_utf8_lossy(&body).into_owned());
                }
            },
            Ok((status, body)) => {
                tally.samples.entry(status).or_insert_with(|| {
                    String::from_utf8_lossy(&body[..body.len().min(400)]).into_owned()
                });
            }
            Err(e) => {
                tally.samples.entry(0).or_insert_with(|| format!("{e:#}"));
            }
        }
        if timed {
            tally.latencies_ms.push(took_ms);
            match status {
                Some(s) => *tally.statuses.entry(s).or_default() += 1,
                None => tally.transport_errors += 1,
            }
            answered.fetch_add(1, Ordering::Relaxed);
        }
    }
    tally
}

/// How many of `ids` are stored operations (each id at most once: callers pass distinct ids).
async fn count_existing(pool: &sqlx::PgPool, ids: &[Uuid]) -> anyhow::Result<i64> {
    fixtures::count_existing(pool, ids)
        .await
        .context("looking up the accepted op_ids")
}

/// Queued operations whose pointer is not yet marked dispatched.
async fn count_unmarked(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    fixtures::count_unmarked(pool)
        .await
        .context("counting operations not marked dispatched")
}

/// The value at quantile `q` of sorted `ms`, by the same rule as [`crate::common::percentiles`].
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// `agentq bench --scenario http`: see the module docs.
pub async fn http(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    if args.connections == 0 || args.duration_secs == 0 {
        return Err(Refused("--connections and --duration-secs must be above 0".into()).into());
    }
    let mut config = config.clone();
    // With no worker draining them, a 20 s run at a few thousand requests/s stores more than
    // the default cap of unfinished operations (AGENTQ_TENANT_MAX_UNFINISHED, 100,000), after
    // which every request is a 429. This scenario measures enqueue, so the limit is lifted; 429s would
    // still be counted under their status.
    config.tenant_max_unfinished = i64::MAX / 2;
    let pool = config.connect().await?;
    // A token per connection, as producers each have their own (one token's rate,
    // AGENTQ_API_TOKEN_RATE, is a tenant's producer's, not the server's).
    let mut auths = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let (_, token) = db::access::create_token(&pool, TENANT, "producer", "bench")
            .await
            .context("creating a producer token")?;
        auths.push(
            HeaderValue::from_str(&format!("Bearer {token}"))
                .context("the token is not a header value")?,
        );
    }
    let commits_before = db::commit_count(&pool).await?;

    let shutdown = CancellationToken::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("listening on 127.0.0.1")?;
    let url: Arc<str> = format!("http://{}/v1/operations", listener.local_addr()?).into();
    let app = agentq_http::router(agentq_http::state(
        &config,
        config.app(pool.clone(), "api"),
        shutdown.clone(),
    ));
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.clone().cancelled_owned())
            .into_future(),
    );

    // One client for all loops; its pool keeps one idle connection per loop between requests.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.connections)
        .http1_only()
        .tcp_nodelay(true)
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .context("building the HTTP client")?;

    let bar = ProgressBar::new(args.duration_secs);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>7} [{bar:40}] {pos}/{len} s  {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix("warm-up");
    let answered = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let window = Window {
        timed_from: started + WARM_UP,
        until: started + WARM_UP + Duration::from_secs(args.duration_secs),
    };
    let loops: Vec<_> = (0..args.connections)
        .map(|c| {
            tokio::spawn(connection(
                client.clone(),
                url.clone(),
                auths[c].clone(),
                c,
                window,
                answered.clone(),
            ))
        })
        .collect();
    drop(client);
    let ticker = {
        let (bar, answered) = (bar.clone(), answered.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tick.tick().await;
                let now = Instant::now();
                if now < window.timed_from {
                    continue;
                }
                let secs = (now - window.timed_from).as_secs_f64();
                let n = answered.load(Ordering::Relaxed);
                bar.set_prefix("load");
                bar.set_position(secs as u64);
                bar.set_message(format!("{n} requests, {:.0}/s", n as f64 / secs));
            }
        })
    };
    let mut tally = Tally::default();
    for l in loops {
        tally.merge(l.await.context("a client connection failed")?);
    }
    // The window runs until the last request sent in it is answered.
    let elapsed = window.timed_from.elapsed();
    ticker.abort();
    bar.finish_and_clear();

    // Stop the server before counting, so no request is still being stored.
    shutdown.cancel();
    match tokio::time::timeout(SERVER_STOP, server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => eprintln!("warning: the API server stopped with an error: {e}"),
        Ok(Err(e)) => eprintln!("warning: the API server task failed: {e}"),
        Err(_) => eprintln!("warning: the API server did not stop within {SERVER_STOP:?}"),
    }

    // The API's dispatcher marks published operations dispatched in batches, in the
    // background, after their 202. With the server stopped its dispatcher is dropped and the
    // marker drains what is left; wait for that before closing the pool. Bounded: with no
    // scheduler running, a pointer whose publish failed is never marked.
    let unmarked_at_stop = count_unmarked(&pool).await?;
    let drain_started = Instant::now();
    let mut own_queries = 2;
    let drained = crate::poll_until(MARK_DRAIN, Duration::from_millis(50), || {
        own_queries += 1;
        async { (count_unmarked(&pool).await.ok()? == 0).then_some(()) }
    })
    .await;
    let drain_secs = drain_started.elapsed().as_secs_f64();
    if drained.is_none() {
        eprintln!(
            "warning: {} operations still not marked dispatched after {MARK_DRAIN:?}",
            count_unmarked(&pool).await.unwrap_or(-1)
        );
    }

    let stored: i64 = db::operations::count_by_status(&pool)
        .await
        .context("counting operations")?
        .iter()
        .map(|(_, n)| n)
        .sum();
    let distinct: Vec<Uuid> = tally
        .op_ids
        .iter()
        .copied()
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let found = count_existing(&pool, &distinct).await?;
    pool.close().await;
    // Own queries: the mark polls, the counts, and the fresh session reading the total.
    let commits = crate::common::commits_now(&config).await? - commits_before - own_queries - 3;
    let commits_per_op = commits.max(0) as f64 / stored.max(1) as f64;

    let accepted = tally.op_ids.len() as u64 + tally.malformed;
    let duplicates = (tally.op_ids.len() - distinct.len()) as u64;
    let missing = distinct.len() as u64 - found as u64;
    let unannounced = (stored - found).max(0) as u64;
    let mismatches = duplicates + missing + unannounced + tally.malformed;

    let requests = tally.latencies_ms.len();
    let secs = elapsed.as_secs_f64();
    let per_s = requests as f64 / secs;
    let mut ms = tally.latencies_ms;
    ms.sort_by(f64::total_cmp);
    let (p50, p90, p99) = (
        quantile(&ms, 0.50),
        quantile(&ms, 0.90),
        quantile(&ms, 0.99),
    );
    let max = ms.last().copied().unwrap_or(0.0);
    let rss = max_rss_kib();

    println!(
        "agentq bench http: POST /v1/operations, {} connections for {} s after a {} s warm-up, \
         DB pool {}, no worker",
        args.connections,
        args.duration_secs,
        WARM_UP.as_secs(),
        config.db_pool
    );
    println!("  {:<34} {:>10}", "requests", requests);
    println!("  {:<34} {:>10.0}", "requests/s", per_s);
    println!("  {:<34} {:>10.2}", "latency p50 ms", p50);
    println!("  {:<34} {:>10.2}", "latency p90 ms", p90);
    println!("  {:<34} {:>10.2}", "latency p99 ms", p99);
    println!("  {:<34} {:>10.2}", "latency max ms", max);
    for (status, n) in &tally.statuses {
        println!("  {:<34} {:>10}", format!("status {status}"), n);
    }
    println!(
        "  {:<34} {:>10}",
        "transport errors", tally.transport_errors
    );
    println!(
        "  {:<34} {:>10}",
        "202 answers (warm-up included)", accepted
    );
    println!("  {:<34} {:>10}", "operations stored", stored);
    println!("  {:<34} {:>10}", "op_ids answered twice", duplicates);
    println!("  {:<34} {:>10}", "op_ids answered, not stored", missing);
    println!("  {:<34} {:>10}", "stored, never answered 202", unannounced);
    println!("  {:<34} {:>10}", "mismatches", mismatches);
    println!(
        "  {:<34} {:>10}",
        "dispatch marks pending at stop", unmarked_at_stop
    );
    println!("  {:<34} {:>10.1}", "  drained in s", drain_secs);
    println!("  {:<34} {:>10.1}", "elapsed s", secs);
    println!("  {:<34} {:>10}", "peak RSS KiB (API + clients)", rss);
    println!("  {:<34} {:>10.2}", "commits/operation", commits_per_op);
    for (status, text) in &tally.samples {
        let what = if *status == 0 {
            "first transport error".to_string()
        } else {
            format!("first {status} answer")
        };
        eprintln!("{what}: {}", text.trim());
    }
    let statuses: serde_json::Map<String, serde_json::Value> = tally
        .statuses
        .iter()
        .map(|(s, n)| (s.to_string(), json!(n)))
        .collect();
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    println!(
        "{}",
        json!({
            "scenario": "http", "connections": args.connections,
            "duration_s": args.duration_secs, "db_pool": config.db_pool,
            "requests": requests, "requests_per_s": per_s.round(),
            "p50_ms": round(p50), "p90_ms": round(p90), "p99_ms": round(p99),
            "max_ms": round(max), "statuses": statuses,
            "transport_errors": tally.transport_errors, "accepted": accepted,
            "operations_stored": stored, "mismatches": mismatches,
            "exactly_once": mismatches == 0,
            "unmarked_at_stop": unmarked_at_stop, "mark_drain_s": round(drain_secs), "elapsed_s": round(secs), "max_rss_kib": rss,
            "commits_per_op": round(commits_per_op),
        })
    );
    anyhow::ensure!(
        accepted > 0,
        "no request was answered 202; see the answers above"
    );
    anyhow::ensure!(
        mismatches == 0,
        "{mismatches} of the 202 answers did not become exactly one operation"
    );
    Ok(())
}
