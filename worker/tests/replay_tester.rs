//! The replay tester, used as a kind's author uses it: kinds written against the public SDK,
//! a scripted model, fake and real tools. It must pass a kind that keeps every rule, and fail,
//! naming the step, a kind that is nondeterministic, one whose unsafe step runs again after a
//! crash, and one whose unsafe step cannot be reconciled.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_core::db::steps::JournalEntry;
use agentq_core::state::{StepKind, StepStatus};
use agentq_worker::agent::AgentSpec;
use agentq_worker::model::{Message, ModelRequest, Role};
use agentq_worker::testing::{Check, ChildEnd, End, FakeTool, ModelScript, Tester, replay_journal};
use agentq_worker::{
    JobContext, JobError, ModelResponse, Reconciled, Registry, Replay, SignalOutcome, Tool,
    ToolContext, TypedTool,
};
use async_trait::async_trait;
use serde_json::{Value, json};

/// A kind that uses every kind of step: a model call, a safe step, an unsafe tool with a
/// reconcile, a sleep, a wait for a signal, two children and their join.
async fn full(ctx: JobContext, input: Value) -> Result<Value, JobError> {
    let answer = ctx.model("plan", ModelRequest::user("plan it")).await?;
    let n = ctx.step("count", || async { Ok(3) }).await?;
    let refund = ctx.registered_tool("refund").expect("registered");
    let refunded = ctx
        .tool(refund.as_ref(), json!({ "cents": input["cents"] }))
        .await?;
    ctx.sleep(Duration::from_secs(3600)).await?;
    let approved = match ctx
        .wait_for_signal("approval", Duration::from_secs(60))
        .await?
    {
        SignalOutcome::Received { payload, .. } => payload["approved"] == json!(true),
        SignalOutcome::TimedOut => false,
    };
    let a = ctx.spawn("child", json!({ "n": 1 })).await?;
    let b = ctx.spawn("child", json!({ "n": 2 })).await?;
    let children = ctx.join(&[a, b]).await?;
    Ok(json!({
        "plan": answer.content,
        "n": n,
        "refunded": refunded,
        "approved": approved,
        "children": children.iter().filter(|c| c.succeeded()).count(),
    }))
}

async fn child(_ctx: JobContext, input: Value) -> Result<Value, JobError> {
    Ok(input)
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register("full", full);
    r.register("child", child);
    r
}

fn refund_fake() -> FakeTool {
    FakeTool::new(
        "refund",
        Replay::Unsafe,
        |args| json!({ "refund": args["cents"] }),
    )
    .reconciles()
}

#[tokio::test]
async fn a_kind_that_keeps_every_rule_passes_at_every_crash_point() {
    let report = Tester::new(&registry(), "full", json!({ "cents": 500 }))
        .model(ModelScript::replies([ModelResponse::text("refund it")]))
        .fake_tool(refund_fake())
        .signal("approval", json!({ "approved": true }))
        .children(|_kind, input| ChildEnd::Succeeded(input.clone()))
        .run()
        .await;
    report.assert_ok();
    assert_eq!(
        report.output(),
        Some(&json!({
            "plan": "refund it", "n": 3, "refunded": { "refund": 500 },
            "approved": true, "children": 2
        }))
    );
    let names: Vec<&str> = report.steps.iter().map(|s| s.1.as_str()).collect();
    assert_eq!(
        names,
        [
            "plan",
            "count",
            "refund",
            "sleep",
            "signal:approval",
            "spawn:child",
            "spawn:child",
            "join"
        ]
    );
    // Before anything, after each write and after the refund's effect, at the least.
    assert!(report.crash_points >= 10, "{report}");
}

#[tokio::test]
async fn a_wait_without_its_signal_times_out_the_same_way_after_every_crash() {
    let report = Tester::new(&registry(), "full", json!({ "cents": 1 }))
        .fake_tool(refund_fake())
        .run()
        .await;
    report.assert_ok();
    assert_eq!(report.output().unwrap()["approved"], json!(false));
}

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// Branches on a counter the journal does not hold.
async fn nondeterministic(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    ctx.step("first", || async { Ok(1) }).await?;
    let name = if RUNS.fetch_add(1, Ordering::SeqCst) == 0 {
        "fetch"
    } else {
        "fetch_v2"
    };
    ctx.step(name, || async { Ok(2) }).await?;
    Ok(Value::Null)
}

