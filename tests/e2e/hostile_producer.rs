//! A hostile producer against the real binary: a producer token (and the CLI where it applies)
//! tries to reach what no operator granted it, and every attempt is refused or contained,
//! nothing is written, no other tenant's data comes back, and the worker and server keep
//! serving. Here:
//!
//! - files and tables: a `doc_migration` naming `/` or `/tmp` instead of a store, the tables
//!   `webhook_secrets` and `operations`, another tenant's store, a read-only store as its
//!   target; `agentq stores add` of agentq's own tables; a symlink and a `..` out of a
//!   registered directory, on read and on write;
//! - a `triage` with a producer's own callback config (only webhook deliveries create one);
//! - a 300 MB callback answer: the worker's peak RSS stays near idle, and the connection is
//!   dropped long before the sender is done.
//!
//! The other attacks of the threat model (docs/security.md) are tried by the tests next to the
//! feature they attack, all against the real binary:
//!
//! | attack | test |
//! |---|---|
//! | `http_get` to another port of an allowed host, to `user:pass@` | `models::a_kind_can_use_its_own_model_and_the_agent_fetches_only_allowed_hosts` |
//! | a callback origin missing from the allow-list | `usecase_webhook::usecase_webhook_every_delivery_is_one_operation_and_one_callback_across_a_worker_kill` |
//! | 400 event streams from one token; a stream outliving its token's revocation | `api::event_streams_are_capped_per_token_and_end_when_their_token_is_revoked`, `api::event_streams_of_many_operations_share_the_poller_and_each_gets_exactly_its_events` |
//! | approving its own operation (API, console, a signal sent before the wait) | `api::approving_needs_an_operator_unless_the_deployment_lets_producers`, `console::console_refuses_producers_forged_forms_and_other_tenants_and_hides_payloads` |
//! | a squatted `webhook:` / `batch:` dedupe key | `api_hostile::api_hostile_input_battery_gets_4xx_problems_and_enqueues_nothing`, `foundation::bad_input_is_refused_with_exit_code_2_and_writes_nothing` |
//! | overflowing dates and durations (CLI flags, query parameters, job inputs, console filters) | the same two, and `hostile_producer::the_console_refuses_overflowing_dates_and_keeps_serving` |
//! | probing which webhook sources exist; `/metrics` without a token | `api_hostile::api_webhooks_refuse_a_thousand_tampered_deliveries_and_store_nothing`, `metrics::*` |
//!
//! Attacks on capacity (docs/security.md, "Capacity"), in `capacity`:
//!
//! | attack | test |
//! |---|---|
//! | every worker slot taken by hour-long steps, plus spawns | `capacity::a_flooding_tenant_gives_way_to_another_and_still_drains`, `capacity::a_tenant_giving_way_never_cuts_an_unsafe_call` |
//! | a running step that ignores cancel and its deadline | `capacity::a_cancel_stops_an_hour_long_step_within_a_lease`, `capacity::a_deadline_stops_a_running_step`, `capacity::an_unsafe_call_a_deadline_interrupts_is_reconciled_not_rerun` |
//! | unbounded unfinished operations by enqueue, webhook, batch, spawn, schedule | `capacity::the_unfinished_cap_refuses_cli_api_webhook_and_batch_enqueues_and_counts_sleepers`, `capacity::a_spawn_at_the_tenants_cap_waits_and_a_spawn_past_the_childrens_cap_fails`, `capacity::a_schedule_at_its_tenants_cap_skips_its_ticks_and_schedules_are_limited` |
//! | a concurrency key with a larger limit; a patched retry that does not fit; a batch of a kind without documents; another tenant's schedules | `capacity::a_concurrency_keys_limit_is_the_keys`, `capacity::a_patched_input_that_does_not_fit_is_refused_and_changes_nothing`, `capacity::a_batch_of_a_kind_that_takes_no_documents_and_another_tenants_schedules_are_refused` |
//! | a journal of 40,000 rows or of huge outputs; one 14 MB `GET /steps` | `capacity::a_journal_is_capped_in_rows_and_in_bytes_across_a_resume`, `capacity::a_journal_is_read_in_pages_of_bounded_size` |
//! | lists that read every tenant's rows | `capacity::a_tenants_list_reads_its_own_rows_through_its_index` |
//! | a kind the admin did not allow, by any way an operation is born (a spawn named by the input too); reading or setting another tenant's list | `capacity::an_admins_list_of_kinds_holds_on_every_way_an_operation_is_born` |

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentq_core::webhook::Secret;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use chrono::Utc;
use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::api::{Api, send};
use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// A directory under the system temp dir, removed when dropped (also when a test fails).
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "agentq-e2e-hostile-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

