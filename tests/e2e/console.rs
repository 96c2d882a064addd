//! The operator console (`/ui`): driven in headless Debian chromium (playwright-core, installed
//! by `.ci/browser-deps`, which `.ci/test` runs) to retry a dead operation, approve an agent's
//! pending tool call seen with its arguments and pause a batch, with the database checked afterwards; and over plain HTTP for its
//! refusals (producer tokens, missing CSRF tokens, another tenant's ids) and for payloads:
//! shown on an operation's page only, each view audited, redacted keys never shown.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "agentq-console-{tag}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where `.ci/browser-deps` put playwright-core (`AGENTQ_PLAYWRIGHT_DIR`, else its default).
fn playwright_dir() -> PathBuf {
    if let Ok(d) = std::env::var("AGENTQ_PLAYWRIGHT_DIR") {
        return PathBuf::from(d);
    }
    let cache = std::env::var("AGENTQ_CI_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache"))
                .join("agentq-ci")
        });
    cache.join("playwright/node_modules")
}

fn count_sql(app: &TestApp, sql: &'static str, op: &str) -> impl Future<Output = i64> {
    let pool = app.pool.clone();
    let op = op.to_string();
    async move {
        sqlx::query_scalar(sql)
            .bind(op)
            .fetch_one(&pool)
            .await
            .unwrap()
    }
}

