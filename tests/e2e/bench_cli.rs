//! `agentq bench` as a user runs it: stopped by a signal (Ctrl-C, or a script's `kill`), it
//! removes the database and the broker namespace it created, as a run that ends does.

use agentq_core::Lane;
use agentq_core::broker::{self, Names};
use agentq_core::db;

use crate::harness::{DEADLINE, TestApp};

/// The benchmark databases on the test's server.
async fn bench_databases(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'agentq\\_bench\\_%'")
        .fetch_all(pool)
        .await
        .expect("databases")
}

/// The database a benchmark's log says it created (other tests run benchmarks beside it).
fn its_database(log: &str) -> Option<String> {
    log.split("database ").skip(1).find_map(|rest| {
        let name = rest.split(',').next()?;
        name.starts_with("agentq_bench_").then(|| name.to_string())
    })
}

#[tokio::test]
async fn a_benchmark_stopped_by_a_signal_removes_its_database_and_namespace() {
    let mut app = TestApp::start().await;
    // Far more jobs than the test waits for: it is stopped mid-run.
    let bench = app.spawn_logged(&[
        "bench",
        "--scenario",
        "e2e",
        "--jobs",
        "1000000",
        "--concurrency",
        "8",
        "--producers",
        "2",
    ]);
    // Its database once operations are in it: the run's processes are up and working.
    let (database, url) = app
        .wait_until("the benchmark's operations", DEADLINE, || {
            let (new, base) = (its_database(&app.log(bench)), app.database_url.clone());
            async move {
                let new = new?;
                let url = db::with_database(&base, &new).ok()?;
                let bench_pool = db::connect(&url, 1).await.ok()?;
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM operations")
                    .fetch_one(&bench_pool)
                    .await
                    .ok()?;
                bench_pool.close().await;
                (n > 0).then_some((new, url))
            }
        })
        .await;
    app.signal(bench, "TERM");
    assert!(
        app.wait_exit(bench, DEADLINE).await,
        "the benchmark stops: {}",
        app.log(bench)
    );
    assert_ne!(
        app.exit_code(bench),
        Some(0),
        "a stopped run is not a result"
    );
    assert!(
        app.log(bench).contains("stopped by SIGTERM"),
        "it says why: {}",
        app.log(bench)
    );
    assert!(
        !bench_databases(&app.pool).await.contains(&database),
        "its database {} is dropped",
        agentq_core::config::redact_url(&url)
    );
    let tag = database.trim_start_matches("agentq_bench_");
    let conn = broker::connect(&app.amqp_url, "test")
        .await
        .expect("broker");
    let names = Names::new(&format!("agentq-bench-{tag}"));
    for lane in [Lane::Interactive, Lane::Batch] {
        assert!(
            broker::queue_depth(&conn, &names, lane).await.is_err(),
            "its {lane} queue is deleted"
        );
    }
    let _ = conn.close(200, "checked".into()).await;
    app.cleanup().await;
}

/// `batch` drains model steps answered by the bench's fake provider after
/// `--model-latency-ms`, and reports that provider's calls as `e2e` and `inflight` do.
#[tokio::test]
async fn a_batch_benchmark_drains_model_steps_through_its_fake_provider() {
    let app = TestApp::start().await;
    let out = app.agentq_ok(&[
        "bench",
        "--scenario",
        "batch",
        "--jobs",
        "200",
        "--concurrency",
        "32",
        "--model-latency-ms",
        "50",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON line: {stdout}"));
    assert_eq!(report["jobs"], 200, "{report}");
    assert!(
        report["model_calls"].as_u64().is_some_and(|n| n >= 200),
        "every operation's call went to the fake provider: {report}"
    );
    assert!(
        report["model_peak_concurrency"]
            .as_u64()
            .is_some_and(|n| n >= 1),
        "{report}"
    );
    assert_eq!(report["model_refused"], 0, "{report}");
    app.cleanup().await;
}