#[tokio::test]
async fn a_nondeterministic_kind_fails_naming_the_step() {
    let mut r = Registry::new();
    r.register("nd", nondeterministic);
    let report = Tester::new(&r, "nd", json!({})).run().await;
    assert!(!report.is_ok());
    let found = report.found(Check::Nondeterminism);
    assert!(!found.is_empty(), "{report}");
    assert!(
        report.to_string().contains("fetch"),
        "the report names the step: {report}"
    );
}

/// A payments API that records every charge, and a tool whose reconcile looks in the wrong
/// place: it never finds the charge a crash interrupted.
#[derive(Default)]
struct Payments {
    charges: Mutex<Vec<String>>,
}

struct Charge(Arc<Payments>);

#[async_trait]
impl Tool for Charge {
    fn name(&self) -> &str {
        "charge"
    }

    fn replay(&self) -> Replay {
        Replay::Unsafe
    }

    async fn call(&self, cx: &ToolContext<'_>, _args: &Value) -> Result<Value, JobError> {
        self.0
            .charges
            .lock()
            .unwrap()
            .push(cx.idempotency_key().to_string());
        Ok(json!({ "charged": true }))
    }

    async fn reconcile(
        &self,
        _cx: &ToolContext<'_>,
        _args: &Value,
    ) -> Result<Reconciled, JobError> {
        // The bug: it asks by a key of its own, which never matches.
        Ok(Reconciled::NotHappened)
    }
}

async fn charge_once(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    let tool = ctx.registered_tool("charge").expect("registered");
    ctx.tool(tool.as_ref(), json!({})).await?;
    ctx.step("receipt", || async { Ok("sent".to_string()) })
        .await?;
    Ok(Value::Null)
}

#[tokio::test]
async fn a_kind_whose_completed_step_runs_again_fails_naming_the_step() {
    let payments = Arc::new(Payments::default());
    let mut r = Registry::new();
    r.register("charge_once", charge_once);
    r.register_tool(Charge(payments.clone()));
    let report = Tester::new(&r, "charge_once", json!({})).run().await;
    let again = report.found(Check::RanAgain);
    assert_eq!(again.len(), 1, "{report}");
    assert_eq!(again[0].step, "charge");
    assert_eq!(again[0].seq, Some(0));
    assert!(
        again[0].at.contains("after the effect of charge"),
        "{report}"
    );
    // The real tool saw it: in the timeline that crashed after the charge, the charge was made
    // again with the same key (every timeline is an operation of its own, with keys of its own).
    let charges = payments.charges.lock().unwrap().clone();
    let twice = charges
        .iter()
        .filter(|k| charges.iter().filter(|c| c == k).count() > 1)
        .count();
    assert_eq!(twice, 2, "one key charged twice: {charges:?}");
}

/// An email tool with no reconcile: after a crash that lost its outcome, nobody can tell
/// whether the email went out.
struct SendEmail;

#[async_trait]
impl TypedTool for SendEmail {
    const NAME: &str = "send_email";
    const REPLAY: Replay = Replay::Unsafe;
    type Args = Value;
    type Output = String;

    async fn call(&self, _cx: &ToolContext<'_>, _args: Value) -> Result<String, JobError> {
        Ok("sent".to_string())
    }
}

async fn unreconciled(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    ctx.call(&SendEmail, json!({})).await?;
    Ok(Value::Null)
}

#[tokio::test]
async fn an_unsafe_step_without_a_reconcile_fails_naming_the_step() {
    let mut r = Registry::new();
    r.register("unreconciled", unreconciled);
    let report = Tester::new(&r, "unreconciled", json!({})).run().await;
    let found = report.found(Check::NoReconcile);
    assert_eq!(found.len(), 1, "{report}");
    assert_eq!(found[0].step, "send_email");
    // The same tool with a reconcile passes.
    let mut r = Registry::new();
    r.register("charge_once", charge_once);
    let fake = FakeTool::new("charge", Replay::Unsafe, |_| json!({ "charged": true })).reconciles();
    Tester::new(&r, "charge_once", json!({}))
        .fake_tool(fake)
        .run()
        .await
        .assert_ok();
}

/// The agent loop with a registered tool behind an approval: a model that calls the tool,
/// then answers.
async fn support(ctx: JobContext, input: Value) -> Result<Value, JobError> {
    let refund = ctx.registered_tool("refund").expect("registered");
    let outcome = ctx
        .agent(AgentSpec {
            system: "You are support.".into(),
            messages: vec![Message::text(
                Role::User,
                input["ask"].as_str().unwrap_or(""),
            )],
            tools: vec![agentq_worker::tool::with_approval(refund)],
            max_turns: 4,
            approval_timeout: Duration::from_secs(3600),
            model: None,
            tool_choice: None,
        })
        .await?;
    Ok(json!({ "answer": outcome.answer, "calls": outcome.tool_calls }))
}