#[tokio::test]
async fn console_in_a_browser_retries_a_dead_operation_approves_and_pauses_a_batch() {
    let chromium = Path::new("/usr/bin/chromium");
    let modules = playwright_dir();
    assert!(
        chromium.exists() && modules.join("playwright-core").exists(),
        "the browser test needs Debian's chromium and playwright-core ({}): run the tests with \
         `bash .ci/test`, which installs them (or run `bash .ci/browser-deps` and export the \
         directory it prints as AGENTQ_PLAYWRIGHT_DIR)",
        modules.display()
    );

    // The model first asks an agent's approval-gated tool call (with a secret among its
    // arguments), then, for the batch, answers slowly.
    let fake = FakeModel::start(crate::approval_context::secret_storing_model()).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_CONSOLE_REDACT", "api_key");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;

    let dead = app.enqueue_script(
        json!([{ "work_ms": 1 }, { "fail": "non_retryable", "times": 9 }]),
        &[],
    );
    let waiting = crate::approval_context::enqueue_gated_agent(&app);
    app.wait_status(&waiting, "waiting", DEADLINE).await;
    fake.set(Mode::Slow(Duration::from_millis(300)));
    let (src, dst, tmp) = (
        TempDir::new("src"),
        TempDir::new("dst"),
        TempDir::new("cfg"),
    );
    for i in 0..40 {
        std::fs::write(
            src.0.join(format!("doc-{i:03}.md")),
            format!("Title: {i}\n\nA paragraph."),
        )
        .unwrap();
    }
    let instructions = tmp.0.join("instructions.txt");
    std::fs::write(&instructions, "Keep the text as it is.").unwrap();
    let (src, dst) = (
        app.dir_store("t1", &src.0, "read"),
        app.dir_store("t1", &dst.0, "write"),
    );
    let started = app.agentq_json(&[
        "batch",
        "start",
        "--tenant",
        "t1",
        "--source",
        &src,
        "--target",
        &dst,
        "--instructions",
        instructions.to_str().unwrap(),
        // A canary waits for its promotion, so it is still there to pause (a batch whose
        // documents all finished is completed, and takes no pause).
        "--canary",
        "5",
        "--json",
    ]);
    let batch = started["batch_id"].as_str().unwrap().to_string();
    app.wait_status(&dead, "dead", DEADLINE).await;
    app.wait_status(&waiting, "waiting", DEADLINE).await;
    // Running when the browser pauses it: its model call is held until the pause is made.
    let call = fake.hold_prompt("held for the pause");
    let running = app.enqueue_script(
        json!([{ "model": "held for the pause" }, { "work_ms": 1 }]),
        &[],
    );
    app.wait_status(&running, "running", DEADLINE).await;
    let release = tokio::spawn({
        let (pool, op) = (app.pool.clone(), running.clone());
        async move {
            loop {
                let paused: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM pauses WHERE op_id = $1::uuid)",
                )
                .bind(&op)
                .fetch_one(&pool)
                .await
                .unwrap();
                if paused {
                    // Its worker learns of the pause at a lease renewal: then the call ends.
                    crate::pauses::two_renewals(&pool, &op).await;
                    call.add_permits(1);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let token = app.token("t1", "operator");

    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    let _ = std::fs::remove_dir_all(&shots);
    let out = tokio::task::spawn_blocking({
        let (base, token, shots) = (base.clone(), token.clone(), shots.clone());
        let (dead, waiting, batch) = (dead.clone(), waiting.clone(), batch.clone());
        let running = running.clone();
        move || {
            Command::new("node")
                .arg(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/tests/browser/console.mjs"
                ))
                .args([
                    &base,
                    &token,
                    shots.to_str().unwrap(),
                    &dead,
                    &waiting,
                    &batch,
                    &running,
                ])
                .env("NODE_PATH", &modules)
                .output()
                .expect("running node (install Node.js)")
        }
    })
    .await
    .unwrap();
    release.abort();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the browser test failed (screenshots in {}):\n{stdout}\n{}",
        shots.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("console screenshots: {}", shots.display());
    for page in [
        "login",
        "overview",
        "dlq",
        "operation-dead",
        "approvals",
        "operation-waiting",
        "batches",
        "operation-paused",
        "pauses",
    ] {
        assert!(shots.join(format!("{page}.png")).exists(), "{page}.png");
    }

    // The retry happened and succeeded, audited under the token like the API's actions.
    app.wait_status(&dead, "succeeded", DEADLINE).await;
    let actor = format!("token:{}", &token[..12]);
    let audited = |action: &'static str, op: &str| {
        let pool = app.pool.clone();
        let (op, actor) = (op.to_string(), actor.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM operator_actions
                  WHERE action = $1 AND op_id = $2::uuid AND actor = $3",
            )
            .bind(action)
            .bind(op)
            .bind(actor)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(audited("retry", &dead).await, 1, "the retry is audited");
    let dl_status: String =
        sqlx::query_scalar("SELECT status FROM dead_letters WHERE op_id = $1::uuid")
            .bind(&dead)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(dl_status, "retried");
    // The approval: the signal with the CLI's payload, audited, and the operation finished.
    assert_eq!(
        audited("approve", &waiting).await,
        1,
        "the approval is audited"
    );
    let payload: serde_json::Value = sqlx::query_scalar(
        "SELECT payload FROM signals WHERE op_id = $1::uuid AND name = 'approval'",
    )
    .bind(&waiting)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(payload["approved"], true, "{payload}");
    assert_eq!(payload["by"], actor.as_str(), "{payload}");
    assert_eq!(payload["reason"], "looks right", "{payload}");
    app.wait_status(&waiting, "succeeded", DEADLINE).await;
    // The pause, audited.
    let status: String = sqlx::query_scalar("SELECT status FROM batches WHERE id = $1::uuid")
        .bind(&batch)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(status, "paused");
    let paused = count_sql(
        &app,
        "SELECT count(*) FROM operator_actions
          WHERE action = 'batch_paused' AND details->>'batch_id' = $1 AND actor LIKE 'token:%'
            AND reason = 'checking the output'",
        &batch,
    )
    .await;
    assert_eq!(paused, 1, "the pause is audited");
    // The operation paused from its page and resumed from the Pauses page, both audited; it
    // finishes on the attempt it began.
    assert_eq!(
        audited("pause", &running).await,
        1,
        "the op's pause is audited"
    );
    assert_eq!(
        audited("resume", &running).await,
        1,
        "its resume is audited"
    );
    app.wait_status(&running, "succeeded", DEADLINE).await;
    let attempt: i32 = sqlx::query_scalar("SELECT attempt FROM operations WHERE id = $1::uuid")
        .bind(&running)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(attempt, 1, "a pause uses no attempt");
    app.cleanup().await;
}

/// A console HTTP client: no redirects followed, the session cookie carried by hand.
pub(crate) struct Browser {
    client: reqwest::Client,
    base: String,
    cookie: String,
}

fn form_body(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| {
            let enc = |s: &str| {
                s.bytes()
                    .map(|b| {
                        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                            (b as char).to_string()
                        } else {
                            format!("%{b:02X}")
                        }
                    })
                    .collect::<String>()
            };
            format!("{}={}", enc(k), enc(v))
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The value of `name="csrf"` in a page.
pub(crate) fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a CSRF field") + 19;
    page[at..at + page[at..].find('"').unwrap()].to_string()
}

impl Browser {
    pub(crate) fn new(base: &str) -> Self {
        Self {
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            base: base.to_string(),
            cookie: String::new(),
        }
    }

    pub(crate) async fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .client
            .get(format!("{}{path}", self.base))
            .header("cookie", &self.cookie)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    pub(crate) async fn post(&self, path: &str, fields: &[(&str, &str)]) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .header("cookie", &self.cookie)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form_body(fields))
            .send()
            .await
            .unwrap()
    }

    /// Signs in with `token`; returns the status of the sign-in answer and its body.
    pub(crate) async fn login(&mut self, token: &str) -> (u16, String) {
        let r = self
            .client
            .get(format!("{}/ui/login", self.base))
            .send()
            .await
            .unwrap();
        let set = r.headers().get("set-cookie").unwrap().to_str().unwrap();
        let login_cookie = set.split(';').next().unwrap().to_string();
        let csrf = csrf_of(&r.text().await.unwrap());
        self.cookie = login_cookie;
        let r = self
            .post("/ui/login", &[("csrf", &csrf), ("token", token)])
            .await;
        let status = r.status().as_u16();
        if let Some(set) = r
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find(|v| v.starts_with("agentq_session="))
        {
            assert!(
                set.contains("HttpOnly") && set.contains("SameSite=Strict"),
                "{set}"
            );
            assert!(!set.contains(token), "the token is not in the cookie");
            self.cookie = set.split(';').next().unwrap().to_string();
        }
        (status, r.text().await.unwrap())
    }
}

