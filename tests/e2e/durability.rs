//! Durable execution under real crashes: SIGKILLed and SIGSTOPped worker processes, lease
//! expiry and the reaper, unsafe side effects, nondeterminism, ordering keys, graceful
//! shutdown, and a chaos run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use agentq_core::broker::{self, Publisher};
use agentq_core::operation::{Lane, OperationId, Pointer};
use serde_json::json;

use agentq_testkit::rng::Lcg;

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// A test world with short leases so crashes are noticed in seconds.
async fn crash_app() -> TestApp {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    app
}

async fn step_statuses(app: &TestApp, op: &str) -> Vec<(i32, String, String)> {
    sqlx::query_as(
        "SELECT seq, name, status FROM operation_steps WHERE op_id = $1::uuid ORDER BY seq",
    )
    .bind(op)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// Starts a worker, waits until the operation's ledger effect exists (the call is in flight,
/// its answer not yet back), kills the worker, and starts a fresh one.
async fn kill_after_effect(app: &mut TestApp, op: &str) {
    let w = app.spawn(&["worker"]);
    app.wait_for("the ledger effect", DEADLINE, || async {
        app.effects(op).await == 1
    })
    .await;
    app.kill(w);
    app.spawn(&["worker"]);
}

#[tokio::test]
async fn a_safe_step_killed_mid_call_reruns_with_the_same_key() {
    let mut app = crash_app().await;
    app.spawn(&["scheduler"]);
    let op = app.enqueue_script(
        json!([{ "tool": "ledger", "replay": "safe", "label": "send", "after_ms": 1500 }]),
        &[],
    );
    kill_after_effect(&mut app, &op).await;

    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.restarts, 1, "recovered once by the reaper");
    assert_eq!(
        app.effects(&op).await,
        1,
        "the re-run reused the idempotency key"
    );
    app.cleanup().await;
}

#[tokio::test]
async fn an_unsafe_step_killed_after_its_effect_fails_closed_to_the_dlq() {
    let mut app = crash_app().await;
    app.spawn(&["scheduler"]);
    let op = app.enqueue_script(
        json!([{ "tool": "ledger", "replay": "unsafe", "label": "charge", "after_ms": 60000 }]),
        &[],
    );
    kill_after_effect(&mut app, &op).await;

    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("unknown_side_effect"));
    assert_eq!(app.effects(&op).await, 1, "never re-run blindly");
    assert_eq!(
        step_statuses(&app, &op).await,
        vec![(0, "ledger:charge".into(), "unknown".into())]
    );
    let (class, failed_step, key): (String, Option<i32>, String) = sqlx::query_as(
        "SELECT d.class, d.failed_step, s.idempotency_key
           FROM dead_letters d JOIN operation_steps s ON s.op_id = d.op_id AND s.seq = d.failed_step
          WHERE d.op_id = $1::uuid AND d.status = 'open'",
    )
    .bind(&op)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (class.as_str(), failed_step),
        ("unknown_side_effect", Some(0))
    );
    assert!(
        dead.error_message.unwrap().contains(&key),
        "the key is kept for a human"
    );
    app.cleanup().await;
}

#[tokio::test]
async fn an_unsafe_step_with_reconcile_is_reconciled_and_succeeds() {
    let mut app = crash_app().await;
    app.spawn(&["scheduler"]);
    let op = app.enqueue_script(
        json!([
            { "tool": "ledger", "replay": "unsafe", "label": "charge", "after_ms": 60000, "reconcile": true },
            { "work_ms": 10 }
        ]),
        &[],
    );
    kill_after_effect(&mut app, &op).await;

    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(app.effects(&op).await, 1);
    assert_eq!(done.restarts, 1);
    let effect_id: i64 = sqlx::query_scalar("SELECT id FROM ledger_effects WHERE op_id = $1::uuid")
        .bind(&op)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        done.result.unwrap()["outputs"][0],
        json!({ "effect_id": effect_id })
    );
    // The step says its effect was found by the reconcile, in `agentq steps` and its JSON.
    let steps = String::from_utf8_lossy(&app.agentq_ok(&["steps", &op]).stdout).into_owned();
    let charge = steps.lines().next().unwrap_or_default();
    assert!(charge.contains("reconciled"), "{steps}");
    let json =
        String::from_utf8_lossy(&app.agentq_ok(&["steps", &op, "--json"]).stdout).into_owned();
    let first: serde_json::Value = serde_json::from_str(json.lines().next().unwrap()).unwrap();
    assert_eq!(first["usage"], json!({ "reconciled": true }), "{json}");
    app.cleanup().await;
}

