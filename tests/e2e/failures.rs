//! Failures, retries and the DLQ: classes end to end, retries as data, poison messages, and
//! the operators' `agentq dlq` commands.

use std::time::Duration;

use agentq_core::broker::{self, Publisher};
use agentq_core::db::dead_letters::{self, Filter};
use agentq_core::operation::{Lane, OperationId, Pointer};
use serde_json::{Value, json};

use crate::harness::{DEADLINE, TestApp, running_app};

fn json_lines(out: &std::process::Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn a_retryable_failure_comes_back_later_and_succeeds_on_attempt_3() {
    let app = running_app().await;
    let op = app.enqueue_script(json!([{ "fail": "retryable", "times": 2 }]), &[]);
    let mut delays = Vec::new();
    for attempt in 1..=2 {
        let delay = app
            .wait_until(
                &format!("retry after attempt {attempt}"),
                DEADLINE,
                || async {
                    let v = app.operation(&op).await;
                    // While it waits, no worker holds it: it is a row with a future run_at.
                    (v.status.as_str() == "queued" && v.attempt == attempt)
                        .then(|| (v.run_at - v.updated_at).num_milliseconds())
                },
            )
            .await;
        delays.push(delay);
    }
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.attempt, 3);
    assert!(delays[0] >= 700, "first delay {delays:?}");
    assert!(delays[1] > delays[0], "the delay grew: {delays:?}");
    app.cleanup().await;
}

#[tokio::test]
async fn exhausted_nonretryable_and_panicking_jobs_end_where_they_should() {
    let app = running_app().await;
    let exhausted = app.enqueue_script(
        json!([{ "fail": "retryable", "times": 9 }]),
        &["--max-attempts", "2"],
    );
    let fatal = app.enqueue_script(
        json!([{ "work_ms": 1 }, { "fail": "non_retryable", "times": 9 }]),
        &[],
    );
    let panics = app.enqueue_script(json!([{ "panic": true, "times": 1 }]), &[]);

    let dead = app.wait_status(&exhausted, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("retries_exhausted"));
    assert_eq!(dead.attempt, 2);
    assert!(
        dead.error_message.unwrap().contains("run 2"),
        "keeps the last error"
    );

    let dead = app.wait_status(&fatal, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("non_retryable"));
    assert_eq!(dead.attempt, 1);
    let letter = dead_letters::find_dead_letter(&app.pool, dead.op_id.0, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (letter.class.as_str(), letter.failed_step),
        ("non_retryable", Some(1))
    );

    let done = app.wait_status(&panics, "succeeded", DEADLINE).await;
    assert_eq!(
        done.attempt, 2,
        "a panic is a retryable failure of that attempt"
    );
    app.cleanup().await;
}

#[tokio::test]
async fn a_not_before_from_the_error_is_honoured_and_overload_spares_attempts() {
    let app = running_app().await;
    let op = app.enqueue_script(
        json!([{ "fail": "retryable", "times": 1, "not_before_ms": 3000 }]),
        &[],
    );
    let overloaded = app.enqueue_script(
        json!([{ "fail": "overloaded", "times": 1 }]),
        &["--max-attempts", "1"],
    );
    let (at, run_at) = app
        .wait_until("the first failure", DEADLINE, || async {
            let v = app.operation(&op).await;
            (v.status.as_str() == "queued" && v.attempt == 1).then_some((v.updated_at, v.run_at))
        })
        .await;
    assert!(
        (run_at - at).num_milliseconds() >= 2900,
        "run_at honours the not-before"
    );
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert!(done.finished_at.unwrap() >= run_at, "not run before it");

    // An overloaded provider parks the operation without using up its only attempt.
    let done = app.wait_status(&overloaded, "succeeded", DEADLINE).await;
    assert_eq!(done.attempt, 1);
    app.cleanup().await;
}