fn migration(doc_id: &str, source: Value, target: Value) -> Value {
    json!({
        "kind": "doc_migration",
        "input": {
            "doc_id": doc_id,
            "source": source,
            "target": target,
            "instructions": "Keep the text exactly as it is.",
        },
    })
}

#[tokio::test]
async fn a_producer_reads_and_writes_no_file_or_table_it_was_not_granted() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let api = Api::new(&base);
    let producer = app.token("acme", "producer");

    // What a hostile tenant would like to read: another tenant's webhook secret and inputs, and
    // a file next to the store.
    let other_secret = app.agentq_json(&[
        "webhooks", "add", "--tenant", "other", "--source", "crm", "--kind", "echo", "--json",
    ])["secret"]
        .as_str()
        .unwrap()
        .to_string();
    let scratch = Scratch::new();
    let (inbox, outbox, outside) = (
        scratch.0.join("inbox"),
        scratch.0.join("outbox"),
        scratch.0.join("outside"),
    );
    write(&outside.join("secret.txt"), "the outside secret\n");
    write(&inbox.join("ok.md"), "Title: fine\n\nhello\n");
    write(
        &inbox.join("esc/x.md"),
        "Title: escape\n\nwrite me outside\n",
    );
    std::os::unix::fs::symlink(outside.join("secret.txt"), inbox.join("link.md")).unwrap();
    std::os::unix::fs::symlink(&outside, inbox.join("up")).unwrap();
    std::fs::create_dir_all(&outbox).unwrap();
    std::os::unix::fs::symlink(&outside, outbox.join("esc")).unwrap();
    app.add_store("acme", "inbox", &["--dir", inbox.to_str().unwrap()], "read");
    app.add_store(
        "acme",
        "outbox",
        &["--dir", outbox.to_str().unwrap()],
        "write",
    );
    app.add_store(
        "other",
        "theirs",
        &["--dir", outside.to_str().unwrap()],
        "read_write",
    );
    let (inbox_ref, outbox_ref) = (json!({ "store": "inbox" }), json!({ "store": "outbox" }));

    // agentq's own tables are never a store, whoever asks.
    for table in [
        "webhook_secrets",
        "public.operations",
        "api_tokens",
        "stores",
        "pg_catalog.pg_authid",
    ] {
        let out = app.agentq(&[
            "stores", "add", "--tenant", "acme", "--name", "sneaky", "--table", table, "--access",
            "read",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "stores add --table {table}: {stderr}"
        );
        assert!(stderr.contains("never a store"), "{table}: {stderr}");
    }
    // The list of agentq's tables is the migrated schema's, so a new table cannot be missed.
    let tables: BTreeSet<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema()",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let listed: BTreeSet<String> = agentq_core::db::stores::AGENTQ_TABLES
        .iter()
        .map(|t| t.to_string())
        .collect();
    assert_eq!(
        tables, listed,
        "db::stores::AGENTQ_TABLES is the migrated schema"
    );

    // Places instead of stores, stores of another tenant, a read-only store as a target, a
    // path out of the store: refused at enqueue (422), saying what to register.
    let attacks = [
        (
            "a file read outside any store",
            migration("etc/passwd", json!({ "dir": "/" }), outbox_ref.clone()),
            "agentq stores add",
        ),
        (
            "a file write outside any store",
            migration("ok.md", inbox_ref.clone(), json!({ "dir": "/tmp" })),
            "agentq stores add",
        ),
        (
            "a read of webhook_secrets",
            migration(
                "x",
                json!({ "table": "webhook_secrets", "id_column": "source_id", "body_column": "secret" }),
                outbox_ref.clone(),
            ),
            "never a directory or a table",
        ),
        (
            "a read of operations",
            migration(
                "x",
                json!({ "table": "operations", "body_column": "input" }),
                outbox_ref.clone(),
            ),
            "never a directory or a table",
        ),
        (
            "another tenant's store",
            migration(
                "secret.txt",
                json!({ "store": "theirs" }),
                outbox_ref.clone(),
            ),
            "tenant acme has no store \"theirs\"",
        ),
        (
            "a read-only store as the target",
            migration("ok.md", inbox_ref.clone(), inbox_ref.clone()),
            "registered for read only",
        ),
        (
            "a .. out of the store",
            migration(
                "../outside/secret.txt",
                inbox_ref.clone(),
                outbox_ref.clone(),
            ),
            "\"..\"",
        ),
        (
            "an absolute doc_id",
            migration("/etc/passwd", inbox_ref.clone(), outbox_ref.clone()),
            "relative",
        ),
    ];
    for (what, body, says) in &attacks {
        let r = api.post("/v1/operations", Some(&producer), body).await;
        let problem = r.problem(422, "unprocessable");
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says), "{what}: {detail}");
        // The CLI refuses the same input the same way (exit 2).
        let out = app.agentq(&[
            "enqueue",
            "--tenant",
            "acme",
            "--kind",
            "doc_migration",
            "--input",
            &body["input"].to_string(),
        ]);
        assert_eq!(out.status.code(), Some(2), "CLI: {what}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "CLI: {what}"
        );
    }
    assert_eq!(app.operation_count().await, 0, "nothing was written");

    // Symlinks out of the registered directories: accepted at enqueue (the names are inside),
    // refused when the worker resolves them, and nothing leaks or lands outside.
    let read_link = api
        .create(
            &producer,
            &migration("link.md", inbox_ref.clone(), outbox_ref.clone()),
        )
        .await;
    let read_up = api
        .create(
            &producer,
            &migration("up/secret.txt", inbox_ref.clone(), outbox_ref.clone()),
        )
        .await;
    let write_out = api
        .create(
            &producer,
            &migration("esc/x.md", inbox_ref.clone(), outbox_ref.clone()),
        )
        .await;
    for (op, says) in [
        (&read_link, "outside the source store"),
        (&read_up, "outside the source store"),
        (&write_out, "outside the target store"),
    ] {
        let v = app.wait_status(op, "dead", DEADLINE).await;
        assert_eq!(v.error_class.as_deref(), Some("non_retryable"));
        let message = v.error_message.unwrap_or_default();
        assert!(message.contains(says), "{op}: {message}");
        for path in [
            format!("/v1/operations/{op}"),
            format!("/v1/operations/{op}/steps"),
        ] {
            let text = api.get(&path, Some(&producer)).await.text();
            assert!(
                !text.contains("outside secret"),
                "{path} leaks the file: {text}"
            );
        }
    }
    assert!(
        !outside.join("x.md").exists(),
        "nothing was written through the symlink"
    );
    assert_eq!(
        std::fs::read_to_string(outside.join("secret.txt")).unwrap(),
        "the outside secret\n"
    );

    // The granted path still works, and no answer carries another tenant's data.
    let ok = api
        .create(
            &producer,
            &migration("ok.md", inbox_ref.clone(), outbox_ref.clone()),
        )
        .await;
    app.wait_status(&ok, "succeeded", DEADLINE).await;
    assert_eq!(
        std::fs::read_to_string(outbox.join("ok.md")).unwrap(),
        "Title: fine\n\nhello\n"
    );
    for op in [&read_link, &read_up, &write_out, &ok] {
        let text = api
            .get(&format!("/v1/operations/{op}/steps"), Some(&producer))
            .await
            .text();
        assert!(!text.contains(&other_secret), "{op} leaks the secret");
    }

    // Removing a store stops what names it: refused at enqueue, and audited.
    app.agentq_ok(&["stores", "remove", "--tenant", "acme", "--name", "outbox"]);
    api.post(
        "/v1/operations",
        Some(&producer),
        &migration("ok.md", inbox_ref.clone(), outbox_ref.clone()),
    )
    .await
    .problem(422, "unprocessable");
    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT action FROM operator_actions WHERE action LIKE 'store_%' ORDER BY created_at, action",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        audited,
        ["store_add", "store_add", "store_add", "store_remove"]
    );
    drop(scratch);
    app.cleanup().await;
}

