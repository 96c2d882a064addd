//! docs/webhooks.md's "Webhook-triggered jobs" walkthrough, end to end: a `triage` source with a
//! callback config, signed deliveries at the HTTP API (with sender retries and duplicates sent
//! at once), a worker killed while callbacks are in flight, a callback refused with 503 and one
//! answered 502 after it was applied — and every webhook-id ends as exactly one operation and
//! exactly one applied callback.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_core::webhook::Secret;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

const SOURCE: &str = "tracker";

/// A callback service as a real one would behave: a POST is applied once per
/// `Idempotency-Key` (a repeat answers what the first one applied), and
/// `GET ?idempotency_key=K` says whether K was applied (200 + the result) or not (404).
#[derive(Default)]
struct Receiver {
    /// Every POST as received: its key and body.
    received: Mutex<Vec<(String, Value)>>,
    /// What each key applied, once.
    applied: Mutex<HashMap<String, Value>>,
    /// Every lookup: its key and the status answered.
    lookups: Mutex<Vec<(String, u16)>>,
    /// How long a POST waits, after being applied, before it answers.
    delay_ms: AtomicU64,
    /// Webhook-ids whose first POST is refused with 503 before anything is applied.
    refuse_once: Mutex<HashSet<String>>,
    /// Webhook-ids whose first POST is applied and then answered 502 (a gateway that fell
    /// over after the receiver acted): the sender cannot know whether it happened.
    fall_over_once: Mutex<HashSet<String>>,
}

impl Receiver {
    fn received(&self) -> Vec<(String, Value)> {
        self.received.lock().unwrap().clone()
    }

    fn applied(&self) -> HashMap<String, Value> {
        self.applied.lock().unwrap().clone()
    }

    fn lookups(&self) -> Vec<(String, u16)> {
        self.lookups.lock().unwrap().clone()
    }
}

async fn receive(
    State(r): State<Arc<Receiver>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key is required").into_response();
    };
    r.received.lock().unwrap().push((key.clone(), body.clone()));
    let webhook_id = body["webhook_id"].as_str().unwrap_or_default();
    if r.refuse_once.lock().unwrap().remove(webhook_id) {
        return (StatusCode::SERVICE_UNAVAILABLE, "busy; nothing applied").into_response();
    }
    let result = {
        let mut applied = r.applied.lock().unwrap();
        let n = applied.len();
        applied
            .entry(key)
            .or_insert_with(|| json!({ "ticket": format!("T-{n}"), "label": body["label"] }))
            .clone()
    };
    if r.fall_over_once.lock().unwrap().remove(webhook_id) {
        return (StatusCode::BAD_GATEWAY, "applied, then fell over").into_response();
    }
    let delay = r.delay_ms.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    Json(result).into_response()
}

