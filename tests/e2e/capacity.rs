//! One tenant cannot hold what others need: a cancel or a deadline stops a running operation
//! where it is (mid-step), and an unsafe call it interrupts is reconciled, never re-run.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{DEADLINE, running_app};

/// The harness's lease (`AGENTQ_LEASE_TTL_SECS=6`): a heartbeat every 2 s.
const LEASE: Duration = Duration::from_secs(6);

#[tokio::test]
async fn a_cancel_stops_an_hour_long_step_within_a_lease() {
    let app = running_app().await;
    let op = app.enqueue_script(json!([{ "work_ms": 3_600_000 }]), &[]);
    app.wait_status(&op, "running", DEADLINE).await;
    let asked = Instant::now();
    let out = app.agentq_json(&["cancel", &op, "--reason", "stuck", "--json"]);
    assert_eq!(out["result"], "requested", "{out}");
    let done = app.wait_status(&op, "cancelled", DEADLINE).await;
    let took = asked.elapsed();
    println!("cancel of a running hour-long step took {took:?}");
    // The step would have run for an hour; the heartbeat (every third of a lease) stopped it.
    assert!(took < 2 * LEASE, "took {took:?}");
    assert!(done.error_message.unwrap_or_default().contains("cancel"));
    app.cleanup().await;
}

#[tokio::test]
async fn a_deadline_stops_a_running_step() {
    let app = running_app().await;
    let op = app.enqueue_script(json!([{ "work_ms": 3_600_000 }]), &["--deadline", "3s"]);
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("deadline_exceeded"));
    app.cleanup().await;
}

/// The journal of `op` as `agentq steps --json` prints it.
fn steps(app: &crate::harness::TestApp, op: &str) -> Vec<Value> {
    app.agentq_json_lines(&["steps", op, "--json"])
}

#[tokio::test]
async fn an_unsafe_call_a_deadline_interrupts_is_reconciled_not_rerun() {
    let app = running_app().await;
    // The ledger records its effect at once, then its answer takes an hour: the deadline
    // passes while the call is in flight.
    let op = app.enqueue_script(
        json!([
            { "tool": "ledger", "replay": "unsafe", "label": "pay", "after_ms": 3_600_000,
              "reconcile": true },
            { "work_ms": 1 }
        ]),
        &["--deadline", "15s"],
    );
    app.wait_for("the payment to happen", DEADLINE, || async {
        app.effects(&op).await == 1
    })
    .await;
    assert_eq!(app.operation(&op).await.status.as_str(), "running");
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("deadline_exceeded"));
    let journal = steps(&app, &op);
    assert_eq!(journal[0]["status"], "unknown", "{journal:?}");

    // An operator runs it again: the deadline is lifted, the unknown step is reconciled (the
    // ledger says it happened), and nothing is paid twice.
    app.agentq_ok(&["dlq", "retry", &op, "--reason", "run it"]);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(app.effects(&op).await, 1);
    let journal = steps(&app, &op);
    assert_eq!(journal[0]["status"], "completed", "{journal:?}");
    assert!(journal[0]["output"]["effect_id"].is_number(), "{journal:?}");
    assert!(done.result.is_some());
    app.cleanup().await;
}

// ---------------------------------------------------------------- caps that count everything

/// Puts `n` sleeping operations of tenant t1 in place (unfinished, holding no worker): the
/// tenant's count of unfinished operations, before the test's own.
async fn sleepers(app: &crate::harness::TestApp, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| app.enqueue_script(json!([{ "sleep_ms": 3_600_000 }]), &[]))
        .collect()
}

/// A world whose tenants may have 3 unfinished operations, 2 children each, 1 schedule.
async fn capped() -> crate::harness::TestApp {
    let mut app = crate::harness::TestApp::start().await;
    app.set_env("AGENTQ_TENANT_MAX_UNFINISHED", "3");
    app.set_env("AGENTQ_MAX_CHILDREN", "2");
    app.set_env("AGENTQ_TENANT_MAX_SCHEDULES", "1");
    app
}

