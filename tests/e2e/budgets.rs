//! Token budgets: an agent whose model would spend 10,000 tokens under a 3,000-token budget
//! parks (`waiting` for `(budget)`, no attempt used, its journal kept) before the call that
//! would cross it, so the provider never receives a call past the budget; a raise queues it
//! again and it finishes. An operation whose budget is not raised in time is dead as
//! `budget_exceeded`.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::fake_model::{FakeModel, Mode, Script, completion, tool_results_in};
use crate::harness::{DEADLINE, TestApp};

/// Turns the agent takes: nine tool calls, then its answer.
const TURNS: usize = 10;
/// Tokens the fake provider reports for every call: 900 prompt + 100 completion.
const PER_CALL: i64 = 1000;

/// A model that asks for `kv_put` until it has seen nine results, then answers; every call
/// reports 900 prompt and 100 completion tokens.
fn spending_model() -> Mode {
    Mode::Script(Script(Arc::new(|request: &Value| {
        let seen = tool_results_in(request);
        let mut answer = if seen + 1 < TURNS {
            let args = json!({ "key": format!("k{seen}"), "value": seen });
            json!({
                "id": "chatcmpl-fake", "model": "fake-model",
                "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": null,
                    "tool_calls": [{ "id": format!("call_{seen}"), "type": "function",
                        "function": { "name": "kv_put", "arguments": args.to_string() } }]
                }}]
            })
        } else {
            completion("done")
        };
        answer["usage"] = json!({ "prompt_tokens": 900, "completion_tokens": 100 });
        answer
    })))
}

fn enqueue(app: &TestApp, budget: &[&str]) -> String {
    let input =
        json!({ "user": "store ten things", "tools": ["kv_put"], "max_turns": TURNS }).to_string();
    let mut args = vec![
        "enqueue", "--tenant", "t1", "--kind", "agent", "--input", &input, "--json",
    ];
    args.extend_from_slice(budget);
    app.agentq_json(&args)["op_id"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn waiting_for(app: &TestApp, op: &str) -> Option<String> {
    sqlx::query_scalar("SELECT waiting_for FROM operations WHERE id = $1::uuid")
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_budget_parks_an_agent_before_the_call_that_would_cross_it_and_a_raise_finishes_it() {
    let fake = FakeModel::start(spending_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);

    // Bad budgets are refused before anything is written.
    for (flags, said) in [
        (vec!["--budget-tokens", "0"], "--budget-tokens"),
        (vec!["--budget-measure", "input"], "need --budget-tokens"),
        (
            vec!["--budget-tokens", "10", "--budget-timeout", "soon"],
            "--budget-timeout",
        ),
    ] {
        let input = r#"{"user":"x"}"#;
        let mut args = vec![
            "enqueue", "--tenant", "t1", "--kind", "agent", "--input", input,
        ];
        args.extend_from_slice(&flags);
        let out = app.agentq(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(said), "{flags:?}: {err}");
    }
    assert_eq!(app.operation_count().await, 0);

    let op = enqueue(&app, &["--budget-tokens", "3000"]);
    app.wait_status(&op, "waiting", DEADLINE).await;
    assert_eq!(waiting_for(&app, &op).await.as_deref(), Some("(budget)"));
    // Two calls fit (2,000 spent); the third's estimate (about 1,100: its prompt and the
    // default 1,024 completion tokens) would pass 3,000: it was never sent.
    assert_eq!(
        fake.requests(),
        2,
        "the provider got no call past the budget"
    );
    let shown = app.agentq_json_lines(&["budget", "show", &op, "--json"]);
    assert_eq!(shown.len(), 1, "{shown:?}");
    let b = &shown[0];
    assert_eq!(
        (
            &b["scope"],
            &b["limit_tokens"],
            &b["spent_tokens"],
            &b["held_tokens"]
        ),
        (
            &json!("operation"),
            &json!(3000),
            &json!(2 * PER_CALL),
            &json!(0)
        ),
        "{b}"
    );
    assert!(b["exceeded_at"].is_string(), "{b}");
    let v = app.operation(&op).await;
    assert_eq!(v.attempt, 1, "parking used no attempt");
    let why = app.agentq_json(&["why", &op, "--json"]);
    assert_eq!(why["detail"]["reason"], "waiting_for_budget", "{why}");
    assert_eq!(why["detail"]["spent_tokens"], json!(2 * PER_CALL), "{why}");
    assert!(
        why["headline"]
            .as_str()
            .unwrap()
            .contains("waiting for its token budget"),
        "{why}"
    );
    let text = app.agentq_ok(&["budget", "show", &op]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("2000 of 3000 total tokens spent"), "{text}");

    // A raise queues it again; it finishes, each call sent once.
    let raised = app.agentq_ok(&[
        "budget",
        "set",
        &op,
        "--budget-tokens",
        "20000",
        "--reason",
        "it needs more",
    ]);
    let said = String::from_utf8_lossy(&raised.stdout);
    assert!(said.contains("queued again"), "{said}");
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(fake.requests(), TURNS);
    let b = &app.agentq_json_lines(&["budget", "show", &op, "--json"])[0];
    assert_eq!(b["spent_tokens"], json!(TURNS as i64 * PER_CALL), "{b}");
    assert_eq!(b["held_tokens"], 0, "{b}");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE action = 'budget_set' AND op_id = $1::uuid
            AND reason = 'it needs more'",
    )
    .bind(&op)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);
    let v = app.operation(&op).await;
    assert_eq!(v.attempt, 1, "the whole run took one attempt");

    // Not raised within its timeout: dead as budget_exceeded, with its journal.
    let before = fake.requests();
    let late = enqueue(&app, &["--budget-tokens", "1500", "--budget-timeout", "2s"]);
    app.wait_status(&late, "dead", DEADLINE).await;
    assert_eq!(
        fake.requests() - before,
        1,
        "one call fit, no other was sent"
    );
    let v = app.operation(&late).await;
    assert_eq!(v.error_class.as_deref(), Some("budget_exceeded"), "{v:?}");
    let dead: String = sqlx::query_scalar("SELECT class FROM dead_letters WHERE op_id = $1::uuid")
        .bind(&late)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(dead, "budget_exceeded");
    app.cleanup().await;
}
