//! The HTTP API of `agentq serve` end to end, against the contract of issue 7: every route,
//! bearer auth and roles, tenant isolation (another tenant's id is a 404 and changes nothing),
//! `Idempotency-Key`, signals and cancel, the DLQ routes and their audit, health, metrics, the
//! OpenAPI document, and the event stream resumed with `Last-Event-ID`.
//!
//! Operations the tests only need to exist are made with the CLI, so a failure here points at
//! the route under test, not at `POST /v1/operations`.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use reqwest::Method;
use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::harness::{DEADLINE, TestApp, running_app};

/// One HTTP answer, read whole (except an event stream, whose body is left unread).
pub(crate) struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    /// The request, for assertion messages.
    pub what: String,
}

impl Reply {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{}: the body is not JSON ({e}): {:?}",
                self.what,
                self.text()
            )
        })
    }

    pub(crate) fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }

    /// Asserts the status; returns the JSON body.
    pub(crate) fn expect(&self, status: u16) -> Value {
        assert_eq!(
            self.status,
            status,
            "{}: expected {status}, got {} {}",
            self.what,
            self.status,
            self.text()
        );
        self.json()
    }

    /// Asserts a problem+json answer of `status` whose type ends in `/problems/<slug>`; returns
    /// the problem.
    pub(crate) fn problem(&self, status: u16, slug: &str) -> Value {
        assert_eq!(
            self.status,
            status,
            "{}: expected {status} {slug}, got {} {}",
            self.what,
            self.status,
            self.text()
        );
        let p = problem_shape(self).unwrap_or_else(|e| panic!("{}: {e}", self.what));
        let ty = p["type"].as_str().unwrap_or_default();
        assert!(
            ty.ends_with(&format!("/problems/{slug}")),
            "{}: problem type {ty:?}, expected .../problems/{slug}: {p}",
            self.what
        );
        p
    }
}

/// Checks that an answer is a well-formed problem (RFC 9457 as the contract has it): the
/// content type, a JSON object whose `status` is the HTTP status, a `type`, and a non-empty
/// `detail`. Returns the problem, or what is wrong with it.
pub(crate) fn problem_shape(r: &Reply) -> Result<Value, String> {
    let ct = r.header("content-type").unwrap_or_default();
    if !ct.starts_with("application/problem+json") {
        return Err(format!(
            "{} {}: content-type {ct:?}, not application/problem+json; body {:?}",
            r.status,
            r.what,
            truncate(&r.text(), 300)
        ));
    }
    let p: Value = serde_json::from_slice(&r.body)
        .map_err(|e| format!("{}: the problem is not JSON ({e})", r.what))?;
    let detail = p["detail"].as_str().unwrap_or_default();
    if detail.trim().is_empty() {
        return Err(format!("{}: the problem has no detail: {p}", r.what));
    }
    if p["status"].as_u64() != Some(u64::from(r.status)) {
        return Err(format!(
            "{}: problem status {} differs from the HTTP status {}",
            r.what, p["status"], r.status
        ));
    }
    if !p["type"].as_str().is_some_and(|t| t.contains("/problems/")) {
        return Err(format!("{}: the problem has no type: {p}", r.what));
    }
    Ok(p)
}

pub(crate) fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    format!("{}…", s.chars().take(n).collect::<String>())
}

/// Sends a request and reads its answer; an event stream's body is not read. A JSON answer
/// the OpenAPI document describes must match its schema there ([`check_documented`]).
pub(crate) async fn send(what: impl Into<String>, rb: reqwest::RequestBuilder) -> Reply {
    let what = what.into();
    let (client, request) = rb.build_split();
    let request = request.unwrap_or_else(|e| panic!("{what}: not a request: {e:?}"));
    let (method, path) = (request.method().clone(), request.url().path().to_string());
    let resp = client
        .execute(request)
        .await
        .unwrap_or_else(|e| panic!("{what}: no answer: {e:?}"));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let streaming = headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let body = if streaming {
        Vec::new()
    } else {
        resp.bytes()
            .await
            .unwrap_or_else(|e| panic!("{what}: reading the body: {e:?}"))
            .to_vec()
    };
    let reply = Reply {
        status,
        headers,
        body,
        what,
    };
    check_documented(&method, &path, &reply);
    reply
}

/// The OpenAPI document's route template for a request path: the route with the most literal
/// segments among those that match (as the router prefers `/v1/dlq/stats` to `/v1/dlq/{id}`).
fn template(method: &Method, path: &str) -> Option<&'static str> {
    let segments: Vec<&str> = path.split('/').collect();
    agentq_http::routes::ROUTES
        .iter()
        .filter(|r| r.method.eq_ignore_ascii_case(method.as_str()))
        .filter(|r| {
            let t: Vec<&str> = r.path.split('/').collect();
            t.len() == segments.len()
                && t.iter()
                    .zip(&segments)
                    .all(|(t, s)| (t.starts_with('{') && !s.is_empty()) || t == s)
        })
        .max_by_key(|r| r.path.split('/').filter(|t| !t.starts_with('{')).count())
        .map(|r| r.path)
}

/// Asserts that an answer is one the OpenAPI document describes: every `/v1` route answered is
/// in the document, every status it answers is documented for that route, and a JSON answer
/// matches the schema the document gives for its route, status and content type. Nothing is
/// skipped: an undocumented route, status or JSON body fails the test.
fn check_documented(method: &Method, path: &str, reply: &Reply) {
    static DOC: std::sync::LazyLock<Value> = std::sync::LazyLock::new(agentq_http::openapi::spec);
    let Some(template) = template(method, path) else {
        assert!(
            !path.starts_with("/v1/") || matches!(reply.status, 404 | 405),
            "{}: {method} {path} answered {}, and the OpenAPI document has no such route (an \
             unknown route must be a 404, an unknown method of a route a 405)",
            reply.what,
            reply.status
        );
        return;
    };
    let documented = &DOC["paths"][template][method.as_str().to_ascii_lowercase()]["responses"]
        [reply.status.to_string()];
    assert!(
        !documented.is_null(),
        "{}: {method} {template} answered {}, a status /openapi.json does not document for it",
        reply.what,
        reply.status
    );
    let content_type = reply.header("content-type").unwrap_or_default();
    let content_type = content_type.split(';').next().unwrap_or_default().trim();
    if !matches!(
        content_type,
        "application/json" | "application/problem+json"
    ) {
        return;
    }
    let schema = &documented["content"][content_type]["schema"];
    assert!(
        !schema.is_null(),
        "{}: {method} {template} answered {} with {content_type}, and /openapi.json gives no \
         schema for that answer",
        reply.what,
        reply.status
    );
    let root = json!({ "$ref": schema["$ref"], "components": DOC["components"] });
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .build(&root)
        .unwrap_or_else(|e| panic!("{template}: the document's schema does not build: {e}"));
    let answer = reply.json();
    let errors: Vec<String> = validator
        .iter_errors(&answer)
        .map(|e| {
            format!(
                "at /{}: {e}",
                e.instance_path().as_str().trim_start_matches('/')
            )
        })
        .collect();
    assert!(
        errors.is_empty(),
        "{}: the {} answer does not match {} in /openapi.json:\n{}\n{answer}",
        reply.what,
        reply.status,
        schema["$ref"],
        errors.join("\n")
    );
}

/// A client of one `agentq serve`.
pub(crate) struct Api {
    pub client: reqwest::Client,
    pub base: String,
}

impl Api {
    pub(crate) fn new(base: &str) -> Self {
        let client = reqwest::Client::builder()
            .timeout(DEADLINE)
            .build()
            .expect("an HTTP client");
        Self {
            client,
            base: base.trim_end_matches('/').to_string(),
        }
    }

    pub(crate) fn req(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let rb = self.client.request(method, format!("{}{path}", self.base));
        match token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    pub(crate) async fn get(&self, path: &str, token: Option<&str>) -> Reply {
        send(format!("GET {path}"), self.req(Method::GET, path, token)).await
    }

    pub(crate) async fn post(&self, path: &str, token: Option<&str>, body: &Value) -> Reply {
        send(
            format!("POST {path} {}", truncate(&body.to_string(), 200)),
            self.req(Method::POST, path, token).json(body),
        )
        .await
    }

    /// `POST /v1/operations`; expects 202 and returns the new operation's id.
    pub(crate) async fn create(&self, token: &str, body: &Value) -> String {
        let v = self
            .post("/v1/operations", Some(token), body)
            .await
            .expect(202);
        v["op_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no op_id in {v}"))
            .to_string()
    }
}

/// Enqueues through the CLI into `tenant` (independent of the server under test).
pub(crate) fn enqueue_cli(app: &TestApp, tenant: &str, kind: &str, input: &Value) -> String {
    let input = input.to_string();
    let v = app.agentq_json(&[
        "enqueue", "--tenant", tenant, "--kind", kind, "--input", &input, "--json",
    ]);
    v["op_id"]
        .as_str()
        .unwrap_or_else(|| panic!("enqueue printed no op_id: {v}"))
        .to_string()
}

/// A token and its id (for `agentq tokens revoke`).
fn token_with_id(app: &TestApp, tenant: &str, role: &str) -> (String, String) {
    let v = app.agentq_json(&[
        "tokens", "create", "--tenant", tenant, "--role", role, "--json",
    ]);
    let field = |f: &str| {
        v[f].as_str()
            .unwrap_or_else(|| panic!("tokens create printed no {f}: {v}"))
            .to_string()
    };
    (field("token"), field("id"))
}

fn waits_for(signal: &str) -> Value {
    json!({ "steps": [{ "wait_signal": signal, "timeout_ms": 600_000 }, { "work_ms": 1 }] })
}

/// The stored input of an operation.
pub(crate) async fn input_of(app: &TestApp, op: &str) -> Value {
    sqlx::query_scalar("SELECT input FROM operations WHERE id = $1::uuid")
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .unwrap_or_else(|e| panic!("the input of {op}: {e}"))
}