/// Bytes a [`huge`] answer has handed to the connection so far.
#[derive(Clone, Default)]
struct Sent(Arc<AtomicU64>);

const HUGE: u64 = 300 * 1024 * 1024;

/// A callback receiver: `/small` answers a small JSON, `/huge` a 300 MB body that streams
/// while the client reads it.
async fn start_receiver(sent: Sent) -> (String, tokio::task::JoinHandle<()>) {
    async fn huge(State(sent): State<Sent>) -> Body {
        let chunk = axum::body::Bytes::from(vec![b'x'; 64 * 1024]);
        let chunks = HUGE / chunk.len() as u64;
        let stream = futures_util::stream::iter(0..chunks).map(move |_| {
            sent.0.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            Ok::<_, std::io::Error>(chunk.clone())
        });
        Body::from_stream(stream)
    }
    let router = Router::new()
        .route(
            "/small",
            post(|| async { axum::Json(json!({ "ok": true })) }),
        )
        .route("/huge", post(huge))
        .with_state(sent);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    (url, task)
}

/// The peak resident set size of a process, in KiB (`VmHWM`).
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in /proc/{pid}/status"))
}

async fn deliver(api: &Api, secret: &Secret, source: &str, id: &str) {
    let body =
        json!({ "title": "Login page is blank", "body": "since the last deploy" }).to_string();
    let ts = Utc::now().timestamp();
    send(
        format!("delivery {id}"),
        api.client
            .post(format!("{}/v1/webhooks/{source}", api.base))
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", secret.sign(id, ts, body.as_bytes()))
            .body(body),
    )
    .await
    .expect(202);
}

