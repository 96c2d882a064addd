//! `agentq why OP` and `GET /v1/operations/{id}/why`: an operation held by each gate is named
//! by that gate with its evidence, through the command line (text and JSON) and the API; then
//! the hold is lifted and the operation runs. Holds are forced by gates (a model call held by
//! the fake provider, a signal not sent, a worker not started), never by timing.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::api::send;
use crate::batch::{TempDir, start_batch, write_docs};
use crate::console::Browser;
use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};
use crate::versions::{stop_worker, worker};

/// Where a test asks: the API's base URL, a token of the tenant, and the console signed in
/// with an operator token.
struct Front {
    base: String,
    token: String,
    ui: Browser,
}

impl Front {
    async fn new(app: &TestApp, base: &str, tenant: &str) -> Self {
        let mut ui = Browser::new(base);
        let (status, _) = ui.login(&app.token(tenant, "operator")).await;
        assert!(status < 400, "console sign-in: {status}");
        Self {
            base: base.to_string(),
            token: app.token(tenant, "producer"),
            ui,
        }
    }
}

/// The answer for `op` through the command line (its text, and its JSON), the API (checked
/// against the OpenAPI document by `send`) and the console's operation page: they agree;
/// returns the text and the API's answer.
async fn ask(app: &TestApp, front: &Front, op: &str) -> (String, Value) {
    let (base, token) = (&front.base, &front.token);
    let out = app.agentq_ok(&["why", op]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let cli = app.agentq_json(&["why", op, "--json"]);
    let api = send(
        format!("why {op}"),
        reqwest::Client::new()
            .get(format!("{base}/v1/operations/{op}/why"))
            .bearer_auth(token),
    )
    .await
    .expect(200);
    assert_eq!(
        cli["detail"]["reason"], api["detail"]["reason"],
        "{cli} vs {api}"
    );
    // The command line is the deployment's operator (an admin): it names the worker's host,
    // which a tenant's token sees as `worker-<its process suffix>`.
    let as_tenant = |s: &str| match (
        cli["detail"]["worker"].as_str(),
        api["detail"]["worker"].as_str(),
    ) {
        (Some(host), Some(unnamed)) => s.replace(host, unnamed),
        _ => s.to_string(),
    };
    assert_eq!(
        as_tenant(cli["headline"].as_str().unwrap()),
        api["headline"].as_str().unwrap(),
        "{cli} vs {api}"
    );
    assert_eq!(
        text.lines().next().map(as_tenant).as_deref(),
        api["headline"].as_str(),
        "the text's first line is the headline"
    );
    let (status, page) = front.ui.get(&format!("/ui/operations/{op}")).await;
    assert_eq!(status, 200, "{page}");
    let escaped = api["headline"]
        .as_str()
        .unwrap()
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;");
    assert!(
        page.contains("id=\"why\"") && page.contains(&escaped),
        "the console's operation page shows {escaped}"
    );
    (text, api)
}

/// A fake provider whose every call is held until the returned gate lets it through.
async fn held_model() -> (FakeModel, Arc<tokio::sync::Semaphore>) {
    let fake = FakeModel::start(Mode::Echo).await;
    let gate = fake.hold_requests();
    (fake, gate)
}

fn reason(why: &Value) -> &str {
    why["detail"]["reason"].as_str().unwrap_or_default()
}

/// One world for the holds a running worker shows: an ordering key and a concurrency key held
/// by an operation whose model call the fake provider holds, a retry's backoff with its last
/// error, a wait for a signal, a join, a sleep; each named, then lifted.
#[tokio::test]
async fn why_names_keys_a_retry_a_signal_a_join_and_a_sleep_then_each_lifts() {
    let (fake, gate) = held_model().await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let front = Front::new(&app, &base, "t1").await;

    let hour = 3_600_000;
    let first = app.enqueue_script(json!([{ "model": "first" }]), &["--ordering-key", "k"]);
    let second = app.enqueue_script(json!([{ "work_ms": 1 }]), &["--ordering-key", "k"]);
    let limit = ["--concurrency-key", "c", "--concurrency-limit", "1"];
    let busy = app.enqueue_script(json!([{ "model": "busy" }]), &limit);
    let next = app.enqueue_script(json!([{ "work_ms": 1 }]), &limit);
    let retry = app.enqueue_script(
        json!([{ "fail": "retryable", "times": 1, "not_before_ms": hour }]),
        &[],
    );
    let waiter = app.enqueue_script(json!([{ "wait_signal": "go", "timeout_ms": hour }]), &[]);
    let parent = app.enqueue_script(
        json!([
            { "spawn": "script",
              "input": { "steps": [{ "wait_signal": "child-go", "timeout_ms": hour }] } },
            { "join": true }
        ]),
        &[],
    );
    let sleeper = app.enqueue_script(json!([{ "sleep_ms": hour }]), &[]);

    app.wait_for("both held model calls in flight", DEADLINE, || async {
        fake.requests() == 2
    })
    .await;
    app.wait_for(
        "the failed attempt to be queued for its retry",
        DEADLINE,
        || async {
            let v = app.operation(&retry).await;
            v.status.as_str() == "queued" && v.error_class.is_some()
        },
    )
    .await;
    app.wait_status(&waiter, "waiting", DEADLINE).await;
    app.wait_status(&parent, "waiting", DEADLINE).await;
    app.wait_status(&sleeper, "sleeping", DEADLINE).await;

    // Running: the worker, since when, the attempt, the lease.
    let (text, why) = ask(&app, &front, &first).await;
    assert_eq!(reason(&why), "running", "{why}");
    assert!(why["detail"]["worker"].is_string(), "{why}");
    assert!(why["detail"]["since"].is_string(), "{why}");
    assert!(
        text.contains("running on worker") && text.contains("lease until"),
        "{text}"
    );

    // Ordering key: the operation ahead, running on its worker.
    let (text, why) = ask(&app, &front, &second).await;
    assert_eq!(reason(&why), "ordering_key", "{why}");
    assert_eq!(why["detail"]["key"], "k");
    assert_eq!(why["detail"]["holder"]["id"], first.as_str(), "{why}");
    assert_eq!(why["detail"]["holder"]["status"], "running", "{why}");
    assert!(
        text.contains(&first) && text.contains("is running on worker"),
        "{text}"
    );

    // Concurrency key: its running count and limit.
    let (text, why) = ask(&app, &front, &next).await;
    assert_eq!(reason(&why), "concurrency_key", "{why}");
    assert_eq!(why["detail"]["running"], 1, "{why}");
    assert_eq!(why["detail"]["limit"], 1, "{why}");
    assert!(text.contains("1 of 1 running"), "{text}");

    // Not due: the retry time and the failed attempt's error.
    let (text, why) = ask(&app, &front, &retry).await;
    assert_eq!(reason(&why), "not_due", "{why}");
    assert_eq!(why["detail"]["error_class"], "retryable", "{why}");
    assert!(why["detail"]["retry_at"].is_string(), "{why}");
    assert!(text.contains("last error: [retryable]"), "{text}");

    // A wait for a signal none sent yet.
    let (text, why) = ask(&app, &front, &waiter).await;
    assert_eq!(reason(&why), "waiting_for_signal", "{why}");
    assert_eq!(why["detail"]["signal"], "go");
    assert_eq!(why["detail"]["pending"], 0);
    assert!(text.contains("waiting for signal \"go\""), "{text}");

    // A join: which child is unfinished.
    let (text, why) = ask(&app, &front, &parent).await;
    assert_eq!(reason(&why), "waiting_for_children", "{why}");
    assert_eq!(why["detail"]["children"], 1);
    let child = why["detail"]["unfinished"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(text.contains(&format!("child {child} is")), "{text}");

    // A sleep: until when.
    let (text, why) = ask(&app, &front, &sleeper).await;
    assert_eq!(reason(&why), "sleeping", "{why}");
    assert!(text.starts_with("sleeping until"), "{text}");

    // Another tenant's operation is not found, as everywhere.
    let other = app.token("t2", "producer");
    send(
        "why of another tenant's operation",
        reqwest::Client::new()
            .get(format!("{base}/v1/operations/{first}/why"))
            .bearer_auth(&other),
    )
    .await
    .problem(404, "not-found");

    // Lift every hold: the model calls answer, the signals are sent, the retry's time comes
    // (forced: its run_at is moved to now, as if the hour had passed).
    gate.add_permits(1000);
    app.agentq_ok(&["signal", &waiter, "go", "--payload", "{}"]);
    app.agentq_ok(&["signal", &child, "child-go", "--payload", "{}"]);
    sqlx::query("UPDATE operations SET run_at = now() WHERE id = $1::uuid")
        .bind(&retry)
        .execute(&app.pool)
        .await
        .unwrap();
    for op in [
        &first, &second, &busy, &next, &retry, &waiter, &child, &parent,
    ] {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    let (text, why) = ask(&app, &front, &second).await;
    assert_eq!(reason(&why), "finished", "{why}");
    assert!(text.starts_with("finished: succeeded"), "{text}");
    app.cleanup().await;
}

/// One world for what deploying and operating decide: no live worker runs an operation's kind,
/// then its pinned version; a paused batch names who paused it and why. Starting the workers
/// and resuming the batch lifts each.
#[tokio::test]
async fn why_names_a_missing_version_and_a_paused_batch_then_each_lifts() {
    let fake = FakeModel::start(Mode::Echo).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    let (_, base) = app.serve().await;
    let front = Front::new(&app, &base, "t1").await;

    // No worker at all: nobody runs `script`.
    let unpinned = app.enqueue_script(json!([{ "work_ms": 1 }]), &[]);
    let (text, why) = ask(&app, &front, &unpinned).await;
    assert_eq!(reason(&why), "version", "{why}");
    assert!(why["detail"]["pinned"].is_null(), "{why}");
    assert_eq!(why["detail"]["workers"], json!([]), "{why}");
    assert!(text.contains("no live worker runs kind script"), "{text}");

    // A batch, paused before any worker could start it.
    let (src, dst, tmp) = (
        TempDir::new("why-src"),
        TempDir::new("why-dst"),
        TempDir::new("why-tmp"),
    );
    write_docs(&src.0, 2);
    let started = start_batch(
        &app,
        (&src.0, &dst.0, &tmp.0),
        "Keep the text as it is.",
        &[],
    );
    let batch = started["batch_id"].as_str().unwrap().to_string();
    app.agentq_ok(&[
        "batch",
        "pause",
        &batch,
        "--reason",
        "checking the canary",
        "--as",
        "ana",
    ]);
    let docs: Vec<String> =
        sqlx::query_scalar("SELECT id::text FROM operations WHERE batch_id = $1::uuid")
            .bind(&batch)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(docs.len(), 2);

    // A worker of version 1: the unpinned operation runs on it; one more is pinned to 1.
    let w1 = worker(&mut app, "1", None);
    app.wait_status(&unpinned, "succeeded", DEADLINE).await;
    let pinned = app.enqueue_script(
        json!([{ "wait_signal": "go", "timeout_ms": 3_600_000 }]),
        &[],
    );
    let v = app.wait_status(&pinned, "waiting", DEADLINE).await;
    assert_eq!(v.kind_version.as_deref(), Some("1"));

    // The paused batch holds its operations although a worker runs their kind.
    let (text, why) = ask(&app, &front, &docs[0]).await;
    assert_eq!(reason(&why), "batch", "{why}");
    assert_eq!(why["detail"]["batch_status"], "paused", "{why}");
    let paused = why["detail"]["paused_reason"].as_str().unwrap_or_default();
    assert!(
        paused.contains("ana") && paused.contains("checking the canary"),
        "{why}"
    );
    assert!(text.contains(&format!("batch {batch} is paused")), "{text}");

    // Only version 2 is live now: the operation pinned to 1 waits for a worker of it.
    stop_worker(&mut app, w1, 0).await;
    let w2 = worker(&mut app, "2", None);
    app.wait_for("the worker of version 2 to register", DEADLINE, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM workers WHERE live_until > now()")
            .fetch_one(&app.pool)
            .await
            .unwrap()
            == 1
    })
    .await;
    app.agentq_ok(&["signal", &pinned, "go", "--payload", "{}"]);
    app.wait_status(&pinned, "queued", DEADLINE).await;
    let (text, why) = ask(&app, &front, &pinned).await;
    assert_eq!(reason(&why), "version", "{why}");
    assert_eq!(why["detail"]["pinned"], "1", "{why}");
    assert_eq!(why["detail"]["newest_live"], "2", "{why}");
    assert_eq!(
        why["detail"]["workers"][0]["versions"],
        json!(["2"]),
        "{why}"
    );
    assert!(text.contains("no live worker runs script@1"), "{text}");
    assert!(text.contains("runs script@2"), "{text}");

    // A worker of version 1 again, and the batch resumed: everything runs.
    worker(&mut app, "1", None);
    app.agentq_ok(&["batch", "resume", &batch]);
    app.wait_status(&pinned, "succeeded", DEADLINE).await;
    for doc in &docs {
        app.wait_status(doc, "succeeded", DEADLINE).await;
    }
    let (_, why) = ask(&app, &front, &docs[0]).await;
    assert_eq!(reason(&why), "finished", "{why}");
    let _ = w2;
    app.cleanup().await;
}

/// The model circuit breaker: a provider failing with 529 opens each worker's breaker, whose
/// calls are then parked until it may close; `why` names the breaker and when it may close.
/// Once the provider answers again the breaker's probe succeeds and the operations finish.
#[tokio::test]
async fn why_names_an_open_model_breaker_then_it_closes() {
    let fake = FakeModel::start(Mode::Error {
        status: 529,
        body: json!({ "error": { "type": "overloaded_error", "message": "busy" } }),
        headers: Vec::new(),
    })
    .await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let front = Front::new(&app, &base, "t1").await;
    let ops: Vec<String> = (0..8)
        .map(|i| app.enqueue_script(json!([{ "model": format!("call {i}") }]), &[]))
        .collect();

    // Failures open the breaker; the calls it refuses while open are parked until it may
    // close (later and later as its probes fail). Found in the database, then asked while it
    // is certainly still parked (its retry more than 8 s ahead).
    let parked: String = app
        .wait_until(
            "an operation parked by the open breaker",
            DEADLINE * 2,
            || async {
                sqlx::query_scalar(
                    "SELECT id::text FROM operations
                  WHERE status = 'queued' AND error_class = 'overloaded'
                    AND error_message LIKE '%parked: the circuit%'
                    AND run_at > now() + interval '8 seconds'
                  LIMIT 1",
                )
                .fetch_optional(&app.pool)
                .await
                .unwrap()
            },
        )
        .await;
    let (text, why) = ask(&app, &front, &parked).await;
    assert_eq!(reason(&why), "breaker_open", "{why}");
    assert!(why["detail"]["may_close_at"].is_string(), "{why}");
    assert!(
        text.contains("the model circuit breaker was open; may close at"),
        "{text}"
    );

    // The provider recovers: the next probe closes the breaker and every operation finishes.
    fake.set(Mode::Echo);
    for op in &ops {
        app.wait_status(op, "succeeded", DEADLINE * 3).await;
    }
    app.cleanup().await;
}

/// Enqueues a `script` operation of `tenant` with `extra` flags; returns its id.
fn script_of(app: &TestApp, tenant: &str, steps: Value, extra: &[&str]) -> String {
    let input = json!({ "steps": steps }).to_string();
    let mut args = vec![
        "enqueue", "--tenant", tenant, "--kind", "script", "--input", &input, "--json",
    ];
    args.extend_from_slice(extra);
    app.agentq_json(&args)["op_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A tenant's fair share: on a worker of four slots (a share of two), tenant a runs two held
/// model calls while tenant b has work queued (behind its own ordering key), so a's third
/// operation is held for the share; `why` names the share, a's running count and b's waiting.
/// Once the calls answer, the worker pulls it and it finishes.
#[tokio::test]
async fn why_names_a_tenants_fair_share_then_it_lifts() {
    let (fake, gate) = held_model().await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker", "--concurrency", "4"]);
    let (_, base) = app.serve().await;
    let front = Front::new(&app, &base, "a").await;

    // b: one running (its call held), and one waiting that a worker could start: queued, due,
    // its pointer out (marked by hand: published nowhere, so no worker takes it before the
    // test lets it).
    let b1 = script_of(&app, "b", json!([{ "model": "b1" }]), &[]);
    let b2 = {
        let (producer, dispatcher) = app.producer();
        let mut tx = app.pool.begin().await.unwrap();
        let pending = producer
            .enqueue_in(
                &mut tx,
                agentq_producer::EnqueueRequest {
                    tenant: "b".into(),
                    kind: "script".into(),
                    input: json!({ "steps": [{ "work_ms": 1 }] }),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        sqlx::query("UPDATE operations SET dispatched_at = now() WHERE id = $1")
            .bind(pending.enqueued.op_id.0)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        dispatcher.close().await;
        pending.enqueued.op_id.to_string()
    };
    // a: two running (held), its share of four slots.
    let a1 = script_of(&app, "a", json!([{ "model": "a1" }]), &[]);
    let a2 = script_of(&app, "a", json!([{ "model": "a2" }]), &[]);
    app.wait_for("three held model calls in flight", DEADLINE, || async {
        fake.requests() == 3
    })
    .await;
    let a3 = script_of(&app, "a", json!([{ "work_ms": 1 }]), &[]);
    app.wait_for(
        "a's third operation to be held for the share",
        DEADLINE,
        || async {
            sqlx::query_scalar::<_, bool>("SELECT share_held FROM operations WHERE id = $1::uuid")
                .bind(&a3)
                .fetch_one(&app.pool)
                .await
                .unwrap()
        },
    )
    .await;
    let (text, why) = ask(&app, &front, &a3).await;
    assert_eq!(reason(&why), "tenant_share", "{why}");
    assert_eq!(why["detail"]["tenant"], "a");
    assert_eq!(why["detail"]["running_in_lane"], 2, "{why}");
    assert_eq!(why["detail"]["others_queued"], true, "{why}");
    assert_eq!(why["detail"]["share"], 0.5, "{why}");
    assert!(
        text.contains("tenant a runs 2 operations in the interactive lane; its share is 50%"),
        "{text}"
    );

    gate.add_permits(1000);
    // b2's pointer goes out now (the dispatch sweeper publishes what has none).
    sqlx::query("UPDATE operations SET dispatched_at = NULL WHERE id = $1::uuid")
        .bind(&b2)
        .execute(&app.pool)
        .await
        .unwrap();
    for op in [&b1, &b2, &a1, &a2, &a3] {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    app.cleanup().await;
}
