//! The OpenAI-compatible model client over real HTTP against the fake provider: every
//! classification row, Retry-After in both forms, each timeout, cut and stalled streams; and
//! end to end, quota errors and a provider outage.

use std::time::Duration;

use agentq_worker::model::{ModelClient, ModelError, ModelRequest};
use agentq_worker::openai::{OpenAiClient, Timeouts};
use chrono::Utc;
use serde_json::json;

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// Longer than the shared [`DEADLINE`], for the waits that span a provider outage (the model
/// breaker's cool-downs: 5 s, doubling on each failed probe) or a killed worker's lease running
/// out before its operation runs again.
const MODEL_DEADLINE: Duration = Duration::from_secs(60);

fn client(url: &str, stream: bool) -> OpenAiClient {
    let timeouts = Timeouts {
        connect: Duration::from_secs(2),
        first_byte: Duration::from_millis(700),
        idle: Duration::from_millis(500),
        total: Duration::from_secs(5),
    };
    OpenAiClient::new(url, Some("sk-test".into()), "fake-model", stream, timeouts).unwrap()
}

fn class(r: &Result<agentq_worker::ModelResponse, ModelError>) -> &'static str {
    match r {
        Ok(_) => "ok",
        Err(ModelError::Retryable { .. }) => "retryable",
        Err(ModelError::Overloaded { .. }) => "overloaded",
        Err(ModelError::NonRetryable { .. }) => "non_retryable",
    }
}

#[tokio::test]
async fn every_classification_row_over_the_wire() {
    let fake = FakeModel::start(Mode::Echo).await;
    let plain = client(&fake.url, false);
    let req = ModelRequest::user("hello there");
    let rows: Vec<(Mode, &str)> = vec![
        (
            FakeModel::error(429, "requests", "rate_limit_exceeded"),
            "retryable",
        ),
        (
            FakeModel::error(429, "insufficient_quota", "insufficient_quota"),
            "non_retryable",
        ),
        (
            FakeModel::error(400, "invalid_request_error", ""),
            "non_retryable",
        ),
        (
            FakeModel::error(400, "invalid_request_error", "context_length_exceeded"),
            "non_retryable",
        ),
        (
            FakeModel::error(400, "invalid_request_error", "content_filter"),
            "non_retryable",
        ),
        (
            FakeModel::error(401, "invalid_request_error", "invalid_api_key"),
            "non_retryable",
        ),
        (
            FakeModel::error(403, "permission_error", ""),
            "non_retryable",
        ),
        (
            FakeModel::error(404, "not_found_error", "model_not_found"),
            "non_retryable",
        ),
        (FakeModel::error(408, "timeout", ""), "retryable"),
        (FakeModel::error(500, "server_error", ""), "retryable"),
        (FakeModel::error(502, "", ""), "retryable"),
        (FakeModel::error(503, "", ""), "overloaded"),
        (FakeModel::error(529, "overloaded_error", ""), "overloaded"),
        (Mode::StallHeaders, "retryable"),
        (Mode::Echo, "ok"),
    ];
    for (mode, expected) in rows {
        fake.set(mode.clone());
        let got = plain.complete(&req).await;
        assert_eq!(class(&got), expected, "{mode:?}: {got:?}");
    }
    fake.set(Mode::StallHeaders);
    let got = plain.complete(&req).await;
    assert!(format!("{got:?}").contains("first-byte"), "{got:?}");

    // Retry-After as seconds and as an HTTP date.
    fake.set(Mode::Error {
        status: 429,
        body: json!({ "error": { "type": "requests", "code": "rate_limit_exceeded" } }),
        headers: vec![("retry-after".into(), "3".into())],
    });
    match plain.complete(&req).await {
        Err(ModelError::Retryable {
            retry_after: Some(t),
            ..
        }) => {
            let secs = (t - Utc::now()).num_milliseconds();
            assert!((2500..=3100).contains(&secs), "{secs}");
        }
        other => panic!("{other:?}"),
    }
    let date = (Utc::now() + chrono::Duration::seconds(30))
        .format("%a, %d %b %Y %H:%M:%S GMT")
        .to_string();
    fake.set(Mode::Error {
        status: 429,
        body: json!({ "error": { "type": "requests" } }),
        headers: vec![("retry-after".into(), date.clone())],
    });
    match plain.complete(&req).await {
        Err(ModelError::Retryable {
            retry_after: Some(t),
            ..
        }) => {
            assert_eq!(t.format("%a, %d %b %Y %H:%M:%S GMT").to_string(), date)
        }
        other => panic!("{other:?}"),
    }

    // Streaming: a whole stream, a cut one, a stalled one.
    let streaming = client(&fake.url, true);
    fake.set(Mode::EchoStream);
    let whole = streaming.complete(&req).await.unwrap();
    assert_eq!(whole.content, "hello there");
    assert_eq!(whole.usage.completion_tokens, 2);
    assert!(!whole.usage.unreported);
    // As llama.cpp's server streams a tool call: the name in every chunk, no usage at all.
    fake.set(Mode::LlamaToolStream);
    let call = streaming.complete(&req).await.unwrap();
    assert_eq!(call.tool_calls.len(), 1, "{call:?}");
    assert_eq!(
        call.tool_calls[0].function.name, "kv_put",
        "a repeated name is one name"
    );
    let args: serde_json::Value =
        serde_json::from_str(&call.tool_calls[0].function.arguments).unwrap();
    assert_eq!(args, json!({ "key": "colour", "value": "blue" }));
    assert!(
        call.usage.unreported,
        "no usage is unknown usage, not zero: {call:?}"
    );
    fake.set(Mode::StreamCut);
    let cut = streaming.complete(&req).await;
    assert_eq!(class(&cut), "retryable");
    assert!(
        format!("{cut:?}").contains("[DONE]"),
        "a cut stream is not half an answer: {cut:?}"
    );
    fake.set(Mode::StreamStall);
    let stalled = streaming.complete(&req).await;
    assert_eq!(class(&stalled), "retryable");
    assert!(format!("{stalled:?}").contains("idle"), "{stalled:?}");

    fake.set(Mode::StreamTrickle);
    let endless = streaming.complete(&req).await;
    assert_eq!(class(&endless), "retryable");
    assert!(
        format!("{endless:?}").contains("total timeout"),
        "{endless:?}"
    );

    // Nobody listening: a connection error is retryable.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let refused = client(&format!("http://{closed}"), false)
        .complete(&req)
        .await;
    assert_eq!(class(&refused), "retryable");
}