#[tokio::test]
async fn triage_is_the_webhook_sources_and_a_300_mb_answer_leaves_the_worker_near_idle() {
    let mut app = TestApp::start().await;
    let fake = FakeModel::start(Mode::Echo).await;
    let sent = Sent::default();
    let (origin, receiver) = start_receiver(sent.clone()).await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_AGENT_HTTP_ALLOW", &origin);
    let (_, base) = app.serve().await;
    app.spawn(&["scheduler"]);
    let worker = app.spawn(&["worker"]);
    let api = Api::new(&base);
    let producer = app.token("acme", "producer");

    // A producer's own triage, with the callback of its choosing: refused on every surface.
    let input = json!({
        "event": {}, "source": "tracker", "webhook_id": "evt_1",
        "config": { "callback_url": format!("{origin}/small") },
    });
    let detail = api
        .post(
            "/v1/operations",
            Some(&producer),
            &json!({ "kind": "triage", "input": input }),
        )
        .await
        .problem(422, "unprocessable")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(detail.contains("webhook source"), "{detail}");
    let out = app.agentq(&[
        "enqueue",
        "--tenant",
        "acme",
        "--kind",
        "triage",
        "--input",
        &input.to_string(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(app.operation_count().await, 0);

    // The admin's sources: one whose receiver answers small, one whose receiver answers 300 MB.
    let add = |source: &str, path: &str| {
        let config = json!({ "callback_url": format!("{origin}{path}") }).to_string();
        let v = app.agentq_json(&[
            "webhooks", "add", "--tenant", "acme", "--source", source, "--kind", "triage",
            "--config", &config, "--json",
        ]);
        Secret::parse(v["secret"].as_str().unwrap()).unwrap()
    };
    let (small, huge) = (add("small", "/small"), add("huge", "/huge"));

    // Warm the worker up with a full triage (model call, callback), then note its peak.
    deliver(&api, &small, "small", "evt_warm").await;
    app.wait_until("the warm-up triage", DEADLINE, || async {
        sqlx::query_scalar::<_, String>(
            "SELECT id::text FROM operations WHERE status = 'succeeded' AND kind = 'triage'",
        )
        .fetch_optional(&app.pool)
        .await
        .unwrap()
    })
    .await;
    let idle = peak_rss_kib(app.pid(worker));

    deliver(&api, &huge, "huge", "evt_huge").await;
    app.wait_until("the 300 MB triage to finish", DEADLINE, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM operations WHERE kind = 'triage' AND status = 'succeeded'",
        )
        .fetch_one(&app.pool)
        .await
        .ok()
        .filter(|n| *n == 2)
    })
    .await;
    let after = peak_rss_kib(app.pid(worker));
    let streamed = sent.0.load(Ordering::Relaxed);
    println!(
        "worker peak RSS: {idle} KiB after the warm-up, {after} KiB after the 300 MB answer; \
         the receiver streamed {} KiB of {} KiB before the worker hung up",
        streamed / 1024,
        HUGE / 1024
    );
    assert!(
        after <= idle + 8 * 1024,
        "the worker's peak RSS grew from {idle} KiB to {after} KiB"
    );
    assert!(
        streamed < HUGE / 4,
        "the worker read {streamed} bytes of a {HUGE}-byte answer"
    );
    // The worker still serves.
    deliver(&api, &small, "small", "evt_after").await;
    app.wait_until("a triage after the huge answer", DEADLINE, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM operations WHERE kind = 'triage' AND status = 'succeeded'",
        )
        .fetch_one(&app.pool)
        .await
        .ok()
        .filter(|n| *n == 3)
    })
    .await;
    receiver.abort();
    app.cleanup().await;
}

#[tokio::test]
async fn the_console_refuses_overflowing_dates_and_keeps_serving() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let operator = app.token("acme", "operator");
    let mut console = crate::console::Browser::new(&base);
    assert_eq!(console.login(&operator).await.0, 303);
    for since in [
        "100000000d",
        "99999999999999999999999d",
        "-5m",
        "0001-01-01T00:00:00Z",
        "99999-01-01T00:00",
    ] {
        for field in ["since", "until"] {
            let path = format!("/ui/operations?{field}={}", crate::api::urlencode(since));
            let (status, page) = console.get(&path).await;
            assert!(
                status == 400 || status == 200,
                "{path}: {status} (a refusal or a page, never a crash)"
            );
            if status == 400 {
                assert!(page.contains(field), "{path}: the refusal names {field}");
            }
        }
    }
    // Still serving.
    assert_eq!(console.get("/ui/operations").await.0, 200);
    app.cleanup().await;
}