#[tokio::test]
async fn a_worker_dying_four_times_on_one_operation_ends_in_crash_loop() {
    let mut app = crash_app().await;
    app.spawn(&["scheduler"]);
    let op = app.enqueue_script(json!([{ "work_ms": 60000 }]), &[]);
    for claim in 1..=4i64 {
        let w = app.spawn(&["worker"]);
        app.wait_for(&format!("claim {claim}"), DEADLINE, || async {
            let (status, epoch): (String, i64) =
                sqlx::query_as("SELECT status, epoch FROM operations WHERE id = $1::uuid")
                    .bind(&op)
                    .fetch_one(&app.pool)
                    .await
                    .unwrap();
            status == "running" && epoch == claim
        })
        .await;
        app.kill(w);
    }
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("crash_loop"));
    assert_eq!(dead.restarts, 4);
    assert_eq!(dead.attempt, 1, "crashes do not use up attempts");
    let letters: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM dead_letters WHERE op_id = $1::uuid AND class = 'crash_loop' AND status = 'open'",
    )
    .bind(&op)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(letters, 1);
    app.cleanup().await;
}

#[tokio::test]
async fn a_paused_worker_past_its_lease_is_fenced_out() {
    let mut app = crash_app().await;
    app.spawn(&["scheduler"]);
    let op = app.enqueue_script(
        json!([{ "work_ms": 2000 }, { "tool": "ledger", "replay": "safe", "label": "after" }]),
        &[],
    );
    let first = app.spawn_logged(&["worker"]);
    app.wait_status(&op, "running", DEADLINE).await;
    app.signal(first, "STOP");

    // The lease expires, the reaper requeues; another worker takes over at epoch 2. Extra
    // copies of the pointer make sure one reaches the live worker, not the paused one.
    let second = app.spawn(&["worker"]);
    app.wait_for("the reaper to requeue", DEADLINE, || async {
        app.operation(&op).await.restarts == 1
    })
    .await;
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let publisher = Publisher::open(&conn, app.names()).await.unwrap();
    let pointer = Pointer::new(OperationId::parse(&op).unwrap(), "t1", "script");
    for _ in 0..3 {
        publisher
            .publish(&pointer, Lane::Interactive)
            .await
            .unwrap();
    }
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.restarts, 1);

    // The paused worker wakes up: its heartbeat is refused and it stops the operation.
    app.signal(first, "CONT");
    app.wait_for("the first worker to notice", DEADLINE, || async {
        let log = app.log(first);
        log.contains("lease lost") || log.contains("discarded")
    })
    .await;
    let epochs: Vec<i64> =
        sqlx::query_scalar("SELECT DISTINCT epoch FROM operation_steps WHERE op_id = $1::uuid")
            .bind(&op)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(epochs, vec![2], "no journal row from the fenced-out epoch");
    let after = app.operation(&op).await;
    assert_eq!(after.status.as_str(), "succeeded");
    assert_eq!(
        after.updated_at, done.updated_at,
        "nothing written after the takeover's result"
    );
    assert_eq!(app.effects(&op).await, 1);
    let _ = second;
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

