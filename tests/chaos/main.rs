//! The chaos suite: a mixed workload of `script` operations on three workers and two
//! schedulers (the real `agentq` binary), while their PostgreSQL and RabbitMQ are restarted,
//! paused and cut off, and the processes are SIGKILLed. The servers are private to this test
//! (free ports, a temporary directory), the processes reach them through in-tree fault proxies.
//! At the end it checks that nothing was lost, duplicated or left hanging, and prints the
//! recovery time after each fault.
//!
//! Reduced size by default (part of `cargo test --workspace`); `AGENTQ_CHAOS_FULL=1` runs the
//! full size: 10,000 operations, 50 worker kills, 2 RabbitMQ restarts, 2 Postgres restarts, 1
//! Postgres pause. `CHAOS_SEED` picks the workload.

mod cluster;
mod proxy;
mod services;

/// The chaos tests run one at a time: each measures recovery times that a second one sharing
/// the two cores would distort.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use agentq_core::db;
use agentq_testkit::process;
use agentq_testkit::rng::Lcg;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::time::Instant;

use proxy::Proxy;
use services::{Postgres, Rabbit, Scratch};

/// The binary under test.
const AGENTQ: &str = env!("CARGO_BIN_EXE_agentq");
/// Lease length of the processes under test (the unit of "stuck").
const LEASE: Duration = Duration::from_secs(4);
/// How long a silent fault drops bytes: longer than a lease, so leases run out under it.
const SILENT: Duration = Duration::from_secs(2 * LEASE.as_secs());
/// Completions after a fault that count as "throughput resumed".
const RESUMED_AFTER: i64 = 10;
/// Crash recoveries an operation may take before `crash_loop` (several faults may hit it).
const RESTART_LIMIT: i32 = 10;
const TERMINAL: &str = "('succeeded', 'dead', 'cancelled', 'discarded')";

/// How big a run is.
struct Size {
    operations: usize,
    worker_kills: usize,
    scheduler_kills: usize,
    rabbit_restarts: usize,
    pg_restarts: usize,
    pg_pauses: usize,
    pause: Duration,
    /// Operations enqueued but not finished, at most.
    window: i64,
}

impl Size {
    fn from_env() -> Self {
        if std::env::var("AGENTQ_CHAOS_FULL").is_ok_and(|v| v == "1") {
            Size {
                operations: 10_000,
                worker_kills: 50,
                scheduler_kills: 4,
                rabbit_restarts: 2,
                pg_restarts: 2,
                pg_pauses: 1,
                pause: Duration::from_secs(20),
                window: 300,
            }
        } else {
            Size {
                operations: 1_200,
                worker_kills: 4,
                scheduler_kills: 1,
                rabbit_restarts: 1,
                pg_restarts: 1,
                pg_pauses: 1,
                pause: Duration::from_secs(20),
                window: 200,
            }
        }
    }
}

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    KillWorker,
    KillScheduler,
    RabbitRestart,
    PgRestart,
    PgPause,
    ProxyReset(Side),
    ProxyBlackhole(Side),
    /// Bytes dropped for longer than a lease, and the connections hit never reset.
    ProxySilent(Side),
    ProxyDelay(Side),
    ProxyCut(Side),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    Pg,
    Amqp,
}

impl Fault {
    fn name(self) -> String {
        let side = |s: Side| {
            if s == Side::Pg {
                "postgres"
            } else {
                "rabbitmq"
            }
        };
        match self {
            Fault::KillWorker => "SIGKILL worker".into(),
            Fault::KillScheduler => "SIGKILL scheduler".into(),
            Fault::RabbitRestart => "rabbitmq stop_app/start_app".into(),
            Fault::PgRestart => "postgres restart -m fast".into(),
            Fault::PgPause => "postgres SIGSTOP 20 s".into(),
            Fault::ProxyReset(s) => format!("proxy reset all ({})", side(s)),
            Fault::ProxyBlackhole(s) => format!("proxy blackhole 5 s ({})", side(s)),
            Fault::ProxySilent(s) => format!(
                "proxy silent {} s, no reset ({})",
                SILENT.as_secs(),
                side(s)
            ),
            Fault::ProxyDelay(s) => format!("proxy delay 300 ms for 5 s ({})", side(s)),
            Fault::ProxyCut(s) => format!("proxy cut mid-frame ({})", side(s)),
        }
    }

