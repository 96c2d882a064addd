//! Rate limits by tokens per window, across three worker processes and a fake provider that
//! records when each call arrives and what it reports using: no window of the limit's length
//! ever holds more than the limit, although the provider reports both more and less than the
//! calls' estimates, and the drain runs at 90 % of the limit or more. Bad limits are refused
//! and change nothing, a producer cannot set one, an operator only its own tenant's keys, and
//! `why` names the limit an operation is parked on and when its window reopens.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::api::Api;
use crate::fake_model::{FakeModel, Mode, Script, completion};
use crate::harness::{DEADLINE, TestApp};

/// The limit's window, in seconds (a minute in production; shorter here to keep the test
/// short: the mechanism is the same, and the window's margin is the same half second).
const WINDOW_SECS: u64 = 15;
/// Tokens allowed in any window.
const LIMIT: i64 = 40_000;
/// Operations in the backlog: one model call each, about 2.6 windows' worth of tokens.
const OPS: usize = 96;
/// What the provider reports using, call after call: 600 and 800 tokens are less than the
/// call's estimate (its input's bytes / 4 plus the 1,024-token default output), 1,500 and
/// 1,600 more.
const USED: [(i64, i64); 4] = [(500, 100), (1_200, 300), (700, 100), (1_400, 200)];

/// Arrival time and reported tokens of every call the fake provider answered.
type Arrivals = Arc<Mutex<Vec<(Instant, i64)>>>;

fn recording_model(arrivals: Arrivals) -> Mode {
    let n = Arc::new(AtomicUsize::new(0));
    Mode::Script(Script(Arc::new(move |_request: &Value| {
        let (prompt, completion_tokens) = USED[n.fetch_add(1, Ordering::SeqCst) % USED.len()];
        arrivals
            .lock()
            .unwrap()
            .push((Instant::now(), prompt + completion_tokens));
        let mut answer = completion("summarized");
        answer["usage"] =
            json!({ "prompt_tokens": prompt, "completion_tokens": completion_tokens });
        answer
    })))
}

/// The most tokens any window of `window` holds: every window starting at an arrival (a
/// busiest window can always be moved to start at one).
fn busiest_window(arrivals: &[(Instant, i64)], window: Duration) -> (i64, usize) {
    let mut best = (0, 0);
    for (i, (start, _)) in arrivals.iter().enumerate() {
        let sum: i64 = arrivals[i..]
            .iter()
            .take_while(|(t, _)| t.duration_since(*start) < window)
            .map(|(_, used)| used)
            .sum();
        if sum > best.0 {
            best = (sum, i);
        }
    }
    best
}