#[tokio::test]
async fn a_journal_that_diverges_from_the_code_is_nondeterminism() {
    let mut app = crash_app().await;
    app.spawn(&["scheduler"]);
    let op = app.enqueue_script(
        json!([{ "work_ms": 1 }, { "fail": "retryable", "times": 1 }]),
        &[],
    );
    let w = app.spawn(&["worker"]);
    app.wait_for("the first attempt to fail", DEADLINE, || async {
        let v = app.operation(&op).await;
        v.attempt == 1 && v.error_class.as_deref() == Some("retryable")
    })
    .await;
    app.kill(w);
    // A deploy changes what the job does: step 0 is now a model call, not `work`.
    sqlx::query(
        r#"UPDATE operations SET input = '{"steps":[{"model":"hi"}]}' WHERE id = $1::uuid"#,
    )
    .bind(&op)
    .execute(&app.pool)
    .await
    .unwrap();
    app.spawn(&["worker"]);
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("nondeterminism"));
    assert!(dead.error_message.unwrap().contains("\"work\""));
    app.cleanup().await;
}

#[tokio::test]
async fn operations_sharing_an_ordering_key_run_one_at_a_time_in_order() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    for _ in 0..3 {
        app.spawn(&["worker"]);
    }
    let ops: Vec<String> = (0..10)
        .map(|_| app.enqueue_script(json!([{ "work_ms": 150 }]), &["--ordering-key", "case-7"]))
        .collect();
    for op in &ops {
        app.wait_status(op, "succeeded", Duration::from_secs(60))
            .await;
    }
    let runs: Vec<(
        String,
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
    )> = sqlx::query_as(
        "SELECT o.id::text, s.started_at, o.finished_at
           FROM operations o JOIN operation_steps s ON s.op_id = o.id AND s.seq = 0
          ORDER BY o.created_at, o.id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(runs.len(), 10);
    let order: Vec<&String> = runs.iter().map(|r| &r.0).collect();
    assert_eq!(order, ops.iter().collect::<Vec<_>>(), "creation order");
    for pair in runs.windows(2) {
        assert!(
            pair[1].1 >= pair[0].2,
            "{} started at {} before {} finished at {}",
            pair[1].0,
            pair[1].1,
            pair[0].0,
            pair[0].2
        );
    }
    app.cleanup().await;
}

/// SIGTERM while a short step is in flight: the grace lets it finish. The short operation's
/// model call is held by the fake provider until the signal has been sent, so its step can only
/// end inside the grace, never before the signal (on any machine); the long one is handed back.
#[tokio::test]
async fn sigterm_lets_short_work_finish_and_hands_long_work_back() {
    let fake = FakeModel::start(Mode::Echo).await;
    let gate = fake.hold_requests();
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_SHUTDOWN_GRACE_SECS", "2");
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let short = app.enqueue_script(json!([{ "model": "short work" }]), &[]);
    let long = app.enqueue_script(json!([{ "work_ms": 60000 }]), &[]);
    let w = app.spawn(&["worker"]);
    app.wait_status(&long, "running", DEADLINE).await;
    app.wait_for(
        "the short step's model call to be in flight",
        DEADLINE,
        || async { fake.requests() == 1 },
    )
    .await;
    app.signal(w, "TERM");
    assert_eq!(
        app.operation(&short).await.status.as_str(),
        "running",
        "the short step is held in flight when SIGTERM arrives"
    );
    gate.add_permits(1);
    assert!(
        app.wait_exit(w, Duration::from_secs(10)).await,
        "worker exits after the grace period"
    );

    assert_eq!(
        app.operation(&short).await.status.as_str(),
        "succeeded",
        "the step in flight at SIGTERM finished within the grace"
    );
    let back = app.operation(&long).await;
    assert_eq!(
        back.status.as_str(),
        "queued",
        "released, not left to lapse"
    );
    assert_eq!(back.restarts, 0, "a graceful hand-back is not a crash");
    assert_eq!(back.attempt, 0, "and it does not use up the attempt");

    // A scheduler republishes it and a new worker takes it.
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    app.wait_for(
        "the long operation to be claimed again",
        DEADLINE,
        || async {
            let v = app.operation(&long).await;
            v.status.as_str() == "running" && v.attempt == 1
        },
    )
    .await;
    app.cleanup().await;
}