    /// Faults that can leave an unsafe step's outcome unknown: a kill or a database outage
    /// ends the lease of the step in flight, and a fault on a PostgreSQL connection (the
    /// ledger's) can lose the answer to a call that happened.
    fn can_lose_an_outcome(self) -> bool {
        !matches!(
            self,
            Fault::RabbitRestart
                | Fault::ProxyReset(Side::Amqp)
                | Fault::ProxyBlackhole(Side::Amqp)
                | Fault::ProxySilent(Side::Amqp)
                | Fault::ProxyDelay(Side::Amqp)
                | Fault::ProxyCut(Side::Amqp)
        )
    }
}

/// The faults of a run, heavy ones spread out and kills in between.
fn schedule(size: &Size) -> Vec<Fault> {
    let mut heavy = Vec::new();
    for side in [Side::Pg, Side::Amqp] {
        heavy.push(Fault::ProxyReset(side));
        heavy.push(Fault::ProxyCut(side));
        heavy.push(Fault::ProxyDelay(side));
        heavy.push(Fault::ProxyBlackhole(side));
        heavy.push(Fault::ProxySilent(side));
    }
    for i in 0..size.rabbit_restarts.max(size.pg_restarts) {
        if i < size.rabbit_restarts {
            heavy.insert(heavy.len().min(2 + 4 * i), Fault::RabbitRestart);
        }
        if i < size.pg_restarts {
            heavy.insert(heavy.len().min(4 + 4 * i), Fault::PgRestart);
        }
    }
    for _ in 0..size.pg_pauses {
        heavy.insert(heavy.len() / 2, Fault::PgPause);
    }
    for i in 0..size.scheduler_kills {
        heavy.insert((2 * i + 1).min(heavy.len()), Fault::KillScheduler);
    }
    // Kills evenly between the heavy faults.
    let slots = heavy.len() + 1;
    let mut all = Vec::new();
    for (i, f) in heavy.into_iter().enumerate() {
        let kills = size.worker_kills * (i + 1) / slots - size.worker_kills * i / slots;
        all.extend(std::iter::repeat_n(Fault::KillWorker, kills));
        all.push(f);
    }
    let placed = all.iter().filter(|f| **f == Fault::KillWorker).count();
    all.extend(std::iter::repeat_n(
        Fault::KillWorker,
        size.worker_kills - placed,
    ));
    all
}

/// A `script` program drawn from the mix: work, safe and unsafe ledger steps (half of the
/// unsafe ones reconcile), sleeps, waits for a signal the test sends, waits that time out and
/// continue, retryable failures. Returns it and whether the test must send it a `go` signal.
fn program(rng: &mut Lcg) -> (Value, bool) {
    let safe =
        |label: &str| json!({ "tool": "ledger", "replay": "safe", "label": label, "after_ms": 50 });
    match rng.below(20) {
        0..=5 => (
            json!([{ "work_ms": 50 + rng.below(250) }, safe("s0")]),
            false,
        ),
        6..=8 => (
            json!([safe("s0"), { "tool": "ledger", "replay": "unsafe", "label": "u1",
                     "after_ms": rng.below(300), "reconcile": rng.below(2) == 0 }]),
            false,
        ),
        9..=11 => (
            json!([{ "sleep_ms": 200 + rng.below(1300) }, safe("s1")]),
            false,
        ),
        12..=14 => (
            json!([{ "wait_signal": "go", "timeout_ms": 120_000 }, safe("s1")]),
            true,
        ),
        15 => (
            json!([{ "wait_signal": "never", "timeout_ms": 1000, "on_timeout": "continue" },
                   { "work_ms": 20 }]),
            false,
        ),
        16..=17 => (
            json!([{ "fail": "retryable", "times": 1 }, safe("s1")]),
            false,
        ),
        _ => (
            json!([{ "work_ms": 20 }, safe("s0"), { "work_ms": 20 }, safe("s1")]),
            false,
        ),
    }
}

/// The `agentq` processes under test, restarted when killed; one that exits by itself is
/// restarted too and counted (a process should never give up because a server went away).
struct Processes {
    env: Vec<(String, String)>,
    logs: std::path::PathBuf,
    workers: Vec<Child>,
    schedulers: Vec<Child>,
    started: usize,
    /// Processes that exited without being killed.
    exited: Vec<String>,
}

impl Processes {
    fn spawn(&mut self, role: &str) -> Child {
        self.started += 1;
        let log = self.logs.join(format!("{role}-{}.log", self.started));
        let mut cmd = process::command(AGENTQ, &[role], self.env.iter().cloned());
        process::spawn_logged(&mut cmd, &log)
    }

