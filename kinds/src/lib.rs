//! agentq-kinds: agentq's built-in job kinds, written with the worker's public SDK only
//! (`agentq_worker`: [`JobContext`], [`Tool`], [`Registry`]), as a kind of a user's own would be.
//!
//! - `echo`: input `{"text": …}`; one model step through the configured model client (the
//!   built-in local model echoes the text); output `{"text": …}`.
//! - `script`: a small JSON program for demos, smoke tests, benchmarks and crash tests (its
//!   format is in the README and on [`ScriptStep`]).
//! - `agent`: the agent loop from JSON ([`AgentInput`]), with built-in tools `kv_put`, `kv_get`
//!   (a key-value table per tenant) and `ledger` (an unsafe side effect with reconcile).
//! - `triage` (in `triage.rs`): the webhook-triggered kind, summarize and classify an event,
//!   then post the result to the source's callback once.
//! - `doc_migration` (in `doc_migration.rs`): one document of a migration, chunked through
//!   the model, validated, reviewed on low confidence, written idempotently.

use std::time::Duration;

use agentq_core::operation::Requires;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use agentq_worker::context::check_park;
use agentq_worker::model::ModelRequest;
use agentq_worker::{JobContext, JobError, Reconciled, Registry, Replay, SignalOutcome, Tool};
mod doc_migration;
pub mod outbound;
mod triage;

/// Input of `echo`.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EchoInput {
    pub text: String,
}

/// Output of `echo`.
#[derive(Debug, Deserialize, Serialize)]
pub struct EchoOutput {
    pub text: String,
}

/// Sends the text to the model and returns its answer.
pub async fn echo(ctx: JobContext, input: EchoInput) -> Result<EchoOutput, JobError> {
    let answer = ctx.model("echo", ModelRequest::user(input.text)).await?;
    Ok(EchoOutput {
        text: answer.content,
    })
}

/// Input of `script`: the steps to run, in order.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, try_from = "ScriptProgram")]
pub struct ScriptInput {
    pub steps: Vec<ScriptStep>,
}

/// `script`'s input as written, before its durations are checked.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptProgram {
    steps: Vec<ScriptStep>,
}

impl TryFrom<ScriptProgram> for ScriptInput {
    type Error = String;

    fn try_from(p: ScriptProgram) -> Result<Self, String> {
        for (i, step) in p.steps.iter().enumerate() {
            let (field, ms) = match step {
                ScriptStep::Sleep { sleep_ms } => ("sleep_ms", *sleep_ms),
                ScriptStep::WaitSignal { timeout_ms, .. } => ("timeout_ms", *timeout_ms),
                _ => continue,
            };
            check_park(&format!("steps[{i}].{field}"), Duration::from_millis(ms))?;
        }
        Ok(Self { steps: p.steps })
    }
}

/// One instruction of a `script` program.
#[derive(Debug, Deserialize, Serialize)]
#[serde(untagged, deny_unknown_fields)]
pub enum ScriptStep {
    /// `{"work_ms": N, "deferred": bool}`: a replay-safe step taking N ms of wall time,
    /// durable before the next step starts; `deferred: true` makes it a
    /// [`JobContext::deferred_step`] (re-run after a crash until a durable write carries it).
    Work {
        work_ms: u64,
        #[serde(default)]
        deferred: bool,
    },
    /// `{"tool": "ledger", "replay": "safe"|"unsafe", "label": "…", "after_ms": N,
    /// "reconcile": bool}`: a side effect (a row in `ledger_effects`). The safe variant is
    /// idempotent on the step's key, the unsafe one inserts every time it runs. `after_ms`:
    /// the call takes N ms more after its effect happened. `reconcile`: recovery may ask the
    /// ledger whether the effect happened.
    Tool {
        tool: ToolName,
        replay: ReplayName,
        label: String,
        #[serde(default)]
        after_ms: u64,
        #[serde(default)]
        reconcile: bool,
    },
    /// `{"model": "prompt"}`: a model step.
    Model { model: String },
    /// `{"sleep_ms": N}`: a durable sleep (the operation parks as `sleeping`).
    Sleep { sleep_ms: u64 },
    /// `{"wait_signal": "name", "timeout_ms": N, "on_timeout": "fail"|"continue"}`: waits for a
    /// signal (the operation parks as `waiting`). A payload with `"approved": false` fails the
    /// operation as non-retryable with the reviewer's reason; a timeout fails it too unless
    /// `on_timeout` is `continue`.
    WaitSignal {
        wait_signal: String,
        timeout_ms: u64,
        #[serde(default)]
        on_timeout: OnTimeout,
    },
    /// `{"fail": "retryable"|"non_retryable"|"overloaded", "times": N, "not_before_ms": M}`:
    /// fails the first N runs of the operation; a retryable failure may say "not before M ms
    /// from now".
    Fail {
        fail: FailClass,
        times: i32,
        #[serde(default)]
        not_before_ms: Option<u64>,
    },
    /// `{"panic": true, "times": N}`: panics on the first N runs (every run without `times`).
    Panic {
        panic: bool,
        #[serde(default)]
        times: Option<i32>,
    },
}

