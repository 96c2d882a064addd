//! The opt-in suite against a real OpenAI-compatible server (docs/models.md): `echo`, the
//! `agent` loop calling a tool, an approval-gated tool, and the same turns streamed. Every other
//! test uses the in-process fake provider; these find what a fake hides (a server's own JSON,
//! its usage accounting, its tool-call format, its stream framing).
//!
//! Ignored unless asked for, and then they need a server:
//!
//! ```sh
//! AGENTQ_TEST_MODEL_URL=http://127.0.0.1:8199 cargo test --test e2e real_model -- --ignored
//! ```
//!
//! (`AGENTQ_TEST_MODEL` names the model when the server serves several.) Assertions are about
//! what agentq does with whatever a small model answers: calls reached the server, answers and
//! token usage were journaled, a tool call ran as a step once, an approval held the tool until
//! it was given; never about what the model said.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::TestApp;

/// A small model on a CPU answers in seconds; a whole agent loop may take a minute.
const REAL_DEADLINE: Duration = Duration::from_secs(300);

/// A test app whose workers call the real server, streamed or not.
async fn app_for_real_model(stream: bool) -> TestApp {
    let Ok(url) = std::env::var("AGENTQ_TEST_MODEL_URL") else {
        panic!(
            "this test needs a real OpenAI-compatible server: set AGENTQ_TEST_MODEL_URL \
             (see docs/models.md), e.g. AGENTQ_TEST_MODEL_URL=http://127.0.0.1:8199"
        );
    };
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &url);
    if let Ok(model) = std::env::var("AGENTQ_TEST_MODEL") {
        app.set_env("AGENTQ_MODEL", &model);
    }
    app.set_env("AGENTQ_MODEL_STREAM", if stream { "true" } else { "false" });
    // Small models are slow on a CPU: give a call the time it needs.
    app.set_env("AGENTQ_MODEL_FIRST_BYTE_SECS", "240");
    app.set_env("AGENTQ_MODEL_TIMEOUT_SECS", "280");
    // Without a cap a small model may write until its context is full.
    app.set_env("AGENTQ_MODEL_MAX_TOKENS", "200");
    app
}

