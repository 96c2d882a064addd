//! Remote kinds (docs/protocol.md): kinds written in Python with the SDK of `sdk/python`, run
//! by real worker processes over the step protocol.
//!
//! - A real Python service (a subprocess running `sdk/python/examples/refund_service.py`): an
//!   agent with a model call, an approval wait and an unsafe refund with a reconcile, through
//!   workers SIGKILLed at random points and the service itself killed and restarted once.
//!   Every completed step ran once, the refund happened exactly once per order, and the model
//!   was never sent a turn already journaled.
//! - Hostile and broken services (in-process fakes speaking the protocol badly): each a
//!   classified, retryable failure naming what was wrong, nothing journaled for it, the worker
//!   unharmed.
//! - The SDK's own test suite, so CI runs it.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_core::webhook::Secret;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::crash_cost::{Rng, Seen, check_request, committed};
use crate::fake_model::{FakeModel, Hook, Mode, last_user};
use crate::harness::{DEADLINE, TestApp};

/// The waits that span killed workers: each one's operations run again only once their
/// leases have run out.
const CRASH_DEADLINE: Duration = Duration::from_secs(120);

fn sdk_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk/python")
}

fn python() -> String {
    std::env::var("AGENTQ_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Which SDK's example service: `sdk/python/examples/refund_service.py` (service `billing`) or
/// `sdk/typescript/examples/refund_service.mjs` (service `ts_billing`).
#[derive(Clone, Copy, Debug)]
enum Sdk {
    Python,
    TypeScript,
}

impl Sdk {
    fn service(self) -> &'static str {
        match self {
            Sdk::Python => "billing",
            Sdk::TypeScript => "ts_billing",
        }
    }

    fn refund_kind(self) -> &'static str {
        match self {
            Sdk::Python => "refund_agent",
            Sdk::TypeScript => "ts_refund",
        }
    }

    fn command(self, port: u16) -> Command {
        let mut cmd = match self {
            Sdk::Python => {
                let mut c = Command::new(python());
                c.arg(sdk_dir().join("examples/refund_service.py"))
                    .env("PYTHONPATH", sdk_dir());
                c
            }
            Sdk::TypeScript => {
                let mut c = Command::new("node");
                c.arg(ts_sdk_dir().join("examples/refund_service.mjs"));
                c
            }
        };
        cmd.args(["--port", &port.to_string()]);
        cmd
    }
}

fn ts_sdk_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk/typescript")
}

/// An SDK's example service as a subprocess; SIGKILLed when dropped.
struct ExampleService {
    child: Child,
    port: u16,
}

