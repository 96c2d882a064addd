//! Child operations: `ctx.spawn` makes exactly one child per spawn step through SIGKILLs,
//! `ctx.join` parks the parent until they finish and hands it their outcomes (a dead child
//! included), and cancelling a parent cancels its children.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{DEADLINE, TestApp};

/// The children of `parent` in the database.
async fn children_of(app: &TestApp, parent: &str) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT id::text, status FROM operations WHERE parent_id = $1::uuid ORDER BY created_at",
    )
    .bind(parent)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// How many spawn steps of `parent` are journaled.
async fn spawns_journaled(app: &TestApp, parent: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM operation_steps
          WHERE op_id = $1::uuid AND kind = 'spawn' AND status = 'completed'",
    )
    .bind(parent)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// The outcomes the parent's join journaled (the last output of its script).
fn joined(result: &Value) -> Vec<Value> {
    let outputs = result["outputs"].as_array().expect("a script's outputs");
    outputs.last().unwrap()["children"]
        .as_array()
        .expect("the join's outcomes")
        .clone()
}

#[tokio::test]
async fn a_parent_spawns_50_children_through_sigkills_between_spawns_and_during_the_join() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    // Each spawn holds 300 ms between storing its child and journaling its step.
    app.set_env("AGENTQ_TEST_SPAWN_PAUSE_MS", "300");
    app.spawn(&["scheduler"]);
    let mut steps = Vec::new();
    for i in 0..50 {
        steps.push(json!({ "spawn": "script", "input": { "steps": [{ "work_ms": 1500 + i }] } }));
        steps.push(json!({ "work_ms": 20 }));
    }
    steps.push(json!({ "join": true }));
    let parent = app.enqueue_script(Value::Array(steps), &[]);

    // Killed twice while spawning, each time in the worst place: a child stored and its spawn
    // step not journaled (the replay must find that child, not make another). Once at least
    // 10 children exist, once at least 30 do.
    let mut worker = app.spawn(&["worker"]);
    for at in [10, 30] {
        app.wait_for(
            &format!("a spawn of child {at} or later caught between store and journal"),
            Duration::from_secs(90),
            || async {
                let children = children_of(&app, &parent).await.len();
                children >= at && spawns_journaled(&app, &parent).await < children as i64
            },
        )
        .await;
        app.kill(worker);
        worker = app.spawn(&["worker"]);
    }
    // Killed once more while the parent is parked on its join and children still run.
    app.wait_status(&parent, "waiting", Duration::from_secs(90))
        .await;
    let unfinished = children_of(&app, &parent)
        .await
        .iter()
        .filter(|(_, s)| s != "succeeded")
        .count();
    assert!(
        unfinished > 0,
        "every child finished before the join parked"
    );
    app.kill(worker);
    app.spawn(&["worker"]);

    let done = app
        .wait_status(&parent, "succeeded", Duration::from_secs(120))
        .await;
    assert!(
        done.restarts >= 2,
        "the parent was recovered after its kills"
    );
    let children = children_of(&app, &parent).await;
    assert_eq!(children.len(), 50, "exactly one child per spawn step");
    let outcomes = joined(&done.result.unwrap());
    assert_eq!(outcomes.len(), 50);
    let mut listed: Vec<&str> = outcomes
        .iter()
        .map(|o| o["op_id"].as_str().unwrap())
        .collect();
    listed.sort();
    let mut stored: Vec<&str> = children.iter().map(|(id, _)| id.as_str()).collect();
    stored.sort();
    assert_eq!(listed, stored, "the join lists every child, none twice");
    for o in &outcomes {
        assert_eq!(o["status"], "succeeded", "{o}");
        assert!(o["result"]["outputs"].is_array(), "{o}");
    }
    // Each child ran its own input: the i-th spawn's child worked 1500 + i ms.
    for (i, o) in outcomes.iter().enumerate() {
        assert_eq!(o["result"]["outputs"][0]["worked_ms"], json!(1500 + i));
    }
    app.cleanup().await;
}

