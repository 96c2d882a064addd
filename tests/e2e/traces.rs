//! Tracing end to end: an in-process OTLP/HTTP receiver (JSON protocol) collects what
//! `agentq serve`, a worker and a scheduler export. One signed webhook delivery with a
//! `traceparent` header becomes one trace: the HTTP request span, the operation span and its
//! model-call span all carry the caller's trace id. And the redaction test: a canary string in
//! an operation's input, its prompt and the model's output appears in no log line (debug level,
//! JSON), no exported span and no metric, for an operation that succeeds and ones that fail.

use std::sync::{Arc, Mutex};

use agentq_core::webhook::Secret;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use serde_json::{Value, json};

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// One exported span, as the receiver read it.
#[derive(Clone, Debug)]
struct Span {
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: Value,
}

impl Span {
    fn attr(&self, key: &str) -> Option<String> {
        let a = self
            .attributes
            .as_array()?
            .iter()
            .find(|a| a["key"] == key)?;
        let v = &a["value"];
        ["stringValue", "intValue", "boolValue"]
            .iter()
            .find_map(|k| v.get(k))
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
    }
}

/// An OTLP/HTTP collector on `127.0.0.1:0` that keeps every span (and every request body).
#[derive(Default)]
struct Receiver {
    spans: Mutex<Vec<Span>>,
    bodies: Mutex<Vec<String>>,
}

impl Receiver {
    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    fn raw(&self) -> String {
        self.bodies.lock().unwrap().join("\n")
    }
}

async fn collect(State(r): State<Arc<Receiver>>, body: Bytes) -> axum::Json<Value> {
    let text = String::from_utf8_lossy(&body).to_string();
    let request: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let mut found = Vec::new();
    for rs in request["resourceSpans"].as_array().into_iter().flatten() {
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                let text = |k: &str| s[k].as_str().unwrap_or_default().to_string();
                found.push(Span {
                    name: text("name"),
                    trace_id: text("traceId"),
                    span_id: text("spanId"),
                    parent_span_id: text("parentSpanId"),
                    attributes: s["attributes"].clone(),
                });
            }
        }
    }
    r.bodies.lock().unwrap().push(text);
    r.spans.lock().unwrap().extend(found);
    axum::Json(json!({}))
}

/// Starts the receiver; returns it and the endpoint for `OTEL_EXPORTER_OTLP_ENDPOINT`.
async fn start_receiver() -> (Arc<Receiver>, String, tokio::task::JoinHandle<()>) {
    let receiver = Arc::new(Receiver::default());
    let app = Router::new()
        .route("/v1/traces", post(collect))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (receiver, url, task)
}

/// Every process started from now on exports its spans, as JSON, to `endpoint`, quickly.
fn export_to(app: &mut TestApp, endpoint: &str) {
    app.set_env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    app.set_env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json");
    app.set_env("OTEL_BSP_SCHEDULE_DELAY", "100");
}

fn random_hex(bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes * 2 {
        s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    }
    s.truncate(bytes * 2);
    s
}

/// Creates a webhook source of `kind` for tenant `t1`; returns its signing secret.
fn webhook_source(app: &TestApp, source: &str, kind: &str) -> Secret {
    let v = app.agentq_json(&[
        "webhooks", "add", "--tenant", "t1", "--source", source, "--kind", kind, "--json",
    ]);
    Secret::parse(v["secret"].as_str().unwrap()).unwrap()
}