async fn count(app: &TestApp, sql: &'static str, op: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A request: method, path and an optional JSON body.
type Route = (Method, String, Option<Value>);

/// The routes that need a bearer token, for an operation `op` and a dead-letter id `dl`, each
/// with a body that would be acceptable.
fn bearer_routes(op: &str, dl: &str) -> Vec<Route> {
    vec![
        (
            Method::POST,
            "/v1/operations".into(),
            Some(json!({ "kind": "echo", "input": { "text": "hi" } })),
        ),
        (Method::GET, "/v1/operations".into(), None),
        (Method::GET, format!("/v1/operations/{op}"), None),
        (Method::GET, format!("/v1/operations/{op}/steps"), None),
        (Method::GET, format!("/v1/operations/{op}/events"), None),
        (
            Method::POST,
            format!("/v1/operations/{op}/signals/go"),
            Some(json!({ "n": 1 })),
        ),
        (
            Method::POST,
            format!("/v1/operations/{op}/cancel"),
            Some(json!({ "reason": "test" })),
        ),
        (Method::GET, "/v1/dlq".into(), None),
        (Method::GET, "/v1/dlq/stats".into(), None),
        (Method::GET, format!("/v1/dlq/{dl}"), None),
        (Method::POST, format!("/v1/dlq/{dl}/retry"), Some(json!({}))),
        (
            Method::POST,
            format!("/v1/dlq/{dl}/resolve"),
            Some(json!({ "happened": true })),
        ),
        (
            Method::POST,
            format!("/v1/dlq/{dl}/discard"),
            Some(json!({ "reason": "test" })),
        ),
    ]
}

#[tokio::test]
async fn api_auth_refuses_missing_malformed_unknown_and_revoked_tokens_and_wrong_roles() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let op = enqueue_cli(&app, "acme", "echo", &json!({ "text": "hi" }));
    let producer = app.token("acme", "producer");
    let operator = app.token("acme", "operator");
    let admin = app.token("ops", "admin");
    let (revoked, revoked_id) = token_with_id(&app, "acme", "producer");
    api.get(&format!("/v1/operations/{op}"), Some(&revoked))
        .await
        .expect(200);
    app.agentq_ok(&["tokens", "revoke", &revoked_id]);
    // Revoked in another process: this server trusts its lookup of a token a second at most.
    app.wait_for("the revocation to reach the server", DEADLINE, || async {
        api.get(&format!("/v1/operations/{op}"), Some(&revoked))
            .await
            .status
            == 401
    })
    .await;
    let before = app.operation_count().await;

    let unknown = format!("agq_{}", Uuid::new_v4().simple());
    let auths: Vec<(&str, Option<String>)> = vec![
        ("no Authorization header", None),
        (
            "Basic credentials",
            Some("Basic YWxhZGRpbjpvcGVuc2VzYW1l".into()),
        ),
        ("the scheme alone", Some("Bearer".into())),
        ("an empty token", Some("Bearer ".into())),
        ("a token without its scheme", Some(producer.clone())),
        ("another scheme", Some(format!("Token {producer}"))),
        ("an unknown token", Some(format!("Bearer {unknown}"))),
        ("a revoked token", Some(format!("Bearer {revoked}"))),
    ];
    for (method, path, body) in bearer_routes(&op, &op) {
        for (label, auth) in &auths {
            let mut rb = api.client.request(method.clone(), format!("{base}{path}"));
            if let Some(a) = auth {
                rb = rb.header("authorization", a.as_str());
            }
            if let Some(b) = &body {
                rb = rb.json(b);
            }
            let r = send(format!("{method} {path} with {label}"), rb).await;
            r.problem(401, "unauthorized");
            let www = r.header("www-authenticate").unwrap_or_default();
            assert!(
                www.starts_with("Bearer"),
                "{}: WWW-Authenticate {www:?}",
                r.what
            );
        }
    }

    // Every route above a token's role refuses it (403), whatever the id or body: the router
    // enforces each route's declared access before the handler reads either. A producer may
    // not work the DLQ, batches or schedules; an operator may not do an admin's acts.
    use agentq_http::routes::{Access, ROUTES};
    let mut refused = 0;
    for route in ROUTES {
        let below: &[(&str, &str)] = match route.access {
            Access::Operator | Access::Approver => &[("producer", &producer)],
            Access::Admin => &[("producer", &producer), ("operator", &operator)],
            Access::Public | Access::Signed | Access::Producer => continue,
        };
        let path = route
            .path
            .replace("{id}", "not-an-id")
            .replace("{name}", "go")
            .replace("{tenant}", "acme");
        let method = Method::from_bytes(route.method.to_uppercase().as_bytes()).unwrap();
        for (role, token) in below {
            let rb = api
                .req(method.clone(), &path, Some(token))
                .header("content-type", "application/json")
                .body("{");
            send(format!("{method} {path} as a {role}"), rb)
                .await
                .problem(403, "forbidden");
            refused += 1;
        }
    }
    assert!(
        refused >= 20,
        "only {refused} refusals: the table lost its operator routes?"
    );
    // The same tokens where their role allows.
    api.get(&format!("/v1/operations/{op}"), Some(&producer))
        .await
        .expect(200);
    api.get("/v1/dlq", Some(&operator)).await.expect(200);
    api.get(&format!("/v1/operations/{op}"), Some(&operator))
        .await
        .expect(200);

    // Tenants in the body: a non-admin names only its own; an admin must name one.
    let echo = |tenant: Option<&str>| {
        let mut v = json!({ "kind": "echo", "input": { "text": "tenant test" } });
        if let Some(t) = tenant {
            v["tenant"] = json!(t);
        }
        v
    };
    api.post("/v1/operations", Some(&producer), &echo(Some("other")))
        .await
        .problem(403, "forbidden");
    api.post("/v1/operations", Some(&operator), &echo(Some("other")))
        .await
        .problem(403, "forbidden");
    let r = api.post("/v1/operations", Some(&admin), &echo(None)).await;
    assert!(
        (400..500).contains(&r.status),
        "an admin without a tenant: {} {}",
        r.status,
        r.text()
    );
    problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        app.operation_count().await,
        before,
        "nothing refused was stored"
    );

    let own = api.create(&producer, &echo(Some("acme"))).await;
    let by_operator = api.create(&operator, &echo(None)).await;
    let for_beta = api.create(&admin, &echo(Some("beta"))).await;
    assert_eq!(app.operation(&own).await.tenant.as_str(), "acme");
    assert_eq!(app.operation(&by_operator).await.tenant.as_str(), "acme");
    assert_eq!(app.operation(&for_beta).await.tenant.as_str(), "beta");
    assert_eq!(app.operation_count().await, before + 3);
    // The admin sees every tenant.
    let v = api
        .get(&format!("/v1/operations/{op}"), Some(&admin))
        .await
        .expect(200);
    assert_eq!(v["tenant"], "acme");
    api.get("/v1/dlq", Some(&admin)).await.expect(200);
    app.cleanup().await;
}

#[tokio::test]
async fn api_another_tenants_ids_are_404_on_every_route_and_change_nothing() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let waiting = enqueue_cli(&app, "beta", "script", &waits_for("go"));
    let dead = enqueue_cli(
        &app,
        "beta",
        "script",
        &json!({ "steps": [{ "fail": "non_retryable", "times": 9 }] }),
    );
    app.wait_status(&waiting, "waiting", DEADLINE).await;
    app.wait_status(&dead, "dead", DEADLINE).await;
    let letter: Uuid = sqlx::query_scalar("SELECT id FROM dead_letters WHERE op_id = $1::uuid")
        .bind(&dead)
        .fetch_one(&app.pool)
        .await
        .expect("the dead operation has a dead letter");
    let letter = letter.to_string();
    let alpha = app.token("alpha", "operator");
    let alpha_producer = app.token("alpha", "producer");
    let beta = app.token("beta", "operator");
    let missing = Uuid::new_v4().to_string();

    let op_routes = |id: &str| -> Vec<Route> {
        vec![
            (Method::GET, format!("/v1/operations/{id}"), None),
            (Method::GET, format!("/v1/operations/{id}/steps"), None),
            (Method::GET, format!("/v1/operations/{id}/events"), None),
            (
                Method::POST,
                format!("/v1/operations/{id}/signals/go"),
                Some(json!({ "from": "alpha" })),
            ),
            (
                Method::POST,
                format!("/v1/operations/{id}/cancel"),
                Some(json!({ "reason": "alpha was here" })),
            ),
        ]
    };
    let dlq_routes = |id: &str| -> Vec<Route> {
        vec![
            (Method::GET, format!("/v1/dlq/{id}"), None),
            (
                Method::POST,
                format!("/v1/dlq/{id}/retry"),
                Some(json!({ "reason": "alpha was here" })),
            ),
            (
                Method::POST,
                format!("/v1/dlq/{id}/resolve"),
                Some(json!({ "happened": true })),
            ),
            (
                Method::POST,
                format!("/v1/dlq/{id}/discard"),
                Some(json!({ "reason": "alpha was here" })),
            ),
        ]
    };
    let mut probes: Vec<(String, Vec<Route>, &str)> = Vec::new();
    for id in [&waiting, &dead] {
        probes.push((id.clone(), op_routes(id), alpha.as_str()));
        probes.push((id.clone(), op_routes(id), alpha_producer.as_str()));
    }
    for id in [&dead, &letter] {
        probes.push((id.clone(), dlq_routes(id), alpha.as_str()));
    }
    let reference_routes = op_routes(&missing)
        .into_iter()
        .chain(dlq_routes(&missing))
        .collect::<Vec<_>>();
    let mut checked = 0;
    for (id, routes, token) in probes {
        for (method, path, body) in routes {
            let call = |path: &str| {
                let mut rb = api.req(method.clone(), path, Some(token));
                if let Some(b) = &body {
                    rb = rb.json(b);
                }
                rb
            };
            let theirs = send(format!("{method} {path} (tenant beta's id)"), call(&path)).await;
            let p = theirs.problem(404, "not-found");
            // The same answer as for an id that exists nowhere.
            let template = path.replace(&id, "{id}");
            let (_, other, _) = reference_routes
                .iter()
                .find(|(m, p, _)| *m == method && p.replace(&missing, "{id}") == template)
                .expect("a reference route");
            let nowhere = send(format!("{method} {other} (no such id)"), call(other)).await;
            let q = nowhere.problem(404, "not-found");
            assert_eq!(
                (&p["type"], &p["title"]),
                (&q["type"], &q["title"]),
                "{method} {path}: another tenant's id answers differently from a missing one"
            );
            assert_eq!(
                p["detail"].as_str().map(|d| d.replace(&id, "{id}")),
                q["detail"].as_str().map(|d| d.replace(&missing, "{id}")),
                "{method} {path}: the detail tells another tenant's id from a missing one"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 28);

    // Lists and stats show nothing of beta to alpha.
    for token in [&alpha, &alpha_producer] {
        let ops = api.get("/v1/operations", Some(token)).await.expect(200);
        assert_eq!(ops["items"], json!([]), "alpha's operations: {ops}");
    }
    let ops = api.get("/v1/operations", Some(&beta)).await.expect(200);
    assert_eq!(ops["items"].as_array().map(Vec::len), Some(2), "{ops}");
    let list = api.get("/v1/dlq", Some(&alpha)).await.expect(200);
    assert_eq!(list["items"], json!([]), "alpha's DLQ: {list}");
    let stats = api.get("/v1/dlq/stats", Some(&alpha)).await.expect(200);
    let counted: i64 = stats["groups"]
        .as_array()
        .unwrap_or_else(|| panic!("no groups in {stats}"))
        .iter()
        .map(|g| g["count"].as_i64().unwrap_or(0))
        .sum();
    assert_eq!(counted, 0, "alpha's stats: {stats}");
    let r = api.get("/v1/dlq?tenant=beta", Some(&alpha)).await;
    if (200..300).contains(&r.status) {
        assert_eq!(
            r.json()["items"],
            json!([]),
            "a non-admin naming another tenant"
        );
    } else {
        problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    }

    // Nothing changed for beta.
    let w = app.operation(&waiting).await;
    assert_eq!(w.status.as_str(), "waiting");
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM signals WHERE op_id = $1::uuid",
            &waiting
        )
        .await,
        0,
        "no signal was stored"
    );
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM operations WHERE id = $1::uuid AND NOT cancel_requested",
            &waiting
        )
        .await,
        1,
        "no cancel was requested"
    );
    assert_eq!(app.operation(&dead).await.status.as_str(), "dead");
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM dead_letters WHERE op_id = $1::uuid AND status = 'open'",
            &dead
        )
        .await,
        1,
        "the dead letter is still open"
    );
    let actions: i64 = sqlx::query_scalar("SELECT count(*) FROM operator_actions")
        .fetch_one(&app.pool)
        .await
        .unwrap_or_default();
    let token_actions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM operator_actions WHERE action LIKE 'token_%'")
            .fetch_one(&app.pool)
            .await
            .unwrap_or_default();
    assert_eq!(actions, token_actions, "no operator action besides tokens");

    // Beta itself sees its operations; so does an admin of another tenant.
    let v = api
        .get(&format!("/v1/operations/{waiting}"), Some(&beta))
        .await
        .expect(200);
    assert_eq!(
        (v["status"].as_str(), v["tenant"].as_str()),
        (Some("waiting"), Some("beta"))
    );
    let list = api.get("/v1/dlq", Some(&beta)).await.expect(200);
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1), "{list}");
    let admin = app.token("alpha", "admin");
    api.get(&format!("/v1/operations/{dead}"), Some(&admin))
        .await
        .expect(200);
    api.get(&format!("/v1/dlq/{letter}"), Some(&admin))
        .await
        .expect(200);
    app.cleanup().await;
}