impl ExampleService {
    /// Starts `sdk`'s on `port` with `secret` and waits until it serves its manifest.
    async fn start(sdk: Sdk, port: u16, secret: &str) -> Self {
        let child = sdk
            .command(port)
            .env("AGENTQ_SERVICE_SECRET", secret)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting the {sdk:?} example service: {e}"));
        let svc = Self { child, port };
        let http = reqwest::Client::new();
        let end = tokio::time::Instant::now() + DEADLINE;
        loop {
            let got = http
                .get(format!("{}/agentq/manifest", svc.url()))
                .send()
                .await;
            if got.is_ok_and(|r| r.status().is_success()) {
                return svc;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "the {sdk:?} service did not serve its manifest within {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ExampleService {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `sdk`'s example service with a new secret and registers it (`agentq services add`).
async fn registered(app: &TestApp, sdk: Sdk, port: u16) -> (ExampleService, String) {
    let secret = Secret::generate().expose();
    let service = ExampleService::start(sdk, port, &secret).await;
    app.agentq_ok(&[
        "services",
        "add",
        "--url",
        &service.url(),
        "--secret",
        &secret,
    ]);
    (service, secret)
}

/// The payments endpoint the refund step calls: a POST is applied once per key (a repeat
/// answers what the first applied) and answered after `delay_ms`; `GET ?key=K` says whether K
/// was applied.
#[derive(Default)]
struct Payments {
    /// Every POST: (key, order).
    posts: Mutex<Vec<(String, String)>>,
    applied: Mutex<HashMap<String, Value>>,
    delay_ms: AtomicU64,
    /// Reconciles asked (`GET ?key=`).
    lookups: AtomicUsize,
}

async fn pay(State(p): State<Arc<Payments>>, Json(body): Json<Value>) -> Response {
    let key = body["key"].as_str().unwrap_or_default().to_string();
    let order = body["order"].as_str().unwrap_or_default().to_string();
    p.posts.lock().unwrap().push((key.clone(), order.clone()));
    let result = {
        let mut applied = p.applied.lock().unwrap();
        let n = applied.len();
        applied
            .entry(key)
            .or_insert_with(|| json!({ "refunded": order, "ref": format!("R-{n}") }))
            .clone()
    };
    tokio::time::sleep(Duration::from_millis(p.delay_ms.load(Ordering::SeqCst))).await;
    Json(result).into_response()
}

async fn lookup(
    State(p): State<Arc<Payments>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let key = q.get("key").cloned().unwrap_or_default();
    p.lookups.fetch_add(1, Ordering::SeqCst);
    match p.applied.lock().unwrap().get(&key) {
        Some(v) => Json(json!({ "happened": true, "output": v })).into_response(),
        None => Json(json!({ "happened": false })).into_response(),
    }
}

async fn serve(app: Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, task)
}

/// Approves every operation waiting for its approval, through `agentq approve`.
async fn approve_waiting(app: &TestApp) {
    let waiting: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM operations WHERE status = 'waiting' AND waiting_for = 'approval'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    for op in waiting {
        let mut cmd = app.command(&["approve", &op.to_string(), "--as", "reviewer"]);
        let out = tokio::task::spawn_blocking(move || cmd.stdin(Stdio::null()).output())
            .await
            .unwrap()
            .unwrap();
        // A worker may take the operation between the query and the approval: a refusal then
        // is harmless (the next round approves it).
        let _ = out;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_agent_survives_killed_workers_and_a_restarted_service() {
    refund_agent_survives_killed_workers_and_a_restarted_service(Sdk::Python).await;
}

/// The same agent written with the TypeScript SDK, through the same kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typescript_agent_survives_killed_workers_and_a_restarted_service() {
    refund_agent_survives_killed_workers_and_a_restarted_service(Sdk::TypeScript).await;
}

async fn refund_agent_survives_killed_workers_and_a_restarted_service(sdk: Sdk) {
    const ORDERS: usize = 10;
    const KILLS: usize = 4;
    let fake = FakeModel::start(Mode::Echo).await;
    let payments = Arc::new(Payments::default());
    payments.delay_ms.store(150, Ordering::SeqCst);
    let (pay_url, pay_task) = serve(
        Router::new()
            .route("/refund", post(pay).get(lookup))
            .with_state(payments.clone()),
    )
    .await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_CONCURRENCY_INTERACTIVE", "8");
    // Kills are restarts, and a service down for a moment is a retried attempt: neither may
    // exhaust an operation here.
    app.set_env("AGENTQ_RESTART_LIMIT", "100");
    app.set_env("AGENTQ_MAX_ATTEMPTS", "30");
    let secret = Secret::generate().expose();
    let port = free_port();
    let mut service = ExampleService::start(sdk, port, &secret).await;
    let added = app.agentq_json(&[
        "services",
        "add",
        "--url",
        &service.url(),
        "--secret",
        &secret,
        "--json",
    ]);
    assert_eq!(added["service"]["name"], sdk.service(), "{added}");
    assert!(
        added.get("secret").is_none(),
        "a given secret is never echoed: {added}"
    );

    let mut ops: HashMap<String, Uuid> = HashMap::new();
    for i in 0..ORDERS {
        let order = format!("order-{i}");
        let input = json!({ "order": order, "effect_url": format!("{pay_url}/refund") });
        let out = app.agentq_json(&[
            "enqueue",
            "--tenant",
            "acme",
            "--kind",
            sdk.refund_kind(),
            "--input",
            &input.to_string(),
            "--json",
        ]);
        ops.insert(order, out["op_id"].as_str().unwrap().parse().unwrap());
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let hook: Hook = {
        let (pool, seen, ops) = (app.pool.clone(), seen.clone(), Arc::new(ops.clone()));
        Arc::new(move |body: Value| {
            let (pool, seen, ops) = (pool.clone(), seen.clone(), ops.clone());
            Box::pin(async move {
                let text = last_user(body.to_string().as_bytes());
                let located = ops.iter().find_map(|(order, op)| {
                    if text == format!("Refund order {order}?") {
                        Some((*op, 1))
                    } else if text.contains(&format!("\"refunded\": \"{order}\""))
                        || text.contains(&format!("\"refunded\":\"{order}\""))
                    {
                        Some((*op, 4))
                    } else {
                        None
                    }
                });
                match located {
                    Some((op, seq)) => check_request(&pool, &seen, op, seq).await,
                    None => seen
                        .lock()
                        .unwrap()
                        .violations
                        .push(format!("a model request for no known step: {text}")),
                }
                // Widens the window a kill can land in.
                tokio::time::sleep(Duration::from_millis(100)).await;
            })
        })
    };
    fake.set_hook(hook);

    let events = || fake.requests() + payments.posts.lock().unwrap().len();
    let mut rng = Rng::from_env_or_clock();
    app.spawn(&["scheduler"]);
    let mut snapshots = Vec::new();
    for kill in 0..KILLS {
        let w = app.spawn(&["worker"]);
        let target = events() + rng.between(1, 8) as usize;
        // A kill point past the last event (30 of them: two model calls and a refund per
        // order) is the end of the run: a seed whose points add up to more must not wait for
        // events that cannot come.
        app.wait_for("the next kill point", CRASH_DEADLINE, || async {
            approve_waiting(&app).await;
            events() >= target || unfinished(&app.pool).await == 0
        })
        .await;
        if kill == 1 {
            // The service dies too, mid-run, and comes back on the same address.
            service.kill();
            tokio::time::sleep(Duration::from_millis(rng.between(0, 300))).await;
            service = ExampleService::start(sdk, port, &secret).await;
        }
        app.kill(w);
        snapshots.push(committed(&app.pool).await);
    }
    app.spawn(&["worker"]);
    app.wait_for("every refund agent to finish", CRASH_DEADLINE, || async {
        approve_waiting(&app).await;
        unfinished(&app.pool).await == 0
    })
    .await;

    for (order, op) in &ops {
        let view = app.operation(&op.to_string()).await;
        assert_eq!(
            view.status.as_str(),
            "succeeded",
            "{order}: {:?} {:?}",
            view.error_class,
            view.error_message
        );
        let result = view.result.unwrap();
        assert_eq!(result["refund"]["refunded"], order.as_str(), "{result}");
    }
    // The refund happened exactly once per order: one key applied, one POST.
    let posts = payments.posts.lock().unwrap().clone();
    let applied = payments.applied.lock().unwrap().clone();
    assert_eq!(applied.len(), ORDERS, "refunds applied: {applied:?}");
    for order in ops.keys() {
        let n = posts.iter().filter(|(_, o)| o == order).count();
        assert_eq!(n, 1, "{order} was posted {n} times: {posts:?}");
    }
    // The model was never sent a turn already journaled, nor one before its earlier steps were
    // durable; every op's two turns were sent.
    {
        let seen = seen.lock().unwrap();
        assert!(seen.violations.is_empty(), "{:#?}", seen.violations);
        for op in ops.values() {
            for seq in [1, 4] {
                assert!(
                    seen.sent.contains_key(&(*op, seq)),
                    "{op} step {seq} never sent"
                );
            }
        }
    }
    // Every step committed before a kill is the same row at the end (never run again).
    let last = committed(&app.pool).await;
    for snap in &snapshots {
        for (key, epoch) in snap {
            assert_eq!(last.get(key), Some(epoch), "step {key:?} was written again");
        }
    }
    // The kills landed on running operations (each kill waits for work done by its worker).
    let restarts: i64 = sqlx::query_scalar("SELECT sum(restarts)::bigint FROM operations")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let lookups = payments.lookups.load(Ordering::SeqCst);
    eprintln!(
        "restarts {restarts}, reconcile lookups {lookups}, model requests {}",
        fake.requests()
    );
    assert!(restarts >= 1, "no kill landed on a running operation");
    // Five steps per operation: lookup, decide, approval, refund, summarize.
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operation_steps WHERE status = 'completed'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(rows, (ORDERS * 5) as i64);
    drop(service);
    pay_task.abort();
    app.cleanup().await;
}

/// `ctx.patched` in a Python kind, through a real worker: the first execution journals the
/// marker (the service asks for it), and the steps after it are where the service says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_kinds_patch_marker_is_journaled_by_the_worker() {
    let mut app = TestApp::start().await;
    let (service, _) = registered(&app, Sdk::Python, free_port()).await;
    app.spawn(&["worker"]);
    let op = app.enqueue_as("acme", "patched_steps", &json!({}), &[]);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.result, Some(json!({ "checked": true })));
    let steps: Vec<(i32, String, String, Option<Value>)> = sqlx::query_as(
        "SELECT seq, name, kind, output FROM operation_steps WHERE op_id = $1::uuid ORDER BY seq",
    )
    .bind(&op)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let shape: Vec<(i32, &str, &str)> = steps
        .iter()
        .map(|(seq, name, kind, _)| (*seq, name.as_str(), kind.as_str()))
        .collect();
    assert_eq!(
        shape,
        [
            (0, "fetch", "custom"),
            (1, "check-first", "patch"),
            (2, "check", "custom"),
            (3, "send", "custom"),
        ]
    );
    assert_eq!(steps[1].3, Some(json!(true)));
    drop(service);
    app.cleanup().await;
}

/// How long `a_down_service_parks_its_operations_and_uses_no_attempt` keeps the service down
/// (`AGENTQ_TEST_SERVICE_DOWN_SECS`, at least until its breaker has parked a call).
fn service_down_for() -> Duration {
    let secs = std::env::var("AGENTQ_TEST_SERVICE_DOWN_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    Duration::from_secs(secs)
}

/// A registered service killed under load and started again later: its operations park (their
/// attempts given back) while it is down, `why` names it, and every one finishes once it is
/// back. Every operation has one attempt, so an attempt spent on the outage would kill it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_service_parks_its_operations_and_uses_no_attempt() {
    const STEPS: usize = 20;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_CONCURRENCY_INTERACTIVE", "8");
    let port = free_port();
    let (mut service, secret) = registered(&app, Sdk::Python, port).await;
    app.spawn(&["worker"]);
    app.spawn(&["scheduler"]);
    let one_attempt = ["--max-attempts", "1"];
    let ten_steps = json!({ "steps": STEPS });
    let mut ops: Vec<(String, &str)> = Vec::new();
    for _ in 0..30 {
        let op = app.enqueue_as("acme", "ten_steps", &ten_steps, &one_attempt);
        ops.push((op, "ten_steps"));
    }
    for _ in 0..10 {
        let op = app.enqueue_as("acme", "sleeper", &json!({}), &one_attempt);
        ops.push((op, "sleeper"));
    }
    // Killed while it serves: a sleeper has called it, and steps are being run.
    app.wait_for("the service to be in use", DEADLINE, || async {
        let (sleeping, steps): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM operations WHERE status = 'sleeping'), \
                    (SELECT count(*) FROM operation_steps WHERE status = 'completed')",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        sleeping >= 1 && steps >= 1
    })
    .await;
    service.kill();
    let killed = tokio::time::Instant::now();
    // Operations enqueued while it is down call it and find nobody there.
    let mut after: Vec<String> = Vec::new();
    for _ in 0..10 {
        after.push(app.enqueue_as("acme", "ten_steps", &ten_steps, &one_attempt));
    }
    let parked = app
        .wait_until("why to name the down service", DEADLINE, || async {
            for op in &after {
                let why = app.agentq_json(&["why", op, "--json"]);
                if why["detail"]["reason"] == "service_down" {
                    return Some(why);
                }
            }
            None
        })
        .await;
    assert_eq!(parked["detail"]["service"], "billing", "{parked}");
    let headline = parked["headline"].as_str().unwrap_or_default();
    assert!(
        headline.contains("remote service \"billing\" is unavailable"),
        "{parked}"
    );
    assert!(
        parked["detail"]["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("connecting to"),
        "{parked}"
    );
    // Down long enough for the worker's breaker to open and park calls without sending them.
    let down_for = service_down_for();
    app.wait_for(
        "the service's breaker to park a call, and the outage to last",
        CRASH_DEADLINE,
        || async {
            let breaker_parked: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM operations WHERE error_class = 'overloaded' \
                 AND error_message LIKE '%its circuit is open%')",
            )
            .fetch_one(&app.pool)
            .await
            .unwrap();
            breaker_parked && killed.elapsed() >= down_for
        },
    )
    .await;
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE status = 'dead'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(dead, 0, "an operation died of the outage");
    let service = ExampleService::start(Sdk::Python, port, &secret).await;
    let outage = killed.elapsed();
    app.wait_for("every operation to finish", CRASH_DEADLINE, || async {
        unfinished(&app.pool).await == 0
    })
    .await;
    ops.extend(after.into_iter().map(|op| (op, "ten_steps")));
    for (op, kind) in &ops {
        let view = app.operation(op).await;
        assert_eq!(
            view.status.as_str(),
            "succeeded",
            "{kind} {op}: {:?} {:?}",
            view.error_class,
            view.error_message
        );
        if *kind == "ten_steps" {
            assert_eq!(view.result, Some(json!({ "steps": STEPS })), "{op}");
        }
    }
    // No attempt was used for the outage, and no worker restarted anything.
    let (attempts, restarts, parks): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM operations WHERE attempt > 1), \
                (SELECT coalesce(sum(restarts), 0)::bigint FROM operations), \
                (SELECT count(*) FROM operation_events WHERE data->>'error_class' = 'overloaded')",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((attempts, restarts), (0, 0));
    eprintln!(
        "service down {outage:?}; {parks} parks; {} operations",
        ops.len()
    );
    // Every step completed once: ten_steps' STEPS, a sleeper's sleep and clock read.
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operation_steps WHERE status = 'completed'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(rows, (40 * STEPS + 10 * 2) as i64);
    drop(service);
    app.cleanup().await;
}