/// Sends one signed delivery (with `traceparent` if given); returns the operation id.
async fn deliver(
    base: &str,
    source: &str,
    secret: &Secret,
    body: &Value,
    traceparent: Option<&str>,
) -> String {
    let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    let ts = chrono::Utc::now().timestamp();
    let body = body.to_string().into_bytes();
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/webhooks/{source}"))
        .header("content-type", "application/json")
        .header("webhook-id", &id)
        .header("webhook-timestamp", ts.to_string())
        .header("webhook-signature", secret.sign(&id, ts, &body))
        .body(body);
    if let Some(tp) = traceparent {
        req = req.header("traceparent", tp);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 202, "the delivery was refused");
    let v: Value = r.json().await.unwrap();
    v["op_id"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_webhook_delivery_and_its_model_call_are_one_trace() {
    let fake = FakeModel::start(Mode::Echo).await;
    let (receiver, endpoint, task) = start_receiver().await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    export_to(&mut app, &endpoint);
    let secret = webhook_source(&app, "tracker", "echo");
    let (_, base) = app.serve().await;
    app.spawn(&["worker"]);

    let (trace_id, caller_span) = (random_hex(16), random_hex(8));
    let traceparent = format!("00-{trace_id}-{caller_span}-01");
    let op = deliver(
        &base,
        "tracker",
        &secret,
        &json!({ "text": "hello" }),
        Some(&traceparent),
    )
    .await;
    app.wait_status(&op, "succeeded", DEADLINE).await;

    // The API's span is a child of the caller's; the operation's of the API's; the model
    // call's sits under the operation's step.
    let spans = app
        .wait_until("the three spans to be exported", DEADLINE, || {
            let spans = receiver.spans();
            let op = op.clone();
            async move {
                let of = |name: &str| spans.iter().find(|s| s.name == name).cloned();
                let http = of("POST /v1/webhooks/{source}")?;
                let operation = spans
                    .iter()
                    .find(|s| s.name == "operation" && s.attr("op_id").as_deref() == Some(&op))
                    .cloned()?;
                let model = of("model_call")?;
                Some((http, operation, model, spans))
            }
        })
        .await;
    let (http, operation, model, all) = spans;
    for s in [&http, &operation, &model] {
        assert_eq!(s.trace_id, trace_id, "{} is in another trace", s.name);
    }
    assert_eq!(http.parent_span_id, caller_span, "the HTTP span's parent");
    assert_eq!(
        operation.parent_span_id, http.span_id,
        "the operation's parent"
    );
    assert!(
        http.attr("request_id")
            .is_some_and(|r| r.starts_with("req_"))
    );
    assert_eq!(operation.attr("tenant").as_deref(), Some("t1"));
    assert_eq!(operation.attr("kind").as_deref(), Some("echo"));
    assert_eq!(operation.attr("attempt").as_deref(), Some("1"));
    assert_eq!(operation.attr("outcome").as_deref(), Some("succeeded"));
    assert_eq!(
        operation.attr("request_id"),
        http.attr("request_id"),
        "the operation span names the request that created it"
    );
    let step = all
        .iter()
        .find(|s| s.span_id == model.parent_span_id)
        .expect("the model call's parent span was exported");
    assert_eq!(step.name, "step echo");
    assert_eq!(step.attr("kind").as_deref(), Some("model"));
    assert_eq!(step.parent_span_id, operation.span_id);
    assert_eq!(model.attr("outcome").as_deref(), Some("ok"));

    // Without a traceparent the request starts a trace of its own, which the worker continues.
    let op2 = deliver(&base, "tracker", &secret, &json!({ "text": "again" }), None).await;
    app.wait_status(&op2, "succeeded", DEADLINE).await;
    let (http2, operation2) = parent_and_operation(&app, &receiver, &op2).await;
    assert_ne!(operation2.trace_id, trace_id);
    assert_eq!(http2.trace_id, operation2.trace_id);
    assert!(http2.parent_span_id.is_empty(), "a new trace's root");

    // `agentq enqueue` continues the caller's trace from `TRACEPARENT`: its span is the caller's
    // child and the operation's parent.
    let (cli_trace, cli_caller) = (random_hex(16), random_hex(8));
    app.set_env("TRACEPARENT", &format!("00-{cli_trace}-{cli_caller}-01"));
    let enqueued = app.agentq_json(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"from the command line"}"#,
        "--json",
    ]);
    let op3 = enqueued["op_id"].as_str().unwrap().to_string();
    app.wait_status(&op3, "succeeded", DEADLINE).await;
    let (enqueue, operation3) = parent_and_operation(&app, &receiver, &op3).await;
    assert_eq!(enqueue.name, "enqueue");
    assert_eq!(enqueue.attr("kind").as_deref(), Some("echo"));
    assert_eq!(
        (&enqueue.trace_id, &operation3.trace_id),
        (&cli_trace, &cli_trace)
    );
    assert_eq!(enqueue.parent_span_id, cli_caller, "the caller's span");

    task.abort();
    app.cleanup().await;
}

