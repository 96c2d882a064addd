//! The walking skeleton: enqueue, idempotency, refusals, duplicate pointers, claim races,
//! claim-before-call, dispatch recovery, migrations.

use std::sync::Arc;
use std::time::Duration;

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};
use agentq_core::broker::{self, Publisher};
use agentq_core::db;
use agentq_core::operation::{Lane, OperationId, Pointer};
use agentq_producer::EnqueueRequest;
use agentq_worker::{JobContext, JobError, LocalModel, Worker};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn enqueued_echo_runs_to_succeeded_with_its_output() {
    let mut app = TestApp::start().await;
    app.spawn(&["worker"]);
    let op = app.enqueue_echo("hello agentq");

    app.wait_status(&op, "succeeded", DEADLINE).await;
    let status = app.agentq_json(&["status", &op, "--json"]);
    assert_eq!(status["status"], "succeeded");
    assert_eq!(status["result"], json!({ "text": "hello agentq" }));
    assert_eq!(status["attempt"], 1);
    assert!(status["finished_at"].is_string());

    let out = app.agentq(&["steps", &op, "--json"]);
    assert!(out.status.success());
    let steps: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 1, "echo journals exactly one model step");
    assert_eq!(steps[0]["kind"], "model");
    assert_eq!(steps[0]["status"], "completed");
    assert_eq!(steps[0]["idempotency_key"].as_str().unwrap().len(), 64);
    app.cleanup().await;
}

#[tokio::test]
async fn same_key_returns_the_same_operation_and_different_input_is_refused() {
    let app = TestApp::start().await;
    let args = |text: &str| {
        vec![
            "enqueue".to_string(),
            "--tenant".into(),
            "t1".into(),
            "--kind".into(),
            "echo".into(),
            "--input".into(),
            json!({ "text": text }).to_string(),
            "--key".into(),
            "order-42".into(),
            "--json".into(),
        ]
    };
    let run = |a: Vec<String>| app.agentq(&a.iter().map(String::as_str).collect::<Vec<_>>());

    let first: Value = serde_json::from_slice(&run(args("a")).stdout).unwrap();
    assert_eq!(first["created"], true);
    let again: Value = serde_json::from_slice(&run(args("a")).stdout).unwrap();
    assert_eq!(again["created"], false);
    assert_eq!(again["op_id"], first["op_id"]);

    let conflict = run(args("b"));
    assert_eq!(conflict.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&conflict.stderr);
    assert!(
        stderr.contains("order-42") && stderr.contains("different input"),
        "{stderr}"
    );
    assert_eq!(
        app.operation_count().await,
        1,
        "a refused enqueue writes nothing"
    );

    // The key is scoped per tenant: another tenant may use it for its own operation.
    let other = app.agentq_json(&[
        "enqueue",
        "--tenant",
        "t2",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"b"}"#,
        "--key",
        "order-42",
        "--json",
    ]);
    assert_eq!(other["created"], true);
    assert_ne!(other["op_id"], first["op_id"]);
    app.cleanup().await;
}

