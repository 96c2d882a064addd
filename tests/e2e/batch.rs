//! Batch campaigns of `doc_migration`: a 2,000-document migration survives an interrupted
//! enqueue and a killed worker with every target written once; auto-pause stops a batch when
//! the provider starts failing, and resume finishes it; batches complete (dead documents
//! counted), a DLQ retry reopens one; names, `batch list` and `GET /v1/batches`, confined to
//! the caller's tenant.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::Api;
use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// A directory removed when dropped.
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("agentq-{tag}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Writes `n` documents (some multi-paragraph, in two subdirectories); returns path → content.
pub(crate) fn write_docs(root: &Path, n: usize) -> BTreeMap<String, String> {
    let mut docs = BTreeMap::new();
    for i in 0..n {
        let kind = if i % 2 == 0 { "report" } else { "memo" };
        let rel = format!("{kind}s/doc-{i:05}.md");
        let text = format!(
            "Title: Document {i}\n\nFirst paragraph of this {kind}.\n\nSecond paragraph, number {}.",
            i * 7
        );
        let path = root.join(&rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        docs.insert(rel, text);
    }
    docs
}

/// Every file under `root` (relative path → bytes).
pub(crate) fn files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                let rel = e
                    .path()
                    .strip_prefix(root)
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                out.insert(rel, std::fs::read(e.path()).unwrap());
            }
        }
    }
    out
}

/// `agentq batch start --json` from `src` to `dst` with `instructions` (written to a file in
/// `tmp`) and `extra` flags.
pub(crate) fn start_batch(
    app: &TestApp,
    dirs: (&Path, &Path, &Path),
    instructions: &str,
    extra: &[&str],
) -> Value {
    let (src, dst, tmp) = dirs;
    let file = tmp.join("instructions.txt");
    std::fs::write(&file, instructions).unwrap();
    json_of(&start_in(app, "t1", (src, dst, &file), extra))
}

async fn batch_status(app: &TestApp, batch: &str) -> Value {
    app.agentq_json(&["batch", "status", batch, "--json"])
}

async fn count(app: &TestApp, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&app.pool).await.unwrap()
}