#[tokio::test]
async fn insufficient_quota_goes_straight_to_the_dlq_without_a_retry() {
    let fake = FakeModel::start(FakeModel::error(
        429,
        "insufficient_quota",
        "insufficient_quota",
    ))
    .await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let op = app.enqueue_echo("hello");
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("non_retryable"));
    assert_eq!(dead.attempt, 1);
    assert!(
        dead.error_message.unwrap().contains("out of quota"),
        "an operator understands why"
    );
    // It is in the DLQ: an open dead letter an operator drains, saying why.
    let letter = agentq_core::db::dead_letters::find_dead_letter(&app.pool, dead.op_id.0, None)
        .await
        .unwrap()
        .expect("a dead letter for the operation");
    assert_eq!(
        (
            letter.class.as_str(),
            letter.status.as_str(),
            letter.attempts
        ),
        ("non_retryable", "open", 1)
    );
    assert!(
        letter.reason.contains("out of quota"),
        "the dead letter says why: {}",
        letter.reason
    );
    assert_eq!(fake.requests(), 1, "not retried");
    app.cleanup().await;
}

#[tokio::test]
async fn a_provider_outage_parks_operations_without_using_attempts() {
    let fake = FakeModel::start(FakeModel::error(529, "overloaded_error", "")).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let docs = (0..200).map(|i| json!({ "text": format!("doc {i}") }));
    app.enqueue_many("echo", agentq_core::Lane::Interactive, docs)
        .await;
    // The outage lasts until the first operations have been parked and re-run at least once.
    let outage_started = std::time::Instant::now();
    app.wait_for(
        "operations parked by the outage",
        MODEL_DEADLINE,
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM operations WHERE error_class = 'overloaded'",
            )
            .fetch_one(&app.pool)
            .await
            .unwrap()
                >= 200
        },
    )
    .await;
    let until = outage_started + Duration::from_secs(20);
    while std::time::Instant::now() < until {
        // Keep the outage going for a fixed length; the breaker, not this loop, bounds the calls.
        let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM operations WHERE status = 'dead'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
        assert_eq!(dead, 0, "an outage never kills operations");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let calls_during_outage = fake.requests();
    fake.set(Mode::Echo);
    app.wait_for("all 200 to succeed", Duration::from_secs(90), || async {
        succeeded(&app).await == 200
    })
    .await;
    let max_attempt: i32 = sqlx::query_scalar("SELECT max(attempt) FROM operations")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    println!("provider outage: {calls_during_outage} calls during 20 s of 529s for 200 operations");
    assert_eq!(max_attempt, 1, "the outage used up no attempts");
    assert!(
        calls_during_outage < 200,
        "the breaker bounds calls: {calls_during_outage}"
    );
    app.cleanup().await;
}

