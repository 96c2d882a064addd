//! Backpressure over HTTP: a tenant over its queued limit gets 429, an unreachable broker 503,
//! both with Retry-After and "not started"; every 202 is exactly one stored operation.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::TestApp;

async fn post(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    text: &str,
) -> (u16, Value, Option<String>) {
    let r = client
        .post(format!("{base}/v1/operations"))
        .bearer_auth(token)
        .json(&json!({ "kind": "echo", "input": { "text": text } }))
        .send()
        .await
        .expect("the server answers");
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (status, r.json().await.unwrap_or(Value::Null), retry_after)
}

#[tokio::test]
async fn api_tenant_at_its_cap_of_unfinished_operations_gets_429_and_nothing_is_lost() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_TENANT_MAX_UNFINISHED", "3");
    let (_, base) = app.serve().await;
    let token = app.token("acme", "producer");
    let other = app.token("zeta", "producer");
    let client = reqwest::Client::new();
    // No worker runs, so everything stays queued; the count is re-read at most once a second.
    let mut accepted = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    let refusal = loop {
        assert!(
            tokio::time::Instant::now() < end,
            "no 429 after {} enqueues",
            accepted.len()
        );
        let (status, body, retry) =
            post(&client, &base, &token, &format!("t{}", accepted.len())).await;
        match status {
            202 => {
                accepted.push(body["op_id"].as_str().unwrap().to_string());
                // Paced so the cached count (re-read each second) catches up.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            429 => break (body, retry),
            other => panic!("unexpected {other}: {body}"),
        }
    };
    let (body, retry) = refusal;
    assert_eq!(retry.as_deref(), Some("5"), "Retry-After");
    assert!(
        body["detail"].as_str().unwrap().contains("not started"),
        "{body}"
    );
    assert_eq!(body["type"], "https://agentq.dev/problems/busy");
    assert_eq!(
        app.operation_count().await,
        accepted.len() as i64,
        "every 202 is one operation, the 429 none"
    );
    assert!(
        accepted.len() >= 3,
        "the cap is 3 unfinished: {}",
        accepted.len()
    );
    // Another tenant is not held back.
    assert_eq!(post(&client, &base, &other, "z").await.0, 202);
    app.cleanup().await;
}

#[tokio::test]
async fn api_unreachable_broker_gets_503_not_started() {
    let mut app = TestApp::start().await;
    // Nothing listens on port 1: the broker is "down" for this server only.
    app.set_env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f");
    let (_, base) = app.serve().await;
    let token = app.token("acme", "producer");
    let client = reqwest::Client::new();
    let (status, body, retry) = post(&client, &base, &token, "x").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(retry.as_deref(), Some("5"));
    assert!(
        body["detail"].as_str().unwrap().contains("not started"),
        "{body}"
    );
    assert_eq!(app.operation_count().await, 0, "nothing was stored");
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready, json!({ "postgres": "ok", "rabbitmq": "down" }));
    assert_eq!(
        client
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200,
        "alive while not ready"
    );
    app.cleanup().await;
}
