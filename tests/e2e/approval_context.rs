//! What a person decides on, everywhere they decide: an agent waiting before an
//! approval-gated tool shows the tool, its arguments (a secret-like one redacted) and the
//! model's text in `agentq status` (text and `--json`), `GET /v1/operations/{id}`, the
//! console's approvals and operation pages and the wait's event; a job's own `about` shows
//! the same way; and an operation's input is read only by an operator, each read audited.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::api::{Api, Sse};
use crate::console::Browser;
use crate::fake_model::{FakeModel, Mode, Script, completion, tool_results_in};
use crate::harness::{DEADLINE, TestApp};

/// A secret in a tool call's arguments, under a key the deployment redacts.
pub(crate) const SECRET: &str = "sk-live-CANARY-4242";
/// The model's text with the tool call.
pub(crate) const TEXT: &str = "I will keep the Stripe key under stripe, as you asked.";
/// An argument that is no secret, shown as it is.
pub(crate) const NOTE: &str = "rotate monthly";

/// A model that first asks for `kv_put` with a secret among its arguments, with some text,
/// then answers `stored`.
pub(crate) fn secret_storing_model() -> Mode {
    Mode::Script(Script(Arc::new(|request: &Value| {
        if tool_results_in(request) > 0 {
            return completion("stored");
        }
        let args = json!({ "key": "stripe", "value": { "api_key": SECRET, "note": NOTE } });
        json!({
            "id": "chatcmpl-fake", "model": "fake-model",
            "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": TEXT,
                "tool_calls": [{ "id": "call_1", "type": "function",
                    "function": { "name": "kv_put", "arguments": args.to_string() } }]
            }}],
            "usage": { "prompt_tokens": 5, "completion_tokens": 5 }
        })
    })))
}

