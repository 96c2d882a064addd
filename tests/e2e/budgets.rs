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
    let status = app.agentq_ok(&["status", &op]);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains("waiting for: its token budget")
            && status.contains("budget:      operation 2000 of 3000 total tokens spent, 0 held"),
        "{status}"
    );
    let status = app.agentq_json(&["status", &op, "--json"]);
    assert_eq!(
        status["budgets"][0]["spent_tokens"],
        json!(2 * PER_CALL),
        "{status}"
    );
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

    // The console's operation page shows the budget and what the wait is for; a raise that
    // names no number of tokens is refused and changes nothing.
    let (_, base) = app.serve().await;
    let mut ui = crate::console::Browser::new(&base);
    ui.login(&app.token("t1", "operator")).await;
    let path = format!("/ui/operations/{op}");
    let (status, page) = ui.get(&path).await;
    assert_eq!(status, 200);
    for needle in [
        "Token budgets",
        "data-budget=\"operation\"",
        "a token budget (see below)",
        "data-action=\"raise-budget\"",
        "waiting for its token budget",
    ] {
        assert!(page.contains(needle), "the page lacks {needle:?}");
    }
    let csrf = crate::console::csrf_of(&page);
    let r = ui
        .post(
            &format!("{path}/budget"),
            &[("csrf", &csrf), ("tokens", "lots"), ("next", &path)],
        )
        .await;
    assert_eq!(r.status().as_u16(), 303);
    let (_, page) = ui.get(&path).await;
    assert!(page.contains("refused: tokens: say how many"), "{page}");
    assert_eq!(app.operation(&op).await.status.as_str(), "waiting");

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