#[tokio::test]
async fn two_hundred_poison_messages_become_dead_letters_and_workers_keep_going() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    let w1 = app.spawn(&["worker"]);
    let w2 = app.spawn(&["worker"]);
    let conn = broker::connect(&app.amqp_url, "test").await.unwrap();
    let publisher = Publisher::open(&conn, app.names()).await.unwrap();
    let mut ops = Vec::new();
    for i in 0..200 {
        let body: Vec<u8> = match i % 50 {
            0..=11 => b"{ this is not json".to_vec(),
            12..=23 => serde_json::to_vec(
                &json!({ "v": 99, "op_id": uuid::Uuid::new_v4(), "tenant": "t1", "kind": "echo" }),
            )
            .unwrap(),
            24..=35 => Pointer::new(OperationId::new(), "t1", "echo").encode(),
            36..=48 => Vec::new(),
            _ => (0..1024 * 1024)
                .map(|n: u32| (n.wrapping_mul(2654435761) >> 24) as u8)
                .collect(),
        };
        let lane = if i % 2 == 0 {
            Lane::Interactive
        } else {
            Lane::Batch
        };
        publisher.publish_raw(&body, lane, "garbage").await.unwrap();
        if i % 10 == 0 {
            ops.push(app.enqueue_echo(&format!("alongside {i}")));
        }
    }
    let pool = app.pool.clone();
    app.wait_for(
        "200 poison dead letters",
        Duration::from_secs(60),
        || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM dead_letters WHERE class = 'poison_message'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            n == 200
        },
    )
    .await;
    for op in &ops {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    let (max_raw, rejected): (Option<i32>, i64) = sqlx::query_as(
        "SELECT max(octet_length(raw_message)), count(*) FILTER (WHERE reason LIKE 'rejected from %')
           FROM dead_letters WHERE class = 'poison_message'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(max_raw, Some(64 * 1024), "raw bytes are capped at 64 KiB");
    assert_eq!(rejected, 200, "the broker's reason is kept");
    assert!(
        !app.wait_exit(w1, Duration::from_millis(10)).await,
        "worker 1 is still up"
    );
    assert!(
        !app.wait_exit(w2, Duration::from_millis(10)).await,
        "worker 2 is still up"
    );
    let names = app.names();
    for lane in Lane::ALL {
        assert_eq!(broker::queue_depth(&conn, &names, lane).await.unwrap(), 0);
    }
    // Listing shows them as dead letters without an operation.
    let out = app.agentq(&[
        "dlq",
        "list",
        "--class",
        "poison_message",
        "--limit",
        "5",
        "--json",
    ]);
    let page = json_lines(&out);
    assert_eq!(page.len(), 5);
    assert!(page.iter().all(|d| d["op_id"].is_null()));
    let _ = conn.close(200, "done".into()).await;
    app.cleanup().await;
}

#[tokio::test]
async fn retry_with_a_patched_input_resumes_from_the_failed_step() {
    let app = running_app().await;
    let a = json!({ "tool": "ledger", "replay": "safe", "label": "a" });
    let b = json!({ "tool": "ledger", "replay": "unsafe", "label": "b" });
    let op = app.enqueue_script(json!([a, b, { "fail": "non_retryable", "times": 9 }]), &[]);
    app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(app.effects(&op).await, 2);

    let patch = json!({ "steps": [a, b, { "work_ms": 5 }] }).to_string();
    app.agentq_ok(&[
        "dlq",
        "retry",
        &op,
        "--patch-input",
        &patch,
        "--as",
        "alice",
        "--reason",
        "fixed the input",
        "--json",
    ]);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        app.effects(&op).await,
        2,
        "completed steps were replayed, not re-run"
    );
    assert_eq!(
        done.result.unwrap()["outputs"][2],
        json!({ "worked_ms": 5 })
    );

    let show = app.agentq_json(&["dlq", "show", &op, "--json"]);
    assert_eq!(show["dead_letter"]["status"], "retried");
    assert_eq!(show["history"][0]["actor"], "alice");
    assert_eq!(show["history"][0]["action"], "retry");
    assert_eq!(show["history"][0]["status_before"], "dead");
    assert_eq!(show["history"][0]["status_after"], "queued");
    assert_eq!(show["history"][0]["reason"], "fixed the input");
    app.cleanup().await;
}