async fn lookup(
    State(r): State<Arc<Receiver>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let key = q.get("idempotency_key").cloned().unwrap_or_default();
    let found = r.applied.lock().unwrap().get(&key).cloned();
    let status = if found.is_some() { 200 } else { 404 };
    r.lookups.lock().unwrap().push((key, status));
    match found {
        Some(v) => Json(v).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// Starts the receiver on `127.0.0.1:0`; returns it and its callback URL.
async fn start_receiver() -> (Arc<Receiver>, String, tokio::task::JoinHandle<()>) {
    let receiver = Arc::new(Receiver::default());
    let app = Router::new()
        .route("/hooks/triage", get(lookup).post(receive))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks/triage", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (receiver, url, task)
}

/// Sends one signed delivery; returns the status and the JSON answer.
async fn deliver(
    http: &reqwest::Client,
    base: &str,
    secret: &Secret,
    id: &str,
    age_secs: i64,
    body: &[u8],
) -> (u16, Value) {
    deliver_to(http, base, SOURCE, secret, id, age_secs, body).await
}

/// Sends one delivery to `source`, signed by `secret` `age_secs` ago; returns the status and
/// the JSON answer.
pub(crate) async fn deliver_to(
    http: &reqwest::Client,
    base: &str,
    source: &str,
    secret: &Secret,
    id: &str,
    age_secs: i64,
    body: &[u8],
) -> (u16, Value) {
    let ts = chrono::Utc::now().timestamp() - age_secs;
    let r = http
        .post(format!("{base}/v1/webhooks/{source}"))
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", secret.sign(id, ts, body))
        .body(body.to_vec())
        .send()
        .await
        .unwrap_or_else(|e| panic!("delivering {id}: {e}"));
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Delivers each event three times at once — the delivery, an exact duplicate, and a sender
/// retry re-signed 30 s later — and checks they name one operation, created once.
async fn deliver_all(
    http: &reqwest::Client,
    base: &str,
    secret: &Secret,
    events: &[(String, Value, &str)],
) -> HashMap<String, String> {
    let mut ops = HashMap::new();
    for (id, event, _) in events {
        let body = event.to_string().into_bytes();
        let (a, b, c) = tokio::join!(
            deliver(http, base, secret, id, 0, &body),
            deliver(http, base, secret, id, 0, &body),
            deliver(http, base, secret, id, -30, &body),
        );
        let answers = [a, b, c];
        for (status, v) in &answers {
            assert!(
                matches!(status, 200 | 202),
                "delivery {id} answered {status}: {v}"
            );
        }
        let created = answers.iter().filter(|(_, v)| v["created"] == true).count();
        assert_eq!(created, 1, "{id}: one delivery creates, the rest find it");
        let op_ids: HashSet<&str> = answers
            .iter()
            .map(|(_, v)| v["op_id"].as_str().unwrap())
            .collect();
        assert_eq!(op_ids.len(), 1, "{id}: one operation, got {op_ids:?}");
        ops.insert(id.clone(), op_ids.into_iter().next().unwrap().to_string());
    }
    ops
}

fn refused(app: &TestApp, config: Option<&str>, what: &str) {
    let mut args = vec![
        "webhooks", "add", "--tenant", "acme", "--source", "bad", "--kind", "triage",
    ];
    if let Some(c) = config {
        args.extend(["--config", c]);
    }
    let out = app.agentq(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
    assert!(stderr.contains("config"), "{what}: {stderr}");
}

#[tokio::test]
async fn usecase_webhook_every_delivery_is_one_operation_and_one_callback_across_a_worker_kill() {
    let mut app = TestApp::start().await;
    let fake = FakeModel::start(Mode::Echo).await;
    let (receiver, callback_url, receiver_task) = start_receiver().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    // The receiver's origin (scheme, host and port) only.
    let origin = callback_url.trim_end_matches("/hooks/triage").to_string();
    app.set_env("AGENTQ_AGENT_HTTP_ALLOW", &origin);
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    let (_, base) = app.serve().await;
    app.spawn(&["scheduler"]);

    // A config that is not an object, or a triage source without a callback URL: refused.
    refused(&app, Some("[1]"), "a config that is not an object");
    refused(&app, Some(r#"{"labels":["bug"]}"#), "no callback_url");
    refused(&app, Some(r#"{"callback_url":"ftp://x"}"#), "not http");
    refused(&app, None, "triage without a config");

    let config = json!({ "callback_url": callback_url, "labels": ["bug", "question", "feature"] });
    let added = app.agentq_json(&[
        "webhooks",
        "add",
        "--tenant",
        "acme",
        "--source",
        SOURCE,
        "--kind",
        "triage",
        "--config",
        &config.to_string(),
        "--json",
    ]);
    let secret = Secret::parse(added["secret"].as_str().unwrap()).unwrap();
    let listed = app.agentq_json(&["webhooks", "list", "--tenant", "acme", "--json"]);
    assert_eq!(listed["config"], config, "{listed}");

    let subjects = [
        ("Login crashes: a bug in the session code", "bug"),
        ("A question about rotating API keys", "question"),
        ("Feature request: dark mode", "feature"),
    ];
    let event = |i: usize| {
        let (title, label) = subjects[i % subjects.len()];
        (
            format!("evt_{i}"),
            json!({ "action": "opened", "ticket": { "number": i, "title": title } }),
            label,
        )
    };
    let first: Vec<_> = (0..6).map(event).collect();
    let later: Vec<_> = (6..8).map(event).collect();
    let http = reqwest::Client::new();

    // Phase 1: a worker is killed while the callbacks it made are applied but unanswered.
    let mut ops = deliver_all(&http, &base, &secret, &first).await;
    let input: Value = sqlx::query_scalar("SELECT input FROM operations WHERE id = $1::uuid")
        .bind(&ops["evt_0"])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        input,
        json!({ "event": first[0].1, "source": SOURCE, "webhook_id": "evt_0", "config": config })
    );
    receiver.delay_ms.store(500, Ordering::SeqCst);
    let doomed = app.spawn(&["worker"]);
    app.wait_for("a first callback", DEADLINE, || {
        let n = receiver.received().len();
        async move { n > 0 }
    })
    .await;
    app.kill(doomed);
    receiver.delay_ms.store(0, Ordering::SeqCst);
    let in_flight = receiver.received().len();
    app.spawn(&["worker"]);

    // Phase 2: a callback refused with 503 is posted again with the same key; one applied
    // and then answered 502 may have happened, so the next attempt asks instead of posting.
    receiver
        .refuse_once
        .lock()
        .unwrap()
        .insert("evt_6".to_string());
    receiver
        .fall_over_once
        .lock()
        .unwrap()
        .insert("evt_7".to_string());
    ops.extend(deliver_all(&http, &base, &secret, &later).await);

    for op in ops.values() {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }

    let events: Vec<_> = first.iter().chain(&later).collect();
    let n = events.len();
    let webhook_ops: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE dedupe_key LIKE 'webhook:tracker:%'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(webhook_ops, n as i64, "one operation per webhook-id");

    let received = receiver.received();
    let applied = receiver.applied();
    let lookups = receiver.lookups();
    assert_eq!(applied.len(), n, "one applied callback per webhook-id");
    let mut keys_by_op: HashMap<String, HashSet<String>> = HashMap::new();
    for (key, body) in &received {
        keys_by_op
            .entry(body["op_id"].as_str().unwrap().to_string())
            .or_default()
            .insert(key.clone());
    }
    for (id, _, label) in &events {
        let op = &ops[id];
        let keys = &keys_by_op[op];
        assert_eq!(
            keys.len(),
            1,
            "{id}: every POST of an operation carries one key"
        );
        let key = keys.iter().next().unwrap();
        let posts: Vec<&Value> = received
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, b)| b)
            .collect();
        let body = posts[0];
        assert_eq!(
            (&body["source"], &body["webhook_id"], &body["label"]),
            (&json!(SOURCE), &json!(id), &json!(label)),
            "{id}: {body}"
        );
        assert!(body["summary"].as_str().is_some_and(|s| !s.is_empty()));
        let out = app.operation(op).await.result.unwrap();
        assert_eq!(out["label"], *label, "{id}: {out}");
        assert_eq!(out["callback"]["body"], applied[key], "{id}: {out}");
        if id == "evt_6" {
            assert_eq!(posts.len(), 2, "evt_6: posted again after the 503");
        }
        if id == "evt_7" {
            assert_eq!(posts.len(), 1, "evt_7: not posted again after the 502");
            assert!(
                lookups.contains(&(key.clone(), 200)),
                "evt_7: the retry asked the receiver, which had applied it: {lookups:?}"
            );
        }
    }
    // The killed worker's callbacks were applied; recovery asked instead of posting again.
    let reconciled: Vec<_> = lookups.iter().filter(|(_, s)| *s == 200).collect();
    assert!(
        !reconciled.is_empty(),
        "recovery reconciled at least the callback the kill interrupted: {lookups:?}"
    );
    for (key, _) in &reconciled {
        assert_eq!(
            received.iter().filter(|(k, _)| k == key).count(),
            1,
            "a reconciled callback was not posted again"
        );
    }
    assert!(in_flight >= 1);
    assert_eq!(
        received.len(),
        n + 1,
        "POSTs: one per webhook-id plus evt_6's after the 503 (lookups {lookups:?})"
    );

    receiver_task.abort();
    app.cleanup().await;
}