#[tokio::test]
async fn bad_input_is_refused_with_exit_code_2_and_writes_nothing() {
    let app = TestApp::start().await;
    // (tenant, kind, input, further flags, what the refusal must say)
    let cases: [(&str, &str, &str, &[&str], &str); 11] = [
        ("t1", "echo", "{not json", &[], "not valid JSON"),
        ("t1", "nope", "{}", &[], "unknown kind"),
        (
            "",
            "echo",
            r#"{"text":"x"}"#,
            &[],
            "tenant must not be empty",
        ),
        ("t1", "echo", r#"{"txt":"x"}"#, &[], "does not fit kind"),
        ("t1", "echo", r#"{"text":"x"}"#, &["--lane", "fast"], "lane"),
        (
            "t1",
            "echo",
            r#"{"text":"x"}"#,
            &["--key", "webhook:tracker:evt_2"],
            "--key: keys starting with \"webhook:\" are agentq's own",
        ),
        // Durations and times at the edges: refused by name, never a panic (exit 101).
        (
            "t1",
            "echo",
            r#"{"text":"x"}"#,
            &["--deadline", "100000000d"],
            "--deadline \"100000000d\" is outside the years",
        ),
        (
            "t1",
            "script",
            r#"{"steps":[{"sleep_ms":18446744073709551615}]}"#,
            &[],
            "steps[0].sleep_ms",
        ),
        (
            "t1",
            "script",
            r#"{"steps":[{"work_ms":0},{"wait_signal":"go","timeout_ms":9999999999999999}]}"#,
            &[],
            "steps[1].timeout_ms",
        ),
        (
            "t1",
            "agent",
            r#"{"user":"x","approval_timeout_s":18446744073709551615}"#,
            &[],
            "approval_timeout_s",
        ),
        // A field missing from a step: its place and its name, never a serde internal.
        (
            "t1",
            "script",
            r#"{"steps":[{"work_ms":0},{"fail":"retryable"}]}"#,
            &[],
            r#"steps[1]: a "fail" step needs "times""#,
        ),
    ];
    for (tenant, kind, input, extra, expected) in cases {
        let mut args = vec![
            "enqueue", "--tenant", tenant, "--kind", kind, "--input", input,
        ];
        args.extend_from_slice(extra);
        let out = app.agentq(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?} should be refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(expected),
            "{args:?}: expected {expected:?} in {stderr}"
        );
    }
    assert_eq!(app.operation_count().await, 0);
    let out = app.agentq(&["status", "not-an-id"]);
    assert_eq!(out.status.code(), Some(2));
    for since in [
        "100000000d",
        "99999999999999999999999d",
        "0001-01-01T00:00:00Z",
    ] {
        for args in [
            vec!["dlq", "list", "--since", since],
            vec!["usage", "--since", since],
        ] {
            let out = app.agentq(&args);
            assert_eq!(out.status.code(), Some(2), "{args:?}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains("--since"), "{args:?}: {stderr}");
        }
    }
    app.cleanup().await;
}

#[tokio::test]
async fn the_same_pointer_published_five_times_runs_the_job_once() {
    let mut app = TestApp::start().await;
    let op = app.enqueue_echo("once");
    // Four more copies of the same pointer, as a retrying publisher or a redelivery would make.
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let publisher = Publisher::open(&conn, app.names()).await.unwrap();
    let pointer = Pointer::new(OperationId::parse(&op).unwrap(), "t1", "echo");
    for _ in 0..4 {
        publisher
            .publish(&pointer, Lane::Interactive)
            .await
            .unwrap();
    }
    app.spawn(&["worker"]);

    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    // Every copy must be consumed (acked) before judging.
    let names = app.names();
    app.wait_for("the queue to drain", DEADLINE, || async {
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap()
            == 0
    })
    .await;
    let epoch: i64 = sqlx::query_scalar("SELECT epoch FROM operations WHERE id = $1::uuid")
        .bind(&op)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(epoch, 1, "exactly one claim");
    assert_eq!(done.attempt, 1);
    let steps = db::steps::list_steps(&app.pool, done.op_id.0, None)
        .await
        .unwrap();
    assert_eq!(steps.len(), 1);
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

/// An operation's status, epoch (one per claim) and attempt.
async fn claim_state(app: &TestApp, op: &str) -> (String, i64, i32) {
    sqlx::query_as("SELECT status, epoch, attempt FROM operations WHERE id = $1::uuid")
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn two_workers_racing_for_one_operation_claim_it_once() {
    // The operation's first step is a model call the fake provider holds at a gate, so its
    // claim is held (running, epoch 1, lease renewed) for as long as the test wants.
    let fake = FakeModel::start(Mode::Echo).await;
    let (open_gate, gate) = tokio::sync::watch::channel(false);
    fake.set_hook(Arc::new(move |_| {
        let mut gate = gate.clone();
        Box::pin(async move {
            let _ = gate.wait_for(|open| *open).await;
        })
    }));
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let workers = [app.spawn_logged(&["worker"]), app.spawn_logged(&["worker"])];
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let publisher = Publisher::open(&conn, app.names()).await.unwrap();
    // A pointer to no operation is rejected (and logged with its id) by the worker it reaches,
    // after every delivery that came before it on that worker has been claimed or refused.
    const REJECTED: &str = "rejecting a pointer to an unknown operation";
    let publish_stray = || async {
        let id = uuid::Uuid::new_v4();
        let stray = Pointer::new(OperationId(id), "t1", "script");
        publisher.publish(&stray, Lane::Interactive).await.unwrap();
        id
    };
    // Both workers consume before the race starts: strays until each has rejected one.
    app.wait_for("both workers to consume", DEADLINE, || async {
        publish_stray().await;
        workers.iter().all(|&w| app.log(w).contains(REJECTED))
    })
    .await;

    let op = app.enqueue_script(
        json!([{ "model": "gate" }, { "tool": "ledger", "replay": "unsafe", "label": "raced" }]),
        &[],
    );
    app.wait_for("the claim to reach the gate", DEADLINE, || async {
        fake.requests() == 1
    })
    .await;
    // While the claim is held, duplicates of its pointer go round-robin to both workers, and
    // strays after them; once every stray is rejected, each worker has tried its duplicates.
    let pointer = Pointer::new(OperationId::parse(&op).unwrap(), "t1", "script");
    for _ in 0..4 {
        publisher
            .publish(&pointer, Lane::Interactive)
            .await
            .unwrap();
    }
    let mut strays = Vec::new();
    for _ in 0..4 {
        strays.push(publish_stray().await.to_string());
    }
    app.wait_for("the duplicates to be refused", DEADLINE, || async {
        let logs: String = workers.iter().map(|&w| app.log(w)).collect();
        strays.iter().all(|id| logs.contains(id.as_str()))
    })
    .await;
    for w in workers {
        let log = app.log(w);
        assert!(
            strays.iter().any(|id| log.contains(id.as_str())),
            "worker {w} took part in the race: {log}"
        );
    }
    assert_eq!(
        claim_state(&app, &op).await,
        ("running".to_string(), 1, 1),
        "the duplicates claimed nothing while the first claim held the operation"
    );
    assert_eq!(fake.requests(), 1, "no second execution reached the model");

    open_gate.send(true).unwrap();
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        claim_state(&app, &op).await,
        ("succeeded".to_string(), 1, 1),
        "exactly one claim across both workers"
    );
    assert_eq!(fake.requests(), 1, "one model call");
    assert_eq!(app.effects(&op).await, 1, "the unsafe step ran once");

    // The claim statement itself, raced by 8 concurrent claimers on a fresh operation.
    for w in workers {
        app.kill(w);
    }
    let fresh = app.enqueue_echo("race again");
    let id = OperationId::parse(&fresh).unwrap().0;
    let claims = futures_util::future::join_all((0..8).map(|i| {
        let pool = app.pool.clone();
        async move {
            let echo = db::versions::Runnable::at_default(&["echo"]);
            db::claim::claim_operations(
                &pool,
                &[id],
                &echo,
                &format!("racer-{i}"),
                Duration::from_secs(30),
            )
            .await
            .unwrap()
            .len()
        }
    }))
    .await;
    assert_eq!(claims.iter().sum::<usize>(), 1, "one winner: {claims:?}");
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

/// What a job saw of its own row, through a separate connection, before doing anything.
#[derive(serde::Serialize, serde::Deserialize)]
struct Observed {
    status: String,
    epoch: i64,
    lease_owner: Option<String>,
    lease_in_future: bool,
}

/// A worker in this test's process running `registry`'s kinds, 4 interactive slots.
fn in_process_worker(
    app: &TestApp,
    registry: agentq_worker::Registry,
    lease_ttl: Duration,
) -> Worker {
    Worker::new(
        worker_settings(app, lease_ttl),
        app.pool.clone(),
        registry,
        Arc::new(LocalModel),
    )
}

/// The settings of a worker in a test's process: 4 interactive slots and 1 batch slot, no fair
/// shares, a model that answers locally.
pub(crate) fn worker_settings(app: &TestApp, lease_ttl: Duration) -> agentq_worker::Settings {
    agentq_worker::Settings {
        amqp_url: app.amqp_url.clone(),
        namespace: app.namespace.clone(),
        lease_ttl,
        concurrency_interactive: 4,
        concurrency_batch: 1,
        shutdown_grace: Duration::from_secs(5),
        gate: Default::default(),
        http_allow: Default::default(),
        job_limits: Default::default(),
        tenant_share: 1.0,
        tenant_share_grace: Duration::from_secs(5),
    }
}

#[tokio::test]
async fn the_job_function_runs_only_after_running_is_committed() {
    let app = TestApp::start().await;
    let observer = app.pool.clone();
    let mut registry = agentq_kinds::registry();
    registry.register("observe", move |ctx: JobContext, _input: Value| {
        let observer = observer.clone();
        async move {
            // A different connection sees only committed state: this is the claim as committed.
            let row: (String, i64, Option<String>, bool) = sqlx::query_as(
                "SELECT status, epoch, lease_owner, lease_expires_at > now()
                   FROM operations WHERE id = $1",
            )
            .bind(ctx.info().op_id.0)
            .fetch_one(&observer)
            .await
            .map_err(|e| JobError::NonRetryable(e.to_string()))?;
            Ok::<_, JobError>(Observed {
                status: row.0,
                epoch: row.1,
                lease_owner: row.2,
                lease_in_future: row.3,
            })
        }
    });
    let kinds = registry.clone();
    let worker = in_process_worker(&app, registry, Duration::from_secs(30));
    let owner = worker.owner().to_string();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));

    let (producer, dispatcher) = app.producer_with(kinds);
    let op = producer
        .enqueue(EnqueueRequest {
            tenant: "t1".into(),
            kind: "observe".into(),
            input: json!({}),
            ..EnqueueRequest::default()
        })
        .await
        .unwrap();
    let done = app
        .wait_status(&op.op_id.to_string(), "succeeded", DEADLINE)
        .await;
    let seen: Observed = serde_json::from_value(done.result.unwrap()).unwrap();
    assert_eq!(seen.status, "running");
    assert_eq!(seen.epoch, 1);
    assert_eq!(seen.lease_owner.as_deref(), Some(owner.as_str()));
    assert!(seen.lease_in_future);

    shutdown.cancel();
    running.await.unwrap().unwrap();
    dispatcher.close().await;
    app.cleanup().await;
}

#[tokio::test]
async fn an_operation_committed_but_never_published_still_completes() {
    let mut app = TestApp::start().await;
    // The producer commits the row and "crashes" before publishing: enqueue_in writes the row
    // in our transaction, we commit, and the pointer is never sent.
    let (producer, dispatcher) = app.producer();
    let mut tx = app.pool.begin().await.unwrap();
    let pending = producer
        .enqueue_in(
            &mut tx,
            EnqueueRequest {
                tenant: "t1".into(),
                kind: "echo".into(),
                input: json!({ "text": "orphan" }),
                ..EnqueueRequest::default()
            },
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(pending);
    dispatcher.close().await;
    let op = producer_op_id(&app).await;
    let names = app.names();
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    assert_eq!(
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap(),
        0
    );

    app.spawn(&["worker"]);
    app.spawn(&["scheduler"]);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.result, Some(json!({ "text": "orphan" })));
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

async fn producer_op_id(app: &TestApp) -> String {
    let id: uuid::Uuid = sqlx::query_scalar("SELECT id FROM operations")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    id.to_string()
}

#[tokio::test]
async fn lost_pointers_are_republished_but_a_backlog_is_left_alone() {
    let app = TestApp::start().await;
    let mut ops = Vec::new();
    for i in 0..5 {
        ops.push(app.enqueue_echo(&format!("backlog {i}")));
    }
    // Wait until the producers' dispatch marks landed.
    app.wait_for("dispatch marks", DEADLINE, || async {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM operations WHERE dispatched_at IS NOT NULL")
                .fetch_one(&app.pool)
                .await
                .unwrap();
        n == 5
    })
    .await;
    let dispatcher = app.dispatcher();
    let settings = agentq_scheduler::Settings {
        lost_after: Duration::ZERO,
        ..Default::default()
    };
    let scheduler = agentq_scheduler::Scheduler::new(
        settings,
        app.pool.clone(),
        dispatcher.clone(),
        &app.namespace,
    );
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let names = app.names();

    // A legitimate backlog: the pointers are in the queue, nothing is republished.
    assert_eq!(
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap(),
        5
    );
    assert_eq!(scheduler.sweep_lost().await.unwrap(), 0);
    assert_eq!(
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap(),
        5
    );

    // The broker loses them: the sweep republishes each exactly once.
    assert_eq!(
        broker::purge_lane(&conn, &names, Lane::Interactive)
            .await
            .unwrap(),
        5
    );
    assert_eq!(scheduler.sweep_lost().await.unwrap(), 5);
    assert_eq!(
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap(),
        5
    );
    assert_eq!(
        scheduler.sweep_lost().await.unwrap(),
        0,
        "queue is no longer empty"
    );

    dispatcher.close().await;
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

/// No path marks a row dispatched before its pointer is confirmed: a sweep that dies (or whose
/// commit answer is lost) before it marks leaves its rows due, and while one sweep holds rows
/// another skips them instead of publishing them twice.
#[tokio::test]
async fn a_sweep_that_never_commits_leaves_its_rows_due_and_a_concurrent_one_skips_them() {
    let app = TestApp::start().await;
    // Three operations whose producer "crashed" before publishing: committed, no pointer.
    let (producer, dispatcher) = app.producer();
    let mut tx = app.pool.begin().await.unwrap();
    for i in 0..3 {
        let pending = producer
            .enqueue_in(
                &mut tx,
                EnqueueRequest {
                    tenant: "t1".into(),
                    kind: "echo".into(),
                    input: json!({ "text": format!("orphan {i}") }),
                    ..EnqueueRequest::default()
                },
            )
            .await
            .unwrap();
        drop(pending);
    }
    tx.commit().await.unwrap();
    let unmarked = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM operations WHERE status = 'queued' AND dispatched_at IS NULL",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };

    // A sweep locks them and dies before publishing (its transaction rolls back).
    let first = db::dispatch::lock_undispatched(&app.pool, Duration::ZERO, 100)
        .await
        .unwrap();
    assert_eq!(first.rows.len(), 3);
    // Meanwhile a second sweeper finds nothing to take: no second pointer per sweep.
    let second = db::dispatch::lock_undispatched(&app.pool, Duration::ZERO, 100)
        .await
        .unwrap();
    assert!(second.rows.is_empty(), "{:?}", second.rows);
    second.mark(&[]).await.unwrap();
    drop(first);
    assert_eq!(unmarked().await, 3, "nothing is marked without a confirm");

    // The next sweep (once the abandoned transaction's rollback has released the locks)
    // publishes all three and marks them as it releases them.
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let names = app.names();
    let again = app
        .wait_until("the abandoned sweep's locks released", DEADLINE, || async {
            let locked = db::dispatch::lock_undispatched(&app.pool, Duration::ZERO, 100)
                .await
                .unwrap();
            (locked.rows.len() == 3).then_some(locked)
        })
        .await;
    let published = dispatcher.publish_locked(again).await.unwrap();
    assert_eq!((published.sent, published.failed), (3, 0));
    assert_eq!(unmarked().await, 0);
    assert_eq!(
        broker::queue_depth(&conn, &names, Lane::Interactive)
            .await
            .unwrap(),
        3
    );
    dispatcher.close().await;
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

/// `AMQP_URL` may list several nodes: a process connects to the first that answers (here the
/// first is dead), and declares the lanes with a quorum size (3 by default for a list) even
/// over a namespace first declared without one, as an upgrade to a cluster would.
#[tokio::test]
async fn a_node_list_connects_past_a_dead_node_and_a_quorum_size_redeclares_cleanly() {
    let mut app = TestApp::start().await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let list = format!("amqp://guest:guest@{dead}/%2f,{}", app.amqp_url);
    app.set_env("AMQP_URL", &list);
    let w = app.spawn_logged(&["worker"]);
    app.spawn(&["scheduler"]);
    let op = app.enqueue_echo("through the second node");
    let end = std::time::Instant::now() + DEADLINE;
    while app.operation(&op).await.status.as_str() != "succeeded" {
        assert!(
            std::time::Instant::now() < end,
            "not run within {DEADLINE:?}; the worker's log:\n{}",
            app.log(w)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let done = app.operation(&op).await;
    assert_eq!(
        done.result,
        Some(json!({ "text": "through the second node" }))
    );
    app.cleanup().await;
}

#[tokio::test]
async fn migrate_is_safe_to_run_twice_and_concurrently() {
    let app = TestApp::start().await;
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
    let url = db::with_database(&app.database_url, &format!("agentq_test_m_{tag}")).unwrap();
    let runs: Vec<_> = (0..3)
        .map(|_| {
            app.command(&["migrate"])
                .env("DATABASE_URL", &url)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for r in runs {
        let out = r.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let again = app
        .command(&["migrate"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(again.status.success());
    let pool = db::connect(&url, 2).await.unwrap();
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables
          WHERE table_schema = 'public'
            AND table_name IN ('operations', 'operation_steps', 'signals', 'dead_letters', 'operator_actions')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(tables, 5);
    pool.close().await;
    db::drop_database(&url).await.unwrap();
    app.cleanup().await;
}

/// The worker's grouped journal write fences each operation by its own epoch: in one statement
/// with successes and another operation's steps, a stale success and stale steps are left alone
/// (their leases were lost) and the others commit, each success with its journal rows.
#[tokio::test]
async fn a_grouped_journal_write_writes_only_the_operations_whose_lease_it_holds() {
    use db::settle::{Completion, RunWrite};
    let app = TestApp::start().await;
    let ids = app
        .enqueue_many(
            "echo",
            Lane::Interactive,
            (0..5).map(|i| json!({ "text": format!("doc {i}") })),
        )
        .await;
    let echo = db::versions::Runnable::at_default(&["echo"]);
    let claimed =
        db::claim::claim_operations(&app.pool, &ids, &echo, "batcher", Duration::from_secs(30))
            .await
            .unwrap();
    assert_eq!(claimed.len(), 5);
    let step = |id: uuid::Uuid| db::steps::StepWrite {
        seq: 0,
        name: "model".into(),
        kind: agentq_core::state::StepKind::Model,
        replay: agentq_core::state::Replay::Safe,
        idempotency_key: format!("key-{id}"),
        status: agentq_core::state::StepStatus::Completed,
        output: Some(json!({ "text": "done" })),
        error: None,
        started_at: chrono::Utc::now(),
        completed_at: Some(chrono::Utc::now()),
        usage: None,
        wake_at: None,
    };
    let batch: Vec<RunWrite> = claimed
        .iter()
        .map(|c| {
            // The second and the fifth lost their leases: another claim bumped their epochs.
            let epoch = if c.id == ids[1] || c.id == ids[4] {
                c.epoch - 1
            } else {
                c.epoch
            };
            if c.id == ids[3] || c.id == ids[4] {
                RunWrite::Steps(db::steps::StepBatch {
                    id: c.id,
                    epoch,
                    steps: vec![step(c.id)],
                })
            } else {
                RunWrite::Complete(Completion {
                    id: c.id,
                    epoch,
                    result: json!({ "text": "done" }),
                    steps: vec![step(c.id)],
                })
            }
        })
        .collect();
    let mut written = db::settle::write_runs(&app.pool, &batch).await.unwrap();
    written.sort();
    let mut expected = vec![ids[0], ids[2], ids[3]];
    expected.sort();
    assert_eq!(written, expected);
    for (id, status, steps) in [
        (ids[0], "succeeded", 1),
        (ids[1], "running", 0),
        (ids[2], "succeeded", 1),
        (ids[3], "running", 1),
        (ids[4], "running", 0),
    ] {
        let (s, n): (String, i64) = sqlx::query_as(
            "SELECT o.status, (SELECT count(*) FROM operation_steps s WHERE s.op_id = o.id)
               FROM operations o WHERE o.id = $1",
        )
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        assert_eq!((s.as_str(), n), (status, steps), "operation {id}");
    }
    app.cleanup().await;
}

/// Statements whose text is `like` waiting on a lock now.
pub(crate) async fn waiting_on_a_lock(app: &TestApp, like: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
    )
    .bind(like)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// Concurrent enqueues share one `INSERT` (group commit). Held behind a lock on the table
/// (two statements waiting on it, fourteen writes queued behind them), the fourteen go in
/// together once it is released, and each answer is still its own: a new operation, its budget written with it,
/// the same operation for a dedupe key repeated within the statement, a refusal for that key
/// with another input; and every created operation's pointer goes out and it runs.
#[tokio::test]
async fn concurrent_enqueues_share_a_statement_and_each_gets_its_own_answer() {
    let app = crate::harness::running_app().await;
    let (producer, dispatcher) = app.producer();
    let mut gate = app.pool.begin().await.unwrap();
    // SHARE conflicts with the ROW EXCLUSIVE lock every INSERT takes.
    sqlx::query("LOCK TABLE operations IN SHARE MODE")
        .execute(&mut *gate)
        .await
        .unwrap();
    let budget = agentq_core::db::budgets::Spec {
        tokens: 100_000,
        measure: agentq_core::db::budgets::Measure::Total,
        timeout_secs: 60,
    };
    let mut reqs: Vec<EnqueueRequest> = (0..10usize)
        .map(|i| EnqueueRequest {
            tenant: "t1".into(),
            kind: "echo".into(),
            input: json!({ "text": format!("doc {i}") }),
            budget: i.is_multiple_of(2).then_some(budget),
            ..Default::default()
        })
        .collect();
    // One dedupe key six times: five with one input, one with another.
    for i in 0..6 {
        reqs.push(EnqueueRequest {
            tenant: "t1".into(),
            kind: "echo".into(),
            input: json!({ "text": if i == 3 { "other" } else { "same" } }),
            dedupe_key: Some("same-key".into()),
            ..Default::default()
        });
    }
    let spawn = |req: EnqueueRequest| {
        let producer = producer.clone();
        let text = req.input["text"].as_str().unwrap().to_string();
        tokio::spawn(async move { (text, producer.enqueue(req).await) })
    };
    let held = || waiting_on_a_lock(&app, "WITH inserted AS%");
    // The first two enqueues take both statements the writer runs at once, one each, and
    // wait on the lock; the other fourteen queue behind them.
    let mut rest = reqs.into_iter();
    let mut tasks = Vec::new();
    for n in 1..=2 {
        tasks.push(spawn(rest.next().unwrap()));
        app.wait_for(
            "an enqueue statement held by the lock",
            DEADLINE,
            || async { held().await == n },
        )
        .await;
    }
    tasks.extend(rest.map(spawn));
    app.wait_for("fourteen enqueues queued", DEADLINE, || async {
        producer.enqueues_waiting() == 14
    })
    .await;
    gate.commit().await.unwrap();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }

    // The ten without a key: each created, each its own.
    let plain: Vec<OperationId> = answers
        .iter()
        .filter(|(text, _)| text.starts_with("doc "))
        .map(|(_, r)| {
            let e = r.as_ref().expect("a plain enqueue is stored");
            assert!(e.created);
            e.op_id
        })
        .collect();
    let distinct: std::collections::HashSet<_> = plain.iter().collect();
    assert_eq!(distinct.len(), 10);
    // The key: one created; the same input gets it back, the other input is refused.
    let keyed: Vec<&(String, Result<_, _>)> = answers
        .iter()
        .filter(|(text, _)| !text.starts_with("doc "))
        .collect();
    let (won_text, won) = keyed
        .iter()
        .find_map(|(text, r)| match r {
            Ok(e) if e.created => Some((text.clone(), e.op_id)),
            _ => None,
        })
        .expect("one enqueue of the key is created");
    for (text, r) in &keyed {
        match r {
            Ok(e) => {
                assert_eq!(text, &won_text, "only the created input is answered");
                assert_eq!(e.op_id, won);
            }
            Err(agentq_producer::Error::KeyConflict { op_id, .. }) => {
                assert_ne!(text, &won_text);
                assert_eq!(*op_id, won);
            }
            Err(e) => panic!("unexpected answer for {text}: {e}"),
        }
    }
    assert_eq!(
        keyed
            .iter()
            .filter(|(_, r)| r.as_ref().is_ok_and(|e| e.created))
            .count(),
        1
    );
    // Eleven rows in three statements: the two held, then the fourteen queued in one. (A
    // row's `created_at` is its statement's transaction start; its `xmin` would not do: the
    // worker may have claimed the row since.)
    let (rows, statements): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT created_at) FROM operations")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!((rows, statements), (11, 3));
    // Each even plain one has its budget, written with it.
    let budgeted: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT op_id FROM budgets WHERE limit_tokens = 100000 AND timeout_secs = 60 ORDER BY op_id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let mut expected: Vec<uuid::Uuid> = answers
        .iter()
        .filter_map(|(text, r)| {
            let i: usize = text.strip_prefix("doc ")?.parse().ok()?;
            i.is_multiple_of(2).then(|| r.as_ref().unwrap().op_id.0)
        })
        .collect();
    expected.sort();
    assert_eq!(budgeted, expected);
    // Every created operation was published and runs.
    for id in plain.iter().chain([&won]) {
        app.wait_status(&id.to_string(), "succeeded", DEADLINE)
            .await;
    }
    dispatcher.close().await;
    app.cleanup().await;
}

/// The worker's journal writer runs one statement at a time while statements are quick, and
/// starts another beside one that is slow: an operation whose statement waits on a row lock
/// (here a transaction holding its row, as an operator's session might) holds up only the
/// operations in that statement. Another operation runs to the end meanwhile, long before the
/// stuck statement's call deadline could have freed the writer.
#[tokio::test]
async fn a_journal_statement_waiting_on_a_row_lock_holds_up_only_its_own_operations() {
    let app = TestApp::start().await;
    let entered = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let mut registry = agentq_kinds::registry();
    {
        let (entered, gate) = (entered.clone(), gate.clone());
        registry.register("gated", move |ctx: JobContext, _input: Value| {
            let (entered, gate) = (entered.clone(), gate.clone());
            async move {
                ctx.step("held", || async move {
                    entered.notify_one();
                    gate.acquire().await.expect("gate").forget();
                    Ok::<_, JobError>(json!({}))
                })
                .await?;
                // Its start writes the row of "held" (held by the lock below).
                ctx.step("after", || async { Ok::<_, JobError>(json!({})) })
                    .await?;
                Ok::<_, JobError>(json!({ "done": true }))
            }
        });
    }
    let kinds = registry.clone();
    // No heartbeat during the test: it locks every running operation's row in id order and
    // would queue behind the lock too.
    let worker = in_process_worker(&app, registry, Duration::from_secs(600));
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    let (producer, dispatcher) = app.producer_with(kinds);
    let enqueue = |kind: &str, input: Value| {
        producer.enqueue(EnqueueRequest {
            tenant: "t1".into(),
            kind: kind.into(),
            input,
            ..EnqueueRequest::default()
        })
    };

    // A runs its first step; its row is locked; its step ends, and the statement writing it
    // waits on the lock.
    let a = enqueue("gated", json!({})).await.unwrap().op_id;
    entered.notified().await;
    let mut lock = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM operations WHERE id = $1 FOR UPDATE")
        .bind(a.0)
        .execute(&mut *lock)
        .await
        .unwrap();
    gate.add_permits(1);
    app.wait_for(
        "A's journal statement waiting on the lock",
        DEADLINE,
        || async { waiting_on_a_lock(&app, "WITH input AS%").await == 1 },
    )
    .await;
    let stuck = std::time::Instant::now();

    // B, three durable steps, runs to the end through a statement of its own.
    let b = enqueue(
        "script",
        json!({ "steps": [{ "work_ms": 0 }, { "work_ms": 0 }, { "work_ms": 0 }] }),
    )
    .await
    .unwrap()
    .op_id;
    let done = app.wait_status(&b.to_string(), "succeeded", DEADLINE).await;
    assert!(
        stuck.elapsed() < db::call_deadline(),
        "B finished {:?} after A's statement stuck: not before its call deadline ({:?}) freed the writer",
        stuck.elapsed(),
        db::call_deadline()
    );
    assert_eq!(done.status.as_str(), "succeeded");
    let a_view = app.operation(&a.to_string()).await;
    assert_eq!(a_view.status.as_str(), "running", "A waits on its lock");

    // The lock goes; A's statement commits and A finishes, each step once.
    lock.commit().await.unwrap();
    app.wait_status(&a.to_string(), "succeeded", DEADLINE).await;
    let steps: Vec<(String, String)> =
        sqlx::query_as("SELECT name, status FROM operation_steps WHERE op_id = $1 ORDER BY seq")
            .bind(a.0)
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        steps,
        [("held", "completed"), ("after", "completed")]
            .map(|(n, s)| (n.to_string(), s.to_string()))
    );

    shutdown.cancel();
    running.await.unwrap().unwrap();
    dispatcher.close().await;
    app.cleanup().await;
}