/// Enqueues the built-in agent with `kv_put` gated by an approval.
pub(crate) fn enqueue_gated_agent(app: &TestApp) -> String {
    let input = json!({ "user": "keep my stripe key", "tools": ["kv_put"],
                        "approval": ["kv_put"], "max_turns": 3 })
    .to_string();
    app.agentq_json(&[
        "enqueue", "--tenant", "t1", "--kind", "agent", "--input", &input, "--json",
    ])["op_id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The pending tool call as the JSON views show it.
fn assert_tool_call(waiting: &Value, what: &str) {
    assert_eq!(waiting["signal"], "approval", "{what}: {waiting}");
    let call = &waiting["tool_call"];
    assert_eq!(call["tool"], "kv_put", "{what}: {waiting}");
    assert_eq!(call["arguments"]["key"], "stripe", "{what}: {waiting}");
    assert_eq!(
        call["arguments"]["value"]["note"], NOTE,
        "{what}: {waiting}"
    );
    assert_eq!(
        call["arguments"]["value"]["api_key"], "[redacted]",
        "{what}: {waiting}"
    );
    assert_eq!(call["text"], TEXT, "{what}: {waiting}");
    assert!(waiting["timeout_at"].is_string(), "{what}: {waiting}");
}

/// Text shown to a person: the call, its arguments and the text, never the secret.
fn assert_shows_call(text: &str, what: &str) {
    assert!(!text.contains(SECRET), "{what} shows the secret:\n{text}");
    for needle in ["kv_put", NOTE, "[redacted]"] {
        assert!(text.contains(needle), "{what} lacks {needle:?}:\n{text}");
    }
    // HTML escapes nothing in the text, which has no special characters.
    assert!(
        text.contains(TEXT),
        "{what} lacks the model's text:\n{text}"
    );
}

#[tokio::test]
async fn an_agent_waiting_before_a_gated_tool_shows_the_call_everywhere_with_secrets_redacted() {
    let fake = FakeModel::start(secret_storing_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_CONSOLE_REDACT", "api_key");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let producer = app.token("t1", "producer");

    // The wait's event is followed from before the wait.
    let api = Api::new(&base);
    let op = enqueue_gated_agent(&app);
    let mut events = Sse::open(&api, &producer, &op, None).await;
    app.wait_status(&op, "waiting", DEADLINE).await;

    // agentq status: says what it waits for and shows the call.
    let out = app.agentq_ok(&["status", &op]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_shows_call(&text, "agentq status");
    assert!(text.contains("waiting for: signal \"approval\""), "{text}");
    let json = app.agentq_json(&["status", &op, "--json"]);
    assert_tool_call(&json["waiting"], "agentq status --json");
    assert_eq!(json["status"], "waiting");
    assert!(json.get("input").is_none(), "no input unless asked: {json}");

    // The API, to a producer too.
    let r = api
        .get(&format!("/v1/operations/{op}"), Some(&producer))
        .await;
    let body = r.expect(200);
    assert!(!r.text().contains(SECRET), "{}", r.text());
    assert_tool_call(&body["waiting"], "GET /v1/operations/{id}");

    // The journal holds the model's turn with the call: redacted for its readers too.
    let r = api
        .get(&format!("/v1/operations/{op}/steps"), Some(&producer))
        .await;
    r.expect(200);
    assert!(r.text().contains("[redacted]"), "{}", r.text());
    assert!(!r.text().contains(SECRET), "GET …/steps: {}", r.text());
    let out = app.agentq_ok(&["steps", &op, "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains(SECRET), "agentq steps: {text}");

    // The console's approvals list and the operation's page.
    let mut ui = Browser::new(&base);
    ui.login(&app.token("t1", "operator")).await;
    let (status, page) = ui.get("/ui/approvals").await;
    assert_eq!(status, 200);
    assert_shows_call(&page, "the approvals page");
    assert!(page.contains("data-tool=\"kv_put\""), "{page}");
    let (status, page) = ui.get(&format!("/ui/operations/{op}")).await;
    assert_eq!(status, 200);
    assert_shows_call(&page, "the operation's page");

    // The wait's event carries the call, redacted.
    let wait_event = tokio::time::timeout(DEADLINE, async {
        loop {
            let e = events
                .next()
                .await
                .expect("the stream stays open while it waits");
            if e.event == "step" && e.data["name"] == "signal:approval" {
                return e;
            }
        }
    })
    .await
    .expect("the wait's step event");
    let about = &wait_event.data["about"];
    assert_eq!(about["tool"], "kv_put", "{about}");
    assert_eq!(
        about["arguments"]["value"]["api_key"], "[redacted]",
        "{about}"
    );
    assert_eq!(about["arguments"]["value"]["note"], NOTE, "{about}");
    assert_eq!(about["text"], TEXT, "{about}");

    // Approved, it runs the call; nothing waits any more.
    app.agentq_ok(&["approve", &op, "--as", "hana"]);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    let json = app.agentq_json(&["status", &op, "--json"]);
    assert!(json["waiting"].is_null(), "{json}");
    app.cleanup().await;
}

#[tokio::test]
async fn a_jobs_own_about_shows_in_status_and_the_api() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let op = app.enqueue_script(
        json!([{ "wait_signal": "go", "timeout_ms": 120000, "on_timeout": "continue" }]),
        &[],
    );
    app.wait_status(&op, "waiting", DEADLINE).await;
    let json = app.agentq_json(&["status", &op, "--json"]);
    let waiting = &json["waiting"];
    assert_eq!(waiting["signal"], "go", "{json}");
    assert_eq!(waiting["about"]["needs"], "a \"go\" signal", "{json}");
    assert_eq!(
        waiting["about"]["on_timeout"], "the script goes on",
        "{json}"
    );
    assert!(waiting["tool_call"].is_null(), "{json}");
    let text = String::from_utf8_lossy(&app.agentq_ok(&["status", &op]).stdout).into_owned();
    assert!(
        text.contains("needs:") && text.contains("the script goes on"),
        "{text}"
    );
    let api = Api::new(&base);
    let body = api
        .get(
            &format!("/v1/operations/{op}"),
            Some(&app.token("t1", "producer")),
        )
        .await
        .expect(200);
    assert_eq!(body["waiting"], *waiting);
    app.cleanup().await;
}

/// Counts `reveal_payloads` audit rows of `op` made through `via`.
async fn reveals(app: &TestApp, op: &str, via: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions
          WHERE op_id = $1::uuid AND action = 'reveal_payloads' AND details->>'via' = $2",
    )
    .bind(op)
    .bind(via)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn an_operations_input_is_shown_to_operators_only_and_each_read_is_audited() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let op = app.enqueue_echo("INPUT-CANARY");
    app.wait_status(&op, "succeeded", DEADLINE).await;
    let path = format!("/v1/operations/{op}?include=input");

    // A producer is refused, clearly, and nothing is read or audited.
    let r = api.get(&path, Some(&app.token("t1", "producer"))).await;
    let problem = r.expect(403);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("operator"),
        "{problem}"
    );
    assert!(
        !r.text().contains("\"text\":\"INPUT-CANARY\""),
        "{}",
        r.text()
    );
    assert_eq!(reveals(&app, &op, "api").await, 0);
    // Without include, a producer reads the operation as before, without its input.
    let plain = api
        .get(
            &format!("/v1/operations/{op}"),
            Some(&app.token("t1", "producer")),
        )
        .await
        .expect(200);
    assert!(plain.get("input").is_none(), "{plain}");
    assert!(plain["waiting"].is_null(), "{plain}");

    // Something else to include is refused, naming the parameter.
    let r = api
        .get(
            &format!("/v1/operations/{op}?include=secrets"),
            Some(&app.token("t1", "operator")),
        )
        .await;
    let problem = r.expect(400);
    assert!(r.text().contains("include"), "{problem}");

    // An operator reads it, audited under the token.
    let body = api
        .get(&path, Some(&app.token("t1", "operator")))
        .await
        .expect(200);
    assert_eq!(body["input"]["text"], "INPUT-CANARY", "{body}");
    assert_eq!(reveals(&app, &op, "api").await, 1);

    // The CLI likewise (it acts as an operator of the deployment).
    let out = app.agentq_ok(&["status", &op, "--show-input"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("input:") && text.contains("INPUT-CANARY"),
        "{text}"
    );
    let json = app.agentq_json(&["status", &op, "--show-input", "--json"]);
    assert_eq!(json["input"]["text"], "INPUT-CANARY", "{json}");
    assert_eq!(reveals(&app, &op, "cli").await, 2);
    app.agentq_ok(&["status", &op]);
    assert_eq!(reveals(&app, &op, "cli").await, 2, "no input, no audit");

    // The console shows it on the operation's page without a separate step, audited.
    let mut ui = Browser::new(&base);
    ui.login(&app.token("t1", "operator")).await;
    let (status, page) = ui.get(&format!("/ui/operations/{op}")).await;
    assert_eq!(status, 200);
    assert!(
        page.contains("<h3>input</h3>") && page.contains("INPUT-CANARY"),
        "{page}"
    );
    assert_eq!(reveals(&app, &op, "console").await, 1);
    app.cleanup().await;
}