#[tokio::test]
async fn the_agent_loop_with_an_approved_tool_holds_at_every_crash_point() {
    let mut r = Registry::new();
    r.register("support", support);
    let report = Tester::new(&r, "support", json!({ "ask": "refund order 7" }))
        .model(ModelScript::replies([
            ModelResponse::tool_call("refund", json!({ "cents": 700 })),
            ModelResponse::text("Refunded."),
        ]))
        .fake_tool(refund_fake())
        .signal("approval", json!({ "approved": true }))
        .run()
        .await;
    report.assert_ok();
    assert_eq!(
        report.output(),
        Some(&json!({ "answer": "Refunded.", "calls": 1 }))
    );
}

fn entry(seq: i32, name: &str, output: Value) -> JournalEntry {
    JournalEntry {
        seq,
        name: name.into(),
        kind: StepKind::Custom,
        replay: Replay::Safe,
        status: StepStatus::Completed,
        output: Some(output),
        error: None,
        wake_at: None,
    }
}

async fn v1(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    ctx.step("fetch", || async { Ok(1) }).await?;
    ctx.step("summarize", || async { Ok(2) }).await?;
    Ok(Value::Null)
}

async fn v2(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    ctx.step("fetch", || async { Ok(1) }).await?;
    ctx.step("classify", || async { Ok(2) }).await?;
    ctx.step("summarize", || async { Ok(3) }).await?;
    Ok(Value::Null)
}

#[tokio::test]
async fn an_exported_journal_replays_against_new_code_without_running_anything() {
    let mut r = Registry::new();
    r.register_version("k", "1", v1);
    r.register_version("k", "2", v2);
    // Waiting after `fetch`: both versions agree so far.
    let journal = vec![entry(0, "fetch", json!(1))];
    let replay = replay_journal(&r, "k", "2", json!({}), journal).await;
    assert!(replay.agrees(), "{:?}", replay.outcome);
    // After `summarize` too: version 2 asks for `classify` where the journal has `summarize`.
    let journal = vec![entry(0, "fetch", json!(1)), entry(1, "summarize", json!(2))];
    let replay = replay_journal(&r, "k", "2", json!({}), journal.clone()).await;
    match &replay.outcome {
        End::Failed { class, message } => {
            assert_eq!(class, "nondeterminism");
            assert!(
                message.contains("classify") && message.contains("summarize"),
                "{message}"
            );
        }
        other => panic!("expected nondeterminism, got {other:?}"),
    }
    assert!(
        replay_journal(&r, "k", "1", json!({}), journal)
            .await
            .agrees()
    );
}

/// A kind that says what its wait needs, with a count of its runs in `about` (so a replay
/// that rewrote it would show a later count).
async fn asks(ctx: JobContext, input: Value) -> Result<Value, JobError> {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, Ordering::SeqCst);
    let about = json!({ "question": "refund this?", "cents": input["cents"], "run": run });
    match ctx
        .wait_for_signal_about("approval", Duration::from_secs(60), about)
        .await?
    {
        SignalOutcome::Received { payload, .. } => Ok(payload),
        SignalOutcome::TimedOut => Ok(json!("timed out")),
    }
}

#[tokio::test]
async fn a_waits_about_is_journaled_with_the_wait_and_shown_by_the_tester() {
    let mut r = Registry::new();
    r.register("asks", asks);
    let report = Tester::new(&r, "asks", json!({ "cents": 700 }))
        .signal("approval", json!({ "approved": true }))
        .run()
        .await;
    report.assert_ok();
    assert_eq!(report.output(), Some(&json!({ "approved": true })));
    assert_eq!(report.waits.len(), 1, "{:?}", report.waits);
    let (seq, name, about) = &report.waits[0];
    assert_eq!((*seq, name.as_str()), (0, "approval"));
    assert_eq!(about["question"], "refund this?");
    assert_eq!(about["cents"], 700);
}

async fn refuses(_ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    Err(JobError::NonRetryable("the input names no customer".into()))
}

#[tokio::test]
async fn a_run_that_fails_is_not_ok_even_with_no_problem_found() {
    let mut r = Registry::new();
    r.register("refuses", refuses);
    let report = Tester::new(&r, "refuses", json!({})).run().await;
    assert!(report.violations.is_empty(), "{report}");
    assert!(!report.is_ok(), "{report}");
    let caught = std::panic::catch_unwind(|| report.assert_ok());
    assert!(caught.is_err(), "assert_ok passed a failed run: {report}");
}