/// A service deployed with another manifest and not registered again is caught by its check
/// (`agentq services check`, as the scheduler runs it every minute): the differences are
/// recorded where an operator looks (`services list`, `kinds`) without touching the roles'
/// snapshot of the table, and registering again clears them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_drifted_from_its_registration_is_named_until_registered_again() {
    let manifest = Arc::new(Mutex::new(
        json!({ "protocol": 1, "service": "drifty", "kinds": [
            { "name": "drifty_kind", "version": "1", "input_schema": { "type": "object" } }
        ]}),
    ));
    let (url, task) = serve(Router::new().route(
        "/agentq/manifest",
        get({
            let manifest = manifest.clone();
            move || async move { Json(manifest.lock().unwrap().clone()) }
        }),
    ))
    .await;
    let app = TestApp::start().await;
    app.agentq_ok(&["services", "add", "--url", &url]);
    let matches = app.agentq_json(&["services", "check", "--json"]);
    assert_eq!(matches, json!([{ "name": "drifty", "drift": [] }]));
    let registered_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT updated_at FROM services WHERE name = 'drifty'")
            .fetch_one(&app.pool)
            .await
            .unwrap();

    // Deployed: version 1 now requires a field, and a version 2 appeared.
    *manifest.lock().unwrap() = json!({ "protocol": 1, "service": "drifty", "kinds": [
        { "name": "drifty_kind", "version": "1",
          "input_schema": { "type": "object", "required": ["order"] } },
        { "name": "drifty_kind", "version": "2", "input_schema": { "type": "object" } }
    ]});
    let out = app.agentq(&["services", "check"]);
    assert_eq!(out.status.code(), Some(1), "a drift exits 1");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("drifty: DRIFT"), "{said}");
    assert!(
        said.contains("kind \"drifty_kind\" version \"1\" takes another input"),
        "{said}"
    );
    assert!(
        said.contains("serves kind \"drifty_kind\" version \"2\", which is not registered"),
        "{said}"
    );
    let listed = app.agentq_json(&["services", "list", "--json"]);
    assert_eq!(
        listed[0]["drift"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );
    assert!(listed[0]["checked_at"].is_string(), "{listed}");
    let kinds = app.agentq_json(&["kinds", "--json"]);
    let drifty = kinds["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == "drifty_kind")
        .cloned()
        .unwrap_or_default();
    assert_eq!(drifty["service_drift"], true, "{kinds}");
    // Recorded beside the registration: every role's snapshot (keyed on it) stays as it was.
    let still: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT updated_at FROM services WHERE name = 'drifty'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(still, registered_at);

    // Registered again: what it serves is what is registered.
    app.agentq_ok(&["services", "add", "--url", &url]);
    let listed = app.agentq_json(&["services", "list", "--json"]);
    assert_eq!(listed[0]["drift"], json!([]), "{listed}");
    let out = app.agentq(&["services", "check"]);
    assert_eq!(out.status.code(), Some(0));
    task.abort();
    app.cleanup().await;
}

/// How the fake service misbehaves.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Misbehave {
    Good,
    BadSignature,
    OtherId,
    Oversized,
    NotJson,
    UnknownType,
    WrongStep,
    Hang,
    Refuse,
    /// A good first step, then garbage.
    StepThenGarbage,
    /// Keeps no session: answers `resend` to every call that is not sent the whole journal.
    Forgetful,
    /// Answers `resend` even to a call that sent the whole journal.
    AlwaysResend,
}

