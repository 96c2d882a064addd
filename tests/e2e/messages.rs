//! What a first-time operator reads: a bad input refused at the field at fault the same way by
//! the CLI, the API and a webhook; a subcommand's help that leads with its own options; a
//! quickstart on a fresh database and namespace that logs no ERROR; a retried step's duration.

use std::time::{Duration, Instant};

use agentq_core::webhook::Secret;
use agentq_core::{broker, db};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::api::Api;
use crate::harness::{BIN, DEADLINE, TestApp, running_app};

/// A `fail` step without its `times`, as the second step.
const NO_TIMES: &str = r#"{"steps":[{"work_ms":1},{"fail":"retryable"}]}"#;
/// What every front end says of it.
const NO_TIMES_SAYS: &str = r#"steps[1]: a "fail" step needs "times""#;

#[tokio::test]
async fn a_bad_input_is_refused_at_its_field_by_the_cli_the_api_and_a_webhook() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);

    // The command line: exit 2, the place and what is missing, no serde internals.
    let out = app.agentq(&[
        "enqueue", "--tenant", "t1", "--kind", "script", "--input", NO_TIMES,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(NO_TIMES_SAYS), "{stderr}");
    assert!(
        !stderr.contains("untagged") && !stderr.contains("variant"),
        "{stderr}"
    );

    // The API: a 422 problem whose field is the JSON Pointer of the step, with the same words.
    let producer = app.token("t1", "producer");
    let input: Value = serde_json::from_str(NO_TIMES).unwrap();
    let problem = api
        .post(
            "/v1/operations",
            Some(&producer),
            &json!({ "kind": "script", "input": input }),
        )
        .await
        .problem(422, "unprocessable");
    assert_eq!(problem["field"], "/input/steps/1", "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(NO_TIMES_SAYS), "{problem}");

    // A webhook delivery whose body becomes the input: the same answer.
    let v = app.agentq_json(&[
        "webhooks", "add", "--tenant", "t1", "--source", "runner", "--kind", "script", "--json",
    ]);
    let secret = Secret::parse(v["secret"].as_str().unwrap_or_default()).unwrap();
    let ts = Utc::now().timestamp();
    let problem = crate::api::send(
        String::from("a signed delivery with a bad script"),
        api.client
            .post(format!("{}/v1/webhooks/runner", api.base))
            .header("content-type", "application/json")
            .header("webhook-id", "msg_1")
            .header("webhook-timestamp", ts.to_string())
            .header(
                "webhook-signature",
                secret.sign("msg_1", ts, NO_TIMES.as_bytes()),
            )
            .body(NO_TIMES),
    )
    .await
    .problem(422, "unprocessable");
    assert_eq!(problem["field"], "/input/steps/1", "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .is_some_and(|d| d.contains(NO_TIMES_SAYS)),
        "{problem}"
    );

    // A webhook source's config is checked as the kind's input, at its place.
    let out = app.agentq(&[
        "webhooks",
        "add",
        "--tenant",
        "t1",
        "--source",
        "tracker",
        "--kind",
        "triage",
        "--config",
        r#"{"callback_url":"ftp://x"}"#,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(r#"config.callback_url: "ftp://x" must be an http:// or https:// URL"#),
        "{stderr}"
    );

    assert_eq!(app.operation_count().await, 0, "nothing refused was stored");
    app.cleanup().await;
}

/// Runs `agentq ARGS` without a database or broker (help needs neither).
fn help(args: &[&str]) -> String {
    let out = std::process::Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "agentq {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn a_subcommand_s_help_shows_its_own_options_and_points_at_the_global_ones() {
    let root = help(&["--help"]);
    let heading = root
        .find("Global options:")
        .expect("a global options heading");
    assert!(
        root[heading..].contains("--database-url") && root[heading..].contains("--namespace"),
        "{root}"
    );

    let batch = help(&["batch", "--help"]);
    assert!(
        batch.lines().count() <= 30,
        "{} lines:\n{batch}",
        batch.lines().count()
    );
    assert!(!batch.contains("--database-url"), "{batch}");
    assert!(batch.contains("agentq --help"), "{batch}");
    let enqueue = help(&["enqueue", "--help"]);
    let own = enqueue.find("--tenant").expect("enqueue's own options");
    let pointer = enqueue
        .find("Global options")
        .expect("the pointer to the globals");
    assert!(own < pointer, "{enqueue}");

    // The globals still work after a subcommand (and below it), as flags and as variables.
    let app = TestApp::start().await;
    let out = app
        .command(&[
            "dlq",
            "list",
            "--database-url",
            &app.database_url,
            "--namespace",
            &app.namespace,
        ])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/nothing")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    app.cleanup().await;
}

#[tokio::test]
async fn the_quickstart_on_a_fresh_database_and_namespace_logs_no_error() {
    let mut app = TestApp::start().await;
    // A database and a namespace nobody made: `agentq dev` creates and declares them.
    let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
    let fresh_db = db::with_database(&app.database_url, &format!("agentq_test_q_{tag}")).unwrap();
    let fresh_ns = format!("test-q-{tag}");
    app.set_env("DATABASE_URL", &fresh_db);
    app.set_env("AGENTQ_NAMESPACE", &fresh_ns);
    app.set_env("AGENTQ_LISTEN", "127.0.0.1:0");
    app.set_env("RUST_LOG", "info");
    app.set_env("NO_COLOR", "1");
    let dev = app.spawn_logged(&["dev"]);
    app.wait_for("agentq dev to serve", DEADLINE, || {
        let log = app.log(dev);
        async move { log.contains("listening on http://") }
    })
    .await;

    // README's quickstart, each command's whole output kept.
    let mut outputs = Vec::new();
    let enqueue = ["enqueue", "--tenant", "demo", "--kind", "echo", "--input"];
    let out = app.agentq(&[&enqueue[..], &[r#"{"text":"hello"}"#, "--json"]].concat());
    assert!(out.status.success(), "{out:?}");
    let op = serde_json::from_slice::<Value>(&out.stdout).unwrap()["op_id"]
        .as_str()
        .unwrap()
        .to_string();
    outputs.push(out);
    let end = Instant::now() + DEADLINE;
    loop {
        let out = app.agentq(&["status", &op, "--json"]);
        let done =
            serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|v| v["status"] == "succeeded");
        outputs.push(out);
        if done {
            break;
        }
        assert!(
            Instant::now() < end,
            "not done in {DEADLINE:?}:\n{}",
            app.log(dev)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    outputs.push(app.agentq(&["steps", &op]));

    let log = app.log(dev);
    assert!(log.contains(" INFO "), "the log is at info: {log}");
    let mut printed = vec![log];
    for o in &outputs {
        printed.push(String::from_utf8_lossy(&o.stdout).into_owned());
        printed.push(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    for text in printed {
        assert!(
            !text.contains("ERROR"),
            "an ERROR on a normal first start:\n{text}"
        );
    }

    app.cleanup().await;
    let _ = db::drop_database(&fresh_db).await;
    if let Ok(conn) = broker::connect(&app_amqp_url(), "test-cleanup").await {
        let _ = broker::delete_topology(&conn, &broker::Names::new(&fresh_ns)).await;
        let _ = conn.close(200, "cleaned".into()).await;
    }
}

fn app_amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

#[tokio::test]
async fn a_retried_step_reports_the_duration_of_its_own_run() {
    let app = running_app().await;
    // The step fails on the first run and is retried no sooner than 3 s later; its second run
    // takes no time.
    let op = app.enqueue_script(
        json!([{ "fail": "retryable", "times": 1, "not_before_ms": 3000 }]),
        &[],
    );
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.attempt, 2, "it ran twice");
    let (started, completed): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "SELECT started_at, completed_at FROM operation_steps WHERE op_id = $1::uuid AND seq = 0",
    )
    .bind(&op)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let took = completed - started;
    assert!(
        took < chrono::Duration::milliseconds(2000),
        "the retried step took {took} by its journal: measured from the failed run"
    );
    // `agentq steps` shows the same: "N ms" of the run that completed it.
    let shown = app.agentq_ok(&["steps", &op]);
    let shown = String::from_utf8_lossy(&shown.stdout);
    let ms: Vec<i64> = shown
        .split(" ms")
        .filter_map(|before| before.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(!ms.is_empty() && ms.iter().all(|&m| m < 2000), "{shown}");
    app.cleanup().await;
}