/// A drain longer than what is left of a lease: the worker keeps renewing its leases until the
/// drain ends, so a scheduler's reaper never takes the operation and the deliberate shutdown is
/// not counted as a crash.
#[tokio::test]
async fn sigterm_drain_longer_than_the_lease_is_not_a_crash() {
    let mut app = crash_app().await; // 3 s leases
    app.set_env("AGENTQ_SHUTDOWN_GRACE_SECS", "15");
    let op = app.enqueue_script(json!([{ "work_ms": 7000 }]), &[]);
    app.spawn(&["scheduler"]);
    let w = app.spawn(&["worker"]);
    app.wait_status(&op, "running", DEADLINE).await;
    app.signal(w, "TERM");
    assert!(
        app.wait_exit(w, Duration::from_secs(30)).await,
        "the worker exits once its operation is done"
    );
    let done = app.operation(&op).await;
    assert_eq!(
        done.status.as_str(),
        "succeeded",
        "finished by the draining worker"
    );
    assert_eq!(done.restarts, 0, "the reaper never took its lease");
    app.cleanup().await;
}

/// A TCP forwarder to the PostgreSQL of `database_url`: until `open` is set it takes every
/// connection and drops it at once, as a server that is restarting does. Returns the URL
/// through it.
async fn gated_postgres(database_url: &str, open: Arc<AtomicBool>) -> String {
    let (scheme, rest) = database_url.split_once("://").unwrap();
    let (authority, path) = rest.split_once('/').unwrap();
    let (user, upstream) = authority.rsplit_once('@').unwrap_or(("", authority));
    let upstream = upstream.to_string();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            if !open.load(Ordering::SeqCst) {
                continue;
            }
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    });
    let at = if user.is_empty() { "" } else { "@" };
    format!("{scheme}://{user}{at}127.0.0.1:{port}/{path}")
}

/// A worker, a scheduler and an API server started while PostgreSQL cannot be reached do not
/// exit: each says so and tries again, and serves once the server is back (the chaos run found
/// a worker restarted during a Postgres pause exiting 1 after its first attempt). One stopped
/// while it waits exits cleanly; a database that does not exist still fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_started_while_postgres_is_down_wait_for_it() {
    let mut app = TestApp::start().await;
    let open = Arc::new(AtomicBool::new(false));
    let gated = gated_postgres(&app.database_url, open.clone()).await;
    app.set_env("DATABASE_URL", &gated);
    let worker = app.spawn_logged(&["worker"]);
    let scheduler = app.spawn_logged(&["scheduler"]);
    let api = app.spawn_logged(&["serve", "--listen", "127.0.0.1:0"]);
    let stopped = app.spawn_logged(&["worker"]);
    app.unset_env("DATABASE_URL");
    for p in [worker, scheduler, api, stopped] {
        app.wait_for("a second failed attempt, logged", DEADLINE, || async {
            app.log(p).matches("PostgreSQL cannot be reached").count() >= 2
        })
        .await;
        assert_eq!(app.exit_code(p), None, "still up:\n{}", app.log(p));
    }
    app.signal(stopped, "TERM");
    assert!(
        app.wait_exit(stopped, DEADLINE).await,
        "SIGTERM while waiting ends it"
    );
    assert_eq!(app.exit_code(stopped), Some(0), "{}", app.log(stopped));

    // Enqueued straight to the database: a step, then a durable sleep only the scheduler wakes.
    let op = app.enqueue_script(json!([{ "work_ms": 1 }, { "sleep_ms": 500 }]), &[]);
    open.store(true, Ordering::SeqCst);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    let base = app
        .wait_until("the API server to listen", DEADLINE, || {
            let log = app.log(api);
            async move {
                let at = log.find("listening on http://")?;
                Some(
                    log[at + "listening on ".len()..]
                        .split_whitespace()
                        .next()?
                        .to_string(),
                )
            }
        })
        .await;
    let ready = reqwest::get(format!("{base}/healthz")).await.unwrap();
    assert_eq!(ready.status(), 200);
    for p in [worker, scheduler, api] {
        assert_eq!(app.exit_code(p), None, "still up:\n{}", app.log(p));
    }

    // What only the operator can mend is said at once.
    let missing = agentq_core::db::with_database(&app.database_url, "agentq_no_such_db").unwrap();
    app.set_env("DATABASE_URL", &missing);
    let out = app.agentq(&["worker"]);
    app.unset_env("DATABASE_URL");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not exist"), "{err}");
    app.cleanup().await;
}