    fn kill(&mut self, role: &str, i: usize) {
        let child = if role == "worker" {
            &mut self.workers[i]
        } else {
            &mut self.schedulers[i]
        };
        process::stop(child);
        let fresh = self.spawn(role);
        if role == "worker" {
            self.workers[i] = fresh;
        } else {
            self.schedulers[i] = fresh;
        }
    }

    /// Restarts processes that exited by themselves; records them.
    fn supervise(&mut self) {
        for role in ["worker", "scheduler"] {
            let n = if role == "worker" {
                self.workers.len()
            } else {
                self.schedulers.len()
            };
            for i in 0..n {
                let child = if role == "worker" {
                    &mut self.workers[i]
                } else {
                    &mut self.schedulers[i]
                };
                if let Ok(Some(status)) = child.try_wait() {
                    self.exited.push(format!("{role} {i}: {status}"));
                    let fresh = self.spawn(role);
                    if role == "worker" {
                        self.workers[i] = fresh;
                    } else {
                        self.schedulers[i] = fresh;
                    }
                }
            }
        }
    }

    /// Lines of every log containing `needle`.
    fn count_in_logs(&self, needle: &str) -> usize {
        std::fs::read_dir(&self.logs)
            .map(|dir| {
                dir.flatten()
                    .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                    .map(|s| s.matches(needle).count())
                    .sum()
            })
            .unwrap_or(0)
    }
}

impl Drop for Processes {
    /// Kills the processes; with `AGENTQ_CHAOS_LOGS=DIR` their logs are copied there first
    /// (the scratch directory holding them is deleted).
    fn drop(&mut self) {
        self.workers
            .iter_mut()
            .chain(self.schedulers.iter_mut())
            .for_each(process::stop);
        if let Ok(keep) = std::env::var("AGENTQ_CHAOS_LOGS") {
            let _ = std::fs::create_dir_all(&keep);
            for e in std::fs::read_dir(&self.logs)
                .into_iter()
                .flatten()
                .flatten()
            {
                let _ = std::fs::copy(e.path(), std::path::Path::new(&keep).join(e.file_name()));
            }
        }
    }
}

/// Progress as seen by the monitor (straight to the private Postgres, not through a proxy).
#[derive(Default)]
struct Progress {
    terminal: AtomicI64,
    enqueued: AtomicI64,
    /// How many operations the enqueuer may have enqueued so far. A reserve of
    /// [`RESUMED_AFTER`] per fault is held back and released as each fault fires, so every
    /// fault leaves work behind it to measure the recovery on, however fast the machine runs
    /// the rest (on a quiet machine the workload could finish during a long fault, leaving the
    /// next one nothing to resume).
    released: AtomicI64,
}

async fn count_terminal(pool: &PgPool) -> Option<i64> {
    let q = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM operations WHERE status IN {TERMINAL}"
    )))
    .fetch_one(pool);
    tokio::time::timeout(Duration::from_secs(2), q)
        .await
        .ok()?
        .ok()
}

/// What happened to one fault.
struct Record {
    fault: Fault,
    /// From the injection to the end of the fault (server back, proxy healed, process restarted).
    outage: Duration,
    /// From the end of the fault until [`RESUMED_AFTER`] more operations finished.
    recovery: Option<Duration>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_workload_survives_kills_restarts_pauses_and_network_faults() {
    let _serial = SERIAL.lock().await;
    let size = Size::from_env();
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xc4a05_u64);
    let run_started = Instant::now();
    let tag = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    // Declared in this order so they drop in reverse: processes, proxies, servers, directory.
    let scratch = Scratch::new(&tag);
    let pg = Postgres::start(&scratch.path);
    let rabbit = Rabbit::start(&scratch.path, &tag);
    let pg_proxy = Proxy::start(pg.addr()).await;
    let amqp_proxy = Proxy::start(rabbit.addr()).await;

