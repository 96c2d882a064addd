//! The support agent's binary end to end, on real PostgreSQL and RabbitMQ (agentq-testkit): its
//! kind accepted by `enqueue`, `serve` and `schedules add`, listed by `kinds`, its tools called
//! by a fake model, and a refund that a SIGKILL interrupts between its effect and its journal
//! write made exactly once.

mod common;

use std::sync::Arc;

use agentq::sqlx;
use agentq_testkit::fake_model::{FakeModel, Mode, Script, completion, tool_call, tool_results_in};
use agentq_testkit::{DEADLINE, World};
use serde_json::{Value, json};

use common::Payments;

const BIN: &str = env!("CARGO_BIN_EXE_support-agent");

/// A world of the support agent's binary, its orders table made and one order of `acme`'s
/// stored, talking to `model` and `payments`.
async fn world(model: &FakeModel, payments: &Payments) -> World {
    let mut world = World::start(BIN).await;
    sqlx::raw_sql(include_str!("../schema.sql"))
        .execute(&world.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO support_orders VALUES ('acme', 'A-1001', 'Ada', 2500, 'delivered'),
                                           ('other', 'B-2002', 'Bob', 9900, 'delivered')",
    )
    .execute(&world.pool)
    .await
    .unwrap();
    world.set_env("AGENTQ_MODEL_BASE_URL", &model.url);
    world.set_env("AGENTQ_AGENT_HTTP_ALLOW", &payments.url);
    world.set_env("SUPPORT_PAYMENTS_URL", &payments.url);
    world
}

/// [`world`] with a scheduler and a worker running.
async fn running(model: &FakeModel, payments: &Payments) -> World {
    let mut world = world(model, payments).await;
    world.spawn(&["scheduler"]);
    world.spawn(&["worker"]);
    world
}