#[tokio::test]
async fn usage_sums_the_tokens_of_model_steps_per_tenant_and_kind() {
    let fake = FakeModel::start(Mode::EchoStream).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_MODEL_STREAM", "true");
    app.spawn(&["worker"]);
    let ops: Vec<String> = (0..3)
        .map(|i| app.enqueue_echo(&format!("three word text{i}")))
        .collect();
    for op in &ops {
        let done = app.wait_status(op, "succeeded", DEADLINE).await;
        assert!(
            done.result.unwrap()["text"]
                .as_str()
                .unwrap()
                .starts_with("three word")
        );
    }
    let out = app.agentq_ok(&["usage", "--tenant", "t1", "--json"]);
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(row["kind"], "echo");
    assert_eq!(row["operations"], 3);
    assert_eq!(row["model_calls"], 3);
    assert_eq!(
        row["prompt_tokens"], 9,
        "3 per call, as the fake provider reports"
    );
    assert_eq!(fake.requests(), 3);
    app.cleanup().await;
}

#[tokio::test]
async fn the_agent_loop_survives_kills_and_runs_each_tool_once_after_approval() {
    let fake = FakeModel::start(Mode::Agent).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    app.spawn(&["scheduler"]);
    let input = json!({ "user": "store a, then record b", "tools": ["kv_put", "ledger"], "approval": ["ledger"], "max_turns": 5 }).to_string();
    let op = app.agentq_json(&[
        "enqueue", "--tenant", "t1", "--kind", "agent", "--input", &input, "--json",
    ])["op_id"]
        .as_str()
        .unwrap()
        .to_string();

    // Killed right after tool A (kv_put) ran.
    let w1 = app.spawn(&["worker"]);
    let pool = app.pool.clone();
    app.wait_for("tool A's effect", DEADLINE, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM agent_kv WHERE key = 'a'")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 1
    })
    .await;
    app.kill(w1);

    // Recovered, it reaches tool B, which waits for approval; killed again while it waits.
    let w2 = app.spawn(&["worker"]);
    let waiting = app.wait_status(&op, "waiting", MODEL_DEADLINE).await;
    assert_eq!(waiting.waiting_for.as_deref(), Some("approval"));
    app.kill(w2);
    assert_eq!(
        app.effects(&op).await,
        0,
        "B does not run before its approval"
    );

    app.spawn(&["worker"]);
    app.agentq_ok(&["approve", &op, "--as", "hana"]);
    let done = app.wait_status(&op, "succeeded", MODEL_DEADLINE).await;
    let result = done.result.unwrap();
    assert_eq!(result["answer"], "done: stored a, recorded b");
    assert_eq!(result["tool_calls"], 2);
    assert_eq!(
        done.restarts, 1,
        "the kill after tool A was recovered by the reaper"
    );
    assert_eq!(
        app.effects(&op).await,
        1,
        "the unsafe tool ran exactly once"
    );
    let value: serde_json::Value =
        sqlx::query_scalar("SELECT value FROM agent_kv WHERE tenant_id = 't1' AND key = 'a'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(value, json!(1));

    // The journal shows every turn, in order.
    let journal: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, status FROM operation_steps WHERE op_id = $1::uuid ORDER BY seq",
    )
    .bind(&op)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let names: Vec<&str> = journal.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "turn 0",
            "kv_put",
            "turn 1",
            "signal:approval",
            "ledger",
            "turn 2"
        ]
    );
    assert!(journal.iter().all(|(_, s)| s == "completed"), "{journal:?}");
    app.cleanup().await;
}