/// A model that answers a document with its own text, reporting 400 prompt and 100
/// completion tokens.
fn echoing_model() -> Mode {
    Mode::Script(Script(Arc::new(|request: &Value| {
        let text = request["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
            .and_then(|m| m["content"].as_str())
            .unwrap_or_default()
            .to_string();
        let mut answer = completion(&text);
        answer["usage"] = json!({ "prompt_tokens": 400, "completion_tokens": 100 });
        answer
    })))
}

/// A batch of 50 under a 10,000-token budget: it pauses once what is spent leaves no room
/// for another call, with no document half-done (every succeeded one written whole, every
/// other queued with no write begun) and no call past the budget; raised and resumed, it
/// finishes.
#[tokio::test]
async fn a_batch_pauses_when_its_budget_is_spent_with_no_document_half_done_and_a_raise_finishes_it()
 {
    use crate::batch::{TempDir, files, start_batch, write_docs};
    const N: usize = 50;
    const LIMIT: i64 = 10_000;
    let fake = FakeModel::start(echoing_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    let docs = write_docs(&src.0, N);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let started = start_batch(
        &app,
        (&src.0, &dst.0, &tmp.0),
        "Keep the text as it is.",
        &["--name", "capped", "--budget-tokens", &LIMIT.to_string()],
    );
    assert_eq!(started["name"], "capped", "{started}");

    let paused = app
        .wait_until("the batch to pause for its budget", DEADLINE, || async {
            let s = app.agentq_json(&["batch", "status", "capped", "--json"]);
            (s["status"] == "paused").then_some(s)
        })
        .await;
    let reason = paused["paused_reason"].as_str().unwrap();
    assert!(reason.starts_with("budget spent: "), "{paused}");
    // Its status shows the budget and what it spent.
    assert_eq!(paused["budget"]["scope"], "batch", "{paused}");
    assert_eq!(paused["budget"]["limit_tokens"], json!(10_000), "{paused}");
    assert!(
        paused["budget"]["spent_tokens"].as_i64().unwrap() <= 10_000,
        "{paused}"
    );
    // Every run in flight settles: a call already held finishes, a refused one is handed back.
    app.wait_for("no operation of the batch running", DEADLINE, || async {
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM operations WHERE batch_id IS NOT NULL AND status = 'running'",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        running == 0
    })
    .await;
    let by_status: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, count(*) FROM operations GROUP BY status ORDER BY status")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    let succeeded = by_status
        .iter()
        .find(|(s, _)| s == "succeeded")
        .map_or(0, |(_, n)| *n);
    assert!(
        succeeded > 0 && succeeded < N as i64,
        "paused mid-batch: {by_status:?}"
    );
    assert_eq!(
        by_status.iter().map(|(_, n)| n).sum::<i64>(),
        N as i64,
        "{by_status:?}"
    );
    assert!(
        by_status
            .iter()
            .all(|(s, _)| s == "succeeded" || s == "queued"),
        "every document succeeded or waits, none half-done: {by_status:?}"
    );
    // No document half-done: the target holds exactly the succeeded ones, each whole.
    let written = files(&dst.0);
    assert_eq!(written.len() as i64, succeeded, "{by_status:?}");
    for (path, bytes) in &written {
        assert_eq!(
            String::from_utf8_lossy(bytes),
            docs[path.as_str()],
            "{path} is whole"
        );
    }
    // No call past the budget: what the provider was sent is within it.
    let b = app
        .agentq_json_lines(&["budget", "show", &first_op(&app).await, "--json"])
        .into_iter()
        .find(|b| b["scope"] == "batch")
        .expect("the batch's budget");
    let spent = b["spent_tokens"].as_i64().unwrap();
    assert_eq!(spent, fake.requests() as i64 * 500, "{b}");
    assert!(spent <= LIMIT, "{b}");
    assert_eq!(b["held_tokens"], 0, "{b}");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE actor = 'budget' AND action = 'batch_paused'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1);

    // Raised and resumed, it finishes: every document once.
    let raised = app.agentq_ok(&[
        "budget",
        "set",
        "--batch",
        "capped",
        "--budget-tokens",
        "1000000",
        "--reason",
        "approved",
    ]);
    let said = String::from_utf8_lossy(&raised.stdout);
    assert!(said.contains("batch resume"), "{said}");
    app.agentq_ok(&["batch", "resume", "capped"]);
    app.wait_until("the batch to complete", DEADLINE, || async {
        let s = app.agentq_json(&["batch", "status", "capped", "--json"]);
        (s["status"] == "completed").then_some(s)
    })
    .await;
    assert_eq!(files(&dst.0).len(), N);
    assert_eq!(fake.requests(), N, "each document's call sent once");
    app.cleanup().await;
}

async fn first_op(app: &TestApp) -> String {
    sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM operations LIMIT 1")
        .fetch_one(&app.pool)
        .await
        .unwrap()
        .to_string()
}

/// The API: a producer enqueues with a budget and reads it; an operator (of the tenant) raises
/// it and lets a call through once; a producer may not, another tenant's operator finds
/// nothing; a bad budget is refused naming its field, changing nothing. Every answer is
/// checked against /openapi.json by the `Api` client.
#[tokio::test]
async fn the_budget_routes_enqueue_read_raise_and_allow_once_for_their_tenant_only() {
    use crate::api::Api;
    use reqwest::Method;
    let fake = FakeModel::start(spending_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let producer = app.token("t1", "producer");
    let operator = app.token("t1", "operator");
    let other = app.token("t2", "operator");
    let put = |path: String, token: String, body: Value| {
        let rb = api.req(Method::PUT, &path, Some(&token)).json(&body);
        crate::api::send(format!("PUT {path}"), rb)
    };

    let input = json!({ "user": "store ten things", "tools": ["kv_put"], "max_turns": TURNS });
    api.post(
        "/v1/operations",
        Some(&producer),
        &json!({ "tenant": "t1", "kind": "agent", "input": input, "budget": { "tokens": 0 } }),
    )
    .await
    .problem(422, "unprocessable");
    assert_eq!(
        app.operation_count().await,
        0,
        "a refused budget writes nothing"
    );
    let op = api
        .create(
            &producer,
            &json!({ "tenant": "t1", "kind": "agent", "input": input,
                     "budget": { "tokens": 2500, "measure": "total", "timeout_secs": 3600 } }),
        )
        .await;
    app.wait_status(&op, "waiting", DEADLINE).await;
    let listed = api
        .get(&format!("/v1/operations/{op}/budgets"), Some(&producer))
        .await
        .expect(200);
    assert_eq!(listed["items"][0]["limit_tokens"], 2500, "{listed}");
    assert_eq!(
        listed["items"][0]["spent_tokens"],
        json!(2 * PER_CALL),
        "{listed}"
    );

    // A producer may not raise it; another tenant's operator does not find it.
    put(
        format!("/v1/operations/{op}/budget"),
        producer.clone(),
        json!({ "tokens": 100000 }),
    )
    .await
    .problem(403, "forbidden");
    put(
        format!("/v1/operations/{op}/budget"),
        other.clone(),
        json!({ "tokens": 100000 }),
    )
    .await
    .problem(404, "not-found");
    put(
        format!("/v1/operations/{op}/budget"),
        operator.clone(),
        json!({ "tokens": -1 }),
    )
    .await
    .problem(422, "unprocessable");
    assert_eq!(app.operation(&op).await.status.as_str(), "waiting");

    // Allow one call through: it is sent, then the next is refused again.
    let allowed = api
        .post(
            &format!("/v1/operations/{op}/budget/allow-once"),
            Some(&operator),
            &json!({ "reason": "one more turn" }),
        )
        .await
        .expect(200);
    assert_eq!(allowed["resumed"], true, "{allowed}");
    app.wait_for(
        "the let-through call and a new refusal",
        DEADLINE,
        || async {
            fake.requests() == 3 && waiting_for(&app, &op).await.as_deref() == Some("(budget)")
        },
    )
    .await;

    // A raise finishes it.
    let set = put(
        format!("/v1/operations/{op}/budget"),
        operator.clone(),
        json!({ "tokens": 100000, "reason": "approved" }),
    )
    .await
    .expect(200);
    assert_eq!(set["resumed"], true, "{set}");
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(fake.requests(), TURNS);
    app.cleanup().await;
}

/// A schedule's budget: each operation it fires is born with it, and parks on it.
#[tokio::test]
async fn a_schedules_firings_are_born_with_its_budget() {
    let fake = FakeModel::start(spending_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let input =
        json!({ "user": "store ten things", "tools": ["kv_put"], "max_turns": TURNS }).to_string();
    let added = app.agentq_json(&[
        "schedules",
        "add",
        "--tenant",
        "t1",
        "--name",
        "capped",
        "--kind",
        "agent",
        "--input",
        &input,
        "--every",
        "1h",
        "--catch-up",
        "2h",
        "--budget-tokens",
        "1500",
        "--json",
    ]);
    assert_eq!(
        (&added["budget_tokens"], &added["budget_measure"]),
        (&json!(1500), &json!("total")),
        "{added}"
    );
    // Fire it now: the tick is moved to the past, as a scheduler that was down finds it.
    sqlx::query("UPDATE schedules SET next_tick = now() - interval '1 minute'")
        .execute(&app.pool)
        .await
        .unwrap();
    let op = app
        .wait_until("the firing", DEADLINE, || async {
            sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM operations LIMIT 1")
                .fetch_optional(&app.pool)
                .await
                .unwrap()
                .map(|id| id.to_string())
        })
        .await;
    app.wait_status(&op, "waiting", DEADLINE).await;
    assert_eq!(waiting_for(&app, &op).await.as_deref(), Some("(budget)"));
    assert_eq!(fake.requests(), 1, "one call fit 1,500 tokens");
    app.agentq_ok(&["schedules", "delete", "capped", "--tenant", "t1"]);
    app.cleanup().await;
}

/// A tenant's budget per period: its operations park when this period's spend cannot cover a
/// call (another tenant's run on), run again when the period rolls over (its spend starts
/// again), and all are queued again when an admin raises it.
#[tokio::test]
async fn a_tenants_budget_per_period_parks_its_operations_until_the_next_period_or_a_raise() {
    let fake = FakeModel::start(spending_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);

    let out = app.agentq(&["budget", "set", "--tenant", "t1", "--budget-tokens", "2500"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--period"));
    let set = app.agentq_json(&[
        "budget",
        "set",
        "--tenant",
        "t1",
        "--period",
        "1h",
        "--budget-tokens",
        "2500",
        "--json",
    ]);
    assert_eq!(
        (&set["budget"]["scope"], &set["budget"]["period_secs"]),
        (&json!("tenant"), &json!(3600)),
        "{set}"
    );
    let op = enqueue(&app, &[]);
    app.wait_status(&op, "waiting", DEADLINE).await;
    assert_eq!(waiting_for(&app, &op).await.as_deref(), Some("(budget)"));
    assert_eq!(
        fake.requests(),
        2,
        "two calls fit the tenant's 2,500 this period"
    );
    let why = app.agentq_json(&["why", &op, "--json"]);
    assert_eq!(why["detail"]["scope"], "tenant", "{why}");
    // Another tenant runs on.
    let input = json!({ "user": "x", "tools": ["kv_put"], "max_turns": TURNS }).to_string();
    let other = app.agentq_json(&[
        "enqueue", "--tenant", "t2", "--kind", "agent", "--input", &input, "--json",
    ])["op_id"]
        .as_str()
        .unwrap()
        .to_string();
    app.wait_status(&other, "succeeded", DEADLINE).await;
    assert_eq!(fake.requests(), 2 + TURNS);

    // The period rolls over (moved back, as time would): the wait's timer fires, the spend
    // starts again, two more calls fit.
    sqlx::query("UPDATE budgets SET period_start = period_start - interval '1 hour'")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE operations SET run_at = now() WHERE id = $1::uuid")
        .bind(&op)
        .execute(&app.pool)
        .await
        .unwrap();
    app.wait_for("two more calls in the new period", DEADLINE, || async {
        fake.requests() == 4 + TURNS && app.operation(&op).await.status.as_str() == "waiting"
    })
    .await;
    let b = &app.agentq_json_lines(&["budget", "show", &op, "--json"])[0];
    assert_eq!(
        (&b["scope"], &b["spent_tokens"]),
        (&json!("tenant"), &json!(2 * PER_CALL)),
        "{b}"
    );

    // A raise (an admin's, over the API) queues the tenant's waiting operations again; the
    // tenant's own operator may not raise its cap.
    let (_, base) = app.serve().await;
    let api = crate::api::Api::new(&base);
    let put = |token: String, body: Value| {
        let path = "/v1/tenants/t1/budget";
        let rb = api
            .req(reqwest::Method::PUT, path, Some(&token))
            .json(&body);
        crate::api::send(format!("PUT {path}"), rb)
    };
    let body = json!({ "tokens": 100000, "period_secs": 3600, "reason": "a bigger plan" });
    put(app.token("t1", "operator"), body.clone())
        .await
        .problem(403, "forbidden");
    put(
        app.token("t1", "admin"),
        json!({ "tokens": 5, "period_secs": 1 }),
    )
    .await
    .problem(422, "unprocessable");
    // The tenant reads its own budget (the CLI and the API, one flow), not another's.
    let shown = &app.agentq_json_lines(&["budget", "show", "--tenant", "t1", "--json"])[0];
    assert_eq!(shown["spent_tokens"], json!(2 * PER_CALL), "{shown}");
    assert!(shown["period_ends"].is_string(), "{shown}");
    let read = api
        .get("/v1/tenants/t1/budget", Some(&app.token("t1", "producer")))
        .await
        .expect(200);
    assert_eq!(read["limit_tokens"], json!(2500), "{read}");
    api.get("/v1/tenants/t1/budget", Some(&app.token("t2", "producer")))
        .await
        .problem(403, "forbidden");
    api.get("/v1/tenants/t2/budget", Some(&app.token("t2", "producer")))
        .await
        .problem(404, "not-found");
    let raised = put(app.token("t1", "admin"), body).await.expect(200);
    assert_eq!(raised["resumed"], true, "{raised}");
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(fake.requests(), 2 * TURNS, "each call of both sent once");
    app.cleanup().await;
}

#[tokio::test]
async fn a_webhook_sources_budget_is_each_of_its_operations_own() {
    use crate::usecase_webhook::deliver_to;
    use agentq_core::webhook::Secret;
    let fake = FakeModel::start(spending_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let add = |extra: &[&str]| {
        let mut args = vec![
            "webhooks", "add", "--tenant", "t1", "--source", "notes", "--kind", "agent",
        ];
        args.extend_from_slice(extra);
        app.agentq(&args)
    };
    // A bad budget adds no source.
    for (flags, said) in [
        (vec!["--budget-tokens", "0"], "tokens"),
        (vec!["--budget-measure", "input"], "need --budget-tokens"),
    ] {
        let out = add(&flags);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(said), "{flags:?}: {err}");
    }
    assert!(
        app.agentq_json_lines(&["webhooks", "list", "--json"])
            .is_empty(),
        "no source added"
    );
    let out = add(&["--budget-tokens", "2500", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let added: Value = serde_json::from_slice(&out.stdout).unwrap();
    let secret = Secret::parse(added["secret"].as_str().unwrap()).unwrap();
    let listed = app.agentq_json_lines(&["webhooks", "list", "--json"]);
    assert_eq!(listed[0]["budget"]["tokens"], json!(2500), "{listed:?}");

    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let http = reqwest::Client::new();
    let mut ops = Vec::new();
    for id in ["msg_1", "msg_2"] {
        let body = json!({ "user": "store ten things", "tools": ["kv_put"], "max_turns": TURNS });
        let body = body.to_string().into_bytes();
        let (status, v) = deliver_to(&http, &base, "notes", &secret, id, 0, &body).await;
        assert_eq!(status, 202, "{v}");
        ops.push(v["op_id"].as_str().unwrap().to_string());
    }
    // Each delivery's operation has 2,500 tokens of its own: two 1,000-token calls each, then
    // it parks before the third.
    for op in &ops {
        app.wait_status(op, "waiting", DEADLINE).await;
        assert_eq!(waiting_for(&app, op).await.as_deref(), Some("(budget)"));
        let b = &app.agentq_json_lines(&["budget", "show", op, "--json"])[0];
        assert_eq!(b["scope"], "operation", "{b}");
        assert_eq!(b["limit_tokens"], json!(2500), "{b}");
        assert_eq!(b["spent_tokens"], json!(2 * PER_CALL), "{b}");
    }
    assert_eq!(fake.requests(), 4, "no call past either budget was sent");
    app.cleanup().await;
}

/// A call back from the provider charges its budget hold before it waits for a lane slot. One
/// slot, and a tenant's budget with room for one call's estimate at a time: A's call is held at
/// the provider, its slot lent to B, whose call must wait for A's hold to be charged. A back
/// from its call charges at once and B's call goes; charged only once A had a slot again, B
/// held the only slot waiting for the room, gave up and was parked (and claimed a second time).
#[tokio::test]
async fn a_call_back_from_the_provider_charges_its_hold_before_it_waits_for_a_slot() {
    let fake = FakeModel::start(Mode::Echo).await;
    let gate = fake.hold_requests();
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    // About 1,030 tokens a call's estimate (its prompt, 1,024 of completion); each uses ~10.
    app.agentq_ok(&[
        "budget",
        "set",
        "--tenant",
        "t1",
        "--period",
        "1h",
        "--budget-tokens",
        "1600",
    ]);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker", "--concurrency", "1"]);
    let a = app.enqueue_script(json!([{ "model": "first" }]), &[]);
    app.wait_for("A's call at the provider", DEADLINE, || async {
        fake.requests() == 1
    })
    .await;
    let b = app.enqueue_script(json!([{ "model": "second" }]), &[]);
    app.wait_status(&b, "running", DEADLINE).await;
    assert_eq!(fake.requests(), 1, "B waits for the room A's hold takes");
    gate.add_permits(1_000);
    for op in [&a, &b] {
        app.wait_status(op, "succeeded", DEADLINE).await;
        let epoch: i64 = sqlx::query_scalar("SELECT epoch FROM operations WHERE id = $1::uuid")
            .bind(op)
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(epoch, 1, "{op} claimed once, never parked");
    }
    assert_eq!(fake.requests(), 2);
    let b = app
        .agentq_json_lines(&["budget", "show", &a, "--json"])
        .into_iter()
        .find(|b| b["scope"] == "tenant")
        .expect("the tenant's budget");
    assert_eq!(b["held_tokens"], 0, "{b}");
    app.cleanup().await;
}
