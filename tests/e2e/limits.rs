//! What decides how much runs, and what runs first: a concurrency key's limit, enforced by the
//! claim across worker processes and crashes, and lanes (interactive work never waits behind
//! a batch backlog).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use crate::harness::{DEADLINE, TestApp};

/// The most intervals `[start, end)` covering one instant.
fn most_at_once(runs: &[(DateTime<Utc>, DateTime<Utc>)]) -> usize {
    // Ends sort before starts at the same instant: an operation that starts exactly when
    // another ends did not run beside it.
    let mut edges: Vec<(DateTime<Utc>, i32)> = runs
        .iter()
        .flat_map(|(start, end)| [(*start, 1), (*end, -1)])
        .collect();
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    most as usize
}

/// How many operations of the key PostgreSQL counts `running`, and its counter row.
async fn running_of(app: &TestApp, key: &str) -> (i64, i32) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM operations
                  WHERE concurrency_key = $1 AND status = 'running'),
                (SELECT running FROM concurrency_keys WHERE tenant_id = 't1' AND key = $1)",
    )
    .bind(key)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// Whether all `n` operations of the key succeeded; fails the test past `end`.
async fn all_succeeded(app: &TestApp, key: &str, n: usize, end: tokio::time::Instant) -> bool {
    let done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operations WHERE concurrency_key = $1 AND status = 'succeeded'",
    )
    .bind(key)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert!(
        done == n as i64 || tokio::time::Instant::now() < end,
        "only {done} of {n} operations of {key} succeeded"
    );
    done == n as i64
}

#[test]
fn most_at_once_counts_overlaps_and_not_touching_ends() {
    let t = |s: i64| DateTime::<Utc>::from_timestamp(s, 0).unwrap();
    assert_eq!(most_at_once(&[]), 0);
    assert_eq!(most_at_once(&[(t(0), t(2)), (t(2), t(4))]), 1);
    assert_eq!(most_at_once(&[(t(0), t(3)), (t(1), t(4)), (t(2), t(5))]), 3);
    assert_eq!(
        most_at_once(&[(t(0), t(3)), (t(1), t(4)), (t(2), t(5)), (t(3), t(6))]),
        3
    );
}

#[tokio::test]
async fn a_key_limited_to_3_never_runs_4_at_once_under_3_workers() {
    let mut app = TestApp::start().await;
    // Everything is queued before any worker exists, so the workers meet the whole backlog.
    let limited = ["--concurrency-key", "account-7", "--concurrency-limit", "3"];
    let ops: Vec<String> = (0..15)
        .map(|_| app.enqueue_script(json!([{ "work_ms": 400 }]), &limited))
        .collect();
    let other = app.enqueue_script(
        json!([{ "work_ms": 10 }]),
        &["--concurrency-key", "account-8", "--concurrency-limit", "1"],
    );
    let free = app.enqueue_script(json!([{ "work_ms": 10 }]), &[]);
    app.spawn(&["scheduler"]);
    for _ in 0..3 {
        app.spawn(&["worker"]);
    }
    let other = app.wait_status(&other, "succeeded", DEADLINE).await;
    let free = app.wait_status(&free, "succeeded", DEADLINE).await;
    // Which workers ran the key's operations (a finished operation has no lease owner).
    let mut owners = std::collections::BTreeSet::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let running: Vec<String> = sqlx::query_scalar(
            "SELECT lease_owner FROM operations
              WHERE concurrency_key = 'account-7' AND status = 'running'",
        )
        .fetch_all(&app.pool)
        .await
        .unwrap();
        owners.extend(running);
        if all_succeeded(&app, "account-7", ops.len(), end).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Each ran from its first step's start (after its claim committed) to its finish (before
    // the completion committed, which is what freed its slot for the next claim).
    let runs: Vec<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT s.started_at, o.finished_at
           FROM operations o JOIN operation_steps s ON s.op_id = o.id AND s.seq = 0
          WHERE o.concurrency_key = 'account-7'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(runs.len(), 15);
    // Work of other keys and of no key is not held back by account-7's limit: both finished
    // before account-7's backlog (five rounds of 400 ms) was through.
    let last_start = runs.iter().map(|r| r.0).max().unwrap();
    for (what, op) in [("account-8", other), ("no key", free)] {
        assert!(
            op.finished_at.unwrap() < last_start,
            "the operation with {what} waited for account-7's backlog"
        );
    }
    let most = most_at_once(&runs);
    assert_eq!(
        most, 3,
        "account-7 ran {most} at once at its busiest: never more than its limit, and the \
         limit (not one at a time) with 3 workers free"
    );
    assert!(
        owners.len() >= 2,
        "the limit held across worker processes ({owners:?} ran the key)"
    );
    assert_eq!(running_of(&app, "account-7").await, (0, 0));
    app.cleanup().await;
}

