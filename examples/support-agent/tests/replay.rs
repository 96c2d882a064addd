//! The support agent under the replay tester: a scripted model, the lookup faked, and the real
//! refund tool against a fake payments API, crashed at every point of a run.

mod common;

use agentq::builtin::outbound::Origins;
use agentq::testing::{Check, FakeTool, ModelScript, Tester};
use agentq::{ModelResponse, Registry, Replay};
use serde_json::{Value, json};
use support_agent::Settings;

use common::Payments;

fn registry(payments: &str) -> Registry {
    let mut r = Registry::new();
    support_agent::register(
        &mut r,
        Settings {
            payments_url: payments.parse().unwrap(),
            orders_url: "postgres://unused".into(),
        },
    );
    r
}

/// The model: look the order up, refund it, answer.
fn model() -> ModelScript {
    ModelScript::replies([
        ModelResponse::tool_call("lookup_order", json!({ "order_id": "A-1001" })),
        ModelResponse::tool_call(
            "refund",
            json!({ "order_id": "A-1001", "cents": 2500, "reason": "arrived broken" }),
        ),
        ModelResponse::text("Your refund of $25.00 is on its way."),
    ])
}

fn lookup() -> FakeTool {
    FakeTool::new("lookup_order", Replay::Safe, |args| {
        json!({ "order_id": args["order_id"], "found": true, "customer": "Ada",
                "total_cents": 2500, "status": "delivered" })
    })
}

fn input(approve: bool) -> Value {
    json!({ "order_id": "A-1001", "message": "It arrived broken, I want my money back.",
            "approve_refunds": approve })
}

#[tokio::test]
async fn the_real_refund_tool_refunds_once_whatever_the_crash_point() {
    let payments = Payments::start(true).await;
    let report = Tester::new(&registry(&payments.url), "support", input(false))
        .model(model())
        .fake_tool(lookup())
        .http_allow(Origins::parse(std::slice::from_ref(&payments.url)).unwrap())
        .run()
        .await;
    report.assert_ok();
    assert_eq!(
        report.output().unwrap()["reply"],
        "Your refund of $25.00 is on its way."
    );
    // A crash after the refund was sent and before its answer was journaled asked the API.
    assert!(payments.lookups() > 0, "{report}");
    // Every timeline is an operation of its own (its own keys): in each, the refund was sent
    // once, whatever the crash point, and its reconcile told the truth (assert_ok above).
    let posts: Vec<String> = payments.posts().into_iter().map(|(k, _)| k).collect();
    let keys: std::collections::BTreeSet<&String> = posts.iter().collect();
    assert!(keys.len() > 1, "{posts:?}");
    assert_eq!(keys.len(), posts.len(), "a key sent twice: {posts:?}");
}

#[tokio::test]
async fn a_refund_behind_an_approval_holds_at_every_crash_point() {
    let payments = Payments::start(true).await;
    let report = Tester::new(&registry(&payments.url), "support", input(true))
        .model(model())
        .fake_tool(lookup())
        .fake_tool(
            FakeTool::new("refund", Replay::Unsafe, |args| {
                json!({ "refund_id": "rf_1", "order_id": args["order_id"], "cents": args["cents"] })
            })
            .reconciles(),
        )
        .signal("approval", json!({ "approved": true, "by": "sam" }))
        .run()
        .await;
    report.assert_ok();
    let names: Vec<&str> = report.steps.iter().map(|s| s.1.as_str()).collect();
    assert!(names.contains(&"signal:approval"), "{names:?}");
}

#[tokio::test]
async fn the_tester_catches_a_refund_tool_without_a_reconcile() {
    // The same kind, had its refund tool no reconcile: a crash during a refund would leave
    // the operation for a human.
    let report = Tester::new(&registry("http://127.0.0.1:9"), "support", input(false))
        .model(model())
        .fake_tool(lookup())
        .fake_tool(FakeTool::new(
            "refund",
            Replay::Unsafe,
            |_| json!({ "refund_id": "rf_1", "order_id": "A-1001", "cents": 2500 }),
        ))
        .run()
        .await;
    let found = report.found(Check::NoReconcile);
    assert_eq!(found.len(), 1, "{report}");
    assert_eq!(found[0].step, "refund");
}