    let direct_db = format!("postgres://postgres@127.0.0.1:{}/agentq_chaos", pg.port);
    let proxied_db = format!(
        "postgres://postgres@127.0.0.1:{}/agentq_chaos",
        pg_proxy.addr.port()
    );
    let direct_amqp = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
    // Heartbeats scaled with the lease as the database deadline is (production: 10 s against a
    // 30 s lease): a connection that went silent is given up after two missed beats.
    let proxied_amqp = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f?heartbeat=2",
        amqp_proxy.addr.port()
    );
    db::migrate(&direct_db).await.expect("migrating");
    let pool = db::connect(&direct_db, 8).await.unwrap();
    let namespace = format!("chaos-{tag}");
    println!(
        "chaos: seed {seed}, {} operations, postgres :{} (proxy :{}), rabbitmq :{} (proxy :{})",
        size.operations,
        pg.port,
        pg_proxy.addr.port(),
        rabbit.port,
        amqp_proxy.addr.port()
    );

    let logs = scratch.path.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let env: Vec<(String, String)> = [
        ("DATABASE_URL", proxied_db.as_str()),
        ("AMQP_URL", proxied_amqp.as_str()),
        ("AGENTQ_NAMESPACE", namespace.as_str()),
        ("AGENTQ_LEASE_TTL_SECS", &LEASE.as_secs().to_string()),
        ("AGENTQ_RESTART_LIMIT", &RESTART_LIMIT.to_string()),
        ("AGENTQ_DISPATCH_GRACE_SECS", "1"),
        // The database call deadline, scaled with the lease (production: 10 s against 30 s).
        ("AGENTQ_DB_TIMEOUT_SECS", "2"),
        ("AGENTQ_CONCURRENCY_INTERACTIVE", "16"),
        ("RUST_LOG", "warn,agentq_worker::context=info"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let mut procs = Processes {
        env,
        logs,
        workers: Vec::new(),
        schedulers: Vec::new(),
        started: 0,
        exited: Vec::new(),
    };
    for _ in 0..3 {
        let w = procs.spawn("worker");
        procs.workers.push(w);
    }
    for _ in 0..2 {
        let s = procs.spawn("scheduler");
        procs.schedulers.push(s);
    }

    // The monitor: terminal count every 100 ms, and supervision of the processes.
    let progress = Arc::new(Progress::default());
    let faults = schedule(&size);
    let reserve = (RESUMED_AFTER * faults.len() as i64).min(size.operations as i64 / 5);
    progress
        .released
        .store(size.operations as i64 - reserve, Ordering::SeqCst);
    let monitor_stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (pool, progress, stop) = (pool.clone(), progress.clone(), monitor_stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                if let Some(n) = count_terminal(&pool).await {
                    progress.terminal.store(n, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // The signaller: `agentq signal <op> go` for every operation that waits for one, retried
    // through faults (each try is a fresh process through the proxy).
    let (sig_tx, mut sig_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let signals_sent = Arc::new(AtomicI64::new(0));
    let signals_refused = Arc::new(AtomicI64::new(0));
    let signaller = {
        let env = procs.env.clone();
        let sent = signals_sent.clone();
        let refused = signals_refused.clone();
        tokio::spawn(async move {
            let limit = Arc::new(tokio::sync::Semaphore::new(8));
            let mut tasks = tokio::task::JoinSet::new();
            while let Some(op) = sig_rx.recv().await {
                let permit = limit.clone().acquire_owned().await.unwrap();
                let (env, sent, refused) = (env.clone(), sent.clone(), refused.clone());
                tasks.spawn(async move {
                    let end = Instant::now() + Duration::from_secs(120);
                    while Instant::now() < end {
                        let args = ["signal", &op, "go", "--payload", r#"{"approved":true}"#];
                        let mut cmd = tokio::process::Command::from(process::command(
                            AGENTQ,
                            &args,
                            env.iter().cloned(),
                        ));
                        // Killed at the timeout below, not left running after the test.
                        cmd.stdin(Stdio::null())
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .kill_on_drop(true);
                        let code = tokio::time::timeout(Duration::from_secs(15), cmd.status())
                            .await
                            .ok()
                            .and_then(|s| s.ok())
                            .and_then(|s| s.code());
                        match code {
                            Some(0) => {
                                sent.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            // Refused: the operation finished, so an earlier try whose answer
                            // was lost (killed at the timeout above) delivered it.
                            Some(2) => {
                                refused.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                            _ => {}
                        }
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    drop(permit);
                });
            }
            while tasks.join_next().await.is_some() {}
        })
    };

    // The enqueuer: every operation has a dedupe key, so a retry after an ambiguous failure
    // (the server went away mid-commit) never creates a second one.
    let enqueuer = {
        let pool = db::connect(&direct_db, 4).await.unwrap();
        let progress = progress.clone();
        let dispatcher = Arc::new(agentq_core::dispatch::Dispatcher::new(
            pool.clone(),
            &direct_amqp,
            agentq_core::broker::Names::new(&namespace),
            "chaos-producer",
        ));
        let producer = agentq_producer::Producer::new(
            pool.clone(),
            dispatcher.clone(),
            std::sync::Arc::new(agentq_kinds::registry()),
            3,
        );
        let (n, window) = (size.operations, size.window);
        tokio::spawn(async move {
            let mut rng = Lcg(seed);
            let mut failures = 0u64;
            for i in 0..n {
                while progress.enqueued.load(Ordering::SeqCst)
                    - progress.terminal.load(Ordering::SeqCst)
                    >= window
                    || i as i64 >= progress.released.load(Ordering::SeqCst)
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let (steps, signal) = program(&mut rng);
                loop {
                    let req = agentq_producer::EnqueueRequest {
                        tenant: "t1".into(),
                        kind: "script".into(),
                        input: json!({ "steps": steps }),
                        dedupe_key: Some(format!("chaos-{i}")),
                        lane: agentq_core::Lane::Interactive,
                        ..Default::default()
                    };
                    let sent = tokio::time::timeout(Duration::from_secs(10), producer.enqueue(req));
                    match sent.await {
                        Ok(Ok(e)) => {
                            if signal {
                                let _ = sig_tx.send(e.op_id.0.to_string());
                            }
                            break;
                        }
                        _ => {
                            failures += 1;
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                }
                progress.enqueued.store(i as i64 + 1, Ordering::SeqCst);
            }
            drop(sig_tx);
            dispatcher.close().await;
            failures
        })
    };

    // The faults, each at its share of the workload, each followed by its recovery.
    let mut records: Vec<Record> = Vec::new();
    let mut rng = Lcg(seed ^ 0xfa17);
    let n = size.operations as i64;
    for (i, fault) in faults.iter().copied().enumerate() {
        // Faults are spread over the first 80 % of the workload, so each leaves work behind it
        // to measure the recovery on.
        let at = n * 4 * (i as i64 + 1) / (5 * (faults.len() as i64 + 1));
        let deadline = Instant::now() + Duration::from_secs(300);
        while progress.terminal.load(Ordering::SeqCst) < at {
            procs.supervise();
            assert!(
                Instant::now() < deadline,
                "no progress towards fault {i} ({}): {} of {n} finished",
                fault.name(),
                progress.terminal.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let started = Instant::now();
        match fault {
            Fault::KillWorker => procs.kill("worker", rng.below(3) as usize),
            Fault::KillScheduler => procs.kill("scheduler", rng.below(2) as usize),
            Fault::RabbitRestart => {
                let r = &rabbit;
                // stop_app, a few seconds down, start_app (blocking CLI calls, off the runtime).
                tokio::task::block_in_place(|| {
                    let out = Command::new("rabbitmqctl")
                        .args(["-q", "-n", &r.node, "stop_app"])
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "stop_app: {out:?}");
                    std::thread::sleep(Duration::from_secs(3));
                    r.restart_app();
                });
            }
            Fault::PgRestart => tokio::task::block_in_place(|| pg.restart_fast()),
            Fault::PgPause => {
                pg.signal_all("STOP");
                tokio::time::sleep(size.pause).await;
                pg.signal_all("CONT");
            }
            Fault::ProxyReset(side) => side_proxy(side, &pg_proxy, &amqp_proxy).reset_all(),
            Fault::ProxyBlackhole(side) => {
                let p = side_proxy(side, &pg_proxy, &amqp_proxy);
                p.blackhole(true);
                tokio::time::sleep(Duration::from_secs(5)).await;
                p.blackhole(false);
            }
            Fault::ProxySilent(side) => {
                let p = side_proxy(side, &pg_proxy, &amqp_proxy);
                p.silent(true);
                tokio::time::sleep(SILENT).await;
                p.silent(false);
            }
            Fault::ProxyDelay(side) => {
                let p = side_proxy(side, &pg_proxy, &amqp_proxy);
                p.delay(Duration::from_millis(300));
                tokio::time::sleep(Duration::from_secs(5)).await;
                p.delay(Duration::ZERO);
            }
            Fault::ProxyCut(side) => {
                let p = side_proxy(side, &pg_proxy, &amqp_proxy);
                p.cut_mid_frame(5 + rng.below(20) as usize);
                let until = Instant::now() + Duration::from_secs(5);
                while p.cut_pending() && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        let ended = Instant::now();
        // Release this fault's share of the reserve (all of it after the last fault).
        let released = if i + 1 == faults.len() {
            n
        } else {
            (progress.released.load(Ordering::SeqCst) + RESUMED_AFTER).min(n)
        };
        progress.released.store(released, Ordering::SeqCst);
        let base = progress.terminal.load(Ordering::SeqCst);
        let target = (base + RESUMED_AFTER).min(n);
        let until = ended + Duration::from_secs(120);
        let mut recovery = None;
        while Instant::now() < until {
            procs.supervise();
            if progress.terminal.load(Ordering::SeqCst) >= target && base < n {
                recovery = Some(ended.elapsed());
                break;
            }
            if base >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "chaos: fault {:>2} {:<40} outage {:>6.1} s, throughput resumed after {} (ended {})",
            i + 1,
            fault.name(),
            (ended - started).as_secs_f64(),
            recovery.map_or("—".to_string(), |d| format!("{:.1} s", d.as_secs_f64())),
            chrono::Utc::now().format("%H:%M:%S%.3f")
        );
        records.push(Record {
            fault,
            outage: ended - started,
            recovery,
        });
    }
    let faults_stopped = Instant::now();

    let enqueue_failures = enqueuer.await.unwrap();
    let enqueued_after = faults_stopped.elapsed();
    let _ = signaller.await;
    println!(
        "chaos: after the last fault: last enqueue {:.1} s, last signal {:.1} s",
        enqueued_after.as_secs_f64(),
        faults_stopped.elapsed().as_secs_f64()
    );
    let stuck_at = faults_stopped.max(Instant::now()) + LEASE * 2 + Duration::from_secs(3);
    // "Stuck": non-terminal 2 lease periods (plus the longest scripted timer) after the faults
    // stopped, the last operation was enqueued and the last signal sent, and due for more than
    // 2 lease periods. An operation that failed during a fault waits for its retry's backoff
    // (up to 10 s at attempt 4): it is scheduled, not stuck, and must be finished by the end.
    while Instant::now() < stuck_at {
        procs.supervise();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pending: Vec<(uuid::Uuid, String, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, status,
                COALESCE(CASE WHEN status = 'running' THEN lease_expires_at ELSE run_at END,
                         '-infinity') < now() - make_interval(secs => {})
           FROM operations WHERE status NOT IN {TERMINAL} ORDER BY created_at",
        (LEASE * 2).as_secs()
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let stuck: Vec<(uuid::Uuid, String)> = pending
        .iter()
        .filter(|(.., overdue)| *overdue)
        .map(|(id, status, _)| (*id, status.clone()))
        .collect();
    for (op, _) in stuck.iter().take(3) {
        explain(&pool, *op).await;
    }
    // Let the scheduled ones finish before the checks, so the figures are final.
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end && count_terminal(&pool).await != Some(n) {
        procs.supervise();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let unfinished: Vec<(uuid::Uuid, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, status FROM operations WHERE status NOT IN {TERMINAL} ORDER BY created_at"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    for (op, _) in unfinished.iter().take(3) {
        explain(&pool, *op).await;
    }
    monitor_stop.store(true, Ordering::SeqCst);
    let _ = monitor.await;

    let report = check(&pool, n, &records).await;
    let reconciled = procs.count_in_logs("reconciled: the effect");
    let took = run_started.elapsed();
    println!(
        "chaos: ---- results (seed {seed}, {:.0} s) ----",
        took.as_secs_f64()
    );
    println!(
        "chaos: operations enqueued {n}, found {}, lost {}",
        report.found, report.lost
    );
    println!("chaos: statuses {:?}", report.statuses);
    println!(
        "chaos: safe ledger effects duplicated {}, missing from succeeded operations {}",
        report.safe_duplicates, report.missing_safe
    );
    println!(
        "chaos: unsafe steps failed closed (unknown_side_effect) {}, reconciled {reconciled}, \
         neither (repeated or left unresolved) {}",
        report.failed_closed, report.unsafe_violations
    );
    println!(
        "chaos: non-terminal {:.0} s after the faults stopped: {} ({} waiting for a scheduled \
         retry, {} due for longer: stuck {:?}); never finished {}",
        (LEASE * 2).as_secs_f64(),
        pending.len(),
        pending.len() - stuck.len(),
        stuck.len(),
        stuck.iter().take(5).collect::<Vec<_>>(),
        unfinished.len()
    );
    println!(
        "chaos: dead letters {:?}, not explained by a fault {} {:?}",
        report.dead_letters,
        report.unexplained.len(),
        report.unexplained.iter().take(5).collect::<Vec<_>>()
    );
    for (op, _) in report.unexplained.iter().take(3) {
        explain(&pool, *op).await;
    }
    println!(
        "chaos: recoveries {}, signals sent {} (refused as already delivered {}), enqueue \
         retries {enqueue_failures}, proxy connections pg {} amqp {}, processes that exited by \
         themselves {:?}",
        report.restarts,
        signals_sent.load(Ordering::SeqCst),
        signals_refused.load(Ordering::SeqCst),
        pg_proxy.accepted(),
        amqp_proxy.accepted(),
        procs.exited
    );
    let mut by_kind: HashMap<String, Vec<(f64, f64)>> = HashMap::new();
    for r in &records {
        by_kind.entry(r.fault.name()).or_default().push((
            r.outage.as_secs_f64(),
            r.recovery.map_or(f64::NAN, |d| d.as_secs_f64()),
        ));
    }
    let mut kinds: Vec<_> = by_kind.into_iter().collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, secs) in &kinds {
        let (outage, secs): (Vec<f64>, Vec<f64>) = secs.iter().copied().unzip();
        let max = secs.iter().copied().fold(0.0, f64::max);
        let mean = secs.iter().sum::<f64>() / secs.len() as f64;
        let down = outage.iter().sum::<f64>() / outage.len() as f64;
        println!(
            "chaos: recovery {name:<40} n={:<3} outage {down:>5.1} s, resumed after mean {mean:>5.1} s, max {max:>5.1} s",
            secs.len()
        );
    }

    assert_eq!(report.lost, 0, "operations lost");
    assert_eq!(report.safe_duplicates, 0, "duplicate safe effects");
    assert_eq!(
        report.missing_safe, 0,
        "succeeded operations missing an effect"
    );
    if report.unsafe_violations > 0 {
        let detail: Vec<UnsafeViolation> = sqlx::query_as(
            "SELECT o.id, o.status, o.error_class, s.seq, s.name, s.status,
                        (SELECT count(*) FROM ledger_effects e WHERE e.op_id = o.id
                            AND e.replay = 'unsafe')
                   FROM operation_steps s JOIN operations o ON o.id = s.op_id
                  WHERE s.replay = 'unsafe'
                    AND ((s.status IN ('started', 'unknown')
                          AND o.status IN ('succeeded', 'dead', 'cancelled', 'discarded')
                          AND NOT (o.status = 'dead' AND o.error_class = 'unknown_side_effect'))
                      OR o.id IN (SELECT op_id FROM ledger_effects WHERE replay = 'unsafe'
                                   GROUP BY op_id, label HAVING count(*) > 1))",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_default();
        println!("chaos: unsafe violations: {detail:?}");
        for (op, ..) in &detail {
            explain(&pool, *op).await;
        }
    }
    assert_eq!(
        report.unsafe_violations, 0,
        "unsafe steps neither failed closed nor reconciled"
    );
    assert!(
        stuck.is_empty(),
        "operations due but not running 2 lease periods after the faults: {stuck:?}"
    );
    assert!(
        unfinished.is_empty(),
        "operations that never finished: {unfinished:?}"
    );
    assert!(
        report.unexplained.is_empty(),
        "unexplained dead letters: {:?}",
        report.unexplained
    );
    let unrecovered: Vec<String> = records
        .iter()
        .filter(|r| r.recovery.is_none())
        .map(|r| r.fault.name())
        .collect();
    assert!(
        unrecovered.is_empty(),
        "throughput did not resume after {unrecovered:?}"
    );
    assert!(
        procs.exited.is_empty(),
        "processes gave up: {:?}",
        procs.exited
    );
    drop(procs);
    pool.close().await;
    drop((pg_proxy, amqp_proxy, rabbit, pg, scratch));
}

/// Prints what the database knows of one operation: its row, its unsafe ledger effects and
/// its event log (used when a check fails, so a finding can be read off the output).
async fn explain(pool: &PgPool, op: uuid::Uuid) {
    type Row = (
        String,
        i32,
        i64,
        i32,
        chrono::DateTime<chrono::Utc>,
        Option<chrono::DateTime<chrono::Utc>>,
        Option<chrono::DateTime<chrono::Utc>>,
        Option<String>,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT status, attempt, epoch, restarts, run_at, dispatched_at, lease_expires_at,
                lease_owner
           FROM operations WHERE id = $1",
    )
    .bind(op)
    .fetch_optional(pool)
    .await
    .unwrap_or_default();
    println!(
        "chaos: {op} (status, attempt, epoch, restarts, run_at, dispatched_at, lease_expires_at, owner) {row:?}"
    );
    let effects: Vec<(i64, String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT id, idempotency_key, created_at FROM ledger_effects
          WHERE op_id = $1 AND replay = 'unsafe' ORDER BY id",
    )
    .bind(op)
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    println!("chaos: {op} unsafe effects {effects:?}");
    let sql = format!(
        "SELECT seq, at, type, data FROM {} e WHERE op_id = $1 ORDER BY seq",
        agentq_core::db::events::EVENT_LOG
    );
    let events: Vec<(i64, chrono::DateTime<chrono::Utc>, String, Value)> =
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(op)
            .fetch_all(pool)
            .await
            .unwrap_or_default();
    for e in events {
        println!("chaos: {op} event {e:?}");
    }
}

fn side_proxy<'a>(side: Side, pg: &'a Proxy, amqp: &'a Proxy) -> &'a Proxy {
    if side == Side::Pg { pg } else { amqp }
}

/// The end-of-run figures.
struct Report {
    found: i64,
    lost: i64,
    statuses: Vec<(String, i64)>,
    restarts: i64,
    safe_duplicates: i64,
    missing_safe: i64,
    failed_closed: i64,
    unsafe_violations: i64,
    dead_letters: Vec<(String, i64)>,
    /// Operation and "class: reason" of each dead letter no injected fault explains.
    unexplained: Vec<(uuid::Uuid, String)>,
}

/// An offending unsafe step: operation, its status and class, the step's seq, name and status,
/// and how many unsafe effects the operation recorded.
type UnsafeViolation = (uuid::Uuid, String, Option<String>, i32, String, String, i64);

async fn check(pool: &PgPool, n: i64, records: &[Record]) -> Report {
    let one = |sql: &'static str| async move {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let found =
        one("SELECT count(DISTINCT dedupe_key) FROM operations WHERE dedupe_key LIKE 'chaos-%'")
            .await;
    let statuses: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM operations GROUP BY status ORDER BY status")
            .fetch_all(pool)
            .await
            .unwrap();
    let restarts = one("SELECT COALESCE(sum(restarts), 0)::bigint FROM operations").await;
    let safe_duplicates = one(
        "SELECT count(*) FROM (SELECT 1 FROM ledger_effects WHERE replay = 'safe'
                                GROUP BY op_id, label HAVING count(*) > 1) d",
    )
    .await;
    let missing_safe = one(
        "SELECT count(*) FROM operations o, jsonb_array_elements(o.input->'steps') st
          WHERE o.status = 'succeeded' AND st->>'tool' = 'ledger'
            AND NOT EXISTS (SELECT 1 FROM ledger_effects e WHERE e.op_id = o.id AND e.label = st->>'label')",
    )
    .await;
    let failed_closed = one(
        "SELECT count(*) FROM operations WHERE status = 'dead' AND error_class = 'unknown_side_effect'",
    )
    .await;
    // An unsafe effect that happened twice, or an unsafe step left started/unknown in an
    // operation that is not dead as unknown_side_effect.
    let unsafe_violations = one(
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM ledger_effects WHERE replay = 'unsafe'
                                        GROUP BY op_id, label HAVING count(*) > 1) d)
              + (SELECT count(*) FROM operation_steps s JOIN operations o ON o.id = s.op_id
                  WHERE s.replay = 'unsafe' AND s.status IN ('started', 'unknown')
                    AND o.status IN ('succeeded', 'dead', 'cancelled', 'discarded')
                    AND NOT (o.status = 'dead' AND o.error_class = 'unknown_side_effect'))",
    )
    .await;
    let dead_letters: Vec<(String, i64)> =
        sqlx::query_as("SELECT class, count(*) FROM dead_letters GROUP BY class ORDER BY class")
            .fetch_all(pool)
            .await
            .unwrap();
    // Explained: unknown_side_effect of an unsafe step without reconcile, left unknown by a
    // fault that can lose an outcome; crash_loop only if such faults happened.
    let outcome_faults = records.iter().any(|r| r.fault.can_lose_an_outcome());
    let letters: Vec<(uuid::Uuid, String, String, bool)> = sqlx::query_as(
        "SELECT d.op_id, d.class, d.reason,
                EXISTS (SELECT 1 FROM operation_steps s
                         WHERE s.op_id = d.op_id AND s.replay = 'unsafe' AND s.status = 'unknown')
                AND EXISTS (SELECT 1 FROM operations o, jsonb_array_elements(o.input->'steps') st
                             WHERE o.id = d.op_id AND st->>'replay' = 'unsafe'
                               AND NOT COALESCE((st->>'reconcile')::boolean, false))
           FROM dead_letters d",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let unexplained = letters
        .into_iter()
        .filter(|(_, class, _, unsafe_unknown)| match class.as_str() {
            "unknown_side_effect" => !(outcome_faults && *unsafe_unknown),
            "crash_loop" => !outcome_faults,
            _ => true,
        })
        .map(|(id, class, reason, _)| (id, format!("{class}: {reason}")))
        .collect();
    Report {
        found,
        lost: n - found,
        statuses,
        restarts,
        safe_duplicates,
        missing_safe,
        failed_closed,
        unsafe_violations,
        dead_letters,
        unexplained,
    }
}