/// Tools a script may call.
#[derive(Debug, Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum ToolName {
    Ledger,
}

/// `safe` or `unsafe`.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ReplayName {
    Safe,
    Unsafe,
}

/// What a script's wait does when its timeout passes first.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, Default, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    #[default]
    Fail,
    Continue,
}

/// Failure classes a script can simulate.
#[derive(Debug, Deserialize, Serialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub enum FailClass {
    Retryable,
    NonRetryable,
    Overloaded,
}

/// Runs a script; the output lists each step's output.
pub async fn script(ctx: JobContext, input: ScriptInput) -> Result<Value, JobError> {
    let mut outputs = Vec::with_capacity(input.steps.len());
    // "The first N runs": every claim of the operation is a run (its epoch), whether it was
    // an attempt that counted or an overload park that gave the attempt back.
    let attempt = ctx.info().epoch as i32;
    for step in input.steps {
        let out = match step {
            ScriptStep::Work { work_ms, deferred } => {
                let work = |_key| async move {
                    // A timer rounds up to the next millisecond tick: 0 ms only yields.
                    if work_ms == 0 {
                        tokio::task::yield_now().await;
                    } else {
                        tokio::time::sleep(Duration::from_millis(work_ms)).await;
                    }
                    Ok(json!({ "worked_ms": work_ms }))
                };
                if deferred {
                    ctx.deferred_step("work", work).await?
                } else {
                    ctx.step("work", Replay::Safe, work).await?
                }
            }
            ScriptStep::Tool {
                tool: ToolName::Ledger,
                replay,
                label,
                after_ms,
                reconcile,
            } => {
                let ledger = Ledger {
                    pool: ctx.pool().clone(),
                    op_id: ctx.info().op_id.0,
                    name: format!("ledger:{label}"),
                    label,
                    replay: if replay == ReplayName::Safe {
                        Replay::Safe
                    } else {
                        Replay::Unsafe
                    },
                    after_ms,
                    reconcile,
                    approval: false,
                };
                ctx.tool(&ledger, json!({})).await?
            }
            ScriptStep::Model { model } => {
                let answer = ctx.model("model", ModelRequest::user(model)).await?;
                json!({ "text": answer.content })
            }
            ScriptStep::Sleep { sleep_ms } => {
                ctx.sleep(Duration::from_millis(sleep_ms)).await?;
                json!({ "slept_ms": sleep_ms })
            }
            ScriptStep::WaitSignal {
                wait_signal,
                timeout_ms,
                on_timeout,
            } => match ctx
                .wait_for_signal(&wait_signal, Duration::from_millis(timeout_ms))
                .await?
            {
                SignalOutcome::Received { payload, sent_by } => {
                    if payload.get("approved").and_then(Value::as_bool) == Some(false) {
                        let by = payload
                            .get("by")
                            .and_then(Value::as_str)
                            .or(sent_by.as_deref())
                            .unwrap_or("a reviewer");
                        let reason = payload
                            .get("reason")
                            .and_then(Value::as_str)
                            .unwrap_or("no reason given");
                        return Err(JobError::NonRetryable(format!(
                            "rejected by {by}: {reason}"
                        )));
                    }
                    json!({ "signal": wait_signal, "payload": payload })
                }
                SignalOutcome::TimedOut if on_timeout == OnTimeout::Continue => {
                    json!({ "signal": wait_signal, "timed_out": true })
                }
                SignalOutcome::TimedOut => {
                    return Err(JobError::NonRetryable(format!(
                        "no {wait_signal:?} signal arrived within {timeout_ms} ms"
                    )));
                }
            },
            ScriptStep::Fail {
                fail,
                times,
                not_before_ms,
            } => {
                ctx.step("fail", Replay::Safe, |_key| async move {
                    if attempt > times {
                        return Ok(json!({ "failed_attempts": times }));
                    }
                    let message = format!("scripted failure on run {attempt} of the first {times}");
                    let not_before = not_before_ms
                        .map(|ms| chrono::Utc::now() + chrono::Duration::milliseconds(ms as i64));
                    Err(match fail {
                        FailClass::Retryable => JobError::Retryable {
                            message,
                            not_before,
                        },
                        FailClass::Overloaded => JobError::Overloaded {
                            message,
                            not_before,
                        },
                        FailClass::NonRetryable => JobError::NonRetryable(message),
                    })
                })
                .await?
            }
            ScriptStep::Panic { panic, times } => {
                if panic && times.is_none_or(|t| attempt <= t) {
                    panic!("scripted panic on run {attempt}");
                }
                json!({ "panicked": false })
            }
        };
        outputs.push(out);
    }
    Ok(json!({ "steps": outputs.len(), "outputs": outputs }))
}