#[tokio::test]
async fn batch_migration_of_2000_documents_survives_an_interrupted_enqueue_and_a_killed_worker() {
    const N: usize = 2000;
    let mut app = TestApp::start().await;
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    let docs = write_docs(&src.0, N);
    let instructions = tmp.0.join("instructions.txt");
    std::fs::write(&instructions, "Keep the text as it is.").unwrap();
    let (s, d, i) = (
        app.dir_store("t1", &src.0, "read"),
        app.dir_store("t1", &dst.0, "write"),
        instructions.to_str().unwrap().to_string(),
    );
    let start = [
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        &s,
        "--target",
        &d,
        "--instructions",
        &i,
        "--json",
    ];

    // Ctrl-C the enqueue midway: in chunks of 25, held (by a test-only hook) once 8 chunks
    // are committed, so the signal lands with exactly 200 of 2,000 enqueued on any machine.
    // It is started as a shell starts a background job, with SIGINT ignored: the command's own
    // handler must stop it (SIGINT's default action never would there).
    const CHUNK: usize = 25;
    const CHUNKS_BEFORE_CTRL_C: usize = 8;
    let mut interrupted = start.to_vec();
    let chunk = CHUNK.to_string();
    interrupted.extend_from_slice(&["--chunk", &chunk]);
    let pause = agentq_app::batches::TEST_PAUSE_AFTER_CHUNKS;
    app.set_env(pause, &CHUNKS_BEFORE_CTRL_C.to_string());
    let enqueue = app.spawn_in_background(&interrupted);
    app.unset_env(pause);
    let held_at = (CHUNK * CHUNKS_BEFORE_CTRL_C) as i64;
    app.wait_for("the enqueue to be under way", DEADLINE, || async {
        app.operation_count().await == held_at
    })
    .await;
    assert!(
        !app.wait_exit(enqueue, Duration::ZERO).await,
        "the enqueue waits at its pause, unfinished"
    );
    app.signal(enqueue, "INT");
    assert!(
        app.wait_exit(enqueue, DEADLINE).await,
        "Ctrl-C ends the enqueue"
    );
    assert_eq!(
        app.exit_code(enqueue),
        Some(130),
        "a command stopped by Ctrl-C exits 130"
    );
    let before = app.operation_count().await;
    assert_eq!(
        before, held_at,
        "interrupted midway: {before} of {N} enqueued"
    );

    app.spawn(&["scheduler"]);
    let worker = app.spawn(&["worker"]);
    // Running it again enqueues only what is missing.
    let again = app.agentq_json(&start);
    assert_eq!(again["enqueued"], N as i64 - before, "{again}");
    assert_eq!(again["existing"], before, "{again}");
    let batch = again["batch_id"].as_str().unwrap().to_string();
    assert_eq!(app.operation_count().await, N as i64);

    // SIGKILL the worker midway; its leases expire and a new worker finishes the batch.
    app.wait_for(
        "a few hundred documents migrated",
        Duration::from_secs(120),
        || async {
            count(
                &app,
                "SELECT count(*) FROM operations WHERE status = 'succeeded'",
            )
            .await
                >= 300
        },
    )
    .await;
    app.kill(worker);
    app.spawn(&["worker"]);
    app.wait_for(
        "every document migrated",
        Duration::from_secs(240),
        || async {
            count(
                &app,
                "SELECT count(*) FROM operations WHERE status = 'succeeded'",
            )
            .await
                == N as i64
        },
    )
    .await;

    // Every target written exactly once: one file per document, the source's bytes, no temp files.
    let written = files(&dst.0);
    assert_eq!(written.len(), N, "one file per document, nothing else");
    for (rel, text) in &docs {
        let got = written
            .get(rel)
            .unwrap_or_else(|| panic!("{rel} not written"));
        assert_eq!(
            sha(got),
            sha(text.as_bytes()),
            "{rel}: the built-in model keeps the text"
        );
    }
    let status = batch_status(&app, &batch).await;
    assert_eq!(status["by_status"]["succeeded"], N as i64, "{status}");
    assert_eq!(status["unfinished"], 0);

    // The report accounts for every document once, with the hash that was written.
    let report = tmp.0.join("report.csv");
    app.agentq_ok(&[
        "batch",
        "report",
        &batch,
        "--format",
        "csv",
        "--out",
        report.to_str().unwrap(),
    ]);
    let csv = std::fs::read_to_string(&report).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("doc_id,op_id,status,attempt,error_class,error_message,sha256,finished_at")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), N);
    for row in &rows {
        assert_eq!(row[2], "succeeded", "{row:?}");
        assert_eq!(row[6], sha(docs[row[0]].as_bytes()), "{row:?}");
    }
    app.cleanup().await;
}

