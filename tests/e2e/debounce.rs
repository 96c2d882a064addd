//! Debounce on a key (issue 29): a webhook source's noisy deliveries of one document fold into
//! one operation with the last body, started after the window; `max_delay` caps a stream that
//! never pauses; the conflict policies for a key whose operation runs (`queue`, `skip`,
//! `cancel_running`), decided with the operation held at a model call; bad debounces refused
//! naming the field, nothing written.

use std::time::Duration;

use agentq_core::webhook::Secret;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::api::Api;
use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp, running_app};
use crate::usecase_webhook::deliver_to;

/// A `script` program that writes a ledger effect labelled with the document and one with its
/// revision: what ran is in `ledger_effects`.
fn revision(doc: &str, rev: usize) -> Value {
    json!({ "steps": [
        { "tool": "ledger", "replay": "safe", "label": doc },
        { "tool": "ledger", "replay": "safe", "label": format!("rev-{rev}") },
    ] })
}

/// When the operation was first claimed (its `running` status event, written at the claim's
/// commit), by PostgreSQL's clock.
async fn started_at(app: &TestApp, op: &str) -> DateTime<Utc> {
    sqlx::query_scalar(
        "SELECT min(at) FROM operation_events
          WHERE op_id = $1::uuid AND type = 'status' AND data->>'status' = 'running'",
    )
    .bind(op)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

async fn labels(app: &TestApp, op: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT label FROM ledger_effects WHERE op_id = $1::uuid ORDER BY id")
        .bind(op)
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

async fn count(app: &TestApp, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn twenty_deliveries_of_one_document_make_one_operation_with_the_last_body_after_the_window()
{
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let added = app.agentq_json(&[
        "webhooks",
        "add",
        "--tenant",
        "acme",
        "--source",
        "docs",
        "--kind",
        "script",
        "--debounce-pointer",
        "/steps/0/label",
        "--debounce",
        "2s",
        "--max-delay",
        "30s",
        "--json",
    ]);
    let secret = Secret::parse(added["secret"].as_str().unwrap()).unwrap();
    let listed = app.agentq_json(&["webhooks", "list", "--tenant", "acme", "--json"]);
    assert_eq!(
        listed["debounce"],
        json!({ "pointer": "/steps/0/label", "window_ms": 2000, "max_delay_ms": 30000,
                "on_running": "queue" }),
        "{listed}"
    );

    let http = reqwest::Client::new();
    let mut answers = Vec::new();
    let mut bodies = Vec::new();
    for rev in 0..20 {
        let body = revision("doc-1", rev).to_string().into_bytes();
        let id = format!("save-{rev}");
        let (status, v) = deliver_to(&http, &base, "docs", &secret, &id, 0, &body).await;
        answers.push((status, v));
        bodies.push((id, body));
        // Twenty saves within about a second: each well inside the 2 s window of the last.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let op = answers[0].1["op_id"].as_str().unwrap().to_string();
    assert_eq!(
        answers[0].0, 202,
        "the first delivery makes it: {:?}",
        answers[0]
    );
    assert_eq!(answers[0].1["debounce"]["outcome"], "pending");
    for (status, v) in &answers[1..] {
        assert_eq!(*status, 200, "a later delivery joins it: {v}");
        assert_eq!(v["op_id"], op.as_str(), "{v}");
        assert_eq!(v["created"], false, "{v}");
        assert_eq!(v["debounce"]["outcome"], "joined", "{v}");
        assert_eq!(v["debounce"]["debounce_key"], "doc-1", "{v}");
    }
    // A sender's retry of a joined delivery is that delivery: same operation, nothing new.
    let (id, body) = &bodies[7];
    let (status, v) = deliver_to(&http, &base, "docs", &secret, id, -30, body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["op_id"].as_str(), &v["debounce"]["outcome"]),
        (Some(op.as_str()), &json!("repeated"))
    );
    // The same webhook-id with another body is refused, as without a debounce.
    let other = revision("doc-1", 99).to_string().into_bytes();
    let (status, v) = deliver_to(&http, &base, "docs", &secret, id, 0, &other).await;
    assert_eq!(status, 409, "{v}");

    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        count(&app, "SELECT count(*) FROM operations").await,
        1,
        "exactly one operation"
    );
    let input: Value = sqlx::query_scalar("SELECT input FROM operations WHERE id = $1::uuid")
        .bind(&op)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(input, revision("doc-1", 19), "the last delivery's body");
    assert_eq!(
        labels(&app, &op).await,
        ["doc-1", "rev-19"],
        "it ran the last body"
    );
    assert!(done.attempt == 1, "one attempt: {done:?}");

    // Each joining delivery is audited; the last one set the start, and it started after it.
    let audits: Vec<(String, Value, DateTime<Utc>)> = sqlx::query_as(
        "SELECT actor, details, created_at FROM operator_actions
          WHERE op_id = $1::uuid AND action = 'debounce' ORDER BY id",
    )
    .bind(&op)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(audits.len(), 19, "one audit row per joining delivery");
    assert!(audits.iter().all(|(actor, d, _)| actor == "webhook:docs"
        && d["debounce_key"] == "doc-1"
        && d.get("input").is_none()));
    let last = audits.last().unwrap().2;
    let started = started_at(&app, &op).await;
    assert!(
        started >= last + chrono::Duration::seconds(2),
        "started {started} before the window after the last delivery ({last}) had passed"
    );
    app.cleanup().await;
}

#[tokio::test]
async fn max_delay_caps_a_stream_that_never_pauses_and_later_arrivals_queue_a_new_operation() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("t1", "producer");

    // Every 300 ms for 5 s, a window of 1 s (never reached) and a cap of 2 s.
    let mut answers: Vec<Value> = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut rev = 0;
    while tokio::time::Instant::now() < end {
        let r = api
            .post(
                "/v1/operations",
                Some(&token),
                &json!({ "kind": "script", "input": revision("doc-9", rev),
                         "debounce_key": "doc-9", "debounce": "1s", "max_delay": "2s" }),
            )
            .await;
        assert!(matches!(r.status, 200 | 202), "{}", r.text());
        answers.push(r.json());
        rev += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let ops: Vec<String> = answers
        .iter()
        .map(|v| v["op_id"].as_str().unwrap().to_string())
        .fold(Vec::new(), |mut ops, op| {
            if !ops.contains(&op) {
                ops.push(op);
            }
            ops
        });
    assert!(
        ops.len() >= 2,
        "a stream past max_delay makes a new operation once the first started: {answers:?}"
    );
    let created: Vec<&Value> = answers.iter().filter(|v| v["created"] == true).collect();
    assert_eq!(created.len(), ops.len(), "one created answer per operation");
    for op in &ops {
        app.wait_status(op, "succeeded", DEADLINE).await;
        let (created_at, run_at): (DateTime<Utc>, DateTime<Utc>) =
            sqlx::query_as("SELECT created_at, run_at FROM operations WHERE id = $1::uuid")
                .bind(op)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        assert!(
            run_at <= created_at + chrono::Duration::seconds(2),
            "{op}: due at {run_at}, past first arrival {created_at} + max_delay"
        );
        // The scheduler publishes it at its next pass (200 ms), a worker claims it at once;
        // on a loaded machine allow 3 s more.
        let started = started_at(&app, op).await;
        assert!(
            started <= created_at + chrono::Duration::seconds(5),
            "{op}: started {started}, long after first arrival {created_at} + max_delay"
        );
    }
    // Answers went to the operation pending at that moment, in order: first, second, …
    let order: Vec<usize> = answers
        .iter()
        .map(|v| {
            ops.iter()
                .position(|o| o == v["op_id"].as_str().unwrap())
                .unwrap()
        })
        .collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
    let first_started = started_at(&app, &ops[0]).await;
    let second_created: DateTime<Utc> =
        sqlx::query_scalar("SELECT created_at FROM operations WHERE id = $1::uuid")
            .bind(&ops[1])
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(
        // The arrival that made it may have begun (its created_at) while the claim it waited
        // for was committing.
        second_created >= first_started - chrono::Duration::seconds(1),
        "the second operation was made once the first had started (policy queue): created \
         {second_created}, the first started {first_started}"
    );
    app.cleanup().await;
}

/// `agentq enqueue --debounce-key KEY --debounce WINDOW [FLAGS…]` of `kind` with `input`,
/// run to completion.
fn debounce_run(
    app: &TestApp,
    kind: &str,
    input: &Value,
    key: &str,
    window: &str,
    flags: &[&str],
) -> std::process::Output {
    let input = input.to_string();
    let mut args = vec![
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        kind,
        "--input",
        &input,
        "--debounce-key",
        key,
        "--debounce",
        window,
    ];
    args.extend_from_slice(flags);
    app.agentq(&args)
}

/// [`debounce_run`] with `--json`, expected to succeed; returns the JSON answer.
fn debounced(
    app: &TestApp,
    kind: &str,
    input: &Value,
    key: &str,
    window: &str,
    flags: &[&str],
) -> Value {
    let mut flags = flags.to_vec();
    flags.push("--json");
    let out = debounce_run(app, kind, input, key, window, &flags);
    assert!(
        out.status.success(),
        "enqueue {key}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A debounced `script` program on `key` with the policy `policy` (a 300 ms window).
fn enqueue(app: &TestApp, key: &str, policy: &str, steps: Value) -> Value {
    let input = json!({ "steps": steps });
    debounced(
        app,
        "script",
        &input,
        key,
        "300ms",
        &["--on-running", policy],
    )
}

#[tokio::test]
async fn the_policies_for_a_key_whose_operation_runs_queue_skip_and_cancel_it() {
    let fake = FakeModel::start(Mode::Echo).await;
    let gate = fake.hold_requests();
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let held = json!([{ "model": "held" }]);
    let quick = json!([{ "work_ms": 1 }]);
    let id = |v: &Value| v["op_id"].as_str().unwrap().to_string();

    // skip: while the key's operation runs, an arrival is answered with it; nothing new.
    let running = id(&enqueue(&app, "k-skip", "skip", held.clone()));
    app.wait_for("the skip key's model call", DEADLINE, || async {
        fake.requests() == 1
    })
    .await;
    let skipped = enqueue(&app, "k-skip", "skip", quick.clone());
    assert_eq!(id(&skipped), running, "{skipped}");
    assert_eq!(
        (&skipped["created"], &skipped["debounce"]["outcome"]),
        (&json!(false), &json!("skipped"))
    );
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM operations WHERE debounce_key = 'k-skip'"
        )
        .await,
        1,
        "skip made nothing"
    );
    gate.add_permits(1);
    app.wait_status(&running, "succeeded", DEADLINE).await;
    // Once it finished, the key is free: a new pending operation.
    let after = enqueue(&app, "k-skip", "skip", quick.clone());
    assert_ne!(id(&after), running);
    assert_eq!(after["debounce"]["outcome"], "pending");
    app.wait_status(&id(&after), "succeeded", DEADLINE).await;

    // queue: a new pending operation, debounced itself, runs beside the held one.
    let first = id(&enqueue(&app, "k-queue", "queue", held.clone()));
    app.wait_for("the queue key's model call", DEADLINE, || async {
        fake.requests() == 2
    })
    .await;
    let queued = enqueue(&app, "k-queue", "queue", quick.clone());
    let again = enqueue(&app, "k-queue", "queue", quick.clone());
    assert_ne!(id(&queued), first);
    assert_eq!(queued["debounce"]["outcome"], "pending");
    assert_eq!(
        (id(&again), &again["debounce"]["outcome"]),
        (id(&queued), &json!("joined"))
    );
    app.wait_status(&id(&queued), "succeeded", DEADLINE).await;
    assert_eq!(app.operation(&first).await.status.as_str(), "running");
    gate.add_permits(1);
    app.wait_status(&first, "succeeded", DEADLINE).await;

    // cancel_running: the running one is cancelled through the cancel flow (audited), and the
    // new pending one runs.
    let doomed = id(&enqueue(&app, "k-cancel", "cancel_running", held.clone()));
    app.wait_for("the cancel key's model call", DEADLINE, || async {
        fake.requests() == 3
    })
    .await;
    let newer = enqueue(&app, "k-cancel", "cancel_running", quick.clone());
    assert_ne!(id(&newer), doomed);
    assert_eq!(newer["debounce"]["cancelled"], json!([doomed]), "{newer}");
    let cancel_actions = count(
        &app,
        &format!(
            "SELECT count(*) FROM operator_actions WHERE action = 'cancel' AND op_id = '{doomed}'"
        ),
    )
    .await;
    assert_eq!(cancel_actions, 1, "the cancel flow audited it");
    // Its worker learns of the cancel at its next lease renewal and stops it where it is,
    // its model call still held.
    app.wait_status(&doomed, "cancelled", DEADLINE).await;
    app.wait_status(&id(&newer), "succeeded", DEADLINE).await;
    let skips = count(
        &app,
        "SELECT count(*) FROM operator_actions WHERE action = 'debounce_skip'",
    )
    .await;
    assert_eq!(skips, 1, "the skipped arrival is audited");
    app.cleanup().await;
}

#[tokio::test]
async fn bad_debounces_are_refused_naming_the_field_and_why_names_a_pending_one() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("t1", "producer");
    let long = "k".repeat(300);
    let input = json!({ "text": "hi" }).to_string();

    // The command line: exit 2, the flag named.
    for (flags, named) in [
        (
            vec!["--debounce-key", "k", "--debounce", "-2s"],
            "--debounce",
        ),
        (
            vec!["--debounce-key", "k", "--debounce", "0s"],
            "--debounce",
        ),
        (
            vec![
                "--debounce-key",
                "k",
                "--debounce",
                "5s",
                "--max-delay",
                "2s",
            ],
            "--max-delay",
        ),
        (
            vec![
                "--debounce-key",
                "k",
                "--debounce",
                "5s",
                "--on-running",
                "later",
            ],
            "--on-running",
        ),
        (
            vec!["--debounce-key", &long, "--debounce", "5s"],
            "--debounce-key",
        ),
        (vec!["--debounce", "5s"], "--debounce-key"),
    ] {
        let mut args = vec![
            "enqueue", "--tenant", "t1", "--kind", "echo", "--input", &input,
        ];
        args.extend(flags.iter().copied());
        let out = app.agentq(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
    }
    // The API: 422 naming the field.
    for (extra, field) in [
        (
            json!({ "debounce_key": "k", "debounce": "-2s" }),
            "/debounce",
        ),
        (
            json!({ "debounce_key": "k", "debounce": "5s", "max_delay": "2s" }),
            "/max_delay",
        ),
        (
            json!({ "debounce_key": "k", "debounce": "5s", "on_running": "x" }),
            "/on_running",
        ),
        (
            json!({ "debounce_key": long, "debounce": "5s" }),
            "/debounce_key",
        ),
        (json!({ "debounce": "5s" }), "/debounce_key"),
        (
            json!({ "debounce_key": "k", "debounce": "5s", "run_at": "2030-01-01T00:00:00Z" }),
            "/run_at",
        ),
    ] {
        let mut body = json!({ "kind": "echo", "input": { "text": "hi" } });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = api.post("/v1/operations", Some(&token), &body).await;
        assert!(matches!(r.status, 400 | 422), "{body}: {}", r.text());
        let p = r.json();
        assert_eq!(p["field"], field, "{body}: {p}");
        assert!(
            p["detail"]
                .as_str()
                .unwrap()
                .contains(field.trim_start_matches('/'))
        );
    }
    // A source: its flags named, no source written.
    for (flags, named) in [
        (
            vec!["--debounce-pointer", "doc", "--debounce", "2s"],
            "--debounce-pointer",
        ),
        (
            vec!["--debounce-pointer", "/doc", "--debounce", "2x"],
            "--debounce",
        ),
        (vec!["--debounce", "2s"], "--debounce-pointer"),
    ] {
        let mut args = vec![
            "webhooks", "add", "--tenant", "t1", "--source", "s", "--kind", "echo",
        ];
        args.extend(flags.iter().copied());
        let out = app.agentq(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
    }
    assert_eq!(app.operation_count().await, 0, "nothing enqueued");
    assert_eq!(
        count(&app, "SELECT count(*) FROM webhook_sources").await,
        0,
        "no source added"
    );

    // A pending operation: `why` names its debounce (an hour's window: no worker runs here).
    // Under a cap of one unfinished operation, an arrival that joins it is admitted (it makes
    // none) and one that would make another is refused.
    app.set_env("AGENTQ_TENANT_MAX_UNFINISHED", "1");
    let hi = json!({ "text": "hi" });
    let pending = debounced(&app, "echo", &hi, "k", "1h", &[]);
    let op = pending["op_id"].as_str().unwrap();
    let newer = json!({ "text": "newer" });
    let joined = debounced(&app, "echo", &newer, "k", "1h", &[]);
    assert_eq!(joined["op_id"], op);
    let over = debounce_run(&app, "echo", &hi, "other", "1h", &[]);
    let stderr = String::from_utf8_lossy(&over.stderr);
    assert!(
        !over.status.success() && stderr.contains("AGENTQ_TENANT_MAX_UNFINISHED"),
        "a new key's operation past the cap: {stderr}"
    );
    let why = app.agentq_json(&["why", op, "--json"]);
    assert_eq!(why["detail"]["reason"], "debouncing", "{why}");
    assert_eq!(why["detail"]["debounce_key"], "k", "{why}");
    assert_eq!(why["detail"]["joined"], 1, "{why}");
    let input: Value = sqlx::query_scalar("SELECT input FROM operations WHERE id = $1::uuid")
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(input, json!({ "text": "newer" }));
    app.cleanup().await;
}