#[tokio::test]
async fn api_idempotency_key_returns_the_same_operation_refuses_a_new_body_and_is_per_tenant() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let alpha = app.token("alpha", "producer");
    let beta = app.token("beta", "producer");
    let one = json!({ "kind": "echo", "input": { "text": "one" } });
    let two = json!({ "kind": "echo", "input": { "text": "two" } });
    let keyed = |token: &str, key: &str, body: &Value| {
        api.req(Method::POST, "/v1/operations", Some(token))
            .header("idempotency-key", key)
            .json(body)
    };

    let first = send("first POST with a key", keyed(&alpha, "order-42", &one)).await;
    let v = first.expect(202);
    let op = v["op_id"].as_str().expect("op_id").to_string();
    assert_eq!(v["created"], true, "{v}");
    assert_eq!(v["status"], "queued", "{v}");
    let status_url = format!("/v1/operations/{op}");
    assert_eq!(v["status_url"], status_url.as_str(), "{v}");
    assert_eq!(
        v["events_url"],
        format!("{status_url}/events").as_str(),
        "{v}"
    );
    let location = first.header("location").unwrap_or_default();
    assert!(
        location.ends_with(&status_url),
        "Location {location:?}, expected {status_url}"
    );

    let again = send("the same key and body", keyed(&alpha, "order-42", &one))
        .await
        .expect(200);
    assert_eq!(
        (again["op_id"].as_str(), &again["created"]),
        (Some(op.as_str()), &json!(false)),
        "{again}"
    );
    assert_eq!(app.operation_count().await, 1);

    let reused = send(
        "the same key, another body",
        keyed(&alpha, "order-42", &two),
    )
    .await;
    reused.problem(422, "idempotency-key-reused");
    assert_eq!(app.operation_count().await, 1, "no new row");
    assert_eq!(
        input_of(&app, &op).await,
        json!({ "text": "one" }),
        "the first body stands"
    );

    // The key is scoped per tenant.
    let other = send(
        "the same key in tenant beta",
        keyed(&beta, "order-42", &one),
    )
    .await
    .expect(202);
    let other_op = other["op_id"].as_str().expect("op_id").to_string();
    assert_ne!(other_op, op);
    assert_eq!(app.operation(&other_op).await.tenant.as_str(), "beta");

    // Without a key every POST is a new operation.
    let a = api.create(&alpha, &one).await;
    let b = api.create(&alpha, &one).await;
    assert_ne!(a, b);
    assert_eq!(app.operation_count().await, 4);

    // A key must be 1-256 printable ASCII characters.
    let long = "k".repeat(257);
    for (label, key) in [("an empty key", ""), ("a 257-character key", long.as_str())] {
        send(label, keyed(&alpha, key, &one))
            .await
            .problem(400, "invalid-request");
    }
    let max = "k".repeat(256);
    send("a 256-character key", keyed(&alpha, &max, &one))
        .await
        .expect(202);
    assert_eq!(app.operation_count().await, 5);
    app.cleanup().await;
}

#[tokio::test]
async fn api_an_operation_created_over_http_runs_to_success_and_reads_back() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("acme", "producer");
    let r = send(
        "POST an echo",
        api.req(Method::POST, "/v1/operations", Some(&token))
            .header("x-request-id", "e2e-req.7:a_b-c")
            .json(&json!({ "kind": "echo", "input": { "text": "hello over http" } })),
    )
    .await;
    assert_eq!(
        r.header("x-request-id").as_deref(),
        Some("e2e-req.7:a_b-c"),
        "the request id is echoed"
    );
    let op = r.expect(202)["op_id"].as_str().expect("op_id").to_string();
    app.wait_status(&op, "succeeded", DEADLINE).await;

    let v = api
        .get(&format!("/v1/operations/{op}"), Some(&token))
        .await
        .expect(200);
    assert_eq!(v["op_id"], op.as_str(), "{v}");
    assert_eq!(v["tenant"], "acme", "{v}");
    assert_eq!(v["kind"], "echo", "{v}");
    assert_eq!(v["status"], "succeeded", "{v}");
    assert_eq!(v["attempt"], 1, "{v}");
    assert_eq!(v["result"], json!({ "text": "hello over http" }), "{v}");
    assert_eq!(v["request_id"], "e2e-req.7:a_b-c", "{v}");
    for field in ["created_at", "updated_at", "finished_at", "run_at"] {
        assert!(v[field].is_string(), "{field} in {v}");
    }
    let stored: Option<String> =
        sqlx::query_scalar("SELECT request_id FROM operations WHERE id = $1::uuid")
            .bind(&op)
            .fetch_one(&app.pool)
            .await
            .unwrap_or_default();
    assert_eq!(stored.as_deref(), Some("e2e-req.7:a_b-c"));

    let steps = api
        .get(&format!("/v1/operations/{op}/steps"), Some(&token))
        .await
        .expect(200);
    let list = steps["steps"]
        .as_array()
        .unwrap_or_else(|| panic!("no steps in {steps}"));
    assert_eq!(list.len(), 1, "{steps}");
    let step = &list[0];
    assert_eq!(
        (&step["seq"], &step["kind"], &step["status"]),
        (&json!(0), &json!("model"), &json!("completed")),
        "{step}"
    );
    assert!(
        step["idempotency_key"]
            .as_str()
            .is_some_and(|k| k.len() == 64),
        "{step}"
    );
    assert!(
        step["name"].is_string() && step["replay"].is_string(),
        "{step}"
    );

    // Every optional field, stored as given.
    let run_at = chrono::Utc::now() + chrono::Duration::hours(1);
    let deadline = run_at + chrono::Duration::hours(1);
    let later = api
        .create(
            &token,
            &json!({
                "kind": "echo", "input": { "text": "later" }, "tenant": "acme",
                "ordering_key": "customer-9", "lane": "batch", "max_attempts": 2,
                "concurrency_key": "account-3", "concurrency_limit": 4,
                "run_at": run_at.to_rfc3339(), "deadline": deadline.to_rfc3339(),
            }),
        )
        .await;
    let (lane, ordering_key, stored_run_at, stored_deadline): (
        String,
        Option<String>,
        chrono::DateTime<chrono::Utc>,
        Option<chrono::DateTime<chrono::Utc>>,
    ) = sqlx::query_as(
        "SELECT lane, ordering_key, run_at, deadline FROM operations WHERE id = $1::uuid",
    )
    .bind(&later)
    .fetch_one(&app.pool)
    .await
    .expect("the operation row");
    assert_eq!(
        (lane.as_str(), ordering_key.as_deref()),
        ("batch", Some("customer-9"))
    );
    assert!((stored_run_at - run_at).num_seconds().abs() <= 1);
    assert!(stored_deadline.is_some_and(|d| (d - deadline).num_seconds().abs() <= 1));
    let v = api
        .get(&format!("/v1/operations/{later}"), Some(&token))
        .await
        .expect(200);
    assert_eq!(
        (&v["concurrency_key"], &v["concurrency_limit"]),
        (&json!("account-3"), &json!(4))
    );
    assert_eq!(
        (&v["status"], &v["max_attempts"]),
        (&json!("queued"), &json!(2)),
        "{v}"
    );

    // Ids: malformed → 400 naming the id; unknown → 404.
    let p = api
        .get("/v1/operations/not-a-uuid", Some(&token))
        .await
        .problem(400, "invalid-request");
    assert_eq!(p["field"], "id", "{p}");
    let missing = Uuid::new_v4();
    api.get(&format!("/v1/operations/{missing}"), Some(&token))
        .await
        .problem(404, "not-found");
    api.get(&format!("/v1/operations/{missing}/steps"), Some(&token))
        .await
        .problem(404, "not-found");
    app.cleanup().await;
}