#[tokio::test]
async fn a_dead_child_reaches_its_parent_as_a_failure_it_can_handle() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let parent = app.enqueue_script(
        json!([
            { "spawn": "script", "input": { "steps": [{ "fail": "non_retryable", "times": 1 }] } },
            { "spawn": "script", "input": { "steps": [{ "work_ms": 10 }] } },
            { "join": true },
            { "work_ms": 1 }
        ]),
        &[],
    );
    let done = app.wait_status(&parent, "succeeded", DEADLINE).await;
    let outcomes = joined_before_last(&done.result.unwrap());
    assert_eq!(outcomes[0]["status"], "dead");
    assert_eq!(outcomes[0]["error_class"], "non_retryable");
    assert!(
        outcomes[0]["error_message"]
            .as_str()
            .unwrap()
            .contains("scripted failure")
    );
    assert_eq!(outcomes[1]["status"], "succeeded");
    // `agentq list --parent` (the API's `?parent=`) finds the children.
    let out = app.agentq_ok(&["list", "--parent", &parent, "--json"]);
    let mut listed: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["op_id"].to_string())
        .collect();
    let mut spawned: Vec<String> = outcomes.iter().map(|o| o["op_id"].to_string()).collect();
    listed.sort();
    spawned.sort();
    assert_eq!(listed, spawned);
    // The dead letter links the child to its parent.
    let dead = outcomes[0]["op_id"].as_str().unwrap();
    let listed = app.agentq_json(&["dlq", "show", dead, "--json"]);
    assert_eq!(
        listed["dead_letter"]["parent_id"],
        json!(parent),
        "{listed}"
    );
    app.cleanup().await;
}

/// The join's outcomes when one more step follows it.
fn joined_before_last(result: &Value) -> Vec<Value> {
    let outputs = result["outputs"].as_array().expect("a script's outputs");
    outputs[outputs.len() - 2]["children"]
        .as_array()
        .expect("the join's outcomes")
        .clone()
}

#[tokio::test]
async fn cancelling_a_parent_cancels_its_children_waiting_and_running() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let busy: Vec<Value> = (0..600).map(|_| json!({ "work_ms": 100 })).collect();
    let parent = app.enqueue_script(
        json!([
            { "spawn": "script", "input": { "steps": [
                { "wait_signal": "go", "timeout_ms": 3_600_000 }] } },
            { "spawn": "script", "input": { "steps": busy } },
            { "join": true }
        ]),
        &[],
    );
    app.wait_status(&parent, "waiting", DEADLINE).await;
    app.wait_for("both children started", DEADLINE, || async {
        let kids = children_of(&app, &parent).await;
        kids.len() == 2 && kids[0].1 == "waiting" && kids[1].1 == "running"
    })
    .await;
    app.agentq_ok(&["cancel", &parent, "--reason", "no longer needed"]);
    app.wait_status(&parent, "cancelled", DEADLINE).await;
    let kids = children_of(&app, &parent).await;
    // The waiting child is cancelled with its parent, in the same transaction.
    assert_eq!(kids[0].1, "cancelled");
    // The running one stops at its worker's next step boundary.
    let running = app.wait_status(&kids[1].0, "cancelled", DEADLINE).await;
    assert!(running.error_message.unwrap_or_default().contains("cancel"));
    app.cleanup().await;
}

#[tokio::test]
async fn a_spawn_is_checked_as_an_enqueue_and_a_misfit_stores_no_child() {
    let mut app = TestApp::start().await;
    // The triage input below is well-formed (its callback allowed): only its kind is refused.
    app.set_env("AGENTQ_AGENT_HTTP_ALLOW", "http://127.0.0.1:9");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    // Each parent's only spawn is refused for a different reason; it dies saying which, and
    // no child exists. The input is checked when the parent runs the step, not at enqueue:
    // a spawn's input is just JSON to the parent's own check.
    for (input, says) in [
        (
            json!({ "spawn": "no_such_kind", "input": {} }),
            "unknown kind",
        ),
        (
            json!({ "spawn": "script", "input": { "steps": "not a list" } }),
            "does not fit kind",
        ),
        (
            json!({ "spawn": "triage", "input": {
                "event": {}, "source": "tracker", "webhook_id": "evt_1",
                "config": { "callback_url": "http://127.0.0.1:9/hook" } } }),
            "only for the deliveries of a webhook source",
        ),
        (
            json!({ "spawn": "doc_migration", "input": {
                "doc_id": "a", "source": { "store": "someone-elses" },
                "target": { "store": "mine" }, "instructions": "copy" } }),
            "tenant t1 has no store \"someone-elses\"",
        ),
    ] {
        let parent = app.enqueue_script(json!([input]), &[]);
        let dead = app.wait_status(&parent, "dead", DEADLINE).await;
        assert_eq!(dead.error_class.as_deref(), Some("non_retryable"));
        let message = dead.error_message.unwrap_or_default();
        assert!(message.contains(says), "{says:?} not in {message:?}");
        assert!(children_of(&app, &parent).await.is_empty());
    }
    // A producer may not take the key namespace children are stored under.
    let out = app.agentq(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"x"}"#,
        "--key",
        "child:0123",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("child"));
    app.cleanup().await;
}