#[tokio::test]
async fn console_refuses_producers_forged_forms_and_other_tenants_and_hides_payloads() {
    const CANARY: &str = "CANARY-7f3e9b1d-console";
    const REDACTED: &str = "LABEL-never-shown-5d1";
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_CONSOLE_REDACT", "label, ssn");
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let op = app.enqueue_echo(&format!("secret {CANARY}"));
    app.wait_status(&op, "succeeded", DEADLINE).await;
    let labelled = app.enqueue_script(
        serde_json::json!([{ "tool": "ledger", "replay": "safe", "label": REDACTED }]),
        &[],
    );
    app.wait_status(&labelled, "succeeded", DEADLINE).await;
    let other = app.agentq_json(&[
        "enqueue",
        "--tenant",
        "t2",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"other tenant"}"#,
        "--json",
    ])["op_id"]
        .as_str()
        .unwrap()
        .to_string();

    // Without a session, every page sends the browser to the sign-in page.
    let anonymous = Browser::new(&base);
    let r = anonymous
        .client
        .get(format!("{base}/ui/operations"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 303);
    assert_eq!(r.headers()["location"], "/ui/login");

    // A producer token is refused with a clear message, and gets no session.
    let mut producer = Browser::new(&base);
    let (status, body) = producer.login(&app.token("t1", "producer")).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("producer token"), "{body}");
    assert!(!producer.cookie.starts_with("agentq_session="));

    let mut ui = Browser::new(&base);
    let (status, _) = ui.login(&app.token("t1", "operator")).await;
    assert_eq!(status, 303);

    // Another tenant's operation is not found.
    let (status, _) = ui.get(&format!("/ui/operations/{other}")).await;
    assert_eq!(status, 404);

    // No list page shows an input, a result or a step output.
    let pages = [
        "/ui".to_string(),
        "/ui/operations".to_string(),
        "/ui/operations?kind=echo&status=succeeded&since=1h".to_string(),
        "/ui/dlq".to_string(),
        "/ui/approvals".to_string(),
        "/ui/batches".to_string(),
        "/ui/kinds".to_string(),
    ];
    let mut csrf = String::new();
    for p in &pages {
        let (status, body) = ui.get(p).await;
        assert_eq!(status, 200, "{p}: {body}");
        assert!(!body.contains(CANARY), "{p} shows the payload");
        csrf = csrf_of(&body);
    }
    // The Kinds page shows what the binary runs: its kinds with their schemas, and the tools.
    let (_, kinds) = ui.get("/ui/kinds").await;
    assert!(kinds.contains("data-kind=\"echo\"") && kinds.contains("data-tool=\"kv_put\""));
    assert_eq!(
        count_sql(
            &app,
            "SELECT count(*) FROM operator_actions WHERE op_id = $1::uuid",
            &op
        )
        .await,
        0
    );

    // A form without the session's CSRF token is refused, and so is a cross-site one.
    let path = format!("/ui/operations/{op}/reveal");
    assert_eq!(ui.post(&path, &[]).await.status().as_u16(), 403);
    assert_eq!(
        ui.post(&path, &[("csrf", "not-the-token")])
            .await
            .status()
            .as_u16(),
        403
    );
    let cross = ui
        .client
        .post(format!("{base}{path}"))
        .header("cookie", &ui.cookie)
        .header("origin", "https://evil.example")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form_body(&[("csrf", &csrf)]))
        .send()
        .await
        .unwrap();
    assert_eq!(cross.status().as_u16(), 403);

    // The operation's page shows an operator the payloads, each view audited (the reveal
    // form of earlier pages answers the same page).
    let (status, page) = ui.get(&format!("/ui/operations/{op}")).await;
    assert_eq!(status, 200);
    assert!(page.contains(CANARY), "the page shows the input");
    let r = ui.post(&path, &[("csrf", &csrf)]).await;
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["cache-control"], "no-store");
    assert!(
        r.text().await.unwrap().contains(CANARY),
        "the reveal shows the input"
    );
    assert_eq!(
        count_sql(
            &app,
            "SELECT count(*) FROM operator_actions WHERE op_id = $1::uuid
                AND action = 'reveal_payloads' AND actor LIKE 'token:%'
                AND details->>'via' = 'console'",
            &op
        )
        .await,
        2
    );
    // Keys named in AGENTQ_CONSOLE_REDACT stay hidden even in a reveal: it adds no occurrence
    // of their values (the script's step names carry the label, as code-defined names do).
    let (_, plain) = ui.get(&format!("/ui/operations/{labelled}")).await;
    let r = ui
        .post(
            &format!("/ui/operations/{labelled}/reveal"),
            &[("csrf", &csrf)],
        )
        .await;
    let revealed = r.text().await.unwrap();
    assert_eq!(
        revealed.matches(REDACTED).count(),
        plain.matches(REDACTED).count(),
        "the reveal shows no redacted value"
    );
    assert!(revealed.contains("[redacted]") && plain.contains("[redacted]"));

    // Signing out ends the session.
    let r = ui.post("/ui/logout", &[("csrf", &csrf)]).await;
    assert_eq!(r.status().as_u16(), 303);
    let (status, _) = ui.get("/ui").await;
    assert_eq!(status, 303);
    app.cleanup().await;
}