struct Hostile {
    secret: Secret,
    mode: Mutex<Misbehave>,
    calls: AtomicUsize,
    /// The test's database: every step a request says is completed must be committed there.
    pool: Mutex<Option<PgPool>>,
    /// Completed steps per session, as the requests' journals said.
    done: Mutex<HashMap<String, usize>>,
    violations: Mutex<Vec<String>>,
    /// Steps of its kind (then the output), and the bytes of each step's output (0: the
    /// step's number).
    steps: AtomicUsize,
    step_bytes: AtomicUsize,
    /// How long the output's answer is held.
    hold_output_ms: AtomicU64,
    /// Request bytes received.
    received: AtomicUsize,
    /// Per operation not yet answered its output: the step output bytes its session's journal
    /// holds as this service answered them (what its worker keeps for that session).
    open: Mutex<HashMap<String, usize>>,
}

impl Hostile {
    fn new(mode: Misbehave) -> Arc<Self> {
        Arc::new(Hostile {
            secret: Secret::generate(),
            mode: Mutex::new(mode),
            calls: AtomicUsize::new(0),
            pool: Mutex::new(None),
            done: Mutex::new(HashMap::new()),
            violations: Mutex::new(Vec::new()),
            steps: AtomicUsize::new(GOOD_STEPS),
            step_bytes: AtomicUsize::new(0),
            hold_output_ms: AtomicU64::new(0),
            received: AtomicUsize::new(0),
            open: Mutex::new(HashMap::new()),
        })
    }