#[tokio::test]
async fn the_unfinished_cap_refuses_cli_api_webhook_and_batch_enqueues_and_counts_sleepers() {
    let mut app = capped().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let held = sleepers(&app, 3).await;
    for op in &held {
        app.wait_status(op, "sleeping", DEADLINE).await;
    }
    // CLI: exit 2, naming the cap; nothing stored.
    let before = app.operation_count().await;
    let out = app.agentq(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"x"}"#,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("AGENTQ_TENANT_MAX_UNFINISHED"), "{stderr}");
    // API: 429 with Retry-After.
    let (_, base) = app.serve().await;
    let token = app.token("t1", "producer");
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{base}/v1/operations"))
        .bearer_auth(&token)
        .json(&json!({ "kind": "echo", "input": { "text": "x" } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "5");
    // A webhook delivery: 429, the sender retries it later.
    let added = app.agentq_json(&[
        "webhooks", "add", "--tenant", "t1", "--source", "crm", "--kind", "echo", "--json",
    ]);
    let secret = agentq_core::webhook::Secret::parse(added["secret"].as_str().unwrap()).unwrap();
    let body = json!({ "text": "hello" }).to_string();
    let ts = chrono::Utc::now().timestamp();
    let r = http
        .post(format!("{base}/v1/webhooks/crm"))
        .header("content-type", "application/json")
        .header("webhook-id", "evt_1")
        .header("webhook-timestamp", ts.to_string())
        .header(
            "webhook-signature",
            secret.sign("evt_1", ts, body.as_bytes()),
        )
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    // A batch: refused as a whole (exit 2), nothing enqueued.
    let src = tempfile_dir("src");
    std::fs::write(src.join("a.md"), "Title: A\nbody").unwrap();
    let dst = tempfile_dir("dst");
    let instructions = src.join("instructions.txt");
    std::fs::write(&instructions, "Keep it.").unwrap();
    let (s, d) = (
        app.dir_store("t1", &src, "read"),
        app.dir_store("t1", &dst, "write"),
    );
    let out = app.agentq(&[
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        &s,
        "--target",
        &d,
        "--instructions",
        instructions.to_str().unwrap(),
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(app.operation_count().await, before, "nothing was stored");
    // Finished operations free the count: cancel two sleepers, and an enqueue passes again
    // (the API's count is at most a second old).
    for op in &held[..2] {
        app.agentq_ok(&["cancel", op]);
    }
    app.wait_until("an enqueue to pass again", DEADLINE, || async {
        let r = http
            .post(format!("{base}/v1/operations"))
            .bearer_auth(&token)
            .json(&json!({ "kind": "echo", "input": { "text": "x" } }))
            .send()
            .await
            .unwrap();
        (r.status() == 202).then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&dst);
    app.cleanup().await;
}

fn tempfile_dir(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "agentq-capacity-{what}-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn a_spawn_at_the_tenants_cap_waits_and_a_spawn_past_the_childrens_cap_fails() {
    let mut app = capped().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    // Two sleepers and the parent: three unfinished, the cap. Its spawn waits (the parent is
    // parked as overloaded, its attempt given back) until a sleeper is cancelled.
    let held = sleepers(&app, 2).await;
    for op in &held {
        app.wait_status(op, "sleeping", DEADLINE).await;
    }
    let parent = app.enqueue_script(
        json!([{ "spawn": "echo", "input": { "text": "child" } }, { "join": true }]),
        &[],
    );
    let parked = app
        .wait_until("the spawn to wait for capacity", DEADLINE, || async {
            let v = app.operation(&parent).await;
            (v.status.as_str() == "queued" && v.error_class.as_deref() == Some("overloaded"))
                .then_some(v)
        })
        .await;
    assert!(
        parked
            .error_message
            .unwrap_or_default()
            .contains("AGENTQ_TENANT_MAX_UNFINISHED"),
        "the parent says why it waits"
    );
    assert_eq!(parked.attempt, 0, "its attempt was given back");
    app.agentq_ok(&["cancel", &held[0]]);
    app.wait_status(&parent, "succeeded", DEADLINE).await;

    // A parent that spawns a third child with a cap of two fails, naming the cap, and has
    // exactly two children.
    app.agentq_ok(&["cancel", &held[1]]);
    let greedy = app.enqueue_script(
        json!([
            { "spawn": "echo", "input": { "text": "1" } },
            { "spawn": "echo", "input": { "text": "2" } },
            { "spawn": "echo", "input": { "text": "3" } }
        ]),
        &[],
    );
    let dead = app.wait_status(&greedy, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("non_retryable"));
    assert!(
        dead.error_message
            .unwrap_or_default()
            .contains("AGENTQ_MAX_CHILDREN"),
        "it names the cap"
    );
    let children = app.agentq_json_lines(&["list", "--parent", &greedy, "--json"]);
    assert_eq!(children.len(), 2);
    app.cleanup().await;
}

#[tokio::test]
async fn a_schedule_at_its_tenants_cap_skips_its_ticks_and_schedules_are_limited() {
    let mut app = capped().await;
    app.set_env("AGENTQ_SCHEDULE_MIN_INTERVAL_SECS", "10");
    app.spawn(&["worker"]);
    // The shortest interval, and the count of schedules, are refused naming them.
    let every = |name: &str, secs: &str| {
        app.agentq(&[
            "schedules",
            "add",
            "--tenant",
            "t1",
            "--name",
            name,
            "--kind",
            "echo",
            "--input",
            r#"{"text":"tick"}"#,
            "--every",
            secs,
            "--json",
        ])
    };
    let fast = every("fast", "1s");
    assert_eq!(fast.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&fast.stderr).contains("AGENTQ_SCHEDULE_MIN_INTERVAL_SECS"));
    let added = every("tick", "10s");
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let second = every("second", "10s");
    assert_eq!(second.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&second.stderr).contains("AGENTQ_TENANT_MAX_SCHEDULES"));
    // At the cap of unfinished operations, its ticks are counted, not fired.
    let held = sleepers(&app, 3).await;
    for op in &held {
        app.wait_status(op, "sleeping", DEADLINE).await;
    }
    let before = app.operation_count().await;
    app.spawn(&["scheduler"]);
    let listed = app
        .wait_until(
            "a tick skipped for capacity",
            Duration::from_secs(60),
            || async {
                let s = app.agentq_json_lines(&["schedules", "list", "--json"]);
                (s[0]["skipped_capacity"].as_i64().unwrap_or(0) >= 1).then(|| s[0].clone())
            },
        )
        .await;
    assert_eq!(listed["fired"], 0, "{listed}");
    assert_eq!(app.operation_count().await, before, "nothing was fired");
    app.cleanup().await;
}

#[tokio::test]
async fn a_concurrency_keys_limit_is_the_keys() {
    let app = crate::harness::TestApp::start().await;
    // No worker: the first operation of the key stays unfinished.
    let first = app.agentq(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"a"}"#,
        "--concurrency-key",
        "k",
        "--concurrency-limit",
        "1",
    ]);
    assert!(first.status.success());
    let greedy = app.agentq(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"b"}"#,
        "--concurrency-key",
        "k",
        "--concurrency-limit",
        "1000",
    ]);
    assert_eq!(greedy.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&greedy.stderr);
    assert!(stderr.contains("has the limit 1"), "{stderr}");
    // The same limit is accepted.
    assert!(
        app.agentq(&[
            "enqueue",
            "--tenant",
            "t1",
            "--kind",
            "echo",
            "--input",
            r#"{"text":"c"}"#,
            "--concurrency-key",
            "k",
            "--concurrency-limit",
            "1",
        ])
        .status
        .success()
    );
    app.cleanup().await;
}