/// Waits until the `operation` span of `op` and the span it is a child of were exported.
async fn parent_and_operation(app: &TestApp, receiver: &Receiver, op: &str) -> (Span, Span) {
    app.wait_until("an operation's span and its parent", DEADLINE, || {
        let spans = receiver.spans();
        async move {
            let operation = spans
                .iter()
                .find(|s| s.name == "operation" && s.attr("op_id").as_deref() == Some(op))
                .cloned()?;
            let parent = spans
                .iter()
                .find(|s| s.span_id == operation.parent_span_id)
                .cloned()?;
            Some((parent, operation))
        }
    })
    .await
}

const CANARY: &str = "CANARY-7f3a9c";

#[tokio::test]
async fn a_canary_in_inputs_prompts_and_outputs_stays_out_of_logs_spans_and_metrics() {
    let fake = FakeModel::start(Mode::Echo).await;
    let (receiver, endpoint, task) = start_receiver().await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("RUST_LOG", "debug");
    app.set_env("AGENTQ_LOG_FORMAT", "json");
    export_to(&mut app, &endpoint);
    let secret = webhook_source(&app, "canary", "echo");
    let token = app.token("t1", "producer");
    let (api, base) = app.serve().await;
    let worker = app.spawn_logged(&["worker"]);
    let scheduler = app.spawn_logged(&["scheduler"]);
    let http = reqwest::Client::new();

    // Succeeds: the canary is the input, the prompt and the model's answer.
    let text = format!("please keep {CANARY} secret");
    let ok = deliver(&base, "canary", &secret, &json!({ "text": text }), None).await;
    // Fails after a model step whose prompt and answer hold the canary.
    let r = http
        .post(format!("{base}/v1/operations"))
        .bearer_auth(&token)
        .json(
            &json!({ "kind": "script", "max_attempts": 1, "input": { "steps": [
            { "model": text }, { "fail": "non_retryable", "times": 1 } ] } }),
        )
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let scripted: Value = r.json().await.unwrap();
    assert_eq!(status, 202, "{scripted}");
    let scripted = scripted["op_id"].as_str().unwrap().to_string();
    let done = app.wait_status(&ok, "succeeded", DEADLINE).await;
    assert_eq!(done.result, Some(json!({ "text": text })));
    app.wait_status(&scripted, "dead", DEADLINE).await;

    // Fails at the model: the provider refuses, quoting the prompt in its error message.
    fake.set(Mode::Error {
        status: 400,
        body: json!({ "error": { "message": format!("cannot answer {text}"),
                                 "type": "invalid_request_error", "code": "" } }),
        headers: Vec::new(),
    });
    let refused = deliver(&base, "canary", &secret, &json!({ "text": text }), None).await;
    app.wait_status(&refused, "dead", DEADLINE).await;

    // The user's data is theirs to read back, on request.
    let shown: Value = http
        .get(format!("{base}/v1/operations/{ok}"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(shown.to_string().contains(CANARY));

    // Everything the three operations exported (the model calls included) is in.
    app.wait_for("the spans of all three operations", DEADLINE, || {
        let spans = receiver.spans();
        let ids = [ok.clone(), scripted.clone(), refused.clone()];
        async move {
            let model_calls = spans.iter().filter(|s| s.name == "model_call").count();
            model_calls >= 3
                && ids.iter().all(|id| {
                    spans
                        .iter()
                        .any(|s| s.name == "operation" && s.attr("op_id").as_deref() == Some(id))
                })
        }
    })
    .await;
    let metrics = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();

    for (what, text) in [
        ("the API's log", app.log(api)),
        ("the worker's log", app.log(worker)),
        ("the scheduler's log", app.log(scheduler)),
        ("the exported spans", receiver.raw()),
        ("GET /metrics", metrics),
    ] {
        assert!(!text.is_empty(), "{what} is empty: nothing was checked");
        if let Some(at) = text.find(CANARY) {
            let from = text[..at].rfind('\n').map_or(0, |i| i + 1);
            let to = text[at..].find('\n').map_or(text.len(), |i| at + i);
            panic!("{what} leaks the canary: {}", &text[from..to]);
        }
    }
    // The logs were at debug level and in JSON, so the check saw everything they say.
    let worker_log = app.log(worker);
    assert!(worker_log.contains("\"level\":\"DEBUG\""));
    assert!(
        worker_log.contains(&ok),
        "the worker's log names the operation"
    );

    task.abort();
    app.cleanup().await;
}
