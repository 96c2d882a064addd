//! Every operator flow — signal, approve, reject, cancel, DLQ retry / resolve / discard, batch
//! pause / resume / cancel — driven through the CLI, the HTTP API and the console: each surface
//! gets the same outcome (the status after it, or the same refusal) and writes the same audit
//! row (action, status before and after, reason), because all three call one function of
//! `agentq-app`. Only the actor differs: the CLI's `--as`, the token's prefix elsewhere.

use serde_json::{Value, json};

use crate::api::Api;
use crate::console::{Browser, csrf_of};
use crate::harness::{DEADLINE, TestApp};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Surface {
    Cli,
    Api,
    Console,
}

const SURFACES: [Surface; 3] = [Surface::Cli, Surface::Api, Surface::Console];

#[derive(Clone, Copy, Debug)]
enum Flow {
    Signal,
    Approve,
    Reject,
    Cancel,
    Retry,
    Resolve,
    Discard,
    Pause,
    Resume,
    CancelBatch,
}

/// One row of the audit trail, without its actor.
type Audit = (String, Option<String>, Option<String>, Option<String>);

struct Surfaces {
    api: Api,
    token: String,
    console: Browser,
    csrf: String,
}

impl Surfaces {
    /// Runs `flow` on `id` through `surface`: `Ok` when it was done, `Err(message)` when it
    /// was refused.
    async fn act(
        &self,
        app: &TestApp,
        surface: Surface,
        flow: Flow,
        id: &str,
    ) -> Result<(), String> {
        match surface {
            Surface::Cli => {
                let args: Vec<&str> = match flow {
                    Flow::Signal => vec!["signal", id, "go", "--payload", "{}"],
                    Flow::Approve => vec!["approve", id],
                    Flow::Reject => vec!["reject", id, "--reason", "no"],
                    Flow::Cancel => vec!["cancel", id, "--reason", "stop"],
                    Flow::Retry => vec!["dlq", "retry", id, "--reason", "again"],
                    Flow::Resolve => vec!["dlq", "resolve", id, "--did-not-happen"],
                    Flow::Discard => vec!["dlq", "discard", id, "--reason", "junk"],
                    Flow::Pause => vec!["batch", "pause", id, "--reason", "hold"],
                    Flow::Resume => vec!["batch", "resume", id],
                    Flow::CancelBatch => vec!["batch", "cancel", id, "--reason", "stop"],
                };
                let mut args = args;
                args.extend(["--as", "flows"]);
                let out = app.agentq(&args);
                match out.status.code() {
                    Some(0) => Ok(()),
                    Some(2) => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
                    other => panic!(
                        "agentq {args:?} exited {other:?}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    ),
                }
            }
            Surface::Api => {
                let (path, body) = match flow {
                    Flow::Signal => (format!("/v1/operations/{id}/signals/go"), json!({})),
                    Flow::Approve => (format!("/v1/operations/{id}/approve"), json!({})),
                    Flow::Reject => (
                        format!("/v1/operations/{id}/reject"),
                        json!({ "reason": "no" }),
                    ),
                    Flow::Cancel => (
                        format!("/v1/operations/{id}/cancel"),
                        json!({ "reason": "stop" }),
                    ),
                    Flow::Retry => (format!("/v1/dlq/{id}/retry"), json!({ "reason": "again" })),
                    Flow::Resolve => (
                        format!("/v1/dlq/{id}/resolve"),
                        json!({ "happened": false }),
                    ),
                    Flow::Discard => (format!("/v1/dlq/{id}/discard"), json!({ "reason": "junk" })),
                    Flow::Pause => (
                        format!("/v1/batches/{id}/pause"),
                        json!({ "reason": "hold" }),
                    ),
                    Flow::Resume => (format!("/v1/batches/{id}/resume"), json!({})),
                    Flow::CancelBatch => (
                        format!("/v1/batches/{id}/cancel"),
                        json!({ "reason": "stop" }),
                    ),
                };
                let r = self.api.post(&path, Some(&self.token), &body).await;
                match r.status {
                    200..=299 => Ok(()),
                    409 => Err(r.json()["detail"].as_str().unwrap_or_default().to_string()),
                    _ => panic!("{}: {} {}", r.what, r.status, r.text()),
                }
            }
            Surface::Console => {
                let (path, fields): (String, Vec<(&str, &str)>) = match flow {
                    Flow::Signal => (
                        format!("/ui/operations/{id}/signal"),
                        vec![("name", "go"), ("payload", "{}")],
                    ),
                    Flow::Approve => (format!("/ui/operations/{id}/approve"), vec![]),
                    Flow::Reject => (
                        format!("/ui/operations/{id}/reject"),
                        vec![("reason", "no")],
                    ),
                    Flow::Cancel => (
                        format!("/ui/operations/{id}/cancel"),
                        vec![("reason", "stop")],
                    ),
                    Flow::Retry => (format!("/ui/dlq/{id}/retry"), vec![("reason", "again")]),
                    Flow::Resolve => (format!("/ui/dlq/{id}/resolve"), vec![("happened", "false")]),
                    Flow::Discard => (format!("/ui/dlq/{id}/discard"), vec![("reason", "junk")]),
                    Flow::Pause => (format!("/ui/batches/{id}/pause"), vec![("reason", "hold")]),
                    Flow::Resume => (format!("/ui/batches/{id}/resume"), vec![]),
                    Flow::CancelBatch => {
                        (format!("/ui/batches/{id}/cancel"), vec![("reason", "stop")])
                    }
                };
                let mut fields = fields;
                fields.push(("csrf", &self.csrf));
                let r = self.console.post(&path, &fields).await;
                assert_eq!(r.status().as_u16(), 303, "console {path}");
                let (_, page) = self.console.get("/ui/approvals").await;
                let flash = flash_of(&page).unwrap_or_else(|| panic!("no flash after {path}"));
                match flash.strip_prefix("refused: ") {
                    Some(why) => Err(why.to_string()),
                    None => Ok(()),
                }
            }
        }
    }
}

/// The text of the console's flash message in a page, unescaped enough to compare.
fn flash_of(page: &str) -> Option<String> {
    let at = page.find("id=\"flash\">")? + "id=\"flash\">".len();
    let end = page[at..].find("</p>")?;
    Some(
        page[at..at + end]
            .replace("&quot;", "\"")
            .replace("&#39;", "'")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

/// `text` with every UUID (each surface acted on its own operation) replaced by `ID`.
fn without_ids(text: &str) -> String {
    let mut out = text.to_string();
    for word in text.split(|c: char| !(c.is_ascii_hexdigit() || c == '-')) {
        if word.len() == 36 && uuid::Uuid::parse_str(word).is_ok() {
            out = out.replace(word, "ID");
        }
    }
    out
}

async fn audit(app: &TestApp, sql: &'static str, id: &str) -> (Vec<Audit>, Vec<String>) {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        Option<String>,
        String,
    );
    let rows: Vec<Row> = sqlx::query_as(sql)
        .bind(id)
        .fetch_all(&app.pool)
        .await
        .unwrap();
    let actors = rows.iter().map(|r| r.4.clone()).collect();
    (
        rows.into_iter()
            .map(|(a, b, c, d, _)| (a, b, c, d))
            .collect(),
        actors,
    )
}

const OP_AUDIT: &str = "SELECT action, status_before, status_after, reason, actor
    FROM operator_actions WHERE op_id = $1::uuid AND action <> 'reveal' ORDER BY id";
const BATCH_AUDIT: &str = "SELECT action, status_before, status_after, reason, actor
    FROM operator_actions WHERE details->>'batch_id' = $1 ORDER BY id";

fn expected_actor(surface: Surface, token: &str) -> String {
    match surface {
        Surface::Cli => "flows".into(),
        _ => format!("token:{}", &token[..12]),
    }
}

#[tokio::test]
async fn every_operator_flow_is_the_same_through_the_cli_the_api_and_the_console() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let token = app.token("acme", "operator");
    let mut console = Browser::new(&base);
    let (status, _) = console.login(&token).await;
    assert_eq!(status, 303, "console login");
    let (_, page) = console.get("/ui/approvals").await;
    let csrf = csrf_of(&page);
    let s = Surfaces {
        api: Api::new(&base),
        token: token.clone(),
        console,
        csrf,
    };

    // Batches first, with no worker running, so nothing moves but what the flows move: a canary
    // of 1 out of 3 documents per surface, paused, resumed (the other 2 enqueued), cancelled.
    let dir = std::env::temp_dir().join(format!("agentq-flows-{}", uuid::Uuid::new_v4().simple()));
    for i in 0..3 {
        std::fs::create_dir_all(dir.join("in")).unwrap();
        std::fs::write(dir.join(format!("in/doc{i}.md")), format!("Title: {i}\n")).unwrap();
    }
    app.add_store(
        "acme",
        "in",
        &["--dir", dir.join("in").to_str().unwrap()],
        "read",
    );
    app.add_store(
        "acme",
        "out",
        &["--dir", dir.join("out").to_str().unwrap()],
        "write",
    );
    let mut batches = Vec::new();
    for surface in SURFACES {
        let instructions = dir.join(format!("{surface:?}.txt"));
        std::fs::write(&instructions, format!("Keep it ({surface:?}).")).unwrap();
        let started = app.agentq_json(&[
            "batch",
            "start",
            "--tenant",
            "acme",
            "--source",
            "in",
            "--target",
            "out",
            "--instructions",
            instructions.to_str().unwrap(),
            "--canary",
            "1",
            "--json",
        ]);
        let id = started["batch_id"].as_str().unwrap().to_string();
        let mut seen = Vec::new();
        for flow in [
            Flow::Pause,
            Flow::Resume,
            Flow::Pause,
            Flow::CancelBatch,
            Flow::Resume,
        ] {
            let outcome = s.act(&app, surface, flow, &id).await;
            let status = app.agentq_json(&["batch", "status", &id, "--json"]);
            seen.push((
                format!("{flow:?}"),
                outcome.is_ok(),
                status["status"].clone(),
                status["by_status"].clone(),
            ));
        }
        let (rows, actors) = audit(&app, BATCH_AUDIT, &id).await;
        assert!(
            actors
                .iter()
                .skip(1)
                .all(|a| *a == expected_actor(surface, &token)),
            "{surface:?}: {actors:?}"
        );
        batches.push((surface, seen, rows));
    }
    for (surface, seen, rows) in &batches[1..] {
        assert_eq!(seen, &batches[0].1, "{surface:?} vs the CLI: outcomes");
        assert_eq!(rows, &batches[0].2, "{surface:?} vs the CLI: audit rows");
    }
    let (_, seen, rows) = &batches[0];
    assert_eq!(
        seen.iter().map(|s| (s.1, s.2.clone())).collect::<Vec<_>>(),
        [
            (true, json!("paused")),
            (true, json!("running")),
            (true, json!("paused")),
            (true, json!("cancelled")),
            (false, json!("cancelled")),
        ],
        "pause, resume, pause, cancel, then a resume refused"
    );
    assert_eq!(
        seen[1].3,
        json!({ "queued": 3 }),
        "resume enqueued the rest"
    );
    assert_eq!(seen[3].3, json!({ "cancelled": 3 }));
    assert!(rows.len() >= 5, "{rows:?}");

    // Operations, with a worker.
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let waits = |signal: &str| json!({ "steps": [{ "wait_signal": signal, "timeout_ms": 600_000 }, { "work_ms": 1 }] });
    let fails = json!({ "steps": [{ "fail": "non_retryable", "times": 1 }] });
    let cases: [(Flow, Value, &str, &str); 7] = [
        (Flow::Signal, waits("go"), "waiting", "succeeded"),
        (Flow::Approve, waits("approval"), "waiting", "succeeded"),
        (Flow::Reject, waits("approval"), "waiting", "dead"),
        (Flow::Cancel, waits("go"), "waiting", "cancelled"),
        (Flow::Retry, fails.clone(), "dead", "succeeded"),
        (Flow::Resolve, fails.clone(), "dead", "dead"),
        (Flow::Discard, fails, "dead", "discarded"),
    ];
    for (flow, input, before, after) in cases {
        let mut results = Vec::new();
        for surface in SURFACES {
            let op = crate::api::enqueue_cli(&app, "acme", "script", &input);
            app.wait_status(&op, before, DEADLINE).await;
            let outcome = s.act(&app, surface, flow, &op).await;
            let v = app.wait_status(&op, after, DEADLINE).await;
            let (rows, actors) = audit(&app, OP_AUDIT, &op).await;
            assert!(
                actors.iter().all(|a| *a == expected_actor(surface, &token)),
                "{flow:?} {surface:?}: {actors:?}"
            );
            // An approval's payload names who decided: the one place the actor shows.
            let result = serde_json::to_string(&v.result)
                .unwrap()
                .replace(&expected_actor(surface, &token), "ACTOR");
            results.push((surface, outcome, result, rows));
        }
        let (_, first, result, rows) = &results[0];
        for (surface, outcome, r, audit) in &results[1..] {
            match (first, outcome) {
                (Ok(()), Ok(())) => {}
                (Err(a), Err(b)) => {
                    let (a, b) = (without_ids(a), without_ids(b));
                    assert!(
                        a.contains(b.trim()) || b.contains(a.trim()),
                        "{flow:?}: the CLI said {a:?}, {surface:?} said {b:?}"
                    )
                }
                _ => panic!("{flow:?}: the CLI {first:?}, {surface:?} {outcome:?}"),
            }
            assert_eq!(r, result, "{flow:?} {surface:?} vs the CLI: result");
            assert_eq!(audit, rows, "{flow:?} {surface:?} vs the CLI: audit rows");
        }
        match flow {
            Flow::Resolve => {
                assert!(
                    first.is_err(),
                    "resolving a non_retryable dead letter is refused"
                );
                assert!(rows.is_empty(), "a refusal writes no audit row: {rows:?}");
            }
            _ => assert!(
                first.is_ok() && !rows.is_empty(),
                "{flow:?}: {first:?} {rows:?}"
            ),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    app.cleanup().await;
}