#[tokio::test]
async fn a_kind_can_use_its_own_model_and_the_agent_fetches_only_allowed_hosts() {
    let fake = FakeModel::start(Mode::Echo).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_MODEL", "base-model");
    app.set_env("AGENTQ_MODEL_BY_KIND", "echo=echo-model");
    // The fake's origin only: not another port of 127.0.0.1.
    app.set_env("AGENTQ_AGENT_HTTP_ALLOW", &fake.url);
    app.spawn(&["worker"]);
    let op = app.enqueue_echo("which model");
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        fake.counters.models.lock().unwrap().as_slice(),
        ["echo-model"]
    );

    // The agent fetches a page from the allowed origin; another host, another port of the same
    // host and a URL with credentials are refused, and the refusal is what the model is told.
    let port = fake.addr.port();
    let other_port = if port == 1 { 2 } else { port - 1 };
    fake.set(Mode::AgentHttp(vec![
        format!("{}/page", fake.url),
        "http://example.com/".into(),
        format!("http://127.0.0.1:{other_port}/internal"),
        format!("http://user:pass@127.0.0.1:{port}/page"),
    ]));
    let input = json!({ "user": "fetch", "tools": ["http_get"] }).to_string();
    let op = app.agentq_json(&[
        "enqueue", "--tenant", "t1", "--kind", "agent", "--input", &input, "--json",
    ])["op_id"]
        .as_str()
        .unwrap()
        .to_string();
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    let answer = done.result.unwrap()["answer"].as_str().unwrap().to_string();
    assert!(answer.contains("hello from the fake web"), "{answer}");
    assert_eq!(
        answer.matches("is not an allowed origin").count(),
        2,
        "example.com and the other port: {answer}"
    );
    assert!(answer.contains("credentials"), "{answer}");
    assert_eq!(
        fake.counters
            .models
            .lock()
            .unwrap()
            .last()
            .map(String::as_str),
        Some("base-model")
    );
    app.cleanup().await;
}