/// Enqueues an `agent` operation of tenant t1 asking `user`, its calls counted against `key`.
fn enqueue_on_key(app: &TestApp, user: &str, key: &str) -> String {
    let input = json!({ "user": user }).to_string();
    let args = [
        "enqueue",
        "--tenant",
        "t1",
        "--kind",
        "agent",
        "--input",
        &input,
        "--rate-key",
        key,
        "--json",
    ];
    app.agentq_json(&args)["op_id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn a_token_limit_holds_in_every_window_across_three_workers_and_reaches_ninety_percent() {
    let arrivals: Arrivals = Arc::default();
    let fake = FakeModel::start(recording_model(arrivals.clone())).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let window = format!("{WINDOW_SECS}s");
    let limit = LIMIT.to_string();
    let set = app.agentq_json(&[
        "limits",
        "set",
        "--scope",
        "key",
        "--name",
        "docs",
        "--tenant",
        "t1",
        "--tokens",
        &limit,
        "--window",
        &window,
        "--reason",
        "provider quota",
        "--json",
    ]);
    assert_eq!(set["max_tokens"], json!(LIMIT), "{set}");
    app.spawn(&["scheduler"]);
    for _ in 0..3 {
        app.spawn(&["worker"]);
    }

    let (producer, dispatcher) = app.producer();
    let mut ops = Vec::new();
    for i in 0..OPS {
        let e = producer
            .enqueue(agentq_producer::EnqueueRequest {
                tenant: "t1".into(),
                kind: "agent".into(),
                input: json!({ "user": format!("summarize document {i}") }),
                rate_key: Some("docs".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        ops.push(e.op_id.0.to_string());
    }
    dispatcher.close().await;
    let drain = Duration::from_secs(WINDOW_SECS * 4) + DEADLINE;
    for op in &ops {
        app.wait_status(op, "succeeded", drain).await;
    }

    let mut seen = arrivals.lock().unwrap().clone();
    seen.sort_by_key(|(t, _)| *t);
    assert_eq!(seen.len(), OPS, "one call per operation");
    let total: i64 = seen.iter().map(|(_, used)| used).sum();
    let window = Duration::from_secs(WINDOW_SECS);
    let (busiest, at) = busiest_window(&seen, window);
    let t0 = seen[0].0;
    assert!(
        busiest <= LIMIT,
        "a window starting {:?} after the first call holds {busiest} tokens, over the limit \
         of {LIMIT}",
        seen[at].0 - t0
    );
    // Throughput: the tokens of the calls sent before the first one sent two windows after
    // the first, per window of that time. A backlog drained at the limit's pace gives the
    // limit; time lost between windows shows as less.
    let cut = seen
        .iter()
        .position(|(t, _)| t.duration_since(t0) >= 2 * window)
        .expect("the backlog lasts more than two windows");
    let before: i64 = seen[..cut].iter().map(|(_, used)| used).sum();
    let per_window = before as f64 / (seen[cut].0 - t0).as_secs_f64() * WINDOW_SECS as f64;
    assert!(
        per_window >= 0.9 * LIMIT as f64,
        "drained {per_window:.0} tokens per window under a limit of {LIMIT} (total {total})"
    );
    // Both over- and under-estimates happened, and the limit learned from the latter.
    let listed = app.agentq_json_lines(&["limits", "list", "--tenant", "t1", "--json"]);
    assert_eq!(listed.len(), 1, "{listed:?}");
    let ratio = listed[0]["usage_ratio"].as_f64().unwrap();
    assert!(
        ratio > 1.0,
        "1,500-token calls over an estimate near 1,100 raise the ratio: {ratio}"
    );
    eprintln!(
        "rate limit: {OPS} calls, {total} tokens; busiest {WINDOW_SECS} s window {busiest} of \
         {LIMIT}; {per_window:.0} tokens per window ({:.1} %); learned ratio {ratio:.2}",
        per_window / LIMIT as f64 * 100.0
    );
    app.cleanup().await;
}

#[tokio::test]
async fn bad_limits_are_refused_producers_cannot_set_them_and_why_names_the_window() {
    let fake = FakeModel::start(Mode::Echo).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);

    let model = |window: &'static str| {
        vec![
            "--scope",
            "model",
            "--name",
            "m",
            "--requests",
            "5",
            "--window",
            window,
        ]
    };
    let key = ["--scope", "key", "--name", "k", "--tenant", "t1"];
    for (args, said) in [
        (key.to_vec(), "--tokens N"),
        ([&key[..], &["--tokens", "0"]].concat(), "max_tokens"),
        (model("0s"), "window"),
        (model("2d"), "window"),
        (
            vec!["--scope", "galaxy", "--name", "m", "--requests", "5"],
            "scope",
        ),
        (
            vec![
                "--scope",
                "tenant",
                "--name",
                "has space",
                "--requests",
                "5",
            ],
            "without spaces",
        ),
    ] {
        let mut full = vec!["limits", "set"];
        full.extend_from_slice(&args);
        let out = app.agentq(&full);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(said), "{args:?}: {err}");
    }
    assert!(
        app.agentq_json_lines(&["limits", "list", "--json"])
            .is_empty(),
        "a refused limit writes nothing"
    );

    // Over the API: a producer sets nothing; an operator its own tenant's keys only.
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let producer = app.token("t1", "producer");
    let operator = app.token("t1", "operator");
    let model_limit = json!({ "scope": "model", "name": "fake-model", "max_requests": 1 });
    api.post("/v1/rate-limits", Some(&producer), &model_limit)
        .await
        .problem(403, "forbidden");
    api.post("/v1/rate-limits", Some(&operator), &model_limit)
        .await
        .problem(403, "forbidden");
    let theirs = json!({ "scope": "key", "name": "k", "tenant": "t2", "max_requests": 1 });
    api.post("/v1/rate-limits", Some(&operator), &theirs)
        .await
        .problem(403, "forbidden");
    let ours = json!({ "scope": "key", "name": "k", "max_requests": 1, "window_secs": 3600 });
    let set = api
        .post("/v1/rate-limits", Some(&operator), &ours)
        .await
        .expect(200);
    assert_eq!(set["tenant"], "t1", "{set}");
    let other = app.token("t2", "producer");
    let listed = api.get("/v1/rate-limits", Some(&other)).await.expect(200);
    assert_eq!(
        listed["items"],
        json!([]),
        "t2 sees no limit of t1: {listed}"
    );

    // One call an hour on key k: the first operation takes it, the second parks on the limit.
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let enqueue = |user: &str| enqueue_on_key(&app, user, "k");
    let first = enqueue("first");
    app.wait_status(&first, "succeeded", DEADLINE).await;
    let second = enqueue("second");
    app.wait_status(&second, "waiting", DEADLINE).await;
    assert_eq!(fake.requests(), 1, "the second call was never sent");
    let why = app.agentq_json(&["why", &second, "--json"]);
    assert_eq!(why["detail"]["reason"], "waiting_for_rate_limit", "{why}");
    assert_eq!(why["detail"]["limit"], "t1:k", "{why}");
    assert_eq!(why["detail"]["window_requests"], json!(1), "{why}");
    let headline = why["headline"].as_str().unwrap_or_default();
    assert!(
        headline.contains("rate limit") && headline.contains("t1:k"),
        "{why}"
    );
    let status = app.agentq_ok(&["status", &second]);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("rate limit key t1:k"), "{status}");
    // The console names the wait on the operation's page and lists the limit with its window;
    // another tenant's operator sees neither.
    let mut ui = crate::console::Browser::new(&base);
    ui.login(&operator).await;
    let (code, page) = ui.get(&format!("/ui/operations/{second}")).await;
    assert_eq!(code, 200);
    assert!(
        page.contains("rate limit key"),
        "the operation page: {page}"
    );
    let (code, page) = ui.get("/ui/limits").await;
    assert_eq!(code, 200);
    assert!(
        page.contains("data-limit=\"k\"") && page.contains("1 of 1"),
        "the limits page: {page}"
    );
    let mut theirs = crate::console::Browser::new(&base);
    theirs.login(&app.token("t2", "operator")).await;
    let (_, page) = theirs.get("/ui/limits").await;
    assert!(page.contains("No rate limit."), "{page}");

    // Removing the limit wakes it at once rather than after the hour.
    let rb = api.req(Method::DELETE, "/v1/rate-limits/key/k", Some(&operator));
    crate::api::send("DELETE /v1/rate-limits/key/k", rb)
        .await
        .expect(200);
    app.wait_status(&second, "succeeded", DEADLINE).await;
    assert_eq!(fake.requests(), 2);
    app.cleanup().await;
}