#[tokio::test]
async fn a_patched_input_that_does_not_fit_is_refused_and_changes_nothing() {
    let app = crate::harness::running_app().await;
    let op = app.enqueue_script(json!([{ "fail": "non_retryable", "times": 1 }]), &[]);
    app.wait_status(&op, "dead", DEADLINE).await;
    let out = app.agentq(&[
        "dlq",
        "retry",
        &op,
        "--patch-input",
        r#"{"steps": "not a list"}"#,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not fit") && stderr.contains("at /steps"),
        "{stderr}"
    );
    assert_eq!(app.operation(&op).await.status.as_str(), "dead");
    let letter = app.agentq_json(&["dlq", "show", &op, "--json"]);
    assert_eq!(letter["dead_letter"]["status"], "open", "{letter}");
    app.cleanup().await;
}

#[tokio::test]
async fn a_batch_of_a_kind_that_takes_no_documents_and_another_tenants_schedules_are_refused() {
    let mut app = crate::harness::TestApp::start().await;
    let src = tempfile_dir("src");
    std::fs::write(src.join("a.md"), "Title: A\nbody").unwrap();
    let dst = tempfile_dir("dst");
    let instructions = src.join("instructions.txt");
    std::fs::write(&instructions, "Keep it.").unwrap();
    let (s, d) = (
        app.dir_store("t1", &src, "read"),
        app.dir_store("t1", &dst, "write"),
    );
    let out = app.agentq(&[
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        &s,
        "--target",
        &d,
        "--instructions",
        instructions.to_str().unwrap(),
        "--kind",
        "echo",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot take a batch's documents"),
        "{stderr}"
    );
    assert_eq!(app.operation_count().await, 0);
    // An operator of t1 naming another tenant's schedules is refused, not shown its own.
    let (_, base) = app.serve().await;
    let token = app.token("t1", "operator");
    let r = reqwest::Client::new()
        .get(format!("{base}/v1/schedules?tenant=t2"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&dst);
    app.cleanup().await;
}

// ---------------------------------------------------------------- fair shares of worker slots

/// Enqueues a `script` of `steps` for `tenant`; its id.
fn script_of(app: &crate::harness::TestApp, tenant: &str, steps: Value) -> String {
    let input = json!({ "steps": steps }).to_string();
    let v = app.agentq_json(&[
        "enqueue", "--tenant", tenant, "--kind", "script", "--input", &input, "--json",
    ]);
    v["op_id"].as_str().unwrap().to_string()
}

/// How many operations `tenant` runs now.
async fn running_of(app: &crate::harness::TestApp, tenant: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE tenant_id = $1 AND status = 'running'",
    )
    .bind(tenant)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// A woken sleeper's lag: from its sleep's wake time to its `queued` status event, in ms.
async fn wake_lag_ms(app: &crate::harness::TestApp, op: &str) -> f64 {
    sqlx::query_scalar(
        "SELECT (extract(epoch FROM min(e.at) - s.wake_at) * 1000)::float8
           FROM operation_steps s
           JOIN operation_events e ON e.op_id = s.op_id AND e.type = 'status'
                                   AND e.data->>'status' = 'queued' AND e.at > s.started_at
          WHERE s.op_id = $1::uuid AND s.kind = 'sleep'
          GROUP BY s.wake_at",
    )
    .bind(op)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_flooding_tenant_gives_way_to_another_and_still_drains() {
    let mut app = crate::harness::TestApp::start().await;
    app.spawn(&["scheduler"]);
    // Four slots per lane, so a tenant's share (AGENTQ_TENANT_SHARE, 0.5) is two.
    app.spawn(&["worker", "--concurrency", "4"]);
    // Tenant a floods: more long operations than slots, and a parent spawning two more.
    const STEP_MS: u64 = 8_000;
    let mut flood: Vec<String> = (0..6)
        .map(|_| script_of(&app, "a", json!([{ "work_ms": STEP_MS }])))
        .collect();
    flood.push(script_of(
        &app,
        "a",
        json!([
            { "spawn": "script", "input": { "steps": [{ "work_ms": STEP_MS }] } },
            { "spawn": "script", "input": { "steps": [{ "work_ms": STEP_MS }] } },
            { "join": true }
        ]),
    ));
    // Alone, it takes every slot (a share holds only while someone else waits).
    app.wait_for("tenant a to hold every slot", DEADLINE, || async {
        running_of(&app, "a").await == 4
    })
    .await;

    // Tenant b arrives: quick operations and 1 s sleeps.
    let arrived = Instant::now();
    let quick: Vec<String> = (0..3)
        .map(|i| script_of(&app, "b", json!([{ "work_ms": 10 + i }])))
        .collect();
    let sleepers: Vec<String> = (0..2)
        .map(|_| script_of(&app, "b", json!([{ "sleep_ms": 1000 }])))
        .collect();
    for op in &quick {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    let started_within = arrived.elapsed();
    println!("tenant b's operations finished {started_within:?} after it arrived");
    // Without giving way, b would wait for a's eight-second steps; a gave slots back.
    assert!(
        started_within < Duration::from_millis(STEP_MS) - Duration::from_secs(1),
        "b waited {started_within:?}"
    );
    for op in &sleepers {
        app.wait_status(op, "succeeded", DEADLINE).await;
        let lag = wake_lag_ms(&app, op).await;
        println!("tenant b's 1 s sleep woke {lag:.0} ms late");
        assert!(lag < 1_500.0, "woke {lag} ms after its time");
    }

    // b is idle again: a's flood drains, every operation of it (the ones that gave their
    // slot back resume from their journals).
    let drain = Duration::from_secs(120);
    for op in &flood {
        app.wait_status(op, "succeeded", drain).await;
    }
    let children = app.agentq_json_lines(&["list", "--parent", &flood[6], "--json"]);
    assert_eq!(children.len(), 2);
    for c in &children {
        assert_eq!(c["status"], "succeeded", "{c}");
    }
    app.cleanup().await;
}

#[tokio::test]
async fn a_tenant_giving_way_never_cuts_an_unsafe_call() {
    let mut app = crate::harness::TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker", "--concurrency", "4"]);
    // Each of a's operations makes a payment (unsafe, no reconcile: cut mid-call, it could
    // only end as unknown_side_effect) whose answer takes 3 s, then works.
    let flood: Vec<String> = (0..4)
        .map(|_| {
            script_of(
                &app,
                "a",
                json!([
                    { "tool": "ledger", "replay": "unsafe", "label": "pay", "after_ms": 3_000 },
                    { "work_ms": 6_000 }
                ]),
            )
        })
        .collect();
    app.wait_for("a's payments to be under way", DEADLINE, || async {
        let mut paid = 0;
        for op in &flood {
            paid += app.effects(op).await;
        }
        paid == 4
    })
    .await;
    // b arrives while every payment's call is in flight: a gives way after the calls.
    let b = script_of(&app, "b", json!([{ "work_ms": 10 }]));
    app.wait_status(&b, "succeeded", DEADLINE).await;
    for op in &flood {
        let done = app
            .wait_status(op, "succeeded", Duration::from_secs(90))
            .await;
        assert_eq!(app.effects(op).await, 1, "one payment for {op}");
        assert!(done.error_class.is_none());
    }
    app.cleanup().await;
}