#[tokio::test]
async fn event_streams_are_capped_per_token_and_end_when_their_token_is_revoked() {
    let mut app = running_app().await;
    app.set_env("AGENTQ_STREAMS_PER_TOKEN", "3");
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let (token, token_id) = token_with_id(&app, "acme", "producer");
    let other = app.token("acme", "producer");
    let op = api
        .create(
            &token,
            &json!({ "kind": "script", "input": waits_for("go") }),
        )
        .await;
    app.wait_status(&op, "waiting", DEADLINE).await;

    let mut open = Vec::new();
    for _ in 0..3 {
        open.push(Sse::open(&api, &token, &op, None).await);
    }
    // A fourth from the same token: 429 with Retry-After; another token still gets one.
    let r = send(
        "a fourth stream of one token",
        api.req(
            Method::GET,
            &format!("/v1/operations/{op}/events"),
            Some(&token),
        ),
    )
    .await;
    r.problem(429, "busy");
    assert!(r.header("retry-after").is_some());
    let kept = Sse::open(&api, &other, &op, None).await;

    // Revoked while open: its streams end within a few seconds (each re-checks every 2 s);
    // the other token's stream goes on.
    app.agentq_ok(&["tokens", "revoke", &token_id]);
    for s in open {
        s.read_to_end("a revoked token's stream").await;
    }
    api.post(
        &format!("/v1/operations/{op}/signals/go"),
        Some(&other),
        &json!({}),
    )
    .await
    .expect(202);
    let events = kept.read_to_end("the other token's stream").await;
    assert_eq!(
        events.last().map(|e| e.data["status"].clone()),
        Some(json!("succeeded")),
        "{events:#?}"
    );
    app.cleanup().await;
}

#[tokio::test]
async fn approving_needs_an_operator_unless_the_deployment_lets_producers() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let producer = app.token("acme", "producer");
    let operator = app.token("acme", "operator");
    let signal = |op: &str, name: &str| format!("/v1/operations/{op}/signals/{name}");
    let waiting = api
        .create(
            &producer,
            &json!({ "kind": "script", "input": waits_for("approval") }),
        )
        .await;
    // Waits for `go`, then for an approval: an approval sent now would be kept for later.
    let later = api
        .create(
            &producer,
            &json!({ "kind": "script", "input": { "steps": [
                { "wait_signal": "go", "timeout_ms": 600_000 },
                { "wait_signal": "approval", "timeout_ms": 600_000 }
            ] } }),
        )
        .await;
    app.wait_status(&later, "waiting", DEADLINE).await;
    app.wait_status(&waiting, "waiting", DEADLINE).await;

    // A producer approves nothing: not a waiting operation, not one that waits later, not a
    // review; nothing is sent or kept.
    for (op, name) in [
        (&waiting, "approval"),
        (&later, "approval"),
        (&waiting, "review"),
    ] {
        let r = api
            .post(
                &signal(op, name),
                Some(&producer),
                &json!({ "approved": true }),
            )
            .await;
        assert!(
            r.problem(403, "forbidden")["detail"]
                .as_str()
                .unwrap()
                .contains("operator")
        );
    }
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM signals")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(kept, 0, "nothing was sent");
    // Its other signals still go through; an operator approves.
    api.post(&signal(&later, "go"), Some(&producer), &json!({}))
        .await
        .expect(202);
    api.post(
        &signal(&waiting, "approval"),
        Some(&operator),
        &json!({ "approved": true }),
    )
    .await
    .expect(202);
    app.wait_status(&waiting, "succeeded", DEADLINE).await;

    // A deployment that lets a tenant's own service approve.
    app.set_env("AGENTQ_PRODUCER_MAY_APPROVE", "true");
    let (_, trusting) = app.serve().await;
    let trusting = Api::new(&trusting);
    let op = trusting
        .create(
            &producer,
            &json!({ "kind": "script", "input": waits_for("approval") }),
        )
        .await;
    app.wait_status(&op, "waiting", DEADLINE).await;
    trusting
        .post(
            &signal(&op, "approval"),
            Some(&producer),
            &json!({ "approved": true }),
        )
        .await
        .expect(202);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    app.cleanup().await;
}

#[tokio::test]
async fn api_signals_are_delivered_or_kept_and_cancel_stops_operations() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("acme", "producer");
    let signal = |op: &str, name: &str| format!("/v1/operations/{op}/signals/{name}");
    let cancel = |op: &str| format!("/v1/operations/{op}/cancel");

    let op = api
        .create(
            &token,
            &json!({ "kind": "script", "input": waits_for("go") }),
        )
        .await;
    let other = api
        .create(
            &token,
            &json!({ "kind": "script", "input": waits_for("go") }),
        )
        .await;
    let bare = api
        .create(
            &token,
            &json!({ "kind": "script", "input": waits_for("go") }),
        )
        .await;
    let busy = api
        .create(
            &token,
            &json!({ "kind": "script", "input": { "steps": [{ "work_ms": 2500 }, { "work_ms": 1 }] } }),
        )
        .await;
    for o in [&op, &other, &bare] {
        app.wait_status(o, "waiting", DEADLINE).await;
    }
    let v = api
        .get(&format!("/v1/operations/{op}"), Some(&token))
        .await
        .expect(200);
    assert_eq!(
        (&v["status"], &v["waiting_for"]),
        (&json!("waiting"), &json!("go")),
        "{v}"
    );

    // A payload that is not JSON is refused and changes nothing.
    let r = send(
        "a signal whose payload is not JSON",
        api.req(Method::POST, &signal(&op, "go"), Some(&token))
            .header("content-type", "application/json")
            .body("{not json"),
    )
    .await;
    r.problem(400, "invalid-request");
    assert_eq!(app.operation(&op).await.status.as_str(), "waiting");

    // A signal nobody waits for yet is kept; the same one again is a conflict.
    let v = api
        .post(&signal(&op, "later"), Some(&token), &json!({ "k": 1 }))
        .await
        .expect(202);
    assert_eq!(
        (v["op_id"].as_str(), &v["signal"], &v["result"]),
        (Some(op.as_str()), &json!("later"), &json!("kept")),
        "{v}"
    );
    api.post(&signal(&op, "later"), Some(&token), &json!({ "k": 2 }))
        .await
        .problem(409, "conflict");

    let v = api
        .post(&signal(&op, "go"), Some(&token), &json!({ "n": 1 }))
        .await
        .expect(202);
    assert_eq!(
        (v["op_id"].as_str(), &v["signal"], &v["result"]),
        (Some(op.as_str()), &json!("go"), &json!("delivered")),
        "{v}"
    );
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(
        done.result.unwrap_or_default()["outputs"][0]["payload"],
        json!({ "n": 1 })
    );
    // A finished operation takes neither signals nor cancels.
    api.post(&signal(&op, "go"), Some(&token), &json!({}))
        .await
        .problem(409, "conflict");
    api.post(&cancel(&op), Some(&token), &json!({}))
        .await
        .problem(409, "conflict");

    // An empty body is a null payload.
    let v = send(
        "a signal without a body",
        api.req(Method::POST, &signal(&bare, "go"), Some(&token)),
    )
    .await
    .expect(202);
    assert_eq!(v["result"], "delivered", "{v}");
    let done = app.wait_status(&bare, "succeeded", DEADLINE).await;
    assert_eq!(
        done.result.unwrap_or_default()["outputs"][0]["payload"],
        Value::Null
    );

    // Cancel: a waiting operation at once.
    let v = api
        .post(
            &cancel(&other),
            Some(&token),
            &json!({ "reason": "no longer needed" }),
        )
        .await
        .expect(202);
    assert_eq!(
        (v["op_id"].as_str(), &v["result"]),
        (Some(other.as_str()), &json!("cancelled")),
        "{v}"
    );
    assert_eq!(app.operation(&other).await.status.as_str(), "cancelled");
    api.post(&cancel(&other), Some(&token), &json!({}))
        .await
        .problem(409, "conflict");

    // A running one at its next step boundary.
    app.wait_status(&busy, "running", DEADLINE).await;
    let v = send(
        "cancel without a body",
        api.req(Method::POST, &cancel(&busy), Some(&token)),
    )
    .await
    .expect(202);
    assert_eq!(v["result"], "requested", "{v}");
    app.wait_status(&busy, "cancelled", DEADLINE).await;
    let v = api
        .get(&format!("/v1/operations/{busy}"), Some(&token))
        .await
        .expect(200);
    assert_eq!(v["status"], "cancelled", "{v}");

    let missing = Uuid::new_v4().to_string();
    api.post(&signal(&missing, "go"), Some(&token), &json!({}))
        .await
        .problem(404, "not-found");
    api.post(&cancel(&missing), Some(&token), &json!({}))
        .await
        .problem(404, "not-found");
    app.cleanup().await;
}