#[tokio::test]
async fn an_operation_parked_on_a_limit_is_woken_when_a_call_returns_its_room() {
    // Every call reports 50 tokens; its estimate (about 1,100) is what a grant counts until the
    // call returns.
    let fake = FakeModel::start(Mode::Script(Script(Arc::new(|_: &Value| {
        let mut answer = completion("short");
        answer["usage"] = json!({ "prompt_tokens": 40, "completion_tokens": 10 });
        answer
    }))))
    .await;
    let gate = fake.hold_requests();
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.agentq_ok(&[
        "limits", "set", "--scope", "key", "--name", "k", "--tenant", "t1", "--tokens", "1500",
        "--window", "1h",
    ]);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let enqueue = |user: &str| enqueue_on_key(&app, user, "k");
    // The first call holds its estimate while the provider holds it; the second finds no room
    // and, past the short wait, parks until the window reopens an hour later.
    let first = enqueue("first");
    app.wait_for("the first call at the provider", DEADLINE, || async {
        fake.requests() == 1
    })
    .await;
    let second = enqueue("second");
    app.wait_status(&second, "waiting", DEADLINE).await;
    let why = app.agentq_json(&["why", &second, "--json"]);
    assert_eq!(why["detail"]["reason"], "waiting_for_rate_limit", "{why}");
    // The first call returns 50 tokens used: its room is back, and the second is woken now,
    // not in an hour.
    gate.add_permits(2);
    app.wait_status(&first, "succeeded", DEADLINE).await;
    app.wait_status(&second, "succeeded", DEADLINE).await;
    let listed = app.agentq_json_lines(&["limits", "list", "--tenant", "t1", "--json"]);
    assert_eq!(listed[0]["window_tokens"], json!(100), "{listed:?}");
    app.cleanup().await;
}
