//! The built-in `doc_migration` kind end to end: directory → directory and table → table with
//! the built-in model (an identity transform), re-runs that rewrite the same targets, chunking
//! into several transform steps, a validation failure that is dead as non-retryable (and an
//! operator's patched retry that runs a new round), a low-confidence document that waits for a
//! human review (edit, reject, retry, approve), and a worker SIGKILLed mid-migration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp, running_app};

/// A directory under the system temp dir, removed when dropped (also when a test fails).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "agentq-e2e-doc-migration-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Every file under `dir`, as paths relative to it, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(
                    path.strip_prefix(dir)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
    }
    out.sort();
    out
}

/// Registers `src` (read) and `out` (write) as tenant t1's stores `src` and `out`.
fn dir_stores(app: &TestApp, src: &Path, out: &Path) {
    app.add_store("t1", "src", &["--dir", src.to_str().unwrap()], "read");
    app.add_store("t1", "out", &["--dir", out.to_str().unwrap()], "write");
}

fn enqueue(app: &TestApp, input: &Value) -> String {
    let input = input.to_string();
    let v = app.agentq_json(&[
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "doc_migration",
        "--input",
        &input,
        "--json",
    ]);
    v["op_id"].as_str().unwrap().to_string()
}

fn step_names(app: &TestApp, op: &str) -> Vec<String> {
    let out = app.agentq_ok(&["steps", op, "--json"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            v["name"].as_str().unwrap().to_string()
        })
        .collect()
}

