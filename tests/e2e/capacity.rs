//! One tenant cannot hold what others need: a cancel or a deadline stops a running operation
//! where it is (mid-step), and an unsafe call it interrupts is reconciled, never re-run.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{DEADLINE, running_app};

/// The harness's lease (`AGENTQ_LEASE_TTL_SECS=6`): a heartbeat every 2 s.
const LEASE: Duration = Duration::from_secs(6);

#[tokio::test]
async fn a_cancel_stops_an_hour_long_step_within_a_lease() {
    let app = running_app().await;
    let op = app.enqueue_script(json!([{ "work_ms": 3_600_000 }]), &[]);
    app.wait_status(&op, "running", DEADLINE).await;
    let asked = Instant::now();
    let out = app.agentq_json(&["cancel", &op, "--reason", "stuck", "--json"]);
    assert_eq!(out["result"], "requested", "{out}");
    let done = app.wait_status(&op, "cancelled", DEADLINE).await;
    let took = asked.elapsed();
    println!("cancel of a running hour-long step took {took:?}");
    // The step would have run for an hour; the heartbeat (every third of a lease) stopped it.
    assert!(took < 2 * LEASE, "took {took:?}");
    assert!(done.error_message.unwrap_or_default().contains("cancel"));
    app.cleanup().await;
}

#[tokio::test]
async fn a_deadline_stops_a_running_step() {
    let app = running_app().await;
    let op = app.enqueue_script(json!([{ "work_ms": 3_600_000 }]), &["--deadline", "3s"]);
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("deadline_exceeded"));
    app.cleanup().await;
}

/// The journal of `op` as `agentq steps --json` prints it.
fn steps(app: &crate::harness::TestApp, op: &str) -> Vec<Value> {
    app.agentq_json_lines(&["steps", op, "--json"])
}

#[tokio::test]
async fn an_unsafe_call_a_deadline_interrupts_is_reconciled_not_rerun() {
    let app = running_app().await;
    // The ledger records its effect at once, then its answer takes an hour: the deadline
    // passes while the call is in flight.
    let op = app.enqueue_script(
        json!([
            { "tool": "ledger", "replay": "unsafe", "label": "pay", "after_ms": 3_600_000,
              "reconcile": true },
            { "work_ms": 1 }
        ]),
        &["--deadline", "15s"],
    );
    app.wait_for("the payment to happen", DEADLINE, || async {
        app.effects(&op).await == 1
    })
    .await;
    assert_eq!(app.operation(&op).await.status.as_str(), "running");
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("deadline_exceeded"));
    let journal = steps(&app, &op);
    assert_eq!(journal[0]["status"], "unknown", "{journal:?}");

    // An operator runs it again: the deadline is lifted, the unknown step is reconciled (the
    // ledger says it happened), and nothing is paid twice.
    app.agentq_ok(&["dlq", "retry", &op, "--reason", "run it"]);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(app.effects(&op).await, 1);
    let journal = steps(&app, &op);
    assert_eq!(journal[0]["status"], "completed", "{journal:?}");
    assert!(journal[0]["output"]["effect_id"].is_number(), "{journal:?}");
    assert!(done.result.is_some());
    app.cleanup().await;
}