#[tokio::test]
async fn api_dlq_routes_list_show_retry_with_a_patch_and_discard_with_an_audit() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let producer = app.token("acme", "producer");
    let operator = app.token("acme", "operator");
    let failing = json!({ "kind": "script", "input": { "steps": [{ "work_ms": 1 }, { "fail": "non_retryable", "times": 9 }] } });
    let a = api.create(&producer, &failing).await;
    let b = api.create(&producer, &failing).await;
    app.wait_status(&a, "dead", DEADLINE).await;
    app.wait_status(&b, "dead", DEADLINE).await;

    let list = api.get("/v1/dlq", Some(&operator)).await.expect(200);
    let items = list["items"]
        .as_array()
        .unwrap_or_else(|| panic!("no items in {list}"));
    assert_eq!(items.len(), 2, "{list}");
    assert!(list["next_cursor"].is_null(), "{list}");
    let mut listed: Vec<&str> = items.iter().filter_map(|d| d["op_id"].as_str()).collect();
    listed.sort();
    let mut expected = vec![a.as_str(), b.as_str()];
    expected.sort();
    assert_eq!(listed, expected);
    for d in items {
        assert_eq!(d["class"], "non_retryable", "{d}");
        assert!(d["cursor"].is_string(), "{d}");
    }
    let letter_of = |op: &str| {
        items
            .iter()
            .find(|d| d["op_id"] == op)
            .and_then(|d| d["id"].as_str())
            .unwrap_or_else(|| panic!("no dead letter id for {op}"))
            .to_string()
    };
    let letter_a = letter_of(&a);

    // Filters.
    for (query, n) in [
        ("class=non_retryable", 2),
        ("class=crash_loop", 0),
        ("kind=script", 2),
        ("kind=echo", 0),
        ("status=open", 2),
        ("since=1h", 2),
    ] {
        let v = api
            .get(&format!("/v1/dlq?{query}"), Some(&operator))
            .await
            .expect(200);
        assert_eq!(v["items"].as_array().map(Vec::len), Some(n), "{query}: {v}");
    }
    // Keyset pages.
    let page = api
        .get("/v1/dlq?limit=1", Some(&operator))
        .await
        .expect(200);
    let cursor = page["next_cursor"]
        .as_str()
        .unwrap_or_else(|| panic!("a full page has a next cursor: {page}"))
        .to_string();
    let next = api
        .get(
            &format!("/v1/dlq?limit=1&after={}", urlencode(&cursor)),
            Some(&operator),
        )
        .await
        .expect(200);
    assert_eq!(next["items"].as_array().map(Vec::len), Some(1), "{next}");
    assert_ne!(page["items"][0]["id"], next["items"][0]["id"]);
    for bad in ["limit=0", "limit=1001", "limit=ten", "since=yesterday"] {
        let r = api.get(&format!("/v1/dlq?{bad}"), Some(&operator)).await;
        assert!(
            r.status == 400 || r.status == 422,
            "{bad}: {} {}",
            r.status,
            r.text()
        );
        problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    }

    let stats = api.get("/v1/dlq/stats", Some(&operator)).await.expect(200);
    let groups = stats["groups"]
        .as_array()
        .unwrap_or_else(|| panic!("no groups in {stats}"));
    let total: i64 = groups.iter().filter_map(|g| g["count"].as_i64()).sum();
    assert_eq!(total, 2, "{stats}");
    for g in groups {
        assert_eq!(
            (&g["class"], &g["kind"]),
            (&json!("non_retryable"), &json!("script")),
            "{g}"
        );
        assert!(g.get("fingerprint").is_some(), "{g}");
    }

    // Show, by operation id and by dead-letter id.
    let shown = api
        .get(&format!("/v1/dlq/{a}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(shown["dead_letter"]["id"], letter_a.as_str(), "{shown}");
    assert_eq!(shown["operation"]["status"], "dead", "{shown}");
    assert_eq!(shown["steps"].as_array().map(Vec::len), Some(2), "{shown}");
    assert_eq!(shown["history"], json!([]), "{shown}");
    let by_letter = api
        .get(&format!("/v1/dlq/{letter_a}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(by_letter["dead_letter"], shown["dead_letter"]);

    // The wrong action for the class is a conflict and changes nothing.
    api.post(
        &format!("/v1/dlq/{a}/resolve"),
        Some(&operator),
        &json!({ "happened": true }),
    )
    .await
    .problem(409, "conflict");
    assert_eq!(app.operation(&a).await.status.as_str(), "dead");

    // Text Postgres cannot store (a NUL) is refused, not a 500, and changes nothing.
    let nul_patch = send(
        "retry with a NUL in the patch",
        api.req(Method::POST, &format!("/v1/dlq/{a}/retry"), Some(&operator))
            .header("content-type", "application/json")
            .body(r#"{"patch_input":{"steps":[{"tool":"ledger","replay":"safe","label":"a\u0000b"}]}}"#),
    )
    .await;
    let nul_reason = send(
        "discard with a NUL in the reason",
        api.req(
            Method::POST,
            &format!("/v1/dlq/{b}/discard"),
            Some(&operator),
        )
        .header("content-type", "application/json")
        .body(r#"{"reason":"dup\u0000licate"}"#),
    )
    .await;
    // Checked at the end, so the rest of the routes are checked whatever these answer.
    let nul_problems: Vec<String> = [&nul_patch, &nul_reason]
        .into_iter()
        .filter_map(|r| {
            if !(400..500).contains(&r.status) {
                return Some(format!("{}: {} {}", r.what, r.status, r.text()));
            }
            problem_shape(r).err()
        })
        .collect();
    assert_eq!(app.operation(&a).await.status.as_str(), "dead");
    assert_eq!(app.operation(&b).await.status.as_str(), "dead");

    // Retry with a patched input: resumes and succeeds.
    let v = api
        .post(
            &format!("/v1/dlq/{a}/retry"),
            Some(&operator),
            &json!({ "patch_input": { "steps": [{ "work_ms": 1 }, { "work_ms": 2 }] }, "reason": "fixed the input" }),
        )
        .await
        .expect(200);
    assert_eq!(
        (&v["result"], v["op_id"].as_str()),
        (&json!("retried"), Some(a.as_str())),
        "{v}"
    );
    assert_eq!(v["id"], letter_a.as_str(), "{v}");
    let done = app.wait_status(&a, "succeeded", DEADLINE).await;
    assert_eq!(
        done.result.unwrap_or_default()["outputs"][1],
        json!({ "worked_ms": 2 })
    );
    api.post(&format!("/v1/dlq/{a}/retry"), Some(&operator), &json!({}))
        .await
        .problem(409, "conflict");

    // Discard needs a non-empty reason.
    for body in [json!({}), json!({ "reason": "" }), json!({ "reason": 5 })] {
        let r = api
            .post(&format!("/v1/dlq/{b}/discard"), Some(&operator), &body)
            .await;
        assert!(
            r.status == 400 || r.status == 422,
            "discard with {body}: {} {}",
            r.status,
            r.text()
        );
        problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(app.operation(&b).await.status.as_str(), "dead");
    let v = api
        .post(
            &format!("/v1/dlq/{b}/discard"),
            Some(&operator),
            &json!({ "reason": "duplicate order" }),
        )
        .await
        .expect(200);
    assert_eq!(v["result"], "discarded", "{v}");
    assert_eq!(app.operation(&b).await.status.as_str(), "discarded");
    api.post(
        &format!("/v1/dlq/{b}/discard"),
        Some(&operator),
        &json!({ "reason": "again" }),
    )
    .await
    .problem(409, "conflict");
    let open = api
        .get("/v1/dlq?status=open", Some(&operator))
        .await
        .expect(200);
    assert_eq!(open["items"], json!([]), "{open}");

    // The audit: one row per action, by the token.
    let rows: Vec<AuditRow> = sqlx::query_as(
        "SELECT op_id::text, actor, reason, status_before, status_after FROM operator_actions
              WHERE action IN ('retry', 'discard') ORDER BY id",
    )
    .fetch_all(&app.pool)
    .await
    .expect("operator_actions");
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        (
            rows[0].0.as_str(),
            rows[0].2.as_deref(),
            rows[0].3.as_deref(),
            rows[0].4.as_deref()
        ),
        (
            a.as_str(),
            Some("fixed the input"),
            Some("dead"),
            Some("queued")
        )
    );
    assert_eq!(
        (
            rows[1].0.as_str(),
            rows[1].2.as_deref(),
            rows[1].4.as_deref()
        ),
        (b.as_str(), Some("duplicate order"), Some("discarded"))
    );
    for row in &rows {
        let prefix = row.1.strip_prefix("token:").unwrap_or_else(|| {
            panic!("actor {:?} is not token:<prefix>", row.1);
        });
        assert!(
            !prefix.is_empty() && operator.starts_with(prefix),
            "actor {:?} is not a prefix of the operator's token",
            row.1
        );
    }
    let shown = api
        .get(&format!("/v1/dlq/{a}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(shown["history"][0]["action"], "retry", "{shown}");
    assert_eq!(shown["dead_letter"]["status"], "retried", "{shown}");
    assert!(
        nul_problems.is_empty(),
        "text with a NUL was not refused with a 4xx:\n{}",
        nul_problems.join("\n")
    );
    app.cleanup().await;
}

#[tokio::test]
async fn api_dlq_resolve_settles_an_unknown_side_effect_both_ways() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    app.spawn(&["scheduler"]);
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let operator = app.token("acme", "operator");
    // An unsafe step whose worker dies after its effect: nobody knows whether it happened.
    let program = json!({ "steps": [
        { "tool": "ledger", "replay": "unsafe", "label": "charge", "after_ms": 2500 },
        { "work_ms": 1 },
    ] });
    let happened = enqueue_cli(&app, "acme", "script", &program);
    let not_happened = enqueue_cli(&app, "acme", "script", &program);
    let w = app.spawn(&["worker"]);
    app.wait_for("both effects", DEADLINE, || async {
        app.effects(&happened).await == 1 && app.effects(&not_happened).await == 1
    })
    .await;
    app.kill(w);
    app.spawn(&["worker"]);
    app.wait_status(&happened, "dead", DEADLINE).await;
    app.wait_status(&not_happened, "dead", DEADLINE).await;

    // A retry would meet the same unknown step: the wrong action for the class.
    api.post(
        &format!("/v1/dlq/{happened}/retry"),
        Some(&operator),
        &json!({}),
    )
    .await
    .problem(409, "conflict");
    for body in [json!({}), json!({ "happened": "yes" })] {
        let r = api
            .post(
                &format!("/v1/dlq/{happened}/resolve"),
                Some(&operator),
                &body,
            )
            .await;
        assert!(
            r.status == 400 || r.status == 422,
            "resolve with {body}: {} {}",
            r.status,
            r.text()
        );
        problem_shape(&r).unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(app.operation(&happened).await.status.as_str(), "dead");

    let v = api
        .post(
            &format!("/v1/dlq/{happened}/resolve"),
            Some(&operator),
            &json!({ "happened": true, "output": { "effect_id": 7 }, "reason": "the bank says it went through" }),
        )
        .await
        .expect(200);
    assert_eq!(
        (&v["result"], v["op_id"].as_str()),
        (&json!("resolved"), Some(happened.as_str())),
        "{v}"
    );
    assert!(v["id"].is_string(), "{v}");
    let done = app.wait_status(&happened, "succeeded", DEADLINE).await;
    assert_eq!(
        done.result.unwrap_or_default()["outputs"][0],
        json!({ "effect_id": 7 })
    );
    assert_eq!(app.effects(&happened).await, 1, "not run again");

    let v = api
        .post(
            &format!("/v1/dlq/{not_happened}/resolve"),
            Some(&operator),
            &json!({ "happened": false }),
        )
        .await
        .expect(200);
    assert_eq!(v["result"], "resolved", "{v}");
    app.wait_status(&not_happened, "succeeded", DEADLINE).await;
    assert_eq!(app.effects(&not_happened).await, 2, "run again, as decided");

    api.post(
        &format!("/v1/dlq/{happened}/resolve"),
        Some(&operator),
        &json!({ "happened": true }),
    )
    .await
    .problem(409, "conflict");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE action = 'resolve' AND actor LIKE 'token:%'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap_or_default();
    assert_eq!(audited, 2, "both resolutions are audited");
    app.cleanup().await;
}

/// An `operator_actions` row: op_id, actor, reason, status_before, status_after.
type AuditRow = (
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
);

pub(crate) fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The routes of the contract, as OpenAPI path templates: the table the server builds its
/// router and its document from.
fn routes() -> impl Iterator<Item = (&'static str, &'static str)> {
    agentq_http::routes::ROUTES
        .iter()
        .map(|r| (r.method, r.path))
}

#[tokio::test]
async fn api_health_metrics_and_an_openapi_document_that_matches_the_routes() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let admin = app.token("ops", "admin");

    let health = api.get("/healthz", None).await;
    assert_eq!(health.expect(200), json!({ "status": "ok" }));
    assert!(
        health
            .header("x-request-id")
            .is_some_and(|id| !id.is_empty())
    );
    let ready = api.get("/readyz", None).await.expect(200);
    assert_eq!(
        (&ready["postgres"], &ready["rabbitmq"]),
        (&json!("ok"), &json!("ok")),
        "{ready}"
    );

    // Request ids: a valid one is echoed, an invalid one replaced.
    let echoed = send(
        "healthz with a request id",
        api.req(Method::GET, "/healthz", None)
            .header("x-request-id", "client-1.a:b_c-d"),
    )
    .await;
    assert_eq!(
        echoed.header("x-request-id").as_deref(),
        Some("client-1.a:b_c-d")
    );
    let long = "r".repeat(129);
    for bad in ["has spaces", "semi;colon", long.as_str()] {
        let r = send(
            format!("healthz with request id {bad:?}"),
            api.req(Method::GET, "/healthz", None)
                .header("x-request-id", bad),
        )
        .await;
        let id = r.header("x-request-id").unwrap_or_default();
        assert!(!id.is_empty() && id != bad, "{bad:?} came back as {id:?}");
    }

    // Some traffic, then the metrics.
    api.get("/v1/dlq", Some(&admin)).await.expect(200);
    // Every tenant's counts: an operator's (or admin's) token, never none.
    api.get("/metrics", None).await.problem(401, "unauthorized");
    let metrics = api.get("/metrics", Some(&admin)).await;
    assert_eq!(metrics.status, 200, "{}", metrics.text());
    let ct = metrics.header("content-type").unwrap_or_default();
    assert!(ct.starts_with("text/plain"), "metrics content-type {ct:?}");
    let text = metrics.text();
    let samples = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter(|l| is_metric_sample(l))
        .count();
    assert!(samples >= 1, "no metric sample in:\n{text}");

    // Unknown routes and wrong methods.
    let r = api.get("/v1/nope", Some(&admin)).await;
    r.problem(404, "not-found");
    assert!(r.header("x-request-id").is_some());
    let r = send(
        "DELETE /v1/operations",
        api.req(Method::DELETE, "/v1/operations", Some(&admin)),
    )
    .await;
    r.problem(405, "method-not-allowed");
    assert!(r.header("x-request-id").is_some());
    send("PUT /healthz", api.req(Method::PUT, "/healthz", None))
        .await
        .problem(405, "method-not-allowed");

    // The OpenAPI document lists every route with its method.
    let doc = api.get("/openapi.json", None).await.expect(200);
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1")),
        "openapi version {}",
        doc["openapi"]
    );
    let paths = doc["paths"]
        .as_object()
        .unwrap_or_else(|| panic!("no paths in the document"));
    let missing: Vec<String> = routes()
        .filter(|(m, p)| paths.get(*p).and_then(|item| item.get(*m)).is_none())
        .map(|(m, p)| format!("{} {p}", m.to_uppercase()))
        .collect();
    assert!(
        missing.is_empty(),
        "routes missing from /openapi.json: {missing:?}; it has {:?}",
        paths.keys().collect::<Vec<_>>()
    );

    // And every path and method it lists is served.
    let mut called = 0;
    for (path, item) in paths {
        let Some(item) = item.as_object() else {
            panic!("path item {path} is not an object");
        };
        for method in item.keys() {
            let Ok(m) = Method::from_bytes(method.to_uppercase().as_bytes()) else {
                continue;
            };
            if !matches!(
                m,
                Method::GET | Method::POST | Method::PUT | Method::PATCH | Method::DELETE
            ) {
                continue;
            }
            let concrete = fill_params(path);
            let mut rb = api.req(m.clone(), &concrete, Some(&admin));
            if m != Method::GET && m != Method::DELETE {
                rb = rb.json(&json!({}));
            }
            let r = send(format!("{m} {concrete} (documented as {path})"), rb).await;
            assert_ne!(r.status, 405, "{}: {}", r.what, r.text());
            assert!(
                r.status < 500 || (path == "/readyz" && r.status == 503),
                "{}: {} {}",
                r.what,
                r.status,
                r.text()
            );
            if !path.contains('{') {
                assert_ne!(r.status, 404, "{}: {}", r.what, r.text());
            }
            called += 1;
        }
    }
    assert!(
        called >= routes().count() && routes().count() >= 23,
        "only {called} documented operations"
    );
    app.cleanup().await;
}

/// `name{labels} value` or `name value` (an optional timestamp after).
fn is_metric_sample(line: &str) -> bool {
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = &line[..name_end];
    let name_ok = !name.is_empty()
        && name.chars().enumerate().all(|(i, c)| {
            c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
        });
    let rest = if line[name_end..].starts_with('{') {
        match line[name_end..].find('}') {
            Some(close) => &line[name_end + close + 1..],
            None => return false,
        }
    } else {
        &line[name_end..]
    };
    let value = rest.split_whitespace().next().unwrap_or_default();
    let value_ok = value.parse::<f64>().is_ok() || matches!(value, "+Inf" | "-Inf" | "NaN");
    name_ok && value_ok
}

/// A documented path with each `{param}` filled: ids with a fresh uuid, names with a word.
fn fill_params(path: &str) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').map_or(rest.len(), |c| open + c);
        let param = &rest[open + 1..close];
        if param.contains("id") {
            out.push_str(&Uuid::new_v4().to_string());
        } else {
            out.push_str(&format!("p{}", Uuid::new_v4().simple()));
        }
        rest = rest.get(close + 1..).unwrap_or_default();
    }
    out.push_str(rest);
    out
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SseEvent {
    pub(crate) id: u64,
    pub(crate) event: String,
    pub(crate) data: Value,
}

/// A `text/event-stream` reader over reqwest's byte stream; cancel-safe (a timed-out `next`
/// loses nothing).
pub(crate) struct Sse {
    stream: BoxStream<'static, reqwest::Result<Vec<u8>>>,
    buf: Vec<u8>,
    id: Option<u64>,
    event: Option<String>,
    data: Option<String>,
}

impl Sse {
    /// Opens the stream of `op`, resuming after `last_event_id` if given.
    pub(crate) async fn open(api: &Api, token: &str, op: &str, last_event_id: Option<u64>) -> Self {
        let mut rb = api
            .client
            .get(format!("{}/v1/operations/{op}/events", api.base))
            .bearer_auth(token)
            .header("accept", "text/event-stream");
        if let Some(id) = last_event_id {
            rb = rb.header("last-event-id", id.to_string());
        }
        Self::from_request(rb).await
    }

    async fn from_request(rb: reqwest::RequestBuilder) -> Self {
        let resp = rb.send().await.expect("the event stream answers");
        let status = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .unwrap_or_default();
        if status != 200 || !ct.starts_with("text/event-stream") {
            let body = resp.text().await.unwrap_or_default();
            panic!("the event stream: {status} {ct:?} {body}");
        }
        Self {
            stream: resp
                .bytes_stream()
                .map(|chunk| chunk.map(|b| b.to_vec()))
                .boxed(),
            buf: Vec::new(),
            id: None,
            event: None,
            data: None,
        }
    }

    /// The next event, or `None` once the server ends the stream.
    pub(crate) async fn next(&mut self) -> Option<SseEvent> {
        loop {
            while let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                let line = String::from_utf8(line).expect("the event stream is UTF-8");
                if line.is_empty() {
                    if let Some(data) = self.data.take() {
                        let data = serde_json::from_str(&data)
                            .unwrap_or_else(|e| panic!("event data is not JSON ({e}): {data}"));
                        let event = SseEvent {
                            id: self
                                .id
                                .take()
                                .unwrap_or_else(|| panic!("an event without an id: {data}")),
                            event: self.event.take().unwrap_or_else(|| "message".into()),
                            data,
                        };
                        return Some(event);
                    }
                    self.id = None;
                    self.event = None;
                    continue;
                }
                if line.starts_with(':') {
                    continue;
                }
                let (field, value) = match line.split_once(':') {
                    Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                    None => (line.as_str(), ""),
                };
                match field {
                    "id" => {
                        self.id = Some(
                            value
                                .trim()
                                .parse()
                                .unwrap_or_else(|_| panic!("event id {value:?} is not a number")),
                        )
                    }
                    "event" => self.event = Some(value.to_string()),
                    "data" => match &mut self.data {
                        Some(d) => {
                            d.push('\n');
                            d.push_str(value);
                        }
                        None => self.data = Some(value.to_string()),
                    },
                    _ => {}
                }
            }
            match self.stream.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => panic!("reading the event stream: {e:?}"),
                None => return None,
            }
        }
    }

    /// Every event until the server ends the stream.
    async fn read_to_end(mut self, what: &str) -> Vec<SseEvent> {
        let mut events = Vec::new();
        let end = tokio::time::Instant::now() + DEADLINE;
        loop {
            match tokio::time::timeout_at(end, self.next()).await {
                Ok(Some(e)) => events.push(e),
                Ok(None) => return events,
                Err(_) => {
                    panic!("{what}: the stream did not end within {DEADLINE:?}; read {events:#?}")
                }
            }
        }
    }
}

fn is_terminal(e: &SseEvent) -> bool {
    e.event == "status"
        && matches!(
            e.data["status"].as_str(),
            Some("succeeded" | "dead" | "cancelled" | "discarded")
        )
}

#[tokio::test]
async fn api_event_stream_resumes_with_last_event_id_and_misses_nothing() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("acme", "producer");
    let program = json!({ "steps": [
        { "work_ms": 20 }, { "model": "first" }, { "work_ms": 20 },
        { "wait_signal": "go", "timeout_ms": 600_000 },
        { "work_ms": 20 }, { "model": "second" }, { "work_ms": 20 },
    ] });
    let op = api
        .create(&token, &json!({ "kind": "script", "input": program }))
        .await;

    // Read until the operation waits for its signal, then hang up in the middle.
    let mut sse = Sse::open(&api, &token, &op, None).await;
    let mut first = Vec::new();
    let end = tokio::time::Instant::now() + DEADLINE;
    loop {
        match tokio::time::timeout(Duration::from_millis(1500), sse.next()).await {
            Ok(Some(e)) => {
                assert!(!is_terminal(&e), "terminal before the signal: {e:?}");
                let waits = e.event == "status" && e.data["status"] == "waiting";
                first.push(e);
                if waits {
                    break;
                }
            }
            Ok(None) => panic!("the stream ended while the operation runs: {first:#?}"),
            Err(_) => {
                if !first.is_empty() && app.operation(&op).await.status.as_str() == "waiting" {
                    break;
                }
            }
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the operation did not wait within {DEADLINE:?}; read {first:#?}"
        );
    }
    drop(sse);
    app.wait_status(&op, "waiting", DEADLINE).await;
    let last = first.last().map(|e| e.id).expect("events before the wait");

    // Come back after the last event seen; the rest arrives live once the signal is sent.
    let rest = Sse::open(&api, &token, &op, Some(last)).await;
    api.post(
        &format!("/v1/operations/{op}/signals/go"),
        Some(&token),
        &json!({ "ok": true }),
    )
    .await
    .expect(202);
    let second = rest.read_to_end("after Last-Event-ID").await;
    assert!(!second.is_empty(), "nothing after the reconnect");

    let all: Vec<SseEvent> = first.iter().chain(&second).cloned().collect();
    println!(
        "event stream: {} events before the disconnect, {} after the reconnect",
        first.len(),
        second.len()
    );
    assert!(
        all.windows(2).all(|w| w[0].id < w[1].id),
        "ids increase, each once, in order: {all:#?}"
    );
    for e in &all {
        assert!(
            matches!(e.event.as_str(), "status" | "step" | "signal"),
            "event type {e:?}"
        );
    }
    for e in &all {
        let keys: &[&str] = match e.event.as_str() {
            "status" => &["status", "attempt"],
            "step" => &["seq", "name", "kind", "status"],
            _ => &["name"],
        };
        for k in keys {
            assert!(e.data.get(*k).is_some(), "{k} missing from {e:?}");
        }
    }
    let terminal = all.last().expect("events");
    assert!(
        is_terminal(terminal) && terminal.data["status"] == "succeeded",
        "the stream ends with the terminal status: {terminal:?}"
    );
    assert!(
        terminal.data.get("result").is_some(),
        "the terminal status carries the result: {terminal:?}"
    );
    assert_eq!(
        all.iter().filter(|e| is_terminal(e)).count(),
        1,
        "one terminal event"
    );
    assert!(
        all.iter()
            .any(|e| e.event == "signal" && e.data["name"] == "go"),
        "the signal is an event: {all:#?}"
    );
    // Every journaled step shows up completed.
    let steps = api
        .get(&format!("/v1/operations/{op}/steps"), Some(&token))
        .await
        .expect(200);
    let steps = steps["steps"].as_array().cloned().unwrap_or_default();
    assert_eq!(steps.len(), 7, "{steps:?}");
    for s in &steps {
        assert!(
            all.iter().any(|e| e.event == "step"
                && e.data["seq"] == s["seq"]
                && e.data["status"] == "completed"),
            "no completed event for step {s}"
        );
    }

    // One uninterrupted read of the finished operation: the same events.
    let whole = Sse::open(&api, &token, &op, None)
        .await
        .read_to_end("from the start")
        .await;
    assert_eq!(whole, all, "a resumed read and a whole read differ");
    // The query-string form resumes too; after the terminal event there is nothing more.
    let k = first.len();
    let tail = Sse::from_request(
        api.client
            .get(format!(
                "{}/v1/operations/{op}/events?last_event_id={}",
                api.base,
                all[k - 1].id
            ))
            .bearer_auth(&token),
    )
    .await
    .read_to_end("?last_event_id")
    .await;
    assert_eq!(tail, all[k..].to_vec());
    let none = Sse::open(&api, &token, &op, Some(terminal.id))
        .await
        .read_to_end("after the terminal event")
        .await;
    assert_eq!(none, Vec::new());
    app.cleanup().await;
}

#[tokio::test]
async fn event_streams_of_many_operations_share_the_poller_and_each_gets_exactly_its_events() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("acme", "producer");
    let mut ops = Vec::new();
    for _ in 0..3 {
        ops.push(
            api.create(
                &token,
                &json!({ "kind": "script", "input": waits_for("go") }),
            )
            .await,
        );
    }
    for op in &ops {
        app.wait_status(op, "waiting", DEADLINE).await;
    }
    // Two streams per operation, one from the start and one resuming after its first event,
    // all following the one poller of this server.
    let mut streams = Vec::new();
    for op in &ops {
        // The log every reader reads: the first event may be served from the operation row.
        let first: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT min(seq) FROM {} l WHERE op_id = $1::uuid",
            agentq_core::db::events::EVENT_LOG
        )))
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .expect("the first event of an operation");
        let first = first as u64;
        streams.push((op.clone(), 0, Sse::open(&api, &token, op, None).await));
        streams.push((
            op.clone(),
            first,
            Sse::open(&api, &token, op, Some(first)).await,
        ));
    }
    // The last operation's row goes away while its streams are open: they end.
    let (gone, live) = ops.split_last().expect("three operations");
    sqlx::query("DELETE FROM operations WHERE id = $1::uuid")
        .bind(gone)
        .execute(&app.pool)
        .await
        .expect("deleting an operation");
    for op in live {
        api.post(
            &format!("/v1/operations/{op}/signals/go"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(202);
    }
    let mut whole: std::collections::HashMap<String, Vec<SseEvent>> = Default::default();
    for (op, after, sse) in streams {
        let events = sse.read_to_end(&format!("a stream of {op}")).await;
        if op == *gone {
            continue;
        }
        assert!(
            events.first().is_some_and(|e| e.id > after)
                && events.windows(2).all(|w| w[0].id < w[1].id),
            "ids after {after}, increasing, each once: {events:#?}"
        );
        let terminal = events.last().expect("events");
        assert!(
            is_terminal(terminal)
                && terminal.data["status"] == "succeeded"
                && terminal.data.get("result").is_some(),
            "ends with the terminal status and its result: {terminal:?}"
        );
        match whole.get(&op) {
            Some(all) => assert_eq!(events, all[1..].to_vec(), "the resumed stream of {op}"),
            None => {
                whole.insert(op, events);
            }
        }
    }
    assert_eq!(whole.len(), live.len());
    app.cleanup().await;
}

/// A journal row of `op` at `seq`, named `s<seq>`, with an output once completed.
pub(crate) fn journal_row(
    op: Uuid,
    seq: i32,
    replay: agentq_core::state::Replay,
    status: agentq_core::state::StepStatus,
) -> agentq_core::db::steps::StepWrite {
    use agentq_core::state::{StepKind, StepStatus};
    agentq_core::db::steps::StepWrite {
        seq,
        name: format!("s{seq}"),
        kind: StepKind::Custom,
        replay,
        idempotency_key: format!("{op}:{seq}"),
        status,
        output: (status == StepStatus::Completed).then(|| json!({ "n": seq })),
        error: None,
        started_at: chrono::Utc::now(),
        completed_at: (status == StepStatus::Completed).then(chrono::Utc::now),
        usage: None,
        wake_at: None,
    }
}

/// The whole event log of `op` (the tests' logs are short), in order.
async fn whole_log(pool: &sqlx::PgPool, op: Uuid) -> Vec<agentq_core::db::events::Event> {
    agentq_core::db::events::events_after(pool, op, 0, 100)
        .await
        .expect("events")
}

/// The `status` each event of `log` names.
fn statuses(log: &[agentq_core::db::events::Event]) -> Vec<&str> {
    log.iter()
        .map(|e| e.data["status"].as_str().unwrap_or("?"))
        .collect()
}

/// Checks the log of an operation that ran, journaled step 0 `completed` and step 1 `started`,
/// then step 1 `completed` and step 2 `completed`, and succeeded: those events in that order,
/// with increasing ids and times.
fn assert_steps_then_success(log: &[agentq_core::db::events::Event]) {
    let seen: Vec<(String, Value, Value)> = log
        .iter()
        .map(|e| {
            (
                e.kind.clone(),
                e.data.get("seq").cloned().unwrap_or(Value::Null),
                e.data["status"].clone(),
            )
        })
        .collect();
    let expected: Vec<(String, Value, Value)> = [
        ("status", Value::Null, "running"),
        ("step", json!(0), "completed"),
        ("step", json!(1), "started"),
        ("step", json!(1), "completed"),
        ("step", json!(2), "completed"),
        ("status", Value::Null, "succeeded"),
    ]
    .into_iter()
    .map(|(k, s, st)| (k.to_string(), s, json!(st)))
    .collect();
    assert_eq!(seen, expected, "the event log in commit order: {log:#?}");
    assert!(
        log.windows(2)
            .all(|w| w[0].seq < w[1].seq && w[0].at <= w[1].at),
        "ids and times increase: {log:#?}"
    );
}

/// A step's event is its journal row (migration 20261207000001): a row written `started` and
/// then `completed` keeps both events, and a row a rebase moves out of the journal keeps its
/// event, all in commit order with the operation's status events. Written through the
/// journal's own statements on an operation no worker runs.
#[tokio::test]
async fn the_event_log_keeps_every_state_of_a_step_and_the_rows_a_rebase_moves() {
    use agentq_core::db::{events, settle, steps, versions};
    use agentq_core::state::{Replay, StepStatus};
    let app = TestApp::start().await;
    let op = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, max_attempts,
                                 status, epoch, upgrade_through)
         VALUES ($1, 'acme', 'script', 'interactive', '{}', 'x', 5, 'running', 1, 5)",
    )
    .bind(op)
    .execute(&app.pool)
    .await
    .expect("a running operation");
    let step = |seq, replay, status| journal_row(op, seq, replay, status);
    let write = |rows: Vec<steps::StepWrite>| {
        let pool = app.pool.clone();
        async move {
            let batch = [settle::RunWrite::Steps(steps::StepBatch {
                id: op,
                epoch: 1,
                steps: rows,
            })];
            let written = settle::write_runs(&pool, &batch).await.expect("journal");
            assert_eq!(written, vec![op], "the journal write is fenced by epoch 1");
        }
    };
    write(vec![
        step(0, Replay::Safe, StepStatus::Completed),
        step(1, Replay::Unsafe, StepStatus::Started),
    ])
    .await;
    write(vec![
        step(1, Replay::Unsafe, StepStatus::Completed),
        step(2, Replay::Safe, StepStatus::Completed),
    ])
    .await;
    assert!(
        versions::rebase(&app.pool, op, 1, 2).await.expect("rebase"),
        "the rebase runs"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM operation_steps WHERE op_id = $1")
        .bind(op)
        .fetch_one(&app.pool)
        .await
        .expect("journal rows");
    assert_eq!(left, 2, "step 2 moved out of the journal");
    sqlx::query("UPDATE operations SET status = 'succeeded', finished_at = now() WHERE id = $1")
        .bind(op)
        .execute(&app.pool)
        .await
        .expect("finishing");

    let log = whole_log(&app.pool, op).await;
    assert_steps_then_success(&log);
    // Resuming after any event gives exactly the ones after it.
    for (i, e) in log.iter().enumerate() {
        let rest = events::events_after(&app.pool, op, e.seq, 100)
            .await
            .expect("events");
        let ids: Vec<i64> = rest.iter().map(|e| e.seq).collect();
        let want: Vec<i64> = log[i + 1..].iter().map(|e| e.seq).collect();
        assert_eq!(ids, want, "after event {}", e.seq);
    }
    app.cleanup().await;
}