/// The `ledger` tool: a stand-in for an outside system with side effects.
struct Ledger {
    pool: PgPool,
    op_id: Uuid,
    name: String,
    /// The effect's label; the agent's model passes it as the `label` argument instead.
    label: String,
    replay: Replay,
    after_ms: u64,
    reconcile: bool,
    approval: bool,
}

#[async_trait]
impl Tool for Ledger {
    fn name(&self) -> &str {
        &self.name
    }

    fn replay(&self) -> Replay {
        self.replay
    }

    fn description(&self) -> &str {
        "Record a side effect in the ledger (like sending an email or charging a card)."
    }

    fn parameters(&self) -> Value {
        json!({ "type": "object", "properties": { "label": { "type": "string" } }, "required": ["label"] })
    }

    fn requires_approval(&self) -> bool {
        self.approval
    }

    async fn call(&self, args: &Value, key: &str) -> Result<Value, JobError> {
        let label = args
            .get("label")
            .and_then(Value::as_str)
            .unwrap_or(&self.label);
        let id = agentq_core::db::ledger::record_effect(
            &self.pool,
            self.op_id,
            label,
            key,
            self.replay == Replay::Safe,
        )
        .await
        .map_err(ledger_error)?;
        // The effect has happened; its answer takes a while to arrive.
        tokio::time::sleep(Duration::from_millis(self.after_ms)).await;
        Ok(json!({ "effect_id": id }))
    }

    async fn reconcile(&self, _args: &Value, key: &str) -> Result<Reconciled, JobError> {
        if !self.reconcile {
            return Ok(Reconciled::Unsupported);
        }
        let found = agentq_core::db::ledger::find_effect(&self.pool, key)
            .await
            .map_err(|e| JobError::retryable(format!("ledger unavailable: {e}")))?;
        Ok(match found {
            Some(id) => Reconciled::Happened(json!({ "effect_id": id })),
            None => Reconciled::NotHappened,
        })
    }
}

/// How a failed ledger write fails the call. No connection to send it on, or PostgreSQL
/// rejecting the statement, means the effect did not happen. A connection lost after the
/// statement was sent leaves it unknown (it may have committed), and so does a server shutting
/// down (SQLSTATE class 57: the session may be ended just after the commit).
fn ledger_error(e: agentq_core::db::Error) -> JobError {
    use agentq_core::db::Error;
    let message = format!("ledger unavailable: {e}");
    let no_effect = match &e {
        Error::Sqlx(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) => true,
        Error::Sqlx(sqlx::Error::Database(db)) => !db
            .code()
            .is_some_and(|c| c.starts_with("57") || c.starts_with("08")),
        _ => false,
    };
    if no_effect {
        JobError::no_effect(message)
    } else {
        JobError::retryable(message)
    }
}

/// Input of `agent`.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentInput {
    #[serde(default = "default_system")]
    pub system: String,
    pub user: String,
    /// Built-in tools it may use.
    #[serde(default)]
    pub tools: Vec<AgentTool>,
    /// Tools whose every call waits for an `approval` signal first.
    #[serde(default)]
    pub approval: Vec<AgentTool>,
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// Seconds an approval may take (default 72 h, at most [`agentq_worker::context::MAX_PARK`]).
    #[serde(
        default = "default_approval_timeout",
        deserialize_with = "approval_timeout"
    )]
    pub approval_timeout_s: u64,
}

