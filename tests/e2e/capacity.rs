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
    let r = post_echo(&base, &token).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "5");
    // A webhook delivery: 429, the sender retries it later.
    let added = app.agentq_json(&[
        "webhooks", "add", "--tenant", "t1", "--source", "crm", "--kind", "echo", "--json",
    ]);
    let secret = added["secret"].as_str().unwrap();
    let delivered = deliver(&base, "crm", secret, "evt_1", &json!({ "text": "hello" })).await;
    assert_eq!(delivered, 429);
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
        let r = post_echo(&base, &token).await;
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
        stderr.contains("does not fit") && stderr.contains("steps: invalid type"),
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
pub(crate) async fn running_of(app: &crate::harness::TestApp, tenant: &str) -> i64 {
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
    // a's steps are one long step each: the slots it owes are taken mid-step, after the grace.
    app.set_env("AGENTQ_TENANT_SHARE_GRACE_SECS", "2");
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
    // Without giving way, b would wait for a's eight-second steps; a gave slots back after the
    // grace.
    assert!(
        started_within < Duration::from_millis(STEP_MS) - Duration::from_secs(1),
        "b waited {started_within:?}"
    );
    for op in &sleepers {
        app.wait_status(op, "succeeded", DEADLINE).await;
        let lag = wake_lag_ms(&app, op).await;
        println!("tenant b's 1 s sleep woke {lag:.0} ms late");
        // Woken within 1.5 s of the sleep's start, however full a's flood keeps the worker.
        assert!(lag < 500.0, "woke {lag} ms after its time");
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

// ---------------------------------------------------------------- journals with limits

#[tokio::test]
async fn a_journal_is_capped_in_rows_and_in_bytes_across_a_resume() {
    let mut app = crate::harness::TestApp::start().await;
    app.set_env("AGENTQ_JOURNAL_MAX_STEPS", "20");
    let first = [app.spawn(&["scheduler"]), app.spawn(&["worker"])];
    // Five steps, a sleep (the run ends; the resume loads the journal), then 30 more: the 21st
    // row is refused, after the resume.
    let mut program = vec![json!({ "work_ms": 1 }); 5];
    program.push(json!({ "sleep_ms": 100 }));
    program.extend(vec![json!({ "work_ms": 1 }); 30]);
    let op = app.enqueue_script(Value::Array(program), &[]);
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("non_retryable"));
    let message = dead.error_message.unwrap_or_default();
    assert!(
        message.contains("journal limit") && message.contains("AGENTQ_JOURNAL_MAX_STEPS"),
        "{message}"
    );
    let journal = steps(&app, &op);
    let rows = journal.iter().filter(|s| s["status"] != "failed").count();
    assert_eq!(rows, 20, "{journal:?}");
    for p in first {
        app.kill(p);
    }

    // Bytes: each work step's output is a few dozen bytes of JSON; 200 bytes stop it within
    // a handful, counted over the journal loaded at the resume too.
    app.set_env("AGENTQ_JOURNAL_MAX_STEPS", "10000");
    app.set_env("AGENTQ_JOURNAL_MAX_BYTES", "200");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let mut program = vec![json!({ "work_ms": 1 }); 2];
    program.push(json!({ "sleep_ms": 100 }));
    program.extend(vec![json!({ "work_ms": 1 }); 30]);
    let op = app.enqueue_script(Value::Array(program), &[]);
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    let message = dead.error_message.unwrap_or_default();
    assert!(message.contains("AGENTQ_JOURNAL_MAX_BYTES"), "{message}");
    let journal = steps(&app, &op);
    let bytes: usize = journal
        .iter()
        .filter_map(|s| s.get("output").filter(|o| !o.is_null()))
        .map(|o| o.to_string().len())
        .sum();
    // Refused at the first step once past 200: at most one output's worth over it.
    assert!(bytes > 200 && bytes < 400, "{bytes} bytes: {journal:?}");
    assert!(journal.len() < 30, "{journal:?}");
    app.cleanup().await;
}

// ---------------------------------------------------------------- kinds per tenant

/// `POST /v1/operations` of an `echo` with `token`.
async fn post_echo(base: &str, token: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/operations"))
        .bearer_auth(token)
        .json(&json!({ "kind": "echo", "input": { "text": "x" } }))
        .send()
        .await
        .unwrap()
}

/// A webhook delivery of `body` to `source`, signed with `secret`; its status.
async fn deliver(base: &str, source: &str, secret: &str, id: &str, body: &Value) -> u16 {
    let secret = agentq_core::webhook::Secret::parse(secret).unwrap();
    let body = body.to_string();
    let ts = chrono::Utc::now().timestamp();
    reqwest::Client::new()
        .post(format!("{base}/v1/webhooks/{source}"))
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", secret.sign(id, ts, body.as_bytes()))
        .body(body)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn an_admins_list_of_kinds_holds_on_every_way_an_operation_is_born() {
    let mut app = crate::harness::TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let http = reqwest::Client::new();
    // Made while t1 may use every kind: a webhook source and a schedule of `echo`.
    let added = app.agentq_json(&[
        "webhooks", "add", "--tenant", "t1", "--source", "crm", "--kind", "echo", "--json",
    ]);
    let secret = added["secret"].as_str().unwrap().to_string();
    let schedule = app.agentq_json(&[
        "schedules",
        "add",
        "--tenant",
        "t1",
        "--name",
        "hourly",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"x"}"#,
        "--every",
        "1h",
        "--json",
    ]);
    let schedule_id = schedule["schedule_id"].as_str().unwrap().to_string();

    // The admin allows t1 `script` only: the schedule of `echo` is paused by the change.
    let set = app.agentq_json(&["tenants", "kinds", "t1", "--allow", "script", "--json"]);
    assert_eq!(set["allowed"], json!(["script"]), "{set}");
    assert_eq!(set["paused_schedules"], json!([schedule_id]), "{set}");
    let before = app.operation_count().await;

    // Every way an `echo` of t1 is born is refused, saying why and what to do.
    let refused = |out: std::process::Output| {
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            stderr.contains("may not create operations of kind")
                && stderr.contains("tenants kinds"),
            "{stderr}"
        );
    };
    refused(app.agentq(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"x"}"#,
    ]));
    refused(app.agentq(&[
        "schedules",
        "add",
        "--tenant",
        "t1",
        "--name",
        "again",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"x"}"#,
        "--every",
        "1h",
    ]));
    refused(app.agentq(&["schedules", "resume", &schedule_id]));
    refused(app.agentq(&[
        "webhooks", "add", "--tenant", "t1", "--source", "other", "--kind", "echo",
    ]));
    refused(app.agentq(&[
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        "docs",
        "--target",
        "out",
        "--instructions",
        "/dev/null",
    ]));
    let producer = app.token("t1", "producer");
    let r = post_echo(&base, &producer).await;
    assert_eq!(r.status(), 403);
    let problem: Value = r.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("\"echo\""),
        "{problem}"
    );
    assert_eq!(
        deliver(&base, "crm", &secret, "evt_1", &json!({ "text": "x" })).await,
        403
    );
    // A spawn: the parent's input names a child t1 may not have; the parent fails, no child.
    let parent = app.enqueue_script(json!([{ "spawn": "echo", "input": { "text": "c" } }]), &[]);
    let dead = app.wait_status(&parent, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("non_retryable"));
    assert!(
        dead.error_message
            .unwrap_or_default()
            .contains("may not create operations"),
        "the parent says why"
    );
    assert_eq!(
        app.operation_count().await,
        before + 1,
        "only the parent was stored"
    );

    // The tenant reads its own list, not another's, and cannot change it.
    let r = http
        .get(format!("{base}/v1/tenants/t1/kinds"))
        .bearer_auth(&producer)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let own: Value = r.json().await.unwrap();
    assert_eq!(own["allowed"], json!(["script"]), "{own}");
    assert_eq!(own["source"], "own");
    for (method, path) in [("GET", "t2"), ("GET", "*"), ("PUT", "t1")] {
        let r = http
            .request(
                method.parse().unwrap(),
                format!("{base}/v1/tenants/{path}/kinds"),
            )
            .bearer_auth(&producer)
            .json(&json!({ "allow": ["echo"] }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{method} {path}");
    }
    // An admin naming a kind the deployment does not run: 422 at the kind, nothing changed.
    let admin = app.token("ops", "admin");
    let r = http
        .put(format!("{base}/v1/tenants/t1/kinds"))
        .bearer_auth(&admin)
        .json(&json!({ "allow": ["script", "nope"] }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let problem: Value = r.json().await.unwrap();
    assert!(problem.to_string().contains("/kinds/1"), "{problem}");
    let shown = app.agentq_json(&["tenants", "kinds", "t1", "--json"]);
    assert_eq!(shown["allowed"], json!(["script"]), "{shown}");

    // The default list (`*`) holds for tenants without their own; `--production` leaves out
    // the kinds for tests.
    app.agentq_ok(&["tenants", "kinds", "*", "--allow", "echo"]);
    refused(app.agentq(&[
        "enqueue",
        "--tenant",
        "t2",
        "--kind",
        "script",
        "--input",
        r#"{"steps":[]}"#,
    ]));
    app.agentq_ok(&[
        "enqueue",
        "--tenant",
        "t2",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"x"}"#,
    ]);
    let prod = app.agentq_json(&["tenants", "kinds", "t3", "--production", "--json"]);
    let allowed: Vec<&str> = prod["allowed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert!(
        allowed.contains(&"echo") && !allowed.contains(&"script"),
        "{prod}"
    );
    // Unset: t1 follows the default list, and its schedule of `echo` may resume.
    let unset = app.agentq_json(&["tenants", "kinds", "t1", "--unset", "--json"]);
    assert_eq!(unset["source"], "default", "{unset}");
    app.agentq_ok(&["schedules", "resume", &schedule_id]);
    // Every change was audited.
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE action = 'tenant_kinds_set'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audited, 4);
    app.cleanup().await;
}

#[tokio::test]
async fn a_journal_is_read_in_pages_of_bounded_size() {
    use agentq_testkit::fake_model::{FakeModel, Mode};
    // Each model answer carries 600 KB: two of them are more than a page's 1 MiB.
    let fake = FakeModel::start(Mode::EchoSuffix("x".repeat(600_000))).await;
    let mut app = crate::harness::TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let mut program = vec![json!({ "work_ms": 0 }); 250];
    program.extend(vec![json!({ "model": "hi" }); 3]);
    let op = app.enqueue_script(Value::Array(program), &[]);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    let (_, base) = app.serve().await;
    let token = app.token("t1", "producer");
    let http = reqwest::Client::new();
    let page = |query: String| {
        let (http, token, base, op) = (http.clone(), token.clone(), base.clone(), op.clone());
        async move {
            let r = http
                .get(format!("{base}/v1/operations/{op}/steps{query}"))
                .bearer_auth(&token)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    // Pages of 100 by default, then pages cut by size: every step once, in order, no gap.
    let (mut seen, mut after, mut sizes) = (Vec::new(), None::<i64>, Vec::new());
    loop {
        let query = after.map(|a| format!("?after={a}")).unwrap_or_default();
        let (status, body) = page(query).await;
        assert_eq!(status, 200, "{body}");
        let steps = body["steps"].as_array().unwrap();
        sizes.push(steps.len());
        seen.extend(steps.iter().map(|s| s["seq"].as_i64().unwrap()));
        match body["next_after"].as_i64() {
            Some(a) => after = Some(a),
            None => break,
        }
    }
    assert_eq!(seen, (0..253).collect::<Vec<i64>>());
    assert_eq!(&sizes[..2], &[100, 100], "{sizes:?}");
    // 50 small steps and the first large one; then one large step a page.
    assert_eq!(&sizes[2..], &[51, 1, 1], "{sizes:?}");
    let (status, body) = page("?limit=5&after=10".into()).await;
    assert_eq!(status, 200);
    assert_eq!(body["steps"][0]["seq"], 11);
    assert_eq!(body["next_after"], 15);
    for bad in [
        "?limit=0",
        "?limit=1001",
        "?after=x",
        "?after=-1",
        "?page=2",
    ] {
        let (status, body) = page(bad.into()).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    // Another tenant's token sees no such operation.
    let other = app.token("t2", "producer");
    let r = http
        .get(format!("{base}/v1/operations/{op}/steps"))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // The CLI reads every page.
    let lines = app.agentq_json_lines(&["steps", &op, "--json"]);
    assert_eq!(lines.len(), 253);
    app.cleanup().await;
}

// ---------------------------------------------------------------- lists per tenant

#[tokio::test]
async fn a_tenants_list_reads_its_own_rows_through_its_index() {
    use agentq_core::db::listing::{self, Filter};
    use agentq_core::state::Status;
    let app = crate::harness::TestApp::start().await;
    // 20,000 finished operations of a noisy tenant, 50 of a quiet one.
    sqlx::query(
        "INSERT INTO operations (id, tenant_id, kind, input, input_sha256, status, attempt,
                                 epoch, finished_at, created_at)
         SELECT gen_random_uuid(), CASE WHEN g <= 20000 THEN 'noisy' ELSE 'quiet' END,
                CASE WHEN g % 2 = 0 THEN 'echo' ELSE 'script' END, '{}', 'x', 'succeeded', 1,
                1, now(), now() - g * interval '1 second'
           FROM generate_series(1, 20050) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE operations")
        .execute(&app.pool)
        .await
        .unwrap();
    for tenant in ["quiet", "noisy"] {
        for (kind, statuses) in [
            (None, vec![]),
            (Some("echo".to_string()), vec![]),
            (None, vec![Status::Succeeded]),
        ] {
            let f = Filter {
                tenant: Some(tenant.into()),
                kind,
                statuses,
                ..Filter::default()
            };
            let plan = listing::explain(&app.pool, &f, 100).await.unwrap();
            assert!(
                plan.contains("operations_tenant_created") && !plan.contains("Seq Scan"),
                "{tenant} {f:?}: {plan}"
            );
        }
    }
    let quiet = Filter {
        tenant: Some("quiet".into()),
        ..Filter::default()
    };
    let page = listing::list(&app.pool, &quiet, 100, None).await.unwrap();
    assert_eq!(page.len(), 50);
    assert!(page.iter().all(|s| s.tenant == "quiet"));
    assert!(page.windows(2).all(|w| w[0].created_at >= w[1].created_at));
    app.cleanup().await;
}