/// The model of the support agent: look the order up, refund what it costs, answer; for the
/// built-in `agent` kind (offered only `lookup_order`): look up, then answer with what it read.
fn model_script() -> Mode {
    Mode::Script(Script(Arc::new(|request: &Value| {
        let offered: Vec<&str> = request["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["function"]["name"].as_str())
            .collect();
        let done = tool_results_in(request);
        let last_tool = request["messages"]
            .as_array()
            .and_then(|m| m.iter().rev().find(|m| m["role"] == "tool"))
            .and_then(|m| m["content"].as_str())
            .unwrap_or_default()
            .to_string();
        match (offered.contains(&"refund"), done) {
            (_, 0) => tool_call("call_1", "lookup_order", json!({ "order_id": "A-1001" })),
            (true, 1) => tool_call(
                "call_2",
                "refund",
                json!({ "order_id": "A-1001", "cents": 2500, "reason": "arrived broken" }),
            ),
            (true, _) => completion("Your refund of $25.00 is on its way."),
            (false, _) => completion(&format!("looked up: {last_tool}")),
        }
    })))
}

/// Enqueues an operation through the binary's CLI; its id.
fn enqueue(world: &World, tenant: &str, kind: &str, input: &str) -> String {
    let out = world.agentq_json(&[
        "enqueue", "--tenant", tenant, "--kind", kind, "--input", input, "--json",
    ]);
    out["op_id"].as_str().unwrap().to_string()
}

fn support_input() -> String {
    json!({ "order_id": "A-1001", "message": "It arrived broken; I want my money back." })
        .to_string()
}

#[tokio::test]
async fn a_refund_a_sigkill_interrupts_after_its_effect_happens_exactly_once() {
    let model = FakeModel::start(model_script()).await;
    // Refund answers wait at the gate: the refund happens, its answer does not arrive.
    let payments = Payments::start(false).await;
    let mut world = world(&model, &payments).await;
    world.spawn(&["scheduler"]);
    let worker = world.spawn(&["worker"]);
    let op = enqueue(&world, "acme", "support", &support_input());

    // The refund reached the payments API; the worker waits for its answer, its journal holds
    // the refund step as `started`. Kill it there.
    payments.wait_for_post(DEADLINE).await;
    let held = world.operation(&op).await;
    assert_eq!(held.status.as_str(), "running");
    world.kill(worker);
    payments.open();
    world.spawn(&["worker"]);

    // Its lease runs out, the reaper requeues it, the new worker replays the journal and asks
    // the payments API whether the refund happened instead of refunding again.
    let done = world.wait_status(&op, "succeeded", DEADLINE).await;
    let result = done.result.unwrap();
    assert_eq!(result["reply"], "Your refund of $25.00 is on its way.");
    assert_eq!(result["tool_calls"], 2);
    assert_eq!(payments.posts().len(), 1, "exactly one refund");
    assert!(payments.lookups() >= 1, "the restart reconciled");
    let steps = world.agentq_json_lines(&["steps", &op, "--json"]);
    let refund = steps.iter().find(|s| s["name"] == "refund").unwrap();
    assert_eq!(refund["status"], "completed");
    assert_eq!(refund["output"]["refund_id"], "rf_1");
    world.cleanup().await;
}

#[tokio::test]
async fn every_front_door_accepts_the_deployments_kind_and_lists_it() {
    let model = FakeModel::start(model_script()).await;
    let payments = Payments::start(true).await;
    let mut world = world(&model, &payments).await;

    // `kinds` lists the kind with its input schema, and the tools an agent may name.
    let kinds = world.agentq_json(&["kinds", "--json"]);
    let support = kinds["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == "support")
        .expect("support is listed");
    let schema = &support["input_schema"];
    assert_eq!(schema["required"], json!(["order_id", "message"]));
    assert_eq!(schema["properties"]["approve_refunds"]["type"], "boolean");
    let tools: Vec<&str> = kinds["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        tools.contains(&"lookup_order") && tools.contains(&"refund"),
        "{tools:?}"
    );

    // `enqueue` checks the input against the kind's type, naming the field.
    let bad = world.agentq(&[
        "enqueue",
        "--tenant",
        "acme",
        "--kind",
        "support",
        "--input",
        r#"{"order_id": 7, "message": "hi"}"#,
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("order_id:"));

    // `schedules add` accepts it, and refuses a misfit.
    world.agentq_ok(&[
        "schedules",
        "add",
        "--tenant",
        "acme",
        "--name",
        "nightly-followup",
        "--kind",
        "support",
        "--input",
        &support_input(),
        "--every",
        "1d",
        "--paused",
    ]);
    let misfit = world.agentq(&[
        "schedules",
        "add",
        "--tenant",
        "acme",
        "--name",
        "broken",
        "--kind",
        "support",
        "--input",
        r#"{"message": "hi"}"#,
        "--every",
        "1d",
    ]);
    assert_eq!(misfit.status.code(), Some(2));

    // `serve`: the API enqueues it, lists it, and refuses a misfit naming the field.
    world.spawn(&["scheduler"]);
    world.spawn(&["worker"]);
    let (_, base) = world.serve().await;
    let token = world.token("acme", "producer");
    let http = reqwest::Client::new();
    let kinds: Value = http
        .get(format!("{base}/v1/kinds"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        kinds["kinds"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["name"] == "support")
    );
    let refused = http
        .post(format!("{base}/v1/operations"))
        .bearer_auth(&token)
        .json(&json!({ "kind": "support", "input": { "order_id": "A-1001", "message": 3 } }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["field"], "/input/message");
    let accepted = http
        .post(format!("{base}/v1/operations"))
        .bearer_auth(&token)
        .json(&json!({ "kind": "support", "input": serde_json::from_str::<Value>(&support_input()).unwrap() }))
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status(), 202);
    let op: Value = accepted.json().await.unwrap();
    let op = op["op_id"].as_str().unwrap().to_string();
    let done = world.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.result.unwrap()["tool_calls"], 2);
    assert_eq!(payments.posts().len(), 1);

    // The OpenAPI document links the kind's input schema to the enqueue body.
    let doc: Value = http
        .get(format!("{base}/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["components"]["schemas"]["KindInput.support"].is_object());
    world.cleanup().await;
}

#[tokio::test]
async fn the_built_in_agent_calls_the_deployments_own_tool_within_its_tenant() {
    let model = FakeModel::start(model_script()).await;
    let payments = Payments::start(true).await;
    let world = running(&model, &payments).await;
    let input = json!({ "user": "What is the status of order A-1001?", "tools": ["lookup_order"] });
    let ours = enqueue(&world, "acme", "agent", &input.to_string());
    let theirs = enqueue(&world, "other", "agent", &input.to_string());
    let answer = |v: &Value| v["answer"].as_str().unwrap_or_default().to_string();
    let ours = world.wait_status(&ours, "succeeded", DEADLINE).await;
    assert!(answer(&ours.result.unwrap()).contains("\"customer\":\"Ada\""));
    // Another tenant's agent asking for the same order finds nothing: the tool reads only the
    // operation's tenant's rows.
    let theirs = world.wait_status(&theirs, "succeeded", DEADLINE).await;
    assert!(answer(&theirs.result.unwrap()).contains("\"found\":false"));
    // A tool nobody registered is refused at enqueue, naming it.
    let unknown = world.agentq(&[
        "enqueue",
        "--tenant",
        "acme",
        "--kind",
        "agent",
        "--input",
        r#"{"user": "hi", "tools": ["lookup_order", "delete_everything"]}"#,
    ]);
    assert_eq!(unknown.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        stderr.contains("tools[1]") && stderr.contains("delete_everything"),
        "{stderr}"
    );
    world.cleanup().await;
}

#[tokio::test]
async fn a_handoff_says_what_it_needs_from_the_person_who_replies() {
    let model = FakeModel::start(model_script()).await;
    let payments = Payments::start(true).await;
    let mut world = running(&model, &payments).await;
    let (_, base) = world.serve().await;
    let input = json!({ "order_id": "A-1001", "message": "Where is my parcel?" });
    let op = enqueue(&world, "acme", "handoff", &input.to_string());
    world.wait_status(&op, "waiting", DEADLINE).await;

    // `status` (text and JSON) and the API show what the kind said it needs.
    let shown = world.agentq_json(&["status", &op, "--json"]);
    let waiting = &shown["waiting"];
    assert_eq!(waiting["signal"], "reply", "{shown}");
    assert_eq!(waiting["about"]["order"]["customer"], "Ada", "{shown}");
    assert_eq!(
        waiting["about"]["message"], "Where is my parcel?",
        "{shown}"
    );
    let text = String::from_utf8_lossy(&world.agentq_ok(&["status", &op]).stdout).into_owned();
    assert!(
        text.contains("waiting for: signal \"reply\"") && text.contains("Where is my parcel?"),
        "{text}"
    );
    let api: Value = reqwest::Client::new()
        .get(format!("{base}/v1/operations/{op}"))
        .bearer_auth(world.token("acme", "producer"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(api["waiting"], *waiting);

    // The reply resumes it.
    world.agentq_ok(&[
        "signal",
        &op,
        "reply",
        "--payload",
        r#"{"text": "It ships today."}"#,
    ]);
    let done = world.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.result.unwrap()["reply"], "It ships today.");
    world.cleanup().await;
}

#[tokio::test]
async fn replay_checks_a_recorded_journal_against_this_binary() {
    let model = FakeModel::start(model_script()).await;
    let payments = Payments::start(true).await;
    let world = running(&model, &payments).await;
    let op = enqueue(&world, "acme", "support", &support_input());
    world.wait_status(&op, "succeeded", DEADLINE).await;
    // From the database: this binary replays its own journal.
    let replayed = world.agentq_json(&["replay", &op, "--json"]);
    assert_eq!(replayed["agrees"], true, "{replayed}");
    // From an exported journal, as a kind with other steps: it would diverge.
    let steps = world.agentq_ok(&["steps", &op, "--json"]);
    let file = std::env::temp_dir().join(format!("support-agent-{op}.jsonl"));
    std::fs::write(&file, &steps.stdout).unwrap();
    let other = world.agentq(&[
        "replay",
        "--journal",
        file.to_str().unwrap(),
        "--kind",
        "echo",
        "--input",
        r#"{"text": "hi"}"#,
        "--json",
    ]);
    std::fs::remove_file(&file).unwrap();
    assert_eq!(other.status.code(), Some(1));
    let line: Value = serde_json::from_slice(&other.stdout).unwrap();
    assert_eq!(line["agrees"], false);
    assert!(
        line["outcome"].as_str().unwrap().contains("nondeterminism"),
        "{line}"
    );
    // Nothing was called again: one refund, no reconcile lookups.
    assert_eq!(payments.posts().len(), 1);
    assert_eq!(payments.lookups(), 0);
    world.cleanup().await;
}