/// The built-in tools of the `agent` kind.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum AgentTool {
    KvPut,
    KvGet,
    Ledger,
    HttpGet,
}

fn default_system() -> String {
    "You are a careful assistant. Use the tools when they help, then answer.".into()
}

fn default_max_turns() -> u32 {
    8
}

fn default_approval_timeout() -> u64 {
    72 * 3600
}

fn approval_timeout<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let secs = u64::deserialize(d)?;
    check_park("approval_timeout_s", Duration::from_secs(secs))
        .map_err(serde::de::Error::custom)?;
    Ok(secs)
}

/// Runs the agent loop with the built-in tools the input names.
pub async fn agent(
    ctx: JobContext,
    input: AgentInput,
) -> Result<agentq_worker::agent::AgentOutcome, JobError> {
    let mut tools: Vec<std::sync::Arc<dyn Tool>> = Vec::new();
    for name in &input.tools {
        let approval = input.approval.contains(name);
        let tool: std::sync::Arc<dyn Tool> = match name {
            AgentTool::KvPut | AgentTool::KvGet => std::sync::Arc::new(Kv {
                pool: ctx.pool().clone(),
                tenant: ctx.info().tenant.clone(),
                put: *name == AgentTool::KvPut,
                approval,
            }),
            AgentTool::Ledger => std::sync::Arc::new(Ledger {
                pool: ctx.pool().clone(),
                op_id: ctx.info().op_id.0,
                name: "ledger".into(),
                label: "agent".into(),
                replay: Replay::Unsafe,
                after_ms: 0,
                reconcile: true,
                approval,
            }),
            AgentTool::HttpGet => std::sync::Arc::new(HttpGet {
                allow: ctx.http_allow(),
                approval,
            }),
        };
        tools.push(tool);
    }
    ctx.agent(agentq_worker::agent::AgentSpec {
        system: input.system,
        messages: vec![agentq_worker::model::Message::text(
            agentq_worker::model::Role::User,
            input.user,
        )],
        tools,
        max_turns: input.max_turns,
        approval_timeout: Duration::from_secs(input.approval_timeout_s),
        model: None,
    })
    .await
}

/// Largest body `http_get` hands to the model.
const HTTP_GET_CAP: usize = 64 * 1024;

/// The `http_get` tool: GET a URL of an allowed origin (`AGENTQ_AGENT_HTTP_ALLOW`), body
/// capped at 64 KiB while it streams, no redirects. Replay-safe (a GET).
struct HttpGet {
    allow: std::sync::Arc<crate::outbound::Origins>,
    approval: bool,
}

#[async_trait]
impl Tool for HttpGet {
    fn name(&self) -> &str {
        "http_get"
    }

    fn replay(&self) -> Replay {
        Replay::Safe
    }

    fn description(&self) -> &str {
        "Fetch a URL (GET) from an allow-listed host; returns the status and the start of the body."
    }

    fn parameters(&self) -> Value {
        json!({ "type": "object", "properties": { "url": { "type": "string" } }, "required": ["url"] })
    }

    fn requires_approval(&self) -> bool {
        self.approval
    }

    async fn call(&self, args: &Value, _key: &str) -> Result<Value, JobError> {
        let url = args
            .get("url")
            .and_then(Value::as_str)
            .ok_or_else(|| JobError::NonRetryable("`url` (a string) is required".into()))?;
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| JobError::NonRetryable(format!("{url:?} is not a URL: {e}")))?;
        let host = parsed.host_str().unwrap_or_default().to_string();
        self.allow
            .check(&parsed)
            .map_err(|why| JobError::NonRetryable(format!("http_get refused {url:?}: {why}")))?;
        let client = crate::outbound::Client::new(Duration::from_secs(20), None)
            .map_err(|e| JobError::retryable(format!("http client: {e}")))?;
        let response = client.send(client.get(parsed)).await.map_err(|e| match e {
            // Where the name leads is the operator's to change, not a retry's.
            crate::outbound::Error::Refused(why) | crate::outbound::Error::UnapprovedPeer(why) => {
                JobError::NonRetryable(format!("http_get refused: {why}"))
            }
            crate::outbound::Error::Http(_) => {
                JobError::retryable(format!("fetching from {host} failed"))
            }
        })?;
        let status = response.status().as_u16();
        let (bytes, truncated) = crate::outbound::read_capped(response, HTTP_GET_CAP)
            .await
            .map_err(|_| JobError::retryable(format!("reading from {host} failed")))?;
        let body = String::from_utf8_lossy(&bytes).into_owned();
        Ok(json!({ "status": status, "body": body, "truncated": truncated }))
    }
}