    /// Sets the bytes operation `op`'s session holds, or (`None`) ends it.
    fn held(&self, op: &str, bytes: Option<usize>) {
        let mut open = self.open.lock().unwrap();
        match bytes {
            Some(b) => open.insert(op.to_string(), b),
            None => open.remove(op),
        };
    }
}

/// The steps of the fake service's kind when it behaves: `a0`, `a1`, `a2`, then the output.
const GOOD_STEPS: usize = 3;

async fn hostile_manifest() -> Json<Value> {
    Json(json!({ "protocol": 1, "service": "hostile", "kinds": [
        { "name": "hostile_kind", "version": "1", "input_schema": { "type": "object" } }
    ]}))
}

async fn hostile_invoke(
    State(h): State<Arc<Hostile>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    h.calls.fetch_add(1, Ordering::SeqCst);
    h.received.fetch_add(body.len(), Ordering::SeqCst);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let id = headers
        .get("webhook-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let entries = request["journal"]["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let completed: Vec<i64> = entries
        .iter()
        .filter(|e| e["status"] == "completed")
        .filter_map(|e| e["seq"].as_i64())
        .collect();
    // A step the service is told is completed is durable: it committed before this call.
    let pool = h.pool.lock().unwrap().clone();
    if let (Some(pool), Some(op)) = (pool, request["operation"]["id"].as_str()) {
        for seq in &completed {
            let status: Option<String> = sqlx::query_scalar(
                "SELECT status FROM operation_steps WHERE op_id = $1::uuid AND seq = $2",
            )
            .bind(op)
            .bind(*seq as i32)
            .fetch_optional(&pool)
            .await
            .unwrap();
            if status.as_deref() != Some("completed") {
                h.violations.lock().unwrap().push(format!(
                    "{op}: step {seq} was sent as completed while it was {status:?} in the journal"
                ));
            }
        }
    }
    let base = request["journal"]["base"].as_i64().unwrap_or(-1);
    let mode = *h.mode.lock().unwrap();
    if mode == Misbehave::AlwaysResend || (mode == Misbehave::Forgetful && base != 0) {
        let answer = json!({ "type": "resend" }).to_string().into_bytes();
        let ts = chrono::Utc::now().timestamp();
        let signature = h.secret.sign(&id, ts, &answer);
        return (
            StatusCode::OK,
            [
                ("content-type", "application/json".to_string()),
                ("webhook-id", id),
                ("webhook-timestamp", ts.to_string()),
                ("webhook-signature", signature),
            ],
            answer,
        )
            .into_response();
    }
    let done = {
        let mut done = h.done.lock().unwrap();
        let n = done
            .entry(request["session"].as_str().unwrap_or_default().to_string())
            .or_default();
        if request["journal"]["base"] == 0 {
            *n = 0;
        }
        *n += completed.len();
        *n
    };
    let step_done = done > 0;
    let step_bytes = h.step_bytes.load(Ordering::SeqCst);
    let op = request["operation"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let good = if done >= h.steps.load(Ordering::SeqCst) {
        h.held(&op, Some(done * step_bytes));
        let hold = h.hold_output_ms.load(Ordering::SeqCst);
        if hold > 0 {
            tokio::time::sleep(Duration::from_millis(hold)).await;
        }
        h.held(&op, None);
        json!({ "type": "output", "output": "done" })
    } else if step_bytes > 0 {
        h.held(&op, Some((done + 1) * step_bytes));
        json!({ "type": "step", "seq": done, "name": format!("a{done}"),
                "output": "x".repeat(step_bytes) })
    } else {
        json!({ "type": "step", "seq": done, "name": format!("a{done}"), "output": done })
    };
    let (answer, sign_with, sign_id): (Vec<u8>, Secret, String) = match mode {
        Misbehave::Good | Misbehave::Forgetful | Misbehave::AlwaysResend => {
            (good.to_string().into_bytes(), h.secret.clone(), id.clone())
        }
        Misbehave::StepThenGarbage if !step_done => {
            (good.to_string().into_bytes(), h.secret.clone(), id.clone())
        }
        Misbehave::StepThenGarbage | Misbehave::NotJson => {
            (b"<html>oops</html>".to_vec(), h.secret.clone(), id.clone())
        }
        Misbehave::BadSignature => (
            good.to_string().into_bytes(),
            Secret::generate(),
            id.clone(),
        ),
        Misbehave::OtherId => (
            good.to_string().into_bytes(),
            h.secret.clone(),
            "msg_other".into(),
        ),
        Misbehave::Oversized => {
            // Built once: serializing 5 MiB on every call took this (debug) server past the
            // service's 2 s timeout on a loaded machine, so agentq saw a timeout instead.
            static BIG: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
                json!({ "type": "output", "output": "x".repeat(5 << 20) })
                    .to_string()
                    .into_bytes()
            });
            (BIG.clone(), h.secret.clone(), id.clone())
        }
        Misbehave::UnknownType => (
            json!({ "type": "teleport", "seq": 0 })
                .to_string()
                .into_bytes(),
            h.secret.clone(),
            id.clone(),
        ),
        Misbehave::WrongStep => (
            json!({ "type": "step", "seq": 5, "name": "a", "output": 1 })
                .to_string()
                .into_bytes(),
            h.secret.clone(),
            id.clone(),
        ),
        Misbehave::Hang => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            (Vec::new(), h.secret.clone(), id.clone())
        }
        Misbehave::Refuse => {
            return (StatusCode::UNAUTHORIZED, "bad signature").into_response();
        }
    };
    let ts = chrono::Utc::now().timestamp();
    // agentq reads at most 4 MiB before it checks a signature: an oversized answer goes
    // unsigned (signing 5 MiB in a debug build is as slow as serializing it).
    let signature = if mode == Misbehave::Oversized {
        "v1,unsigned".to_string()
    } else {
        sign_with.sign(&sign_id, ts, &answer)
    };
    (
        StatusCode::OK,
        [
            ("content-type", "application/json".to_string()),
            ("webhook-id", sign_id),
            ("webhook-timestamp", ts.to_string()),
            ("webhook-signature", signature),
        ],
        answer,
    )
        .into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_and_broken_services_are_classified_failures_that_journal_nothing() {
    let hostile = Hostile::new(Misbehave::Good);
    let (url, task) = serve(
        Router::new()
            .route("/agentq/manifest", get(hostile_manifest))
            .route("/agentq/invoke", post(hostile_invoke))
            .with_state(hostile.clone()),
    )
    .await;
    let mut app = TestApp::start().await;
    *hostile.pool.lock().unwrap() = Some(app.pool.clone());
    let secret = hostile.secret.expose();
    // Bad registrations change nothing.
    for (args, says) in [
        (vec!["--url", "ftp://x"], "http or https"),
        (
            vec!["--url", "http://127.0.0.1:1"],
            "is the service running",
        ),
        (vec!["--url", &url, "--secret", "nope"], "whsec_"),
        (vec!["--url", &url, "--timeout-secs", "0"], "1 to 86400"),
        // Link-local and cloud metadata addresses, refused before anything is sent.
        (
            vec!["--url", "http://169.254.169.254"],
            "is a link-local address; agentq calls it only for a service registered with --allow-link-local",
        ),
        (
            vec!["--url", "http://[::ffff:169.254.169.254]"],
            "link-local",
        ),
        (
            vec!["--url", "http://[fd00:ec2::254]"],
            "a cloud metadata address",
        ),
        (
            vec!["--url", "http://100.100.100.200"],
            "a cloud metadata address",
        ),
    ] {
        let mut full = vec!["services", "add"];
        full.extend(args);
        let out = app.agentq(&full);
        assert_eq!(out.status.code(), Some(2), "{full:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{full:?}: {err}");
    }
    assert!(app.agentq_json(&["services", "list", "--json"]) == json!([]));
    app.agentq_ok(&[
        "services",
        "add",
        "--url",
        &url,
        "--secret",
        &secret,
        "--timeout-secs",
        "2",
    ]);
    let w = app.spawn(&["worker"]);
    app.spawn(&["scheduler"]);

    let run = |mode: Misbehave| {
        *hostile.mode.lock().unwrap() = mode;
        let out = app.agentq_json(&[
            "enqueue",
            "--tenant",
            "acme",
            "--kind",
            "hostile_kind",
            "--input",
            "{}",
            "--max-attempts",
            "1",
            "--json",
        ]);
        out["op_id"].as_str().unwrap().to_string()
    };
    let steps = |op: String| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_as::<_, (i32, String)>(
                "SELECT seq, status FROM operation_steps WHERE op_id = $1::uuid ORDER BY seq",
            )
            .bind(op)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };

    // A service that behaves runs to its end, each step committed before the next call.
    let op = run(Misbehave::Good);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.result, Some(json!("done")));
    let all_completed: Vec<(i32, String)> = (0..GOOD_STEPS as i32)
        .map(|s| (s, "completed".to_string()))
        .collect();
    assert_eq!(steps(op).await, all_completed);
    // A service that keeps no session gets the whole journal again each time it asks.
    let op = run(Misbehave::Forgetful);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(done.result, Some(json!("done")));
    assert_eq!(steps(op).await, all_completed);

    for (mode, says) in [
        (
            Misbehave::BadSignature,
            "answer's signature does not verify",
        ),
        (Misbehave::OtherId, "not the request's"),
        (Misbehave::Oversized, "more than 4 MiB"),
        (Misbehave::NotJson, "not a step protocol answer"),
        (Misbehave::UnknownType, "not a step protocol answer"),
        (
            Misbehave::WrongStep,
            "answered step 5 but the journal asks for step 0",
        ),
        (Misbehave::Hang, "did not answer within 2 s"),
        (Misbehave::Refuse, "refused agentq's signature"),
        (Misbehave::StepThenGarbage, "not a step protocol answer"),
        (
            Misbehave::AlwaysResend,
            "asked to resend a journal it was sent whole",
        ),
    ] {
        let op = run(mode);
        let dead = app.wait_status(&op, "dead", DEADLINE).await;
        // Retryable, with its one attempt spent (`--max-attempts 1`): a retry would call again.
        assert_eq!(
            dead.error_class.as_deref(),
            Some("retries_exhausted"),
            "{mode:?}"
        );
        let message = dead.error_message.unwrap_or_default();
        assert!(
            message.contains("remote service \"hostile\"") && message.contains(says),
            "{mode:?}: {message}"
        );
        let journaled = steps(op).await;
        let want = if mode == Misbehave::StepThenGarbage {
            // The good step is kept; nothing of the garbage.
            vec![(0, "completed".to_string())]
        } else {
            Vec::new()
        };
        assert_eq!(journaled, want, "{mode:?}");
    }
    // A service row pointing at the cloud's metadata address (written before the check, or
    // by hand) is called by no worker: the run fails naming it, and nothing reaches anyone.
    sqlx::query("UPDATE services SET url = 'http://169.254.169.254', updated_at = now()")
        .execute(&app.pool)
        .await
        .unwrap();
    // Each worker reads the services again within a few seconds: runs go on until one meets
    // the new URL.
    let finished = |op: String| {
        let app = &app;
        async move {
            app.wait_until("the run to finish", DEADLINE, || async {
                let o = app.operation(&op).await;
                o.status.is_terminal().then_some(o)
            })
            .await
        }
    };
    let (op, message) = app
        .wait_until("a run against the new URL", DEADLINE, || async {
            let op = run(Misbehave::Good);
            let o = finished(op.clone()).await;
            let message = o.error_message.unwrap_or_default();
            message.contains("link-local").then_some((op, message))
        })
        .await;
    let calls = hostile.calls.load(Ordering::SeqCst);
    assert!(
        message.contains("remote service \"hostile\"") && message.contains("--allow-link-local"),
        "{op}: {message}"
    );
    let op = run(Misbehave::Good);
    let o = finished(op.clone()).await;
    assert!(o.error_message.unwrap_or_default().contains("link-local"));
    assert_eq!(
        hostile.calls.load(Ordering::SeqCst),
        calls,
        "{op} called someone"
    );
    sqlx::query("UPDATE services SET url = $1, updated_at = now()")
        .bind(&url)
        .execute(&app.pool)
        .await
        .unwrap();
    // The worker is unharmed: still running, and still runs remote and built-in kinds.
    app.wait_until("a run against the service again", DEADLINE, || async {
        let o = finished(run(Misbehave::Good)).await;
        (o.status == agentq_core::Status::Succeeded).then_some(())
    })
    .await;
    let echo = app.enqueue_echo("still here");
    app.wait_status(&echo, "succeeded", DEADLINE).await;
    assert_eq!(app.exit_code(w), None, "the worker exited");
    let violations = hostile.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "{violations:#?}");
    // Only an admin registers services: a producer's token is refused at the API.
    let (_, base) = app.serve().await;
    let token = app.token("acme", "producer");
    let refused = reqwest::Client::new()
        .post(format!("{base}/v1/services"))
        .bearer_auth(&token)
        .json(&json!({ "url": url }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 403);
    let listed = reqwest::Client::new()
        .get(format!("{base}/v1/services"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status().as_u16(), 403);
    // The kind is listed with the service that runs it, for anyone who may enqueue it.
    let kinds: Value = reqwest::Client::new()
        .get(format!("{base}/v1/kinds"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed = kinds["kinds"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["name"] == "hostile_kind")
        .cloned()
        .unwrap_or_default();
    assert_eq!(listed["service"], "hostile", "{kinds}");
    assert_eq!(listed["live_versions"], json!(["1"]), "{listed}");
    task.abort();
    app.cleanup().await;
}

/// A registered service could make a worker hold and send unbounded bytes: each remote run kept
/// its journal in memory beside the loaded one, bounded only per operation, and a service that
/// asked for the whole journal at every call made the worker send the square of it (633 MB for
/// one operation of 4 MiB steps). Now a run resends at most twice its journal and a MiB, and
/// the worker's remote runs hold their journals within one budget
/// (AGENTQ_REMOTE_JOURNAL_MEMORY).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_journals_have_a_memory_budget_and_a_service_that_keeps_asking_for_them_fails() {
    const MIB: usize = 1 << 20;
    let hostile = Hostile::new(Misbehave::Forgetful);
    let (url, task) = serve(
        Router::new()
            .route("/agentq/manifest", get(hostile_manifest))
            .route("/agentq/invoke", post(hostile_invoke))
            .layer(axum::extract::DefaultBodyLimit::disable())
            .with_state(hostile.clone()),
    )
    .await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_REMOTE_JOURNAL_MEMORY", &(12 * MIB).to_string());
    let secret = hostile.secret.expose();
    app.agentq_ok(&["services", "add", "--url", &url, "--secret", &secret]);
    app.spawn(&["worker"]);
    app.spawn(&["scheduler"]);
    let enqueue = |attempts: &str| {
        let out = app.agentq_json(&[
            "enqueue",
            "--tenant",
            "ta",
            "--kind",
            "hostile_kind",
            "--input",
            "{}",
            "--max-attempts",
            attempts,
            "--json",
        ]);
        out["op_id"].as_str().unwrap().to_string()
    };

    // Twelve steps of 1 MiB, and the whole journal asked for again at every call: sent whole
    // every time, that is 78 MiB; the run fails after its allowance instead.
    hostile.steps.store(12, Ordering::SeqCst);
    hostile.step_bytes.store(MIB, Ordering::SeqCst);
    let op = enqueue("1");
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    let message = dead.error_message.unwrap_or_default();
    assert!(
        message.contains("remote service \"hostile\"")
            && message.contains("asked for the whole journal again"),
        "{message}"
    );
    let received = hostile.received.swap(0, Ordering::SeqCst);
    assert!(received < 24 * MIB, "{received} bytes sent for one run");

    // Five runs of four 1 MiB steps at once, each holding its last answer a second: together
    // their journals would hold 20 MiB; they hold 12 at most (an operation that gives way goes
    // back to the queue, and its session's journal with it: it is not counted while queued).
    *hostile.mode.lock().unwrap() = Misbehave::Good;
    hostile.steps.store(4, Ordering::SeqCst);
    hostile.hold_output_ms.store(1_000, Ordering::SeqCst);
    hostile.open.lock().unwrap().clear();
    let ops: Vec<String> = (0..5).map(|_| enqueue("5")).collect();
    let mut most = 0;
    let end = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let running: Vec<String> = sqlx::query_scalar(
            "SELECT id::text FROM operations WHERE status = 'running' AND id::text = ANY($1)",
        )
        .bind(&ops)
        .fetch_all(&app.pool)
        .await
        .unwrap();
        let held: usize = {
            let mut open = hostile.open.lock().unwrap();
            open.retain(|op, _| running.contains(op));
            open.values().sum()
        };
        most = most.max(held);
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM operations WHERE status = 'succeeded' AND id::text = ANY($1)",
        )
        .bind(&ops)
        .fetch_one(&app.pool)
        .await
        .unwrap();
        if done == 5 {
            break;
        }
        assert!(tokio::time::Instant::now() < end, "{done} of 5 succeeded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        most <= 12 * MIB,
        "the worker held {} MiB of remote journals at once",
        most / MIB
    );
    task.abort();
    app.cleanup().await;
}

/// The Python SDK's own tests (signing, replay, sessions, the HTTP servers, the replay
/// tester), run by CI through this suite.
#[test]
fn the_python_sdk_passes_its_own_tests() {
    let out = Command::new(python())
        .args(["-m", "unittest", "discover", "-s", "tests"])
        .current_dir(sdk_dir())
        .output()
        .expect("running python3");
    assert!(
        out.status.success(),
        "the Python SDK's tests failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The TypeScript SDK's own tests (signing, replay, unsafe steps, sessions, patches, the HTTP
/// server), run with Node's test runner by CI through this suite.
#[test]
fn the_typescript_sdk_passes_its_own_tests() {
    let out = Command::new("node")
        .args(["--test", "test/"])
        .current_dir(ts_sdk_dir())
        .output()
        .expect("running node (20 or newer)");
    assert!(
        out.status.success(),
        "the TypeScript SDK's tests failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Operations neither succeeded nor dead.
async fn unfinished(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM operations WHERE status NOT IN ('succeeded', 'dead')")
        .fetch_one(pool)
        .await
        .unwrap()
}