#[tokio::test]
async fn an_unknown_side_effect_is_resolved_both_ways() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    app.spawn(&["scheduler"]);
    let program = json!([{ "tool": "ledger", "replay": "unsafe", "label": "charge", "after_ms": 2500 }, { "work_ms": 1 }]);
    let happened = app.enqueue_script(program.clone(), &[]);
    let not_happened = app.enqueue_script(program, &[]);
    let w = app.spawn(&["worker"]);
    app.wait_for("both effects", DEADLINE, || async {
        app.effects(&happened).await == 1 && app.effects(&not_happened).await == 1
    })
    .await;
    app.kill(w);
    app.spawn(&["worker"]);
    app.wait_status(&happened, "dead", DEADLINE).await;
    app.wait_status(&not_happened, "dead", DEADLINE).await;

    // A retry would hit the same unknown step: refused, with the way out.
    let out = app.agentq(&["dlq", "retry", &happened]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("dlq resolve"));

    app.agentq_ok(&[
        "dlq",
        "resolve",
        &happened,
        "--happened",
        "--output",
        r#"{"effect_id": 7}"#,
        "--as",
        "bob",
    ]);
    let done = app.wait_status(&happened, "succeeded", DEADLINE).await;
    assert_eq!(
        done.result.unwrap()["outputs"][0],
        json!({ "effect_id": 7 })
    );
    assert_eq!(app.effects(&happened).await, 1, "not re-run");

    app.agentq_ok(&[
        "dlq",
        "resolve",
        &not_happened,
        "--did-not-happen",
        "--as",
        "bob",
    ]);
    app.wait_status(&not_happened, "succeeded", DEADLINE).await;
    assert_eq!(
        app.effects(&not_happened).await,
        2,
        "run again, as the operator decided"
    );

    // Resolving it again: refused, nothing changes.
    let out = app.agentq(&["dlq", "resolve", &happened, "--happened"]);
    assert_eq!(out.status.code(), Some(2));
    app.cleanup().await;
}

#[tokio::test]
async fn discard_needs_a_reason() {
    let app = running_app().await;
    let op = app.enqueue_script(json!([{ "fail": "non_retryable", "times": 1 }]), &[]);
    app.wait_status(&op, "dead", DEADLINE).await;
    let out = app.agentq(&["dlq", "discard", &op]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--reason"));
    assert_eq!(
        app.operation(&op).await.status.as_str(),
        "dead",
        "refused: nothing changed"
    );

    app.agentq_ok(&[
        "dlq",
        "discard",
        &op,
        "--reason",
        "duplicate order",
        "--as",
        "carol",
    ]);
    assert_eq!(app.operation(&op).await.status.as_str(), "discarded");
    let (actor, reason, after): (String, String, String) = sqlx::query_as(
        "SELECT actor, reason, status_after FROM operator_actions WHERE op_id = $1::uuid AND action = 'discard'",
    )
    .bind(&op)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        (actor.as_str(), reason.as_str(), after.as_str()),
        ("carol", "duplicate order", "discarded")
    );
    app.cleanup().await;
}

#[tokio::test]
async fn a_bulk_retry_of_1000_dead_operations_dry_run_then_for_real() {
    let app = running_app().await;
    let failing = json!({ "steps": [{ "fail": "non_retryable", "times": 1 }] });
    app.enqueue_many("script", Lane::Batch, std::iter::repeat_n(failing, 1000))
        .await;
    let pool = app.pool.clone();
    let dead = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM operations WHERE status = 'dead'")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    app.wait_for("1000 dead operations", Duration::from_secs(60), || async {
        dead().await == 1000
    })
    .await;

    let dry = app.agentq(&[
        "dlq",
        "retry",
        "--class",
        "non_retryable",
        "--dry-run",
        "--json",
    ]);
    assert!(dry.status.success());
    assert_eq!(json_lines(&dry).len(), 1000);
    assert!(String::from_utf8_lossy(&dry.stderr).contains("1000 dead letters would be retried"));
    assert_eq!(dead().await, 1000, "a dry run changes nothing");

    let patch = json!({ "steps": [{ "fail": "non_retryable", "times": 0 }] }).to_string();
    let out = app.agentq_ok(&[
        "dlq",
        "retry",
        "--class",
        "non_retryable",
        "--patch-input",
        &patch,
        "--rate",
        "5000/s",
        "--as",
        "dana",
        "--reason",
        "bulk fix",
        "--json",
    ]);
    assert_eq!(
        json_lines(&out)
            .iter()
            .filter(|l| l["result"] == "retried")
            .count(),
        1000
    );
    app.wait_for("1000 successes", Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM operations WHERE status = 'succeeded'")
            .fetch_one(&app.pool)
            .await
            .unwrap()
            == 1000
    })
    .await;
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT op_id) FROM operator_actions
          WHERE action = 'retry' AND actor = 'dana' AND reason = 'bulk fix'
            AND status_before = 'dead' AND status_after = 'queued'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audited, 1000);
    app.cleanup().await;
}

