//! Pause and resume: an operator holds live work without cancelling it. A paused operation is
//! not claimed; a running one stops at its next step boundary with its journal kept and its
//! attempt given back; resuming dispatches what was held.

use std::time::Duration;

use agentq_core::Lane;
use agentq_core::broker;
use agentq_testkit::fake_model::{FakeModel, Mode};
use serde_json::{Value, json};

use crate::harness::{DEADLINE, TestApp};

/// Operations of `kind` in `status`.
async fn count(app: &TestApp, kind: &str, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM operations WHERE kind = $1 AND status = $2")
        .bind(kind)
        .bind(status)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// Each operation of `kind`'s (id, epoch): an epoch moves on every claim.
async fn epochs(app: &TestApp, kind: &str) -> Vec<(uuid::Uuid, i64)> {
    sqlx::query_as("SELECT id, epoch FROM operations WHERE kind = $1 ORDER BY id")
        .bind(kind)
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

/// Enqueues an `echo` and waits for it to succeed: the workers are claiming and running work
/// right now, so whatever they left alone meanwhile was left alone on purpose.
async fn probe(app: &TestApp) {
    let op = app.enqueue_echo("probe");
    app.wait_status(&op, "succeeded", DEADLINE).await;
}

/// [`probe`] with a `script` of one short step (where `echo` would call a held fake model).
async fn probe_script(app: &TestApp) {
    let op = app.enqueue_script(json!([{ "work_ms": 1 }]), &[]);
    app.wait_status(&op, "succeeded", DEADLINE).await;
}

/// 500 operations of an unsafe-effect script across 3 workers, paused by kind mid-run: nothing
/// of the kind is claimed while paused, the running ones stop at a step boundary with their
/// attempt given back and their journal kept, and after resume every one succeeds on its first
/// attempt with its unsafe effect made exactly once.
#[tokio::test]
async fn pausing_a_kind_mid_run_holds_it_and_resume_finishes_every_operation_once() {
    let mut app = TestApp::start().await;
    // Heartbeats every second, so running work learns of the pause quickly.
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    // Four processes of small pools: the tests running beside this one need connections too
    // (PostgreSQL's default max_connections is 100).
    app.set_env("AGENTQ_DB_POOL", "6");
    app.spawn(&["scheduler"]);
    // 48 slots in all, so the kind is still mid-run when the pause comes whatever the speed.
    for _ in 0..3 {
        app.spawn(&["worker", "--concurrency", "16"]);
    }
    // A long first step: most running operations are inside it when the pause comes, and stop
    // at the boundary after it.
    let program = |i: usize| {
        json!({ "steps": [
            { "work_ms": 2000 },
            { "tool": "ledger", "replay": "unsafe", "label": format!("effect-{i}") },
            { "work_ms": 300 },
            { "work_ms": 300 },
        ] })
    };
    let ops = app
        .enqueue_many("script", Lane::Interactive, (0..500).map(program))
        .await;
    assert_eq!(ops.len(), 500);
    app.wait_for("50 operations to succeed", DEADLINE, || async {
        count(&app, "script", "succeeded").await >= 50
    })
    .await;

    let dry = app.agentq_json(&[
        "pause",
        "--kind",
        "script",
        "--reason",
        "load test",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(dry["dry_run"], true);
    assert!(dry["pause"].is_null(), "a dry run makes no pause: {dry}");
    let listed = app.agentq(&["pauses", "--json"]);
    assert!(listed.stdout.is_empty(), "a dry run wrote nothing");

    let paused = app.agentq_json(&[
        "pause",
        "--kind",
        "script",
        "--reason",
        "load test",
        "--json",
    ]);
    assert_eq!(paused["created"], true, "{paused}");
    let held = &paused["operations"];
    let total: i64 = ["queued", "sleeping", "waiting", "running"]
        .iter()
        .map(|s| held[s].as_i64().unwrap())
        .sum();
    assert!(total > 0, "the pause came mid-run: {paused}");

    // Every running operation of the kind stops at its next step boundary.
    let long = Duration::from_secs(90);
    app.wait_for("no script operation to run", long, || async {
        count(&app, "script", "running").await == 0
    })
    .await;
    let before = epochs(&app, "script").await;
    probe(&app).await;
    probe(&app).await;
    assert_eq!(
        epochs(&app, "script").await,
        before,
        "nothing of the paused kind was claimed while other work ran"
    );
    let unfinished: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT o.attempt, (SELECT count(*) FROM operation_steps s
                             WHERE s.op_id = o.id AND s.status = 'completed')
           FROM operations o WHERE o.kind = 'script' AND o.status <> 'succeeded'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert!(!unfinished.is_empty(), "the pause held work back");
    assert!(
        unfinished.iter().all(|(attempt, _)| *attempt == 0),
        "a paused operation used no attempt: {unfinished:?}"
    );
    assert!(
        unfinished.iter().any(|(_, steps)| *steps > 0),
        "some were stopped mid-run, their finished steps kept: {unfinished:?}"
    );

    let resumed = app.agentq_json(&["resume", "--kind", "script", "--reason", "done", "--json"]);
    assert_eq!(
        resumed["freed"]["queued"].as_i64().unwrap(),
        unfinished.len() as i64,
        "{resumed}"
    );
    app.wait_for("every script operation to succeed", long, || async {
        count(&app, "script", "succeeded").await == 500
    })
    .await;
    let (attempts, effects): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM operations WHERE kind = 'script' AND attempt <> 1),
                (SELECT count(*) FROM ledger_effects)",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        attempts, 0,
        "every operation succeeded on its first attempt"
    );
    assert_eq!(effects, 500, "each unsafe effect happened exactly once");
    let audit: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE action IN ('pause', 'resume')",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audit, 2, "the pause and the resume are audited");
    app.cleanup().await;
}

/// The race of a step finishing just after the pause, forced: the step's model call is held
/// by the fake provider until the worker's heartbeat has seen the pause, then let go. The
/// operation stops at the boundary after that step (journaled, never flipped back to running,
/// its attempt given back), is not claimed while paused, and after resume finishes without the
/// model being asked that turn again. A second operation whose last step is the one in flight
/// simply succeeds: nothing after the step is left to stop.
#[tokio::test]
async fn a_step_finishing_just_after_the_pause_is_kept_and_the_run_stops_at_that_boundary() {
    let fake = FakeModel::start(Mode::Echo).await;
    let gate = fake.hold_requests();
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let op = app.enqueue_script(
        json!([{ "model": "first" }, { "work_ms": 10 }, { "model": "second" }]),
        &[],
    );
    let last = app.enqueue_script(json!([{ "model": "only" }]), &[]);
    app.wait_for("both model calls to be in flight", DEADLINE, || async {
        fake.requests() == 2
    })
    .await;
    app.agentq_ok(&["pause", &op, "--reason", "hold it"]);
    app.agentq_ok(&["pause", &last, "--reason", "hold it too"]);
    for op in [&op, &last] {
        two_renewals(&app.pool, op).await;
    }
    assert_eq!(app.operation(&op).await.status.as_str(), "running");
    gate.add_permits(2);

    let v = app.wait_status(&op, "queued", DEADLINE).await;
    assert_eq!(v.attempt, 0, "the paused run's attempt was given back");
    app.wait_status(&last, "succeeded", DEADLINE).await;
    let steps = app.agentq_json_lines(&["steps", &op, "--json"]);
    let completed: Vec<&Value> = steps
        .iter()
        .filter(|s| s["status"] == "completed")
        .collect();
    assert_eq!(
        completed.len(),
        1,
        "the step in flight at the pause is journaled, and nothing after it ran: {steps:?}"
    );
    // `agentq why` names the pause, who made it and why.
    let why = app.agentq_json(&["why", &op, "--json"]);
    assert_eq!(why["detail"]["reason"], "paused", "{why}");
    assert_eq!(why["detail"]["pause"]["reason"], "hold it", "{why}");
    let text = String::from_utf8_lossy(&app.agentq_ok(&["why", &op]).stdout).to_string();
    assert!(
        text.contains("paused") && text.contains("hold it"),
        "{text}"
    );
    let before = app.operation(&op).await;
    probe_script(&app).await;
    let after = app.operation(&op).await;
    assert_eq!(
        (after.status.as_str(), after.attempt),
        ("queued", 0),
        "not claimed while paused"
    );
    assert_eq!(
        before.updated_at, after.updated_at,
        "untouched while paused"
    );

    let resumed = app.agentq_json(&["resume", &op, "--json"]);
    assert_eq!(resumed["redispatched"], 1, "{resumed}");
    gate.add_permits(1);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.attempt, 1, "paused and resumed, it ran on one attempt");
    assert_eq!(
        fake.requests(),
        3,
        "the journaled turn was not sent again; only the second model step was"
    );
    app.cleanup().await;
}

/// Every scope a pause takes, its refusals, and the API: a tenant's pause holds only that
/// tenant, a producer may not pause, an operator may not pause another tenant, a pause with
/// no reason or naming nothing is refused and writes nothing, and `--all` (drain mode) holds
/// every new operation until resumed.
#[tokio::test]
async fn pauses_hold_their_scope_refuse_bad_requests_and_drain_mode_holds_everything() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    let worker = app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let http = reqwest::Client::new();
    let operator_t2 = app.token("t2", "operator");
    let producer_t1 = app.token("t1", "producer");
    let post = |path: String, token: &str, body: Value| {
        http.post(format!("{base}{path}"))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let get = |path: String, token: &str| {
        let sent = http.get(format!("{base}{path}")).bearer_auth(token).send();
        async move { sent.await.unwrap().json::<Value>().await.unwrap() }
    };

    // Refusals change nothing.
    for (token, body, status) in [
        (
            &producer_t1,
            json!({ "scope": { "tenant": "t1" }, "reason": "x" }),
            403,
        ),
        (
            &operator_t2,
            json!({ "scope": { "tenant": "t1" }, "reason": "x" }),
            403,
        ),
        (
            &operator_t2,
            json!({ "scope": { "kind": "echo" }, "reason": " " }),
            422,
        ),
        (&operator_t2, json!({ "scope": {}, "reason": "x" }), 422),
        (
            &operator_t2,
            json!({ "scope": { "kind": "echo", "everything": true }, "reason": "x" }),
            422,
        ),
        (
            &operator_t2,
            json!({ "scope": { "lane": "sideways" }, "reason": "x" }),
            422,
        ),
    ] {
        let r = post("/v1/pauses".into(), token, body.clone())
            .await
            .unwrap();
        assert_eq!(
            r.status().as_u16(),
            status,
            "{body}: {}",
            r.text().await.unwrap()
        );
    }
    // A schedule by its name: an unknown one is refused naming the field; a known one is
    // paused by its id.
    let schedule = post(
        "/v1/schedules".into(),
        &operator_t2,
        json!({ "name": "hourly", "kind": "echo", "input": { "text": "s" },
                "interval_secs": 3600 }),
    )
    .await
    .unwrap()
    .json::<Value>()
    .await
    .unwrap()["schedule_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = post(
        "/v1/pauses".into(),
        &operator_t2,
        json!({ "scope": { "schedule": "no-such" }, "reason": "x" }),
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let said: Value = r.json().await.unwrap();
    assert_eq!(
        (&said["detail"], &said["field"]),
        (
            &json!("no schedule named \"no-such\""),
            &json!("/scope/schedule")
        ),
        "{said}"
    );
    let dry = post(
        "/v1/pauses".into(),
        &operator_t2,
        json!({ "scope": { "schedule": "hourly" }, "reason": "x", "dry_run": true }),
    )
    .await
    .unwrap()
    .json::<Value>()
    .await
    .unwrap();
    assert_eq!(dry["dry_run"], true, "{dry}");
    let by_cli = app.agentq_json(&[
        "pause",
        "--schedule",
        "hourly",
        "--tenant",
        "t2",
        "--reason",
        "x",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(by_cli["dry_run"], true, "{by_cli}");
    // Another tenant's operator does not find it by name.
    let operator_t1 = app.token("t1", "operator");
    let r = post(
        "/v1/pauses".into(),
        &operator_t1,
        json!({ "scope": { "schedule": "hourly" }, "reason": "x" }),
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let held = post(
        "/v1/pauses".into(),
        &operator_t2,
        json!({ "scope": { "schedule": "hourly" }, "reason": "schedule incident" }),
    )
    .await
    .unwrap()
    .json::<Value>()
    .await
    .unwrap();
    assert_eq!(
        held["pause"]["scope"],
        json!({ "tenant": "t2", "schedule_id": schedule }),
        "{held}"
    );
    let pause_id = held["pause"]["pause_id"].as_str().unwrap().to_string();
    let r = post(
        format!("/v1/pauses/{pause_id}/resume"),
        &operator_t2,
        json!({}),
    )
    .await
    .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    app.agentq_ok(&["schedules", "delete", "hourly", "--tenant", "t2"]);

    let refused = app.agentq(&["pause", "--reason", "nothing named"]);
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("name what to pause"), "{said}");
    let pauses: i64 = sqlx::query_scalar("SELECT count(*) FROM pauses")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        pauses, 0,
        "no refused request wrote a pause (the schedule's was resumed)"
    );

    // A tenant's pause holds that tenant only: t2's operator pauses t2.
    let paused = post(
        "/v1/pauses".into(),
        &operator_t2,
        json!({ "scope": { "everything": true }, "reason": "t2 incident" }),
    )
    .await
    .unwrap();
    assert_eq!(paused.status().as_u16(), 200);
    let paused: Value = paused.json().await.unwrap();
    assert_eq!(
        paused["pause"]["scope"],
        json!({ "tenant": "t2" }),
        "{paused}"
    );
    let t2 = app.agentq_json(&[
        "enqueue",
        "--tenant",
        "t2",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"t2"}"#,
        "--json",
    ])["op_id"]
        .as_str()
        .unwrap()
        .to_string();
    probe(&app).await; // t1 runs
    app.wait_for("t2's pointer to be refused", DEADLINE, || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT dispatched_at IS NOT NULL FROM operations WHERE id = $1::uuid",
        )
        .bind(t2.as_str())
        .fetch_one(&app.pool)
        .await
        .unwrap()
    })
    .await;
    probe(&app).await;
    assert_eq!(app.operation(&t2).await.status.as_str(), "queued");
    let why = get(format!("/v1/operations/{t2}/why"), &operator_t2).await;
    assert_eq!(why["detail"]["reason"], "paused", "{why}");
    assert_eq!(
        why["detail"]["pause"]["scope"],
        json!({ "tenant": "t2" }),
        "{why}"
    );
    let listed = get("/v1/pauses".into(), &operator_t2).await;
    let id = listed["items"][0]["pause_id"].as_str().unwrap().to_string();
    let r = post(format!("/v1/pauses/{id}/resume"), &operator_t2, json!({}))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    app.wait_status(&t2, "succeeded", DEADLINE).await;

    // Drain mode: an admin's pause of everything holds every new operation. The worker takes
    // the pointer (the queue empties) and then stops: had it not acked the pointer, it would
    // be back in the queue; acked with the operation still queued means the claim refused it.
    app.agentq_ok(&["pause", "--all", "--reason", "maintenance"]);
    let held = app.enqueue_echo("held");
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let names = app.names();
    let depth = || async {
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap()
    };
    app.wait_for("the worker to take the pointer", DEADLINE, || async {
        depth().await == 0
    })
    .await;
    app.signal(worker, "TERM");
    assert!(app.wait_exit(worker, DEADLINE).await, "the worker stops");
    assert_eq!(
        depth().await,
        0,
        "the refused pointer was acked, not returned"
    );
    let v = app.operation(&held).await;
    assert_eq!(
        (v.status.as_str(), v.attempt),
        ("queued", 0),
        "never claimed"
    );
    let again = app.agentq_json(&["pause", "--all", "--reason", "again", "--json"]);
    assert_eq!(
        again["created"], false,
        "pausing twice finds the pause in force"
    );
    let lines = app.agentq_json_lines(&["pauses", "--json"]);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["reason"], "maintenance");
    app.spawn(&["worker"]);
    let resumed = app.agentq_json(&["resume", "--all", "--json"]);
    assert_eq!(resumed["redispatched"], 1, "{resumed}");
    app.wait_status(&held, "succeeded", DEADLINE).await;
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