/// A value of docker-compose.yml, by key (the first `key: value` line): what a deployment from
/// the repository's compose file runs with.
fn compose_setting(key: &str) -> String {
    let compose =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml"))
            .expect("docker-compose.yml");
    compose
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("docker-compose.yml sets no {key}"))
}

/// docs/deploy.md's rolling deploy, on compose's settings: the old worker gets SIGTERM in the
/// middle of long operations, drains for compose's `AGENTQ_SHUTDOWN_GRACE_SECS` and exits well
/// within compose's `stop_grace_period` (after which Docker would SIGKILL it), handing its
/// operations back without counting a restart or an attempt; the new worker runs them.
#[tokio::test]
async fn a_rolling_deploy_on_composes_settings_hands_work_back_without_a_restart() {
    let grace: u64 = compose_setting("AGENTQ_SHUTDOWN_GRACE_SECS")
        .parse()
        .unwrap();
    let stop_grace: u64 = compose_setting("stop_grace_period")
        .trim_end_matches('s')
        .parse()
        .unwrap();
    assert!(
        stop_grace > grace,
        "compose must wait longer than the drain"
    );
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_SHUTDOWN_GRACE_SECS", &grace.to_string());
    // Compose leaves the lease at its default.
    app.set_env("AGENTQ_LEASE_TTL_SECS", "30");
    app.spawn(&["scheduler"]);
    let old = app.spawn(&["worker"]);
    let long: Vec<String> = (0..2)
        .map(|_| app.enqueue_script(json!([{ "work_ms": 600_000 }]), &[]))
        .collect();
    let short = app.enqueue_script(json!([{ "work_ms": 3000 }]), &[]);
    for op in long.iter().chain([&short]) {
        app.wait_status(op, "running", DEADLINE).await;
    }
    let stopped = std::time::Instant::now();
    app.signal(old, "TERM");
    assert!(
        app.wait_exit(old, Duration::from_secs(stop_grace)).await,
        "the worker exits before compose's stop_grace_period ({stop_grace} s) runs out"
    );
    println!(
        "rolling deploy: the old worker exited {:.1} s after SIGTERM (drain {grace} s, compose \
         waits {stop_grace} s)",
        stopped.elapsed().as_secs_f64()
    );
    assert_eq!(app.operation(&short).await.status.as_str(), "succeeded");
    for op in &long {
        let back = app.operation(op).await;
        assert_eq!(
            back.status.as_str(),
            "queued",
            "handed back, not left to lapse"
        );
        assert_eq!(back.restarts, 0, "a deploy is not a crash");
        assert_eq!(back.attempt, 0, "and costs no attempt");
    }
    // The new version's worker picks them up.
    app.spawn(&["worker"]);
    for op in &long {
        app.wait_for("the new worker to run it", DEADLINE, || async {
            let v = app.operation(op).await;
            v.status.as_str() == "running" && v.attempt == 1 && v.restarts == 0
        })
        .await;
    }
    app.cleanup().await;
}