/// An operation enqueued `queued` and due at once serves its creation event from its own row
/// (migration 20261208000001): no `operation_events` row, the same event as before (`queued`,
/// attempt 0, `run_at` its creation) with the operation's first id, and the events after it in
/// commit order. A delayed enqueue, which names when it is due, keeps its event as a row; so
/// does an enqueue many at once through the batch statement. A repeated dedupe key adds nothing.
#[tokio::test]
async fn a_creation_event_is_served_from_the_operation_row_when_it_says_nothing_more() {
    use agentq_core::db::events;
    let app = TestApp::start().await;
    let (producer, dispatcher) = app.producer();
    let request = |run_at: Option<chrono::DateTime<chrono::Utc>>, key: Option<&str>| {
        agentq_producer::EnqueueRequest {
            tenant: "t1".into(),
            kind: "echo".into(),
            input: json!({ "text": "hi" }),
            run_at,
            dedupe_key: key.map(str::to_string),
            ..Default::default()
        }
    };
    let now = producer
        .enqueue(request(None, Some("k")))
        .await
        .expect("enqueue")
        .op_id
        .0;
    let later_at = chrono::Utc::now() + chrono::Duration::hours(1);
    let later = producer
        .enqueue(request(Some(later_at), None))
        .await
        .expect("enqueue")
        .op_id
        .0;
    let many = producer
        .enqueue_many(vec![request(None, None)])
        .await
        .expect("enqueue many")
        .created[0]
        .0;
    let again = producer
        .enqueue(request(None, Some("k")))
        .await
        .expect("the same dedupe key");
    assert!(
        !again.created && again.op_id.0 == now,
        "the key names the first"
    );
    dispatcher.close().await;

    let stored = |op: Uuid| {
        let pool = app.pool.clone();
        async move {
            let (created_at, from_row): (chrono::DateTime<chrono::Utc>, Option<i64>) =
                sqlx::query_as("SELECT created_at, created_event_id FROM operations WHERE id = $1")
                    .bind(op)
                    .fetch_one(&pool)
                    .await
                    .expect("the operation");
            let rows: i64 =
                sqlx::query_scalar("SELECT count(*) FROM operation_events WHERE op_id = $1")
                    .bind(op)
                    .fetch_one(&pool)
                    .await
                    .expect("event rows");
            (created_at, from_row, rows)
        }
    };
    // What the insert trigger wrote: exactly these three keys.
    let queued = |data: &Value| -> (String, i64, chrono::DateTime<chrono::Utc>, usize) {
        let run_at = data["run_at"]
            .as_str()
            .expect("run_at")
            .parse()
            .expect("a time");
        let keys = data.as_object().map_or(0, |o| o.len());
        (
            data["status"].to_string(),
            data["attempt"].as_i64().unwrap_or(-1),
            run_at,
            keys,
        )
    };
    for op in [now, many] {
        let (created_at, from_row, rows) = stored(op).await;
        let log = whole_log(&app.pool, op).await;
        assert_eq!(rows, 0, "no event row for {op}");
        assert_eq!(log.len(), 1, "one event: {log:#?}");
        assert_eq!(Some(log[0].seq), from_row, "the row's id");
        assert_eq!((log[0].kind.as_str(), log[0].at), ("status", created_at));
        assert_eq!(
            queued(&log[0].data),
            ("\"queued\"".into(), 0, created_at, 3),
            "what the trigger wrote before: {log:#?}"
        );
    }
    let (_, from_row, rows) = stored(later).await;
    let log = whole_log(&app.pool, later).await;
    assert_eq!(
        (from_row, rows),
        (None, 1),
        "a delayed enqueue keeps its row"
    );
    assert_eq!(log.len(), 1, "one event: {log:#?}");
    let run_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT run_at FROM operations WHERE id = $1")
            .bind(later)
            .fetch_one(&app.pool)
            .await
            .expect("run_at");
    assert_eq!(
        queued(&log[0].data),
        ("\"queued\"".into(), 0, run_at, 3),
        "it names when it is due: {log:#?}"
    );

    // The next status change (as a claim writes it) follows the creation event, and resuming
    // after the creation event gives exactly it.
    sqlx::query(
        "UPDATE operations SET status = 'running', attempt = 1, epoch = epoch + 1 WHERE id = $1",
    )
    .bind(now)
    .execute(&app.pool)
    .await
    .expect("running");
    let log = whole_log(&app.pool, now).await;
    assert_eq!(statuses(&log), ["queued", "running"], "{log:#?}");
    assert!(
        log[0].seq < log[1].seq && log[0].at <= log[1].at,
        "{log:#?}"
    );
    let rest = events::events_after(&app.pool, now, log[0].seq, 100)
        .await
        .expect("events");
    assert_eq!(rest.iter().map(|e| e.seq).collect::<Vec<_>>(), [log[1].seq]);
    app.cleanup().await;
}