#[tokio::test]
async fn documents_migrate_between_directories_and_tables_and_reruns_rewrite_the_same_targets() {
    let app = running_app().await;
    let scratch = Scratch::new();
    let (src, out) = (scratch.path("src"), scratch.path("out"));
    dir_stores(&app, &src, &out);
    let long: String = (1..=8)
        .map(|i| format!("Paragraph {i}: {}", "lorem ipsum ".repeat(4)))
        .collect::<Vec<_>>()
        .join("\n\n");
    let docs = [
        (
            "notes/plain.md",
            "Title: Plain\n\nhello world\n".to_string(),
        ),
        (
            "ünïcødé/日本.md",
            "Title: Ünïcødé 🦀\n\nこんにちは、世界。\n\n\n".to_string(),
        ),
        ("long.md", format!("Title: Long\n\n{long}\n")),
    ];
    for (id, text) in &docs {
        write(&src.join(id), text);
    }
    let input = |id: &str| {
        json!({
            "doc_id": id,
            "source": { "store": "src" },
            "target": { "store": "out" },
            "instructions": "Keep the text exactly as it is.",
            "chunk_chars": if id == "long.md" { 100 } else { 8000 },
            "validate": { "required": ["Title:"] },
        })
    };

    // First run, then a second operation per document (a re-run, as after a lost batch).
    let mut hashes = Vec::new();
    for round in 0..2 {
        let ops: Vec<String> = docs
            .iter()
            .map(|(id, _)| enqueue(&app, &input(id)))
            .collect();
        for (op, (id, text)) in ops.iter().zip(&docs) {
            let v = app.wait_status(op, "succeeded", DEADLINE).await;
            let result = v.result.unwrap();
            let written = std::fs::read(out.join(id)).unwrap();
            assert_eq!(
                written,
                text.as_bytes(),
                "{id}: the built-in model is an identity"
            );
            assert_eq!(result["sha256"], sha256_hex(text.as_bytes()), "{id}");
            assert_eq!(result["bytes"], text.len());
            assert_eq!(result["doc_id"], *id);
            assert_eq!(result["reviewed"], false);
            assert_eq!(result["confidence"], 1.0);
            if round == 0 {
                hashes.push(result["sha256"].clone());
            } else {
                assert_eq!(hashes.remove(0), result["sha256"], "{id}: the same hash");
            }
            if *id == "long.md" {
                let chunks = result["chunks"].as_u64().unwrap() as usize;
                assert!(chunks >= 4, "{chunks} chunks");
                let names = step_names(&app, op);
                let transforms: Vec<String> =
                    (0..chunks).map(|i| format!("transform:{i}")).collect();
                let mut expected = vec!["read".to_string(), "plan".into()];
                expected.extend(transforms);
                expected.extend(["validate".into(), "write".into()]);
                assert_eq!(names, expected);
            } else {
                assert_eq!(result["chunks"], 1, "{id}");
            }
        }
        // One file per document, nothing else (no temporary file, no duplicate).
        let mut expected: Vec<String> = docs.iter().map(|(id, _)| id.to_string()).collect();
        expected.sort();
        assert_eq!(files(&out), expected);
    }

    // A table source and a table target (created by the first write).
    sqlx::query("CREATE TABLE docs_in (id text PRIMARY KEY, body text)")
        .execute(&app.pool)
        .await
        .unwrap();
    let rows = [
        ("a-1", "Title: A\n\nfrom a table\n"),
        ("b-2", "Title: B 🦀\n"),
    ];
    for (id, body) in rows {
        sqlx::query("INSERT INTO docs_in (id, body) VALUES ($1, $2)")
            .bind(id)
            .bind(body)
            .execute(&app.pool)
            .await
            .unwrap();
    }
    app.add_store("t1", "docs_in", &["--table", "docs_in"], "read");
    app.add_store("t1", "docs_out", &["--table", "docs_out"], "write");
    let table_input = |id: &str| {
        json!({
            "doc_id": id,
            "source": { "store": "docs_in" },
            "target": { "store": "docs_out" },
            "instructions": "Keep the text exactly as it is.",
        })
    };
    let mut last_op = String::new();
    for _ in 0..2 {
        for (id, body) in rows {
            let op = enqueue(&app, &table_input(id));
            let v = app.wait_status(&op, "succeeded", DEADLINE).await;
            assert_eq!(v.result.unwrap()["sha256"], sha256_hex(body.as_bytes()));
            last_op = op;
        }
    }
    let written: Vec<(String, String, String, uuid::Uuid)> =
        sqlx::query_as("SELECT doc_id, body, sha256, op_id FROM docs_out ORDER BY doc_id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(written.len(), 2, "one row per document after two runs");
    for ((doc_id, body, sha, _), (id, text)) in written.iter().zip(rows) {
        assert_eq!((doc_id.as_str(), body.as_str()), (id, text));
        assert_eq!(*sha, sha256_hex(text.as_bytes()));
    }
    assert_eq!(
        written[1].3.to_string(),
        last_op,
        "the row says which operation wrote it"
    );

    // Many first writes at once may all try to create the table: none fails.
    let racing = agentq_core::db::batch_source::Ident::table("public.docs_raced").unwrap();
    let creates =
        (0..8).map(|_| agentq_kinds::tables::docs::create_target_table(&app.pool, &racing));
    for created in futures_util::future::join_all(creates).await {
        created.unwrap();
    }

    // A row that is not there fails for good, saying so.
    let op = enqueue(&app, &table_input("nope"));
    let v = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(v.error_class.as_deref(), Some("non_retryable"));
    assert!(v.error_message.unwrap().contains("document not found"));

    drop(scratch);
    app.cleanup().await;
}

#[tokio::test]
async fn a_missing_required_string_is_dead_and_a_patched_retry_runs_a_new_round() {
    let app = running_app().await;
    let scratch = Scratch::new();
    let (src, out) = (scratch.path("src"), scratch.path("out"));
    dir_stores(&app, &src, &out);
    write(&src.join("memo.md"), "Memo without a heading\n");
    let input = json!({
        "doc_id": "memo.md",
        "source": { "store": "src" },
        "target": { "store": "out" },
        "instructions": "Add a Title: line.",
        "validate": { "required": ["Title:"] },
    });

    // Inputs that cannot work are refused at enqueue, with nothing written: a path or a table
    // instead of a store, a store the tenant lacks, or has without the access needed.
    for (bad, says) in [
        (json!({ "doc_id": "../memo.md" }), "doc_migration"),
        (json!({ "doc_id": "/etc/passwd" }), "doc_migration"),
        (json!({ "source": { "dir": src } }), "agentq stores add"),
        (
            json!({ "source": { "store": "nope" } }),
            "has no store \"nope\"",
        ),
        (
            json!({ "target": { "store": "src" } }),
            "registered for read only",
        ),
        (
            json!({ "target": { "dir": "relative/out" } }),
            "agentq stores add",
        ),
    ] {
        let mut v = input.clone();
        for (k, x) in bad.as_object().unwrap() {
            v[k] = x.clone();
        }
        let out = app.agentq(&[
            "enqueue",
            "--tenant",
            "t1",
            "--kind",
            "doc_migration",
            "--input",
            &v.to_string(),
        ]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{bad}: {stderr}");
    }
    assert_eq!(app.operation_count().await, 0);

    let op = enqueue(&app, &input);
    let v = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(v.error_class.as_deref(), Some("non_retryable"));
    assert_eq!(
        v.error_message.as_deref(),
        Some("validation failed: the output lacks the required string \"Title:\"")
    );
    assert_eq!(v.attempt, 1, "not retried");
    assert!(!out.join("memo.md").exists(), "nothing written");

    // The operator fixes the instruction (and drops the check): the retry sees that the
    // recorded transform was made with other instructions and runs a new round, which starts
    // where the failed step was.
    let patch = json!({ "instructions": "Keep it as it is.", "validate": null }).to_string();
    app.agentq_ok(&[
        "dlq",
        "retry",
        &op,
        "--patch-input",
        &patch,
        "--reason",
        "fixed the instruction",
    ]);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        std::fs::read_to_string(out.join("memo.md")).unwrap(),
        "Memo without a heading\n"
    );
    assert_eq!(
        step_names(&app, &op),
        [
            "read",
            "plan",
            "transform:0",
            "plan",
            "transform:0",
            "validate",
            "write"
        ]
    );

    // A document that is not there is dead at once with a clear reason.
    let mut missing = input.clone();
    missing["doc_id"] = json!("absent.md");
    let op = enqueue(&app, &missing);
    let v = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(v.error_class.as_deref(), Some("non_retryable"));
    assert_eq!(
        v.error_message.as_deref(),
        Some("document not found in the source store")
    );

    drop(scratch);
    app.cleanup().await;
}

#[tokio::test]
async fn a_low_confidence_document_waits_for_a_review_and_the_decision_is_applied() {
    let fake = FakeModel::start(Mode::EchoSuffix("\nconfidence: 0.1".into())).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let scratch = Scratch::new();
    let (src, out) = (scratch.path("src"), scratch.path("out"));
    dir_stores(&app, &src, &out);
    write(&src.join("edit.md"), "Title: Draft\n\nunsure text\n");
    write(&src.join("reject.md"), "Title: Other\n\nalso unsure\n");
    let input = |id: &str| {
        json!({
            "doc_id": id,
            "source": { "store": "src" },
            "target": { "store": "out" },
            "instructions": "Polish the prose.",
            "review": { "timeout_ms": 600000 },
        })
    };

    // Edited by the reviewer: the edit is what gets written.
    let op = enqueue(&app, &input("edit.md"));
    let v = app.wait_status(&op, "waiting", DEADLINE).await;
    assert_eq!(v.waiting_for.as_deref(), Some("review"));
    assert!(!out.join("edit.md").exists());
    let edited = "Title: Final\n\nreviewed text\n";
    let payload = json!({ "decision": "edit", "text": edited }).to_string();
    app.agentq_ok(&["signal", &op, "review", "--payload", &payload]);
    let v = app.wait_status(&op, "succeeded", DEADLINE).await;
    let result = v.result.unwrap();
    assert_eq!(
        std::fs::read_to_string(out.join("edit.md")).unwrap(),
        edited
    );
    assert_eq!(result["sha256"], sha256_hex(edited.as_bytes()));
    assert_eq!(result["reviewed"], true);
    assert_eq!(result["confidence"], 0.1);

    // Rejected: dead, non-retryable, with the reviewer's reason.
    let op = enqueue(&app, &input("reject.md"));
    app.wait_status(&op, "waiting", DEADLINE).await;
    let payload = json!({ "decision": "reject", "reason": "off topic" }).to_string();
    app.agentq_ok(&["signal", &op, "review", "--payload", &payload]);
    let v = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(v.error_class.as_deref(), Some("non_retryable"));
    assert_eq!(
        v.error_message.as_deref(),
        Some("rejected by reviewer: off topic")
    );
    assert!(!out.join("reject.md").exists());

    // Retried by an operator: a new round asks for a new review; approved, the model's text
    // (its confidence line stripped) is written.
    app.agentq_ok(&["dlq", "retry", &op, "--reason", "second opinion"]);
    app.wait_for("a second review wait", DEADLINE, || async {
        app.operation(&op).await.status.as_str() == "waiting"
    })
    .await;
    let payload = json!({ "decision": "approve" }).to_string();
    app.agentq_ok(&["signal", &op, "review", "--payload", &payload]);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        std::fs::read_to_string(out.join("reject.md")).unwrap(),
        "Title: Other\n\nalso unsure\n"
    );
    let names = step_names(&app, &op);
    assert_eq!(
        names.iter().filter(|n| *n == "signal:review").count(),
        2,
        "{names:?}"
    );
    assert_eq!(files(&out), ["edit.md", "reject.md"]);

    drop(scratch);
    app.cleanup().await;
}