#[tokio::test]
async fn two_operators_retrying_one_dead_letter_requeue_it_once() {
    let mut app = TestApp::start().await;
    // A dead operation, made by a worker that then goes away so nothing re-runs it.
    let w = app.spawn(&["worker"]);
    let op = app.enqueue_script(json!([{ "fail": "non_retryable", "times": 1 }]), &[]);
    app.wait_status(&op, "dead", DEADLINE).await;
    app.kill(w);
    let letter =
        dead_letters::find_dead_letter(&app.pool, OperationId::parse(&op).unwrap().0, None)
            .await
            .unwrap()
            .unwrap();
    let id = letter.id.to_string();
    let racers: Vec<_> = (0..2)
        .map(|i| {
            app.command(&["dlq", "retry", &id, "--as", &format!("op{i}")])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let codes: Vec<Option<i32>> = racers
        .into_iter()
        .map(|r| r.wait_with_output().unwrap().status.code())
        .collect();
    let mut sorted = codes.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        vec![Some(0), Some(2)],
        "one wins, one is told it is already retried: {codes:?}"
    );
    let actions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operator_actions WHERE dead_letter_id = $1")
            .bind(letter.id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(actions, 1);
    assert_eq!(app.operation(&op).await.status.as_str(), "queued");
    app.cleanup().await;
}

#[tokio::test]
async fn listing_100k_dead_operations_by_class_uses_an_index() {
    let app = TestApp::start().await;
    sqlx::query(
        "WITH ops AS (
            INSERT INTO operations (id, tenant_id, kind, input, input_sha256, status, attempt, finished_at, created_at)
            SELECT gen_random_uuid(), 'tenant-' || (g % 7), 'script', '{}', 'x', 'dead', 3, now(),
                   now() - make_interval(secs => g)
              FROM generate_series(1, 100000) g
         RETURNING id, tenant_id, kind, created_at)
         INSERT INTO dead_letters (id, op_id, tenant_id, kind, class, reason, attempts, created_at)
         SELECT gen_random_uuid(), id, tenant_id, kind,
                (ARRAY['retries_exhausted', 'non_retryable', 'crash_loop', 'unknown_side_effect'])[1 + (abs(hashtext(id::text)) % 4)],
                'failed: error ' || abs(hashtext(id::text)) % 10, 3, created_at
           FROM ops",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE operations")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE dead_letters")
        .execute(&app.pool)
        .await
        .unwrap();

    let filter = Filter {
        class: Some("retries_exhausted".into()),
        ..Default::default()
    };
    let plan = dead_letters::explain_list(&app.pool, &filter, 50)
        .await
        .unwrap();
    // Read in index order and stop after the page: no sequential scan, no sort of all matches.
    assert!(
        plan.contains("Index Scan using dead_letters_open"),
        "expected an index scan:\n{plan}"
    );
    assert!(
        !plan.contains("Seq Scan on dead_letters") && !plan.contains("Sort"),
        "{plan}"
    );

    let started = std::time::Instant::now();
    let page = dead_letters::list_dead_letters(&app.pool, &filter, 50, None)
        .await
        .unwrap();
    let query_ms = started.elapsed().as_secs_f64() * 1000.0;
    let started = std::time::Instant::now();
    let out = app.agentq(&["dlq", "list", "--class", "retries_exhausted", "--json"]);
    let cli_ms = started.elapsed().as_secs_f64() * 1000.0;
    assert!(out.status.success());
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 50);
    assert_eq!(page.len(), 50);
    println!(
        "dlq list on 100k dead operations: first page query {query_ms:.1} ms, whole CLI {cli_ms:.1} ms"
    );

    // The next page continues exactly where the first ended.
    let cursor = lines[49]["cursor"].as_str().unwrap().to_string();
    let next = json_lines(&app.agentq(&[
        "dlq",
        "list",
        "--class",
        "retries_exhausted",
        "--json",
        "--after",
        &cursor,
    ]));
    assert_eq!(next.len(), 50);
    assert!(
        next.iter()
            .all(|d| !lines.iter().any(|l| l["id"] == d["id"]))
    );
    assert!(next[0]["created_at"].as_str() <= lines[49]["created_at"].as_str());
    app.cleanup().await;
}