/// A success written by the completion serves its `succeeded` event from the operation row
/// (migration 20261208000002): after the steps the same statement wrote (their ids first), the
/// same data the status trigger wrote, no event row, the outcome with it on the stream; and
/// should a column the event shows change later, the event is archived with its id and data.
#[tokio::test]
async fn a_success_is_served_from_the_operation_row_after_its_last_steps() {
    use agentq_core::db::{events, settle, steps};
    use agentq_core::state::{Replay, StepStatus};
    let app = TestApp::start().await;
    let (op, bare) = (Uuid::new_v4(), Uuid::new_v4());
    for id in [op, bare] {
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, status,
                                     attempt, epoch)
             VALUES ($1, 'acme', 'script', 'interactive', '{}', 'x', 'running', 1, 1)",
        )
        .bind(id)
        .execute(&app.pool)
        .await
        .expect("a running operation");
    }
    let step = |seq, replay, status| journal_row(op, seq, replay, status);
    let batch = [settle::RunWrite::Steps(steps::StepBatch {
        id: op,
        epoch: 1,
        steps: vec![
            step(0, Replay::Safe, StepStatus::Completed),
            step(1, Replay::Unsafe, StepStatus::Started),
        ],
    })];
    settle::write_runs(&app.pool, &batch)
        .await
        .expect("journal");
    // One statement finishes both: one with its last rows (one of them a row written before),
    // one with none.
    let completions = [
        settle::RunWrite::Complete(settle::Completion {
            id: op,
            epoch: 1,
            result: json!({ "ok": true }),
            steps: vec![
                step(1, Replay::Unsafe, StepStatus::Completed),
                step(2, Replay::Safe, StepStatus::Completed),
            ],
        }),
        settle::RunWrite::Complete(settle::Completion {
            id: bare,
            epoch: 1,
            result: json!({ "ok": 2 }),
            steps: vec![],
        }),
    ];
    let mut done = settle::write_runs(&app.pool, &completions)
        .await
        .expect("completion");
    done.sort();
    let mut both = vec![op, bare];
    both.sort();
    assert_eq!(done, both, "both fenced by epoch 1");

    let log = whole_log(&app.pool, op).await;
    assert_steps_then_success(&log);
    let (run_at, from_row): (chrono::DateTime<chrono::Utc>, Option<i64>) =
        sqlx::query_as("SELECT run_at, finished_event_id FROM operations WHERE id = $1")
            .bind(op)
            .fetch_one(&app.pool)
            .await
            .expect("the operation");
    let last = log.last().expect("the success").clone();
    assert_eq!(Some(last.seq), from_row, "served from the row");
    let shown: chrono::DateTime<chrono::Utc> = last.data["run_at"]
        .as_str()
        .expect("run_at")
        .parse()
        .expect("a time");
    assert_eq!(
        (
            last.data["attempt"].as_i64(),
            shown,
            last.data.as_object().map(|o| o.len())
        ),
        (Some(1), run_at, Some(3)),
        "what the status trigger wrote: {last:#?}"
    );
    let rows = |id: Uuid| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM operation_events
                  WHERE op_id = $1 AND type = 'status' AND data->>'status' = 'succeeded'",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("event rows")
        }
    };
    assert_eq!(rows(op).await, 0, "no event row for the success");
    // The stream's poller gives the success with the outcome.
    let news = events::events_of_many(&app.pool, &[(op, Some(log[4].seq))], 10)
        .await
        .expect("news");
    let (event, outcome) = &news[0].events[0];
    assert_eq!((event.seq, news[0].head), (last.seq, last.seq));
    assert_eq!(
        outcome.as_ref().and_then(|o| o.result.clone()),
        Some(json!({ "ok": true }))
    );
    let bare_log = whole_log(&app.pool, bare).await;
    assert_eq!(
        statuses(&bare_log),
        ["running", "succeeded"],
        "{bare_log:#?}"
    );

    // A column the event shows changes: the event is archived as it was served.
    sqlx::query("UPDATE operations SET error_message = 'changed later' WHERE id = $1")
        .bind(op)
        .execute(&app.pool)
        .await
        .expect("an update");
    let after = whole_log(&app.pool, op).await;
    let pairs = |log: &[events::Event]| -> Vec<(i64, Value)> {
        log.iter().map(|e| (e.seq, e.data.clone())).collect()
    };
    assert_eq!(pairs(&after), pairs(&log), "the log is unchanged");
    assert_eq!(rows(op).await, 1, "archived");
    app.cleanup().await;
}