/// Payments made by `pay`, by idempotency key: the outside system a kind's unsafe step calls.
static PAID: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Pays once through `ctx.unsafe_step` (recorded in `PAID` by the step's key) with `reconcile`
/// as the step's reconcile, then writes a receipt; returns what the step returned.
async fn pay_with<R, F>(ctx: JobContext, reconcile: R) -> Result<Value, JobError>
where
    R: FnOnce(String) -> F + Send,
    F: std::future::Future<Output = Result<Option<String>, JobError>> + Send,
{
    let pay = |key: String| async move {
        PAID.lock().unwrap().push(key.clone());
        Ok(key)
    };
    let paid = ctx.unsafe_step("pay", pay, reconcile).await?;
    ctx.step("receipt", || async { Ok(1) }).await?;
    Ok(json!(paid))
}

/// Pays, its reconcile asking the payments by the step's key.
async fn pay(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    pay_with(ctx, |key| async move {
        Ok(PAID.lock().unwrap().contains(&key).then_some(key))
    })
    .await
}

/// The same, with a reconcile that never finds the payment (it asks by another key).
async fn pay_blind(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    pay_with(ctx, |_key| async move { Ok(None) }).await
}

/// The same, with a reconcile that always says the payment happened.
async fn pay_lying(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    pay_with(ctx, |key| async move { Ok(Some(key)) }).await
}

/// The same, with a reconcile that finds the payment but answers another output.
async fn pay_misreported(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    pay_with(ctx, |key| async move {
        let found = PAID.lock().unwrap().contains(&key);
        Ok(found.then(|| "a payment".to_string()))
    })
    .await
}

#[tokio::test]
async fn a_reconcile_that_answers_other_than_what_happened_fails_naming_the_step() {
    let mut r = Registry::new();
    r.register("pay_lying", pay_lying);
    r.register("pay_misreported", pay_misreported);
    let report = Tester::new(&r, "pay_lying", json!({})).run().await;
    let wrong = report.found(Check::WrongReconcile);
    assert_eq!(wrong.len(), 1, "{report}");
    assert_eq!((wrong[0].step.as_str(), wrong[0].seq), ("pay", Some(0)));
    assert!(
        wrong[0].at.contains("was written started"),
        "the crash between the started row and the effect: {report}"
    );
    assert!(!report.is_ok());
    let report = Tester::new(&r, "pay_misreported", json!({})).run().await;
    let wrong = report.found(Check::WrongReconcile);
    assert_eq!(wrong.len(), 1, "{report}");
    assert!(wrong[0].message.contains("another output"), "{report}");
}

#[tokio::test]
async fn an_unsafe_step_with_closures_is_checked_like_a_tool() {
    let mut r = Registry::new();
    r.register("pay", pay);
    r.register("pay_blind", pay_blind);
    Tester::new(&r, "pay", json!({})).run().await.assert_ok();
    let report = Tester::new(&r, "pay_blind", json!({})).run().await;
    let again = report.found(Check::RanAgain);
    assert_eq!(again.len(), 1, "{report}");
    assert_eq!(again[0].step, "pay");
    assert!(!report.is_ok(), "{report}");
}

/// Keys whose payment answered with a timeout, though it went through.
static TIMED_OUT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Pays, and the first answer for each key is lost after the payment went through (a
/// timeout): the step is left unknown and its honest reconcile finds the payment.
async fn pay_timing_out(ctx: JobContext, _input: Value) -> Result<Value, JobError> {
    let paid = ctx
        .unsafe_step(
            "pay",
            |key| async move {
                PAID.lock().unwrap().push(key.clone());
                let mut timed_out = TIMED_OUT.lock().unwrap();
                if !timed_out.contains(&key) {
                    timed_out.push(key);
                    return Err(JobError::retryable("the payments API timed out"));
                }
                Ok(key)
            },
            |key| async move { Ok(PAID.lock().unwrap().contains(&key).then_some(key)) },
        )
        .await?;
    Ok(json!(paid))
}

#[tokio::test]
async fn an_honest_reconcile_after_a_body_that_failed_is_not_wrong() {
    let mut r = Registry::new();
    r.register("pay_timing_out", pay_timing_out);
    Tester::new(&r, "pay_timing_out", json!({}))
        .run()
        .await
        .assert_ok();
}