/// A retry waiting out its delay, paused and resumed meanwhile, runs when it is due: not
/// before, and not a minute late. Its pointer is sent when it is due, by the dispatch sweep;
/// sent at the resume, a claim dropped it as not due and the mark hid it from the sweep.
#[tokio::test]
async fn a_retry_paused_and_resumed_during_its_delay_runs_when_it_is_due() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let op = app.enqueue_script(
        json!([{ "fail": "retryable", "times": 1, "not_before_ms": 6000 }]),
        &[],
    );
    let run_at = app
        .wait_until("the retry's delay", DEADLINE, || async {
            let v = app.operation(&op).await;
            (v.status.as_str() == "queued" && v.attempt == 1).then_some(v.run_at)
        })
        .await;
    app.agentq_ok(&["pause", &op, "--reason", "look first"]);
    let resumed = app.agentq_json(&["resume", &op, "--json"]);
    assert!(
        chrono::Utc::now() < run_at,
        "resumed within the delay, or this test tests nothing: {resumed}"
    );
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert!(
        done.finished_at.unwrap() >= run_at,
        "not run before it was due"
    );
    assert_eq!(done.attempt, 2);
    app.cleanup().await;
}

/// Waits for two renewals of `op`'s lease after this call: the second began after whatever
/// committed before it (a pause), so the worker's heartbeat has seen that.
pub(crate) async fn two_renewals(pool: &sqlx::PgPool, op: &str) {
    let lease = || async {
        sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
            "SELECT lease_expires_at FROM operations WHERE id = $1::uuid",
        )
        .bind(op)
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut seen = lease().await;
    for _ in 0..2 {
        let was = seen;
        while seen == was {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for a lease renewal of {op}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            seen = lease().await;
        }
    }
}