/// The `kv_put` / `kv_get` tools: a key-value table per tenant. Both are replay-safe (an upsert
/// and a read).
struct Kv {
    pool: PgPool,
    tenant: String,
    put: bool,
    approval: bool,
}

#[async_trait]
impl Tool for Kv {
    fn name(&self) -> &str {
        if self.put { "kv_put" } else { "kv_get" }
    }

    fn replay(&self) -> Replay {
        Replay::Safe
    }

    fn description(&self) -> &str {
        if self.put {
            "Store a JSON value under a key."
        } else {
            "Read the JSON value stored under a key (null if none)."
        }
    }

    fn parameters(&self) -> Value {
        if self.put {
            json!({ "type": "object", "properties": { "key": { "type": "string" }, "value": {} }, "required": ["key", "value"] })
        } else {
            json!({ "type": "object", "properties": { "key": { "type": "string" } }, "required": ["key"] })
        }
    }

    fn requires_approval(&self) -> bool {
        self.approval
    }

    async fn call(&self, args: &Value, _key: &str) -> Result<Value, JobError> {
        let key = args
            .get("key")
            .and_then(Value::as_str)
            .ok_or_else(|| JobError::NonRetryable("`key` (a string) is required".into()))?;
        let unavailable =
            |e: agentq_core::db::Error| JobError::retryable(format!("kv unavailable: {e}"));
        if self.put {
            let value = args.get("value").cloned().unwrap_or(Value::Null);
            agentq_core::db::kv::put(&self.pool, &self.tenant, key, &value)
                .await
                .map_err(unavailable)?;
            Ok(json!({ "ok": true }))
        } else {
            let value = agentq_core::db::kv::get(&self.pool, &self.tenant, key)
                .await
                .map_err(unavailable)?;
            Ok(json!({ "value": value }))
        }
    }
}

/// Registers the built-in kinds (`echo`, `script`, `agent`, `triage`, `doc_migration`) in `r`,
/// next to a deployment's own kinds.
pub fn register_builtin(r: &mut Registry) {
    r.register("echo", echo);
    r.register("script", script);
    r.register("agent", agent);
    // triage's configuration comes from its webhook source: a producer cannot supply one.
    r.register_requiring("triage", triage::triage, |_| Requires {
        webhook_only: true,
        ..Requires::default()
    });
    r.register_requiring(
        "doc_migration",
        doc_migration::doc_migration,
        doc_migration::requires,
    );
}

/// A registry holding the built-in kinds only: what `agentq worker` runs and what producers
/// check inputs against.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    register_builtin(&mut r);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_error_says_whether_the_effect_may_have_happened() {
        use agentq_core::db::Error;
        let never_sent = ledger_error(Error::Sqlx(sqlx::Error::PoolTimedOut));
        assert!(
            matches!(never_sent, JobError::NoEffect(_)),
            "{never_sent:?}"
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let answer_lost = ledger_error(Error::Sqlx(sqlx::Error::Io(reset)));
        assert!(
            matches!(answer_lost, JobError::Retryable { .. }),
            "{answer_lost:?}"
        );
    }

    #[test]
    fn script_inputs_are_checked_before_anything_runs() {
        let r = registry();
        assert!(
            r.check_input("script", &json!({ "steps": [{ "work_ms": 5 }] }))
                .is_ok()
        );
        assert!(
            r.check_input(
                "script",
                &json!({ "steps": [{ "work_ms": 5, "bogus": 1 }] })
            )
            .is_err()
        );
        assert!(
            r.check_input(
                "script",
                &json!({ "steps": [{ "tool": "ledger", "replay": "maybe", "label": "x" }] })
            )
            .is_err()
        );
        assert!(
            r.check_input("script", &json!({ "steps": [{ "sleep": 5 }] }))
                .is_err()
        );
        assert!(
            r.check_input("agent", &json!({ "user": "hi", "tools": ["kv_put"] }))
                .is_ok()
        );
        assert!(
            r.check_input("agent", &json!({ "tools": ["kv_put"] }))
                .is_err(),
            "user is required"
        );
        assert!(
            r.check_input("agent", &json!({ "user": "hi", "tools": ["rm_rf"] }))
                .is_err()
        );
    }
}