#[tokio::test]
async fn chaos_500_operations_three_workers_and_random_sigkills() {
    let mut app = crash_app().await;
    app.set_env("AGENTQ_RESTART_LIMIT", "100");
    app.set_env("AGENTQ_CONCURRENCY_INTERACTIVE", "24");
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_u64);
    let mut rng = Lcg(seed);
    println!("chaos seed {seed}");

    // Programs: 1–3 steps of work, safe effects, unsafe effects (half with reconcile).
    let mut inputs = Vec::new();
    for _ in 0..500 {
        let mut steps = Vec::new();
        for s in 0..(1 + rng.below(3)) {
            steps.push(match rng.below(4) {
                0 | 1 => json!({ "work_ms": 100 + rng.below(700) }),
                2 => json!({ "tool": "ledger", "replay": "safe", "label": format!("s{s}"), "after_ms": rng.below(300) }),
                _ => json!({ "tool": "ledger", "replay": "unsafe", "label": format!("u{s}"),
                              "after_ms": rng.below(300), "reconcile": rng.below(2) == 0 }),
            });
        }
        inputs.push(json!({ "steps": steps }));
    }
    app.enqueue_many("script", agentq_core::Lane::Interactive, inputs)
        .await;

    app.spawn(&["scheduler"]);
    let mut workers: Vec<usize> = (0..3).map(|_| app.spawn(&["worker"])).collect();
    let pool = app.pool.clone();
    let unfinished = move || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM operations
                  WHERE status NOT IN ('succeeded', 'dead', 'cancelled', 'discarded')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    // Kill a random worker (and restart it at once) each time another 5–25 operations have
    // finished, or after a second without that progress; at least 15 kills, at most 40.
    let mut kills = 0;
    while kills < 40 && (kills < 15 || unfinished().await > 0) {
        let target = unfinished().await - 5 - rng.below(21) as i64;
        let until = tokio::time::Instant::now() + Duration::from_secs(1);
        while unfinished().await > target && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let i = rng.below(3) as usize;
        app.kill(workers[i]);
        workers[i] = app.spawn(&["worker"]);
        kills += 1;
    }
    app.wait_for(
        "every operation to finish",
        Duration::from_secs(120),
        || async { unfinished().await == 0 },
    )
    .await;

    let by_status: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM operations GROUP BY status ORDER BY status")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let total: i64 = by_status.iter().map(|(_, n)| n).sum();
    let restarts: i64 = sqlx::query_scalar("SELECT COALESCE(sum(restarts), 0) FROM operations")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    // Safe effects: exactly once per safe ledger step of a succeeded operation, never twice.
    let safe_dupes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM ledger_effects WHERE replay = 'safe'
                                GROUP BY op_id, label HAVING count(*) > 1) d",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let unsafe_dupes: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM ledger_effects WHERE replay = 'unsafe'
                                GROUP BY op_id, label HAVING count(*) > 1) d",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let missing_safe: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations o, jsonb_array_elements(o.input->'steps') st
          WHERE o.status = 'succeeded' AND st->>'tool' = 'ledger'
            AND NOT EXISTS (SELECT 1 FROM ledger_effects e WHERE e.op_id = o.id AND e.label = st->>'label')",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    // Dead operations: exactly those with an unsafe step whose outcome a kill made unknown.
    let (dead, dead_unknown, unknown_not_dead): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'dead'),
                count(*) FILTER (WHERE status = 'dead' AND error_class = 'unknown_side_effect'
                                 AND EXISTS (SELECT 1 FROM operation_steps s
                                              WHERE s.op_id = o.id AND s.status = 'unknown' AND s.replay = 'unsafe')),
                count(*) FILTER (WHERE status <> 'dead'
                                 AND EXISTS (SELECT 1 FROM operation_steps s
                                              WHERE s.op_id = o.id AND s.status = 'unknown'))
           FROM operations o",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    println!(
        "chaos: {kills} kills, {restarts} recoveries, statuses {by_status:?}, dead/unknown_side_effect {dead_unknown}, \
         safe duplicates {safe_dupes}, unsafe repeats {unsafe_dupes}, missing effects {missing_safe}"
    );
    assert!(kills >= 15);
    assert_eq!(total, 500, "no operation lost");
    assert_eq!(safe_dupes, 0);
    assert_eq!(unsafe_dupes, 0, "no unsafe effect ever repeated");
    assert_eq!(
        missing_safe, 0,
        "every succeeded operation has all its effects"
    );
    assert_eq!(
        dead, dead_unknown,
        "every dead operation is an unknown unsafe effect"
    );
    assert_eq!(unknown_not_dead, 0);
    app.cleanup().await;
}