#[tokio::test]
async fn a_killed_worker_gives_its_slots_back_and_the_limit_holds() {
    let mut app = TestApp::start().await;
    // Short, so the reaper finds the dead worker's leases soon; not so short that a live
    // worker's heartbeat (every third of it) misses one on a loaded machine: at 3 s, CI on
    // bdb51ae saw a third operation reaped from a live worker.
    app.set_env("AGENTQ_LEASE_TTL_SECS", "6");
    app.spawn(&["scheduler"]);
    let limited = ["--concurrency-key", "account-9", "--concurrency-limit", "2"];
    let ops: Vec<String> = (0..8)
        .map(|_| app.enqueue_script(json!([{ "work_ms": 1500 }]), &limited))
        .collect();
    // All eight are queued before any worker exists: without the limit one claim takes them.
    let first = app.spawn(&["worker"]);
    app.wait_for("two of the key running", DEADLINE, || async {
        running_of(&app, "account-9").await.0 == 2
    })
    .await;
    // The only worker dies holding both slots; its operations stay `running` until the
    // reaper finds their leases expired, and only then may others of the key start.
    let held: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT id FROM operations WHERE concurrency_key = 'account-9' AND status = 'running'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(held.len(), 2);
    app.kill(first);
    app.spawn(&["worker"]);
    app.spawn(&["worker"]);
    let end = tokio::time::Instant::now() + Duration::from_secs(90);
    let mut most = 0;
    loop {
        let (running, counted) = running_of(&app, "account-9").await;
        assert!(running <= 2, "{running} of a key limited to 2 were running");
        assert!(
            (0..=2).contains(&counted),
            "the counter said {counted} running"
        );
        most = most.max(running);
        if all_succeeded(&app, "account-9", ops.len(), end).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(most, 2);
    // The two the dead worker held were reaped (a live worker's heartbeat may also miss its
    // lease on a loaded machine and have one of its own reaped: that changes no count above).
    let restarted: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operations WHERE id = ANY($1) AND restarts > 0")
            .bind(&held)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(restarted, 2, "the two the dead worker held were reaped");
    assert_eq!(running_of(&app, "account-9").await, (0, 0));
    app.cleanup().await;
}

#[tokio::test]
async fn an_interactive_operation_starts_ahead_of_a_batch_backlog() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_CONCURRENCY_BATCH", "1");
    app.spawn(&["scheduler"]);
    let backlog: Vec<String> = (0..20)
        .map(|_| app.enqueue_script(json!([{ "work_ms": 1000 }]), &["--lane", "batch"]))
        .collect();
    app.spawn(&["worker"]);
    // The backlog is being worked through, one at a time, before the urgent one exists.
    app.wait_status(&backlog[0], "running", DEADLINE).await;
    let urgent = app.enqueue_script(json!([{ "work_ms": 1 }]), &["--lane", "interactive"]);
    let done = app.wait_status(&urgent, "succeeded", DEADLINE).await;
    let (queued, finished): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'queued'),
                count(*) FILTER (WHERE finished_at < $1)
           FROM operations WHERE lane = 'batch'",
    )
    .bind(done.finished_at.unwrap())
    .fetch_one(&app.pool)
    .await
    .unwrap();
    println!(
        "the interactive operation finished with {queued} of 20 batch operations still queued \
         and {finished} finished before it"
    );
    // 20 s of backlog at one a second: whatever the machine's load, most of it is still there.
    assert!(
        queued >= 10,
        "only {queued} batch operations were left queued"
    );
    app.cleanup().await;
}