#[tokio::test]
async fn a_worker_killed_mid_migration_leaves_each_target_written_once() {
    let fake = FakeModel::start(Mode::Slow(Duration::from_millis(150))).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    let worker = app.spawn(&["worker"]);
    let scratch = Scratch::new();
    let (src, out) = (scratch.path("src"), scratch.path("out"));
    dir_stores(&app, &src, &out);
    let docs: Vec<(String, String)> = (0..12)
        .map(|i| {
            let text = (0..3)
                .map(|p| format!("Document {i}, paragraph {p}: {}", "words ".repeat(6)))
                .collect::<Vec<_>>()
                .join("\n\n");
            (format!("batch/doc-{i}.md"), text)
        })
        .collect();
    for (id, text) in &docs {
        write(&src.join(id), text);
    }
    let ops: Vec<String> = docs
        .iter()
        .map(|(id, _)| {
            enqueue(
                &app,
                &json!({
                    "doc_id": id,
                    "source": { "store": "src" },
                    "target": { "store": "out" },
                    "instructions": "Keep it.",
                    "chunk_chars": 64,
                }),
            )
        })
        .collect();

    // Every operation is inside its transforms when the worker dies.
    app.wait_for("the first chunk of every document", DEADLINE, || async {
        fake.requests() >= docs.len()
    })
    .await;
    app.kill(worker);
    app.spawn(&["worker"]);

    let mut restarted = 0;
    for (op, (id, text)) in ops.iter().zip(&docs) {
        let v = app.wait_status(op, "succeeded", DEADLINE).await;
        restarted += i64::from(v.restarts > 0);
        assert_eq!(v.result.unwrap()["sha256"], sha256_hex(text.as_bytes()));
        assert_eq!(std::fs::read_to_string(out.join(id)).unwrap(), *text);
    }
    assert!(restarted > 0, "the kill interrupted running operations");
    let mut expected: Vec<String> = docs.iter().map(|(id, _)| id.clone()).collect();
    expected.sort();
    assert_eq!(files(&out), expected, "one file per document, no leftovers");

    drop(scratch);
    app.cleanup().await;
}
