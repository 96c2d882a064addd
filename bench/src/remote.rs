//! `agentq bench --scenario remote --steps N`: a remote kind against the same kind in Rust.
//! Phase one runs `script` operations of N safe `work_ms: 0` steps (Rust, in the worker);
//! phase two runs the Python example service's `ten_steps` kind with `steps: N` (N safe steps
//! in the service, each journaled by the worker before the next call): steps/s, the time of a
//! step (an operation's run over N), and the bytes the worker sent the service per step,
//! counted on the wire by a proxy in front of the service (request heads and bodies).
//!
//! The service is `sdk/python/examples/refund_service.py` of agentq's source tree, run with
//! `python3` (`AGENTQ_BENCH_PYTHON`, `AGENTQ_BENCH_SERVICE_SCRIPT` override them).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::{Report, percentiles};
use crate::jobs::{Enqueue, Measured, run_jobs};
use crate::{Args, Deployment};

/// A TCP proxy to `upstream` counting the bytes clients send through it.
struct CountingProxy {
    url: String,
    sent: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    count: Option<Arc<AtomicU64>>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(c) = &count {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl CountingProxy {
    async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let sent = Arc::new(AtomicU64::new(0));
        let counted = sent.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, counted) = (upstream.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, Some(counted)), pipe(sr, cw, None));
                });
            }
        });
        Ok(Self { url, sent, task })
    }
}

/// The Python example service, killed when dropped.
struct Service {
    child: tokio::process::Child,
    addr: String,
}

impl Service {
    async fn start(secret: &str) -> anyhow::Result<Self> {
        let script = std::env::var("AGENTQ_BENCH_SERVICE_SCRIPT").unwrap_or_else(|_| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../sdk/python/examples/refund_service.py"
            )
            .into()
        });
        anyhow::ensure!(
            std::path::Path::new(&script).exists(),
            "the remote scenario runs sdk/python/examples/refund_service.py of agentq's source \
             tree, not found at {script}: set AGENTQ_BENCH_SERVICE_SCRIPT to it"
        );
        let python = std::env::var("AGENTQ_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = tokio::process::Command::new(&python)
            .arg(&script)
            .args(["--port", &port.to_string()])
            .env("AGENTQ_SERVICE_SECRET", secret)
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {python} {script}"))?;
        let addr = format!("127.0.0.1:{port}");
        crate::poll_until(
            Duration::from_secs(30),
            Duration::from_millis(50),
            || async { TcpStream::connect(&addr).await.ok().map(|_| ()) },
        )
        .await
        .context("the Python service did not listen within 30 s")?;
        Ok(Self { child, addr })
    }
}

/// Per-step figures of one phase.
fn per_step(m: &Measured, steps: usize) -> (f64, f64, f64) {
    let run = percentiles(m.run_ms().iter().map(|t| t / steps as f64).collect());
    let steps_per_s = (m.jobs * steps) as f64 / m.drain().as_secs_f64().max(1e-9);
    (steps_per_s, run.p50, run.p99)
}

pub async fn remote(config: &Deployment, args: &Args) -> anyhow::Result<()> {
    let steps = args.steps;
    let secret = agentq_core::webhook::Secret::generate().expose();
    let mut service = Service::start(&secret).await?;
    let proxy = CountingProxy::start(service.addr.clone()).await?;
    let pool = config.connect().await?;
    let app = config.app(pool.clone(), "bench");
    let admin = agentq_app::Caller::command_line("bench");
    let registered = agentq_app::services::register(
        &app,
        &admin,
        &agentq_app::services::ServiceRequest {
            url: proxy.url.clone(),
            secret: Some(secret),
            timeout_secs: None,
            allow_link_local: false,
        },
    )
    .await;
    app.dispatcher.close().await;
    registered.context("registering the Python service")?;
    config.kinds.load_services(&pool).await?;

    eprintln!("Rust: script operations of {steps} safe steps…");
    let program: Vec<Value> = (0..steps).map(|_| json!({ "work_ms": 0 })).collect();
    let rust_input = json!({ "steps": program });
    let rust = run_jobs(
        config,
        args,
        "script",
        Arc::new(move |_| rust_input.clone()),
        Enqueue::OneByOne,
        None,
    )
    .await?;
    eprintln!("remote: ten_steps operations of {steps} safe steps in the Python service…");
    let before = proxy.sent.load(Ordering::Relaxed);
    let remote = run_jobs(
        config,
        args,
        "ten_steps",
        Arc::new(move |_| json!({ "steps": steps })),
        Enqueue::OneByOne,
        None,
    )
    .await?;
    let sent = proxy.sent.load(Ordering::Relaxed) - before;
    let _ = service.child.kill().await;

    let (r_sps, r_p50, r_p99) = per_step(&rust, steps);
    let (p_sps, p_p50, p_p99) = per_step(&remote, steps);
    let mut r = Report::new(
        "remote",
        format!(
            "agentq bench remote: {} operations of {steps} safe steps, in Rust (script) and in \
             a Python service (ten_steps), {} producers, concurrency {}",
            args.jobs, args.producers, args.concurrency
        ),
    );
    r.val("steps per operation", "steps", json!(steps))
        .num("Rust: steps/s", "rust_steps_per_s", r_sps, 0)
        .num("Rust: ms per step, p50", "rust_step_p50_ms", r_p50, 3)
        .num("Rust: ms per step, p99", "rust_step_p99_ms", r_p99, 3)
        .num(
            "Rust: commits/job",
            "rust_commits_per_job",
            rust.commits_per_job,
            2,
        )
        .num("remote: steps/s", "remote_steps_per_s", p_sps, 0)
        .num("remote: ms per step, p50", "remote_step_p50_ms", p_p50, 3)
        .num("remote: ms per step, p99", "remote_step_p99_ms", p_p99, 3)
        .num(
            "remote: commits/job",
            "remote_commits_per_job",
            remote.commits_per_job,
            2,
        )
        .num(
            "remote: bytes sent per step (wire, heads + bodies)",
            "remote_bytes_per_step",
            sent as f64 / (remote.jobs * steps) as f64,
            0,
        );
    remote.report_common(&mut r);
    r.print();
    Ok(())
}