/// A model call in flight lends its operation's lane slot to another operation: a worker with
/// 2 slots and a gate of 6 calls has 6 calls in flight at once (with the slots held for the
/// whole run, 2), and 8 operations running: 6 in calls, 2 waiting at the full gate, each with a
/// slot. Then with 1 slot and a gate of 1, operations of two model calls around a step all finish:
/// an operation back from a call waits for a slot holding no call slot, so the two never wait on
/// each other.
#[tokio::test]
async fn a_model_call_in_flight_lends_its_slot_to_another_operation() {
    let fake = FakeModel::start(Mode::Echo).await;
    let gate = fake.hold_requests();
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_MODEL_CONCURRENCY", "6");
    app.set_env("AGENTQ_MODEL_TENANT_CONCURRENCY", "6");
    let ops: Vec<String> = (0..8)
        .map(|i| {
            app.enqueue_script(
                json!([{ "model": format!("call {i}") }, { "work_ms": 1 }]),
                &[],
            )
        })
        .collect();
    let w = app.spawn(&["worker", "--concurrency", "2"]);
    app.wait_for("six model calls in flight", DEADLINE, || async {
        fake.requests() == 6
    })
    .await;
    app.wait_for("eight operations running", DEADLINE, || async {
        running(&app).await == 8
    })
    .await;
    assert_eq!(fake.requests(), 6, "no call beyond the gate's 6");
    gate.add_permits(1_000);
    for op in &ops {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    app.kill(w);

    app.set_env("AGENTQ_MODEL_CONCURRENCY", "1");
    app.set_env("AGENTQ_MODEL_TENANT_CONCURRENCY", "1");
    let program = json!([{ "model": "first" }, { "work_ms": 5 }, { "model": "second" }]);
    let ops: Vec<String> = (0..6)
        .map(|_| app.enqueue_script(program.clone(), &[]))
        .collect();
    app.spawn(&["worker", "--concurrency", "1"]);
    for op in &ops {
        app.wait_status(op, "succeeded", DEADLINE).await;
    }
    assert_eq!(fake.requests(), 8 + 12);
    app.cleanup().await;
}

async fn succeeded(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM operations WHERE status = 'succeeded'")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn running(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM operations WHERE status = 'running'")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// With `AGENTQ_MODEL_CONCURRENCY` unset a worker finds how many model calls its provider
/// takes. A provider that answers 300 at once (in 1.5 s: long enough for a worker on a loaded
/// machine to have more than that in flight) and refuses the rest with a 503: the worker's
/// limit grows past its start (256) while its calls return, comes down at the first refusals,
/// and its breaker, which counts a refusal only when the limit came down for it, stays closed.
/// Every one of 1,200 operations succeeds, with fewer refusals than operations.
#[tokio::test]
async fn the_model_call_limit_grows_to_what_the_provider_takes_and_comes_down_on_pushback() {
    const CAPACITY: usize = 300;
    const N: usize = 1200;
    let fake = FakeModel::start(Mode::Capacity {
        calls: CAPACITY,
        latency: Duration::from_millis(1500),
    })
    .await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.spawn(&["scheduler"]);
    app.enqueue_many(
        "echo",
        agentq_core::Lane::Interactive,
        (0..N).map(|i| json!({ "text": format!("document {i}") })),
    )
    .await;
    let w = app.spawn_logged(&["worker"]);
    app.wait_for("every operation to succeed", 3 * DEADLINE, || async {
        succeeded(&app).await == N as i64
    })
    .await;
    let (peak, refused) = (fake.peak(), fake.refused());
    assert!(
        peak > agentq_worker::limiter::AUTO_START,
        "grew past its start: {peak} at once"
    );
    assert!(refused > 0, "reached what the provider takes");
    assert!(peak < 2 * CAPACITY, "came down, not on: {peak} at once");
    assert!(refused < N, "{refused} refusals for {N} operations");
    assert!(
        !app.log(w).contains("model circuit open"),
        "the limit's overshoot is no outage"
    );
    app.cleanup().await;
}

/// A tenant cannot take every model call slot of a worker, even with calls that never return:
/// tenant t1's 100 calls are held at the provider, and t1 fills the limit (64 here, fixed, as
/// a found limit grows when t2's call returns) but the eighth it must leave free; tenant t2's
/// call goes at once and its operation succeeds while t1's calls are still held. Then t1's
/// calls return and all of its operations succeed.
#[tokio::test]
async fn a_tenant_whose_calls_never_return_leaves_call_slots_to_another() {
    const N: usize = 100;
    let fake = FakeModel::start(Mode::Echo).await;
    let held = fake.hold_prompt("slow");
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_MODEL_CONCURRENCY", "64");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    app.enqueue_many(
        "script",
        agentq_core::Lane::Interactive,
        (0..N).map(|_| json!({ "steps": [{ "model": "slow" }] })),
    )
    .await;
    let taken = 64 - 64 / agentq_worker::limiter::RESERVE;
    app.wait_for("t1's calls at the provider", DEADLINE, || async {
        fake.requests() == taken
    })
    .await;
    let input = json!({ "steps": [{ "model": "quick" }] });
    let other = app.enqueue_as("t2", "script", &input, &[]);
    app.wait_status(&other, "succeeded", DEADLINE).await;
    assert_eq!(
        fake.requests(),
        taken + 1,
        "t1's calls still held, none more sent"
    );
    held.add_permits(N);
    app.wait_for("every operation to succeed", DEADLINE, || async {
        succeeded(&app).await == N as i64 + 1
    })
    .await;
    app.cleanup().await;
}
