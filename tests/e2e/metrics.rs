//! Metrics: `agentq worker` and `agentq scheduler` serve `GET /metrics` on `AGENTQ_METRICS_ADDR`,
//! `agentq serve` on its API address; the counters and database gauges move as operations run,
//! succeed and fail, and no input ever shows up in them.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;

use crate::api::Api;
use crate::harness::{DEADLINE, TestApp};

/// Part of every input: it must never appear in a metric.
const CANARY: &str = "canary-7f3a9c-metrics";

/// Waits for a process started with `AGENTQ_METRICS_ADDR=127.0.0.1:0` to print its address.
pub(crate) async fn metrics_url(app: &TestApp, index: usize) -> String {
    app.wait_until("the metrics endpoint", Duration::from_secs(30), || {
        let log = app.log(index);
        async move {
            let at = log.find("metrics on http://")?;
            let base = log[at + "metrics on ".len()..].split_whitespace().next()?;
            Some(format!("{base}/metrics"))
        }
    })
    .await
}

/// One scrape: every sample by `name{sorted labels}`, and the raw text.
pub(crate) struct Scrape {
    samples: BTreeMap<String, f64>,
    text: String,
}

impl Scrape {
    /// A scrape of a metrics address (no token).
    pub(crate) async fn of(url: &str) -> Self {
        Self::fetch(reqwest::Client::new().get(url), url).await
    }

    /// A scrape of the API's `/metrics`, which needs an operator token.
    async fn authed(url: &str, token: &str) -> Self {
        Self::fetch(reqwest::Client::new().get(url).bearer_auth(token), url).await
    }

    async fn fetch(req: reqwest::RequestBuilder, url: &str) -> Self {
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert_eq!(resp.status(), 200, "GET {url}");
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(ct.starts_with("text/plain"), "content-type {ct:?}");
        let text = resp.text().await.unwrap();
        let mut samples = BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("name value");
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
            samples.insert(normalize(series), value);
        }
        Self { samples, text }
    }

    /// The sample `name` with exactly `labels`, 0 when absent (a counter not yet touched).
    pub(crate) fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        pairs.sort();
        let key = if pairs.is_empty() {
            name.to_string()
        } else {
            format!("{name}{{{}}}", pairs.join(","))
        };
        self.samples.get(&key).copied().unwrap_or(0.0)
    }

    fn declares(&self, name: &str) -> bool {
        self.text.contains(&format!("# TYPE {name} "))
    }
}

/// `name{b="2",a="1"}` → `name{a="1",b="2"}` (the label values here hold no `,`).
fn normalize(series: &str) -> String {
    match series.split_once('{') {
        None => series.to_string(),
        Some((name, rest)) => {
            let mut pairs: Vec<&str> = rest.trim_end_matches('}').split(',').collect();
            pairs.sort();
            format!("{name}{{{}}}", pairs.join(","))
        }
    }
}