/// The journal of `op` as `agentq steps --json` prints it.
fn steps(app: &TestApp, op: &str) -> Vec<Value> {
    let out = app.agentq_ok(&["steps", op, "--json"]);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn model_steps(steps: &[Value]) -> Vec<&Value> {
    steps.iter().filter(|s| s["kind"] == "model").collect()
}

/// Every model step was completed with the server's token usage, or marked as a call whose
/// server reported none (llama.cpp's server sends no usage in a stream); returns how many were.
fn assert_usage_journaled(steps: &[Value]) -> usize {
    let models = model_steps(steps);
    assert!(!models.is_empty(), "no model step: {steps:?}");
    let mut unreported = 0;
    for s in models {
        assert_eq!(s["status"], "completed", "{s}");
        let usage = &s["output"]["usage"];
        if usage["unreported"] == true {
            unreported += 1;
            assert_eq!(usage["prompt_tokens"], 0, "{s}");
        } else {
            assert!(
                usage["prompt_tokens"].as_u64().unwrap_or(0) > 0,
                "the server's prompt tokens are journaled: {s}"
            );
        }
    }
    unreported
}

/// Enqueues an `agent` operation for tenant `t1` through the CLI; returns its id.
fn enqueue_agent(app: &TestApp, input: &Value) -> String {
    let args = ["enqueue", "--tenant", "t1", "--kind", "agent", "--input"];
    let input = input.to_string();
    let mut all: Vec<&str> = args.to_vec();
    all.extend([input.as_str(), "--json"]);
    app.agentq_json(&all)["op_id"].as_str().unwrap().to_string()
}

async fn echo_against_the_server(stream: bool) {
    let mut app = app_for_real_model(stream).await;
    app.spawn(&["worker"]);
    let op = app.enqueue_echo("Say hello to agentq in five words.");
    let done = app.wait_status(&op, "succeeded", REAL_DEADLINE).await;
    let text = done.result.as_ref().unwrap()["text"].as_str().unwrap();
    assert!(!text.trim().is_empty(), "the model answered: {done:?}");
    let journal = steps(&app, &op);
    assert_usage_journaled(&journal);
    println!(
        "real model, echo (stream {stream}): {} characters",
        text.len()
    );
    app.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a real model server: AGENTQ_TEST_MODEL_URL (docs/models.md)"]
async fn real_model_echo() {
    echo_against_the_server(false).await;
}

#[tokio::test]
#[ignore = "needs a real model server: AGENTQ_TEST_MODEL_URL (docs/models.md)"]
async fn real_model_echo_streamed() {
    echo_against_the_server(true).await;
}

async fn agent_calls_a_tool(stream: bool) {
    let mut app = app_for_real_model(stream).await;
    app.spawn(&["worker"]);
    let input = json!({
        "user": "Remember that my favourite colour is blue: store it under the key colour.",
        "tools": ["kv_put"],
        "tool_choice": "kv_put",
        "max_turns": 4,
    });
    let op = enqueue_agent(&app, &input);
    let done = app.wait_status(&op, "succeeded", REAL_DEADLINE).await;
    let result = done.result.clone().unwrap();
    assert!(
        result["tool_calls"].as_u64().unwrap() >= 1,
        "the named tool was called: {result}"
    );
    let journal = steps(&app, &op);
    let unreported = assert_usage_journaled(&journal);
    let tools: Vec<&Value> = journal.iter().filter(|s| s["kind"] == "tool").collect();
    // Each call the model asked for that names the tool with JSON arguments runs as a
    // journaled step; one with another name or arguments that are not JSON is answered with
    // the error at once, without a step (the model's turn is journaled, so a replay decides
    // the same).
    let asked: Vec<&Value> = journal
        .iter()
        .filter(|s| s["kind"] == "model")
        .flat_map(|s| s["output"]["tool_calls"].as_array().into_iter().flatten())
        .collect();
    let runnable = asked
        .iter()
        .filter(|c| {
            c["function"]["name"] == "kv_put"
                && c["function"]["arguments"].as_str().is_some_and(|a| {
                    a.trim().is_empty() || serde_json::from_str::<Value>(a).is_ok()
                })
        })
        .count();
    assert_eq!(
        tools.len(),
        runnable,
        "each runnable call ran as a journaled step, once ({} asked): {journal:?}",
        asked.len()
    );
    assert!(
        tools.iter().all(|s| s["status"] == "completed"),
        "{tools:?}"
    );
    // A small model may call the tool with arguments that do not fit its schema: the call is
    // then refused (its step's output is the error the model gets back) and stores nothing. A
    // call that ran stored what it was asked.
    let ran = tools
        .iter()
        .filter(|s| s["output"].get("error").is_none())
        .count();
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_kv WHERE tenant_id = 't1'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        stored >= 1,
        ran >= 1,
        "kv_put stored something exactly when a call ran ({ran} of {} ran): {journal:?}",
        tools.len()
    );
    println!(
        "real model, agent (stream {stream}): {} turns, {} tool calls ({ran} ran, the rest \
         refused for their arguments), answer {} characters, {unreported} calls without usage",
        result["turns"],
        result["tool_calls"],
        result["answer"].as_str().unwrap_or("").len()
    );
    app.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a real model server: AGENTQ_TEST_MODEL_URL (docs/models.md)"]
async fn real_model_agent_calls_a_tool() {
    agent_calls_a_tool(false).await;
}

#[tokio::test]
#[ignore = "needs a real model server: AGENTQ_TEST_MODEL_URL (docs/models.md)"]
async fn real_model_agent_calls_a_tool_streamed() {
    agent_calls_a_tool(true).await;
}

#[tokio::test]
#[ignore = "needs a real model server: AGENTQ_TEST_MODEL_URL (docs/models.md)"]
async fn real_model_agent_waits_for_approval_before_its_tool() {
    let mut app = app_for_real_model(false).await;
    app.spawn(&["worker"]);
    app.spawn(&["scheduler"]);
    let input = json!({
        "user": "Record a payment of 10 euros in the ledger.",
        "tools": ["ledger"],
        "approval": ["ledger"],
        "tool_choice": "ledger",
        "max_turns": 4,
    });
    let op = enqueue_agent(&app, &input);
    // The model asked for the tool: the operation waits for a human, the effect not yet done.
    let waiting = app.wait_status(&op, "waiting", REAL_DEADLINE).await;
    assert_eq!(waiting.waiting_for.as_deref(), Some("approval"));
    assert_eq!(
        app.effects(&op).await,
        0,
        "nothing happens before the approval"
    );

    app.agentq_ok(&["approve", &op]);
    let done = app.wait_status(&op, "succeeded", REAL_DEADLINE).await;
    assert_eq!(app.effects(&op).await, 1, "the approved call happened once");
    let result = done.result.unwrap();
    println!(
        "real model, approval: {} turns, {} tool calls",
        result["turns"], result["tool_calls"]
    );
    app.cleanup().await;
}