#[tokio::test]
async fn batch_auto_pauses_when_the_provider_fails_and_resume_finishes_it() {
    const N: usize = 120;
    let fake = FakeModel::start(Mode::Slow(Duration::from_millis(100))).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    write_docs(&src.0, N);
    let scheduler = app.spawn_logged(&["scheduler"]);
    app.spawn(&["worker"]);
    let started = start_batch(
        &app,
        (&src.0, &dst.0, &tmp.0),
        "Keep the text as it is.",
        &["--pause-window", "10", "--pause-ratio", "0.5"],
    );
    let batch = started["batch_id"].as_str().unwrap().to_string();
    app.wait_for(
        "the first documents migrated",
        Duration::from_secs(60),
        || async {
            count(
                &app,
                "SELECT count(*) FROM operations WHERE status = 'succeeded'",
            )
            .await
                >= 10
        },
    )
    .await;

    // The provider starts failing: the batch pauses within its window.
    fake.set(FakeModel::error(500, "server_error", ""));
    let paused = app
        .wait_until(
            "the batch to auto-pause",
            Duration::from_secs(60),
            || async {
                let s = batch_status(&app, &batch).await;
                (s["status"] == "paused").then_some(s)
            },
        )
        .await;
    assert!(
        paused["paused_reason"]
            .as_str()
            .unwrap()
            .starts_with("auto-paused: "),
        "{paused}"
    );
    let failed: i64 = count(&app, "SELECT count(*) FROM batch_outcomes WHERE NOT ok").await;
    assert!(failed >= 5, "paused after failures: {failed}");
    // Nothing new starts while paused: claims stop. First every attempt in flight settles
    // (none of the batch's operations is running any more). Claims are counted by epoch, which
    // every claim raises, not by attempt, which a claim parked by the open breaker gives back.
    let claims = || {
        count(
            &app,
            "SELECT COALESCE(sum(epoch), 0)::bigint FROM operations WHERE batch_id IS NOT NULL",
        )
    };
    app.wait_for(
        "in-flight attempts to settle",
        Duration::from_secs(30),
        || async {
            count(
                &app,
                "SELECT count(*) FROM operations WHERE batch_id IS NOT NULL AND status = 'running'",
            )
            .await
                == 0
        },
    )
    .await;
    let settled = claims().await;
    let unfinished = count(
        &app,
        "SELECT count(*) FROM operations WHERE batch_id IS NOT NULL AND status <> 'succeeded'",
    )
    .await;
    assert!(unfinished > 0, "the pause left work undone");
    assert!(
        app.log(scheduler).contains("batch auto-paused"),
        "the scheduler logs the pause"
    );
    let history = count(
        &app,
        "SELECT count(*) FROM operator_actions WHERE action = 'batch_paused' AND actor = 'scheduler'",
    )
    .await;
    assert_eq!(history, 1, "the pause is audited");
    // Every queued operation of the paused batch is made due and its pointer delivered again
    // (as a redelivery or a sweep might): the claim itself must start none of them. Then an
    // operation enqueued on the same lane after those pointers runs, so the worker has taken
    // every delivery before it, and still none of the paused batch's operations was claimed.
    let due: Vec<(uuid::Uuid,)> = sqlx::query_as(
        "UPDATE operations SET run_at = now() WHERE batch_id IS NOT NULL AND status = 'queued'
         RETURNING id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert!(!due.is_empty(), "the pause left queued operations to test");
    let conn = agentq_core::broker::connect(&app.amqp_url, "test")
        .await
        .unwrap();
    let publisher = agentq_core::broker::Publisher::open(&conn, app.names())
        .await
        .unwrap();
    for (id,) in &due {
        let pointer = agentq_core::operation::Pointer::new(
            agentq_core::operation::OperationId(*id),
            "t1",
            "doc_migration",
        );
        publisher
            .publish(&pointer, agentq_core::Lane::Batch)
            .await
            .unwrap();
    }
    let _ = conn.close(200, "done".into()).await;
    let probe = app.enqueue_script(json!([{ "work_ms": 0 }]), &["--lane", "batch"]);
    app.wait_status(&probe, "succeeded", DEADLINE).await;
    assert_eq!(claims().await, settled, "no claims while paused");

    // The provider recovers; resume finishes the batch.
    fake.set(Mode::Echo);
    app.agentq_ok(&["batch", "resume", &batch]);
    app.wait_for(
        "the batch to finish after resume",
        Duration::from_secs(120),
        || async {
            count(
                &app,
                "SELECT count(*) FROM operations WHERE batch_id IS NOT NULL AND status = 'succeeded'",
            )
            .await
                == N as i64
        },
    )
    .await;
    assert_eq!(files(&dst.0).len(), N);
    let done = app
        .wait_until("the batch to complete", DEADLINE, || async {
            let s = batch_status(&app, &batch).await;
            (s["status"] == "completed").then_some(s)
        })
        .await;
    // Its rate is over its running time: the stretch it was paused is not in it.
    let times: (f64, f64) = sqlx::query_as(
        "SELECT extract(epoch FROM finished_at - started_at)::float8,
                (SELECT extract(epoch FROM max(created_at) FILTER (WHERE action = 'batch_running')
                                         - min(created_at) FILTER (WHERE action = 'batch_paused'))
                   FROM operator_actions)::float8
           FROM batches",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let (wall, paused) = times;
    let running = done["running_secs"].as_f64().unwrap();
    assert!(
        running > 0.0 && running <= wall - paused + 0.2,
        "running {running} s of {wall} s, {paused} s of it paused: {done}"
    );
    assert_eq!(done["eta_secs"], Value::Null, "{done}");
    app.cleanup().await;
}

/// A resume retries at once what waited out a retry's delay: three documents rate limited
/// with ten minutes to wait, the batch paused and resumed, all three migrate now. (The delays
/// are cut in a statement of their own, committed before the pointers go: cut under the lock
/// they are sent under, a claim that came before the commit read the row as not due and
/// dropped its pointer, and the operation sat queued until the lost-pointer sweep a minute
/// on. That race is argued in `db::dispatch::Locked`; this test does not force it.)
#[tokio::test]
async fn a_resume_retries_at_once_what_waited_out_a_retry_delay() {
    const N: usize = 3;
    let fake = FakeModel::start(Mode::Error {
        status: 429,
        body: json!({ "error": { "message": "slow down", "type": "rate_limit", "code": "" } }),
        headers: vec![("Retry-After".into(), "600".into())],
    })
    .await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    write_docs(&src.0, N);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let started = start_batch(
        &app,
        (&src.0, &dst.0, &tmp.0),
        "Keep the text as it is.",
        &[],
    );
    let batch = started["batch_id"].as_str().unwrap().to_string();
    app.wait_for("every document waiting to retry", DEADLINE, || async {
        count(
            &app,
            "SELECT count(*) FROM operations
              WHERE status = 'queued' AND attempt = 1 AND run_at > now() + interval '5 minutes'",
        )
        .await
            == N as i64
    })
    .await;
    app.agentq_ok(&["batch", "pause", &batch, "--reason", "fix the rate"]);
    fake.set(Mode::Echo);
    app.agentq_ok(&["batch", "resume", &batch]);
    app.wait_until("the batch to complete", DEADLINE, || async {
        let s = batch_status(&app, &batch).await;
        (s["status"] == "completed").then_some(s)
    })
    .await;
    assert_eq!(files(&dst.0).len(), N);
    assert_eq!(
        fake.requests(),
        2 * N,
        "each document rate limited once, then migrated"
    );
    app.cleanup().await;
}

/// docs/dlq.md's "Draining the DLQ" walkthrough: a bad instruction fails the memos, three
/// empty files can never succeed, a provider outage only parks operations; the operator
/// discards the broken, retries the rest with the instruction fixed, and the batch completes.
#[tokio::test]
async fn batch_dlq_drain_walkthrough() {
    let fake = FakeModel::start(FakeModel::error(529, "overloaded_error", "")).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    let docs = write_docs(&src.0, 40); // 20 reports, 20 memos
    for empty in [
        "reports/empty-1.md",
        "reports/empty-2.md",
        "reports/empty-3.md",
    ] {
        std::fs::write(src.0.join(empty), "").unwrap();
    }
    let good = "Rewrite each document as plain English; keep the Title: line.";
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    // A wide auto-pause window: this walkthrough wants every failure at once.
    let started = start_batch(
        &app,
        (&src.0, &dst.0, &tmp.0),
        &format!("{good} Also drop titles from memos."),
        &["--require", "Title:", "--pause-window", "1000"],
    );
    let batch = started["batch_id"].as_str().unwrap().to_string();
    assert_eq!(started["enqueued"], 43);
    // The outage parks what it touches; then the provider comes back.
    app.wait_for(
        "the outage to park operations",
        Duration::from_secs(30),
        || async {
            count(
                &app,
                "SELECT count(*) FROM operations WHERE error_class = 'overloaded'",
            )
            .await
                > 0
        },
    )
    .await;
    fake.set(Mode::Obey);
    let settled = app
        .wait_until("the batch to settle", Duration::from_secs(90), || async {
            let s = batch_status(&app, &batch).await;
            (s["unfinished"] == 0).then_some(s)
        })
        .await;
    assert_eq!(settled["by_status"]["succeeded"], 20, "{settled}");
    assert_eq!(settled["by_status"]["dead"], 23, "{settled}");
    // Every document has an outcome, dead ones too: the batch completes, with its failures.
    let completed = app
        .wait_until("the batch to complete", DEADLINE, || async {
            let s = batch_status(&app, &batch).await;
            (s["status"] == "completed").then_some(s)
        })
        .await;
    assert!(completed["finished_at"].is_string(), "{completed}");
    assert_eq!(completed["by_status"]["dead"], 23, "{completed}");
    assert_eq!(completed["eta_secs"], Value::Null);
    let reasons: Vec<&str> = settled["top_failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["reason"].as_str().unwrap())
        .collect();
    assert!(reasons.contains(&"document is empty"), "{settled}");

    // dlq stats groups them; list finds the empty ones; discard them with a reason.
    let stats = app.agentq(&["dlq", "stats", "--batch", &batch, "--json"]);
    let groups: Vec<Value> = String::from_utf8_lossy(&stats.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!(
        groups
            .iter()
            .map(|g| g["count"].as_i64().unwrap())
            .sum::<i64>(),
        23
    );
    let listed = app.agentq(&["dlq", "list", "--batch", &batch, "--json"]);
    let empty: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|d| d["reason"] == "document is empty")
        .map(|d| d["op_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(empty.len(), 3);
    let mut discard = vec![
        "dlq",
        "discard",
        "--reason",
        "empty source file; owner notified",
    ];
    discard.extend(empty.iter().map(String::as_str));
    app.agentq_ok(&discard);

    // Dry run first, then the retry with the instruction fixed.
    let dry = app.agentq_ok(&[
        "dlq",
        "retry",
        "--batch",
        &batch,
        "--class",
        "non_retryable",
        "--dry-run",
    ]);
    assert_eq!(String::from_utf8_lossy(&dry.stdout).lines().count(), 20);
    let patch = serde_json::json!({ "instructions": good }).to_string();
    app.agentq_ok(&[
        "dlq",
        "retry",
        "--batch",
        &batch,
        "--class",
        "non_retryable",
        "--reason",
        "instructions fixed",
        "--patch-input",
        &patch,
    ]);
    // The retry reopened the batch (in its own transaction), and it completes again.
    let done = app
        .wait_until("the batch to complete", Duration::from_secs(60), || async {
            let s = batch_status(&app, &batch).await;
            (s["status"] == "completed" && s["by_status"]["succeeded"] == 40).then_some(s)
        })
        .await;
    assert_eq!(done["by_status"]["discarded"], 3, "{done}");
    assert_eq!(done["unfinished"], 0, "{done}");
    let first: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(completed["finished_at"].clone()).unwrap();
    let again: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(done["finished_at"].clone()).unwrap();
    assert!(again > first, "{first} then {again}");
    for (rel, text) in &docs {
        let got = std::fs::read_to_string(dst.0.join(rel)).unwrap();
        assert_eq!(&got, text, "{rel} migrated with its title");
    }
    // The audit trail shows each step, and the batch completing, reopening and completing.
    let actions: Vec<(String, i64)> = sqlx::query_as(
        "SELECT action || ':' || COALESCE(reason, ''), count(*) FROM operator_actions
          WHERE action IN ('discard', 'retry', 'batch_completed', 'batch_reopen')
          GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        actions,
        vec![
            ("batch_completed:".to_string(), 2),
            ("batch_reopen:".to_string(), 1),
            ("discard:empty source file; owner notified".to_string(), 3),
            ("retry:instructions fixed".to_string(), 20)
        ]
    );
    app.cleanup().await;
}

/// The walkthrough's canary: only the first N documents run until `batch resume`; here from a
/// table to a table, with a pause and a cancel refused or applied as the state allows.
#[tokio::test]
async fn batch_canary_runs_first_then_resume_runs_the_rest_from_a_table() {
    const N: i64 = 30;
    let mut app = TestApp::start().await;
    sqlx::query("CREATE TABLE docs_in (id text PRIMARY KEY, body text)")
        .execute(&app.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO docs_in SELECT 'doc-' || g, 'Title: ' || g || E'\\n\\nbody ' || g
           FROM generate_series(1, $1) g",
    )
    .bind(N)
    .execute(&app.pool)
    .await
    .unwrap();
    let tmp = TempDir::new("cfg");
    let file = tmp.0.join("instructions.txt");
    std::fs::write(&file, "Keep the text as it is.").unwrap();
    app.add_store("t1", "docs_in", &["--table", "docs_in"], "read");
    app.add_store("t1", "docs_out", &["--table", "docs_out"], "write");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let started = app.agentq_json(&[
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        "docs_in",
        "--target",
        "docs_out",
        "--instructions",
        file.to_str().unwrap(),
        "--require",
        "Title:",
        "--canary",
        "5",
        "--json",
    ]);
    assert_eq!(started["status"], "canary", "{started}");
    assert_eq!(
        (started["documents"].as_i64(), started["enqueued"].as_i64()),
        (Some(N), Some(5))
    );
    let batch = started["batch_id"].as_str().unwrap().to_string();
    app.wait_until("the canary to finish", Duration::from_secs(60), || async {
        let s = batch_status(&app, &batch).await;
        (s["by_status"]["succeeded"] == 5).then_some(())
    })
    .await;
    assert_eq!(app.operation_count().await, 5, "nothing but the canary ran");
    // The canary waits for a person: no ETA, and no running time while it waits.
    let waiting = batch_status(&app, &batch).await;
    assert_eq!(
        (
            &waiting["status"],
            &waiting["eta_secs"],
            &waiting["running_secs"]
        ),
        (&json!("canary"), &Value::Null, &json!(0.0)),
        "{waiting}"
    );
    // A paused batch refuses a second pause; resume runs the rest.
    assert_eq!(
        app.agentq(&["batch", "cancel", "not-a-uuid"]).status.code(),
        Some(2)
    );
    let resumed = app.agentq_json(&["batch", "resume", &batch, "--json"]);
    assert_eq!(resumed["enqueued"], N - 5, "{resumed}");
    assert_eq!(resumed["was"], "canary");
    let done = app
        .wait_until("the batch to complete", Duration::from_secs(60), || async {
            let s = batch_status(&app, &batch).await;
            (s["status"] == "completed").then_some(s)
        })
        .await;
    assert_eq!(done["by_status"], json!({ "succeeded": N }), "{done}");
    let (started, finished): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) = (
        serde_json::from_value(done["started_at"].clone()).unwrap(),
        serde_json::from_value(done["finished_at"].clone()).unwrap(),
    );
    assert!(finished > started, "{done}");
    assert!(done["running_secs"].as_f64().unwrap() > 0.0, "{done}");
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT doc_id, body FROM docs_out ORDER BY doc_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(rows.len() as i64, N, "one row per document");
    assert!(
        rows.iter()
            .all(|(id, body)| body.starts_with("Title: ") && id.starts_with("doc-"))
    );
    // Completed, it is neither paused nor cancelled, and says why.
    for control in ["pause", "cancel"] {
        let out = app.agentq(&["batch", control, &batch, "--reason", "done anyway"]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{control}: {said}");
        assert!(said.contains("is completed"), "{control}: {said}");
    }
    assert_eq!(batch_status(&app, &batch).await["status"], "completed");
    let report = app.agentq_ok(&["batch", "report", &batch]);
    let lines: Vec<Value> = String::from_utf8_lossy(&report.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as i64, N);
    assert!(
        lines
            .iter()
            .all(|l| l["status"] == "succeeded" && l["sha256"].is_string())
    );
    app.cleanup().await;
}

#[tokio::test]
async fn workers_dying_do_not_auto_pause_a_batch_failing_documents_do() {
    let app = TestApp::start().await;
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    write_docs(&src.0, 1);
    let instructions = tmp.0.join("instructions.txt");
    std::fs::write(&instructions, "Keep the text as it is.").unwrap();
    let (src, dst) = (
        app.dir_store("t1", &src.0, "read"),
        app.dir_store("t1", &dst.0, "write"),
    );
    let started = app.agentq_json(&[
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        &src,
        "--target",
        &dst,
        "--instructions",
        instructions.to_str().unwrap(),
        "--json",
    ]);
    let batch: uuid::Uuid = started["batch_id"].as_str().unwrap().parse().unwrap();
    let outcomes = |n: i32, class: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO batch_outcomes (batch_id, ok, error_class)
                 SELECT $1, false, $3 FROM generate_series(1, $2)",
            )
            .bind(batch)
            .bind(n)
            .bind(class)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    // A killed worker's operations come back through lease expiry: 40 of them fill the window
    // twice over, and the batch keeps running.
    outcomes(40, "lease_expired").await;
    let paused = agentq_core::db::batches::auto_pause(&app.pool)
        .await
        .unwrap();
    assert!(paused.is_empty(), "paused by worker deaths");
    // Documents failing do pause it.
    outcomes(20, "non_retryable").await;
    let paused = agentq_core::db::batches::auto_pause(&app.pool)
        .await
        .unwrap();
    assert_eq!(paused.iter().map(|p| p.id).collect::<Vec<_>>(), vec![batch]);
    app.cleanup().await;
}

/// `agentq batch start` in `tenant` from `src` to `dst` with `instructions`, as JSON; `extra`
/// flags after (a name, a canary).
fn start_in(app: &TestApp, tenant: &str, dirs: (&Path, &Path, &Path), extra: &[&str]) -> Output {
    let (src, dst, file) = dirs;
    let (src, dst) = (
        app.dir_store(tenant, src, "read"),
        app.dir_store(tenant, dst, "write"),
    );
    let mut args = vec![
        "batch",
        "start",
        "--tenant",
        tenant,
        "--source",
        &src,
        "--target",
        &dst,
        "--instructions",
        file.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    app.agentq(&args)
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A named batch runs to `completed` with its times; `batch list` and `GET /v1/batches` show
/// it by name, newest first, a page at a time; `batch status NAME` and `/v1/batches/NAME`
/// find it; a name is unique in its tenant (a duplicate changes nothing) and free in another;
/// another tenant's operator neither sees nor resolves it (404, not 403), and a name two
/// tenants use needs `--tenant` on the command line.
#[tokio::test]
async fn a_named_batch_completes_and_is_listed_and_found_by_name_in_its_tenant_only() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let operator = app.token("t1", "operator");
    let other = app.token("t2", "operator");
    let producer = app.token("t1", "producer");
    let admin = app.token("t1", "admin");
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    write_docs(&src.0, 4);
    let file = tmp.0.join("instructions.txt");
    std::fs::write(&file, "Keep the text as it is.").unwrap();
    let dirs = (src.0.as_path(), dst.0.as_path(), file.as_path());
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);

    // A name that reads as a UUID is refused before anything is written.
    let out = start_in(
        &app,
        "t1",
        dirs,
        &["--name", &uuid::Uuid::new_v4().to_string()],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("reads as a UUID"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = json_of(&start_in(&app, "t1", dirs, &["--name", "nightly"]));
    assert_eq!(started["name"], "nightly", "{started}");
    let id = started["batch_id"].as_str().unwrap().to_string();
    let done = app
        .wait_until("the batch to complete", DEADLINE, || async {
            let s = batch_status(&app, "nightly").await;
            (s["status"] == "completed").then_some(s)
        })
        .await;
    assert_eq!(
        (&done["batch_id"], &done["name"], &done["by_status"]),
        (&json!(id), &json!("nightly"), &json!({ "succeeded": 4 })),
        "{done}"
    );
    assert!(done["started_at"].is_string() && done["finished_at"].is_string());
    assert_eq!(done["eta_secs"], Value::Null);
    let text = app.agentq_ok(&["batch", "status", "nightly"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("\"nightly\"  completed") && text.contains("finished 20"),
        "{text}"
    );

    // A second batch (other instructions: another id) may not take the name; nothing changes.
    let (batches, operations) = (
        count(&app, "SELECT count(*) FROM batches").await,
        app.operation_count().await,
    );
    let file2 = tmp.0.join("instructions-2.txt");
    std::fs::write(&file2, "Keep it, again.").unwrap();
    let dirs2 = (src.0.as_path(), dst.0.as_path(), file2.as_path());
    let out = start_in(&app, "t1", dirs2, &["--name", "nightly"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("already has a batch named"), "{said}");
    let body = json!({ "source": app.dir_store("t1", &src.0, "read"),
                       "target": app.dir_store("t1", &dst.0, "write"),
                       "instructions": "Keep it, again.", "name": "nightly" });
    // A 503 (the broker was not reachable when the request came: nothing started) is retried,
    // as its Retry-After asks.
    app.wait_until("the start to be admitted", DEADLINE, || async {
        let r = api.post("/v1/batches", Some(&operator), &body).await;
        (r.status != 503).then_some(r)
    })
    .await
    .problem(409, "conflict");
    assert_eq!(count(&app, "SELECT count(*) FROM batches").await, batches);
    assert_eq!(app.operation_count().await, operations);
    // Unnamed, it starts; it is the newest.
    let second = json_of(&start_in(&app, "t1", dirs2, &[]));
    let second = second["batch_id"].as_str().unwrap().to_string();

    // The CLI's list, newest first, filtered by status.
    let listed = app.agentq_json_lines(&["batch", "list", "--json"]);
    let ids: Vec<&str> = listed
        .iter()
        .map(|b| b["batch_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [second.as_str(), id.as_str()], "{listed:?}");
    assert_eq!(listed[1]["name"], "nightly");
    assert_eq!(listed[1]["status"], "completed");
    assert_eq!(listed[1]["succeeded"], 4);
    let completed = app.agentq_json_lines(&["batch", "list", "--status", "completed", "--json"]);
    assert!(
        completed.iter().all(|b| b["status"] == "completed"),
        "{completed:?}"
    );
    assert!(completed.iter().any(|b| b["batch_id"] == json!(id)));
    assert_eq!(
        app.agentq(&["batch", "list", "--status", "done"])
            .status
            .code(),
        Some(2)
    );

    // The API's list, a page of one at a time, and the batch by name.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..10 {
        let path = match &after {
            Some(a) => format!("/v1/batches?limit=1&after={}", crate::api::urlencode(a)),
            None => "/v1/batches?limit=1".to_string(),
        };
        let page = api.get(&path, Some(&operator)).await.expect(200);
        for b in page["items"].as_array().unwrap() {
            seen.push(b["batch_id"].as_str().unwrap().to_string());
        }
        match page["next_cursor"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, [second.clone(), id.clone()]);
    let only = api
        .get("/v1/batches?status=completed", Some(&operator))
        .await
        .expect(200);
    assert!(
        only["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|b| b["batch_id"] == json!(id) && b["name"] == "nightly"),
        "{only}"
    );
    let shown = api
        .get("/v1/batches/nightly", Some(&operator))
        .await
        .expect(200);
    assert_eq!(
        (&shown["batch_id"], &shown["status"]),
        (&json!(id), &json!("completed"))
    );
    // Wherever a batch id is taken, the name is too: the operations and dead letters of a
    // batch, on the command line and in the API (a producer's list included); a name the
    // caller's tenant does not have is refused, naming the filter.
    let ops = app.agentq_json_lines(&["list", "--batch", "nightly", "--json"]);
    assert_eq!(ops.len(), 4, "{ops:?}");
    assert!(ops.iter().all(|o| o["batch_id"] == json!(id)), "{ops:?}");
    for token in [&operator, &producer] {
        let page = api
            .get("/v1/operations?batch=nightly", Some(token))
            .await
            .expect(200);
        assert_eq!(page["items"].as_array().unwrap().len(), 4, "{page}");
    }
    let refused = api
        .get("/v1/operations?batch=nightly", Some(&other))
        .await
        .problem(400, "invalid-request");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap()
            .contains("no batch named"),
        "{refused}"
    );
    let dead = app.agentq_json_lines(&["dlq", "list", "--batch", "nightly", "--json"]);
    assert_eq!(dead, Vec::<Value>::new());
    let out = app.agentq(&["dlq", "list", "--batch", "no-such"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("--batch") && said.contains("no batch named"),
        "{said}"
    );
    // Completed: pause and cancel are refused and change nothing.
    for control in ["pause", "cancel"] {
        api.post(
            &format!("/v1/batches/nightly/{control}"),
            Some(&operator),
            &json!({}),
        )
        .await
        .problem(409, "conflict");
    }

    // Another tenant's operator: nothing listed, nothing found by name or id; a producer's
    // token is below the route's role.
    let theirs = api.get("/v1/batches", Some(&other)).await.expect(200);
    assert_eq!(theirs["items"], json!([]), "{theirs}");
    for path in [
        "/v1/batches/nightly".to_string(),
        format!("/v1/batches/{id}"),
        "/v1/batches/nightly/report".to_string(),
    ] {
        api.get(&path, Some(&other)).await.problem(404, "not-found");
    }
    api.post("/v1/batches/nightly/pause", Some(&other), &json!({}))
        .await
        .problem(404, "not-found");
    api.get("/v1/batches", Some(&producer))
        .await
        .problem(403, "forbidden");
    let admins = api
        .get("/v1/batches?tenant=t2", Some(&admin))
        .await
        .expect(200);
    assert_eq!(admins["items"], json!([]), "{admins}");

    // The name is free in another tenant; then a bare name is ambiguous for the command line
    // (an admin of every tenant) until --tenant says which.
    let (src2, dst2) = (TempDir::new("src"), TempDir::new("dst"));
    write_docs(&src2.0, 1);
    let t2 = json_of(&start_in(
        &app,
        "t2",
        (src2.0.as_path(), dst2.0.as_path(), file.as_path()),
        &["--name", "nightly"],
    ));
    let out = app.agentq(&["batch", "status", "nightly"]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("t1, t2") && said.contains("--tenant"),
        "{said}"
    );
    let mine = app.agentq_json(&["batch", "status", "nightly", "--tenant", "t2", "--json"]);
    assert_eq!(mine["batch_id"], t2["batch_id"]);
    let theirs = api
        .get("/v1/batches/nightly", Some(&other))
        .await
        .expect(200);
    assert_eq!(theirs["batch_id"], t2["batch_id"]);
    let missing = app.agentq(&["batch", "status", "no-such-batch"]);
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no batch named \"no-such-batch\""),
        "{}",
        String::from_utf8_lossy(&missing.stderr)
    );
    app.cleanup().await;
}