#[tokio::test]
async fn metrics_move_as_operations_run_succeed_and_fail() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_METRICS_ADDR", "127.0.0.1:0");
    let worker = app.spawn_logged(&["worker"]);
    let scheduler = app.spawn_logged(&["scheduler"]);
    let worker_url = metrics_url(&app, worker).await;
    let scheduler_url = metrics_url(&app, scheduler).await;
    let (_, base) = app.serve().await;
    let api_url = format!("{base}/metrics");
    let api = Api::new(&base);
    let token = app.token("t1", "producer");
    let operator = app.token("t1", "operator");

    // The same address answers GET /healthz from the role's loop (the worker's lease heartbeat,
    // the scheduler's passes), and `agentq probe` (the image's health check) reads it.
    for (url, check) in [
        (&worker_url, "lease_renewal"),
        (&scheduler_url, "scheduler_pass"),
    ] {
        let health = url.replace("/metrics", "/healthz");
        let r = reqwest::get(&health).await.unwrap();
        assert_eq!(r.status(), 200, "GET {health}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["status"], "ok", "{body}");
        assert_eq!(body["checks"][check]["status"], "ok", "{body}");
        let probe = app.agentq(&["probe", &health]);
        assert!(probe.status.success(), "agentq probe {health}: {probe:?}");
    }
    let down = app.agentq(&["probe", &format!("{base}/no-such-route")]);
    assert_eq!(
        down.status.code(),
        Some(1),
        "a 404 fails the probe: {down:?}"
    );

    // The API's /metrics carries every tenant's counts: no token or a producer's gets nothing.
    for t in [None, Some(&token)] {
        let mut req = reqwest::Client::new().get(&api_url);
        if let Some(t) = t {
            req = req.bearer_auth(t);
        }
        let status = req.send().await.unwrap().status();
        assert!([401, 403].contains(&status.as_u16()), "{t:?}: {status}");
    }
    let before = [
        Scrape::of(&worker_url).await,
        Scrape::of(&scheduler_url).await,
        Scrape::authed(&api_url, &operator).await,
    ];
    for s in &before {
        for name in [
            "agentq_operations_enqueued_total",
            "agentq_operations_finished_total",
            "agentq_step_duration_seconds",
            "agentq_queue_depth",
            "agentq_dead_letters_open",
            "agentq_timer_lag_seconds",
        ] {
            assert!(s.declares(name), "{name} is not declared:\n{}", s.text);
        }
    }
    let [w0, s0, a0] = &before;
    // The counters the alert rules read exist at 0 before anything happened, so a first event
    // is an increase to Prometheus.
    for (s, series) in [
        (
            w0,
            "agentq_model_call_errors_total{class=\"parked\",provider=\"local\"}",
        ),
        (s0, "agentq_crash_loops_total{kind=\"script\"}"),
        (s0, "agentq_leases_expired_total{kind=\"echo\"}"),
    ] {
        assert_eq!(s.samples.get(series), Some(&0.0), "{series}:\n{}", s.text);
    }

    const OK: usize = 3;
    const DEAD: usize = 2;
    let mut ok = Vec::new();
    for i in 0..OK {
        let input = json!({ "text": format!("{CANARY} hello {i}") });
        ok.push(
            api.create(&token, &json!({ "kind": "echo", "input": input }))
                .await,
        );
    }
    let mut dead = Vec::new();
    for _ in 0..DEAD {
        let input = json!({ "steps": [{ "work_ms": 1 }, { "fail": "non_retryable", "times": 9 }] });
        dead.push(
            api.create(&token, &json!({ "kind": "script", "input": input }))
                .await,
        );
    }
    let sleeper = api
        .create(
            &token,
            &json!({ "kind": "script", "input": { "steps": [{ "sleep_ms": 200 }, { "work_ms": 1 }] } }),
        )
        .await;
    for op in ok.iter().chain([&sleeper]) {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    for op in &dead {
        app.wait_status(op, "dead", DEADLINE).await;
    }

    // The worker's counters: outcomes, failure classes, step and attempt durations, tokens.
    // Its last settle may land just after the status is visible: poll until it shows.
    let (ok_n, dead_n) = (OK as f64, DEAD as f64);
    let finished = |s: &Scrape, kind: &str, outcome: &str| {
        s.get(
            "agentq_operations_finished_total",
            &[("kind", kind), ("outcome", outcome)],
        )
    };
    let w1 = app
        .wait_until("the worker's counters", DEADLINE, || {
            let url = worker_url.clone();
            async move {
                let s = Scrape::of(&url).await;
                (finished(&s, "echo", "succeeded") - finished(w0, "echo", "succeeded") >= ok_n
                    && finished(&s, "script", "dead") - finished(w0, "script", "dead") >= dead_n
                    && finished(&s, "script", "succeeded") >= 1.0)
                    .then_some(s)
            }
        })
        .await;
    assert_eq!(
        finished(&w1, "echo", "succeeded") - finished(w0, "echo", "succeeded"),
        ok_n
    );
    assert_eq!(
        finished(&w1, "script", "dead") - finished(w0, "script", "dead"),
        dead_n
    );
    assert_eq!(finished(&w1, "echo", "dead"), 0.0);
    let failures = |s: &Scrape| {
        s.get(
            "agentq_operation_failures_total",
            &[("kind", "script"), ("class", "non_retryable")],
        )
    };
    assert_eq!(failures(&w1) - failures(w0), dead_n);
    let model_steps = |s: &Scrape| {
        s.get(
            "agentq_step_duration_seconds_count",
            &[("step_kind", "model")],
        )
    };
    assert!(model_steps(&w1) - model_steps(w0) >= ok_n, "{}", w1.text);
    let custom_steps = |s: &Scrape| {
        s.get(
            "agentq_step_duration_seconds_count",
            &[("step_kind", "custom")],
        )
    };
    assert!(
        custom_steps(&w1) - custom_steps(w0) >= 2.0 * dead_n,
        "{}",
        w1.text
    );
    let attempts = |s: &Scrape| {
        s.get(
            "agentq_operation_attempt_duration_seconds_count",
            &[("kind", "echo")],
        )
    };
    assert!(attempts(&w1) - attempts(w0) >= ok_n, "{}", w1.text);
    let prompt = |s: &Scrape| {
        s.get(
            "agentq_model_tokens_total",
            &[("kind", "echo"), ("type", "prompt")],
        )
    };
    assert!(prompt(&w1) > prompt(w0), "{}", w1.text);
    assert!(
        w1.get(
            "agentq_model_call_duration_seconds_count",
            &[("provider", "local")]
        ) >= ok_n,
        "{}",
        w1.text
    );
    assert_eq!(
        w1.get("agentq_circuit_breaker_state", &[("provider", "local")]),
        0.0
    );

    // The database gauges are read at most every GAUGES_TTL (5 s) per process: scrape until
    // a read after the last operation finished has happened.
    let caught_up = |s: &Scrape| {
        s.get("agentq_operations", &[("status", "succeeded")]) == ok_n + 1.0
            && s.get("agentq_operations", &[("status", "dead")]) == dead_n
    };
    let s1 = app
        .wait_until("the scheduler's database gauges", DEADLINE, || async {
            let s = Scrape::of(&scheduler_url).await;
            caught_up(&s).then_some(s)
        })
        .await;
    // The scheduler woke the sleeper: one timer lag observed.
    assert!(
        s1.get("agentq_timer_lag_seconds_count", &[])
            - s0.get("agentq_timer_lag_seconds_count", &[])
            >= 1.0,
        "{}",
        s1.text
    );

    // Labels a client chooses stay bounded: made-up methods count as `other`, a path as its
    // route template, a path no route matches as `unmatched`.
    let client = reqwest::Client::new();
    const MADE_UP: usize = 30;
    for i in 0..MADE_UP {
        let method = reqwest::Method::from_bytes(format!("X-CANARY-{i}").as_bytes()).unwrap();
        let r = client
            .request(method, format!("{base}/healthz"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405);
    }
    let missing = format!("{base}/v1/operations/{}", uuid::Uuid::new_v4());
    let r = client
        .get(&missing)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = client
        .get(format!("{base}/no/such/path-canary"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // The API: enqueued by kind, and the database gauges read at scrape time.
    let a1 = app
        .wait_until("the API's database gauges", DEADLINE, || async {
            let s = Scrape::authed(&api_url, &operator).await;
            caught_up(&s).then_some(s)
        })
        .await;
    let enqueued =
        |s: &Scrape, kind: &str| s.get("agentq_operations_enqueued_total", &[("kind", kind)]);
    assert_eq!(enqueued(&a1, "echo") - enqueued(a0, "echo"), ok_n);
    assert_eq!(
        enqueued(&a1, "script") - enqueued(a0, "script"),
        dead_n + 1.0
    );
    for s in [&a1, &s1] {
        assert_eq!(
            s.get("agentq_operations", &[("status", "succeeded")]),
            ok_n + 1.0,
            "{}",
            s.text
        );
        assert_eq!(
            s.get("agentq_operations", &[("status", "dead")]),
            dead_n,
            "{}",
            s.text
        );
        assert_eq!(
            s.get("agentq_dead_letters_open", &[("class", "non_retryable")]),
            dead_n,
            "{}",
            s.text
        );
        for lane in ["interactive", "batch"] {
            assert!(
                s.samples
                    .contains_key(&format!("agentq_queue_depth{{lane=\"{lane}\"}}")),
                "no queue depth for {lane}:\n{}",
                s.text
            );
            assert_eq!(s.get("agentq_queue_depth", &[("lane", lane)]), 0.0);
        }
    }
    assert!(
        a1.get(
            "agentq_http_requests_total",
            &[
                ("method", "POST"),
                ("route", "/v1/operations"),
                ("status", "202")
            ]
        ) >= ok_n + dead_n + 1.0,
        "{}",
        a1.text
    );

    // Requests since the first scrape, by method, route and status.
    let http = |method: &str, route: &str, status: &str| {
        let labels = [("method", method), ("route", route), ("status", status)];
        a1.get("agentq_http_requests_total", &labels)
            - a0.get("agentq_http_requests_total", &labels)
    };
    assert_eq!(
        http("other", "/healthz", "405"),
        MADE_UP as f64,
        "{}",
        a1.text
    );
    assert_eq!(
        http("GET", "/v1/operations/{id}", "404"),
        1.0,
        "{}",
        a1.text
    );
    assert_eq!(http("GET", "unmatched", "404"), 1.0, "{}", a1.text);
    for raw in ["X-CANARY", "path-canary", missing.as_str()] {
        assert!(!a1.text.contains(raw), "{raw} became a label:\n{}", a1.text);
    }

    // Labels are ids, never inputs.
    for s in [&w1, &s1, &a1] {
        assert!(
            !s.text.contains(CANARY),
            "an input leaked into metrics:\n{}",
            s.text
        );
    }

    // An operation the scheduler ends (its deadline passed while it waited) is counted by the
    // scheduler: finished as dead, failed as deadline_exceeded.
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(1500);
    let late = api
        .create(
            &token,
            &json!({ "kind": "script", "deadline": deadline,
                     "input": { "steps": [{ "wait_signal": "never", "timeout_ms": 60_000 }] } }),
        )
        .await;
    app.wait_status(&late, "dead", DEADLINE).await;
    let ended = |s: &Scrape| {
        (
            finished(s, "script", "dead"),
            s.get(
                "agentq_operation_failures_total",
                &[("kind", "script"), ("class", "deadline_exceeded")],
            ),
        )
    };
    let before = ended(&s1);
    let s2 = app
        .wait_until("the scheduler's counters", DEADLINE, || {
            let url = scheduler_url.clone();
            async move {
                let s = Scrape::of(&url).await;
                (ended(&s).1 > before.1).then_some(s)
            }
        })
        .await;
    assert_eq!(
        (ended(&s2).0 - ended(&s1).0, ended(&s2).1 - ended(&s1).1),
        (1.0, 1.0),
        "{}",
        s2.text
    );
    app.cleanup().await;
}
