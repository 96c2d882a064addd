//! The `script` kind: a small JSON program for demos, smoke tests, benchmarks and crash tests
//! (its format is in docs/kinds.md and on [`ScriptStep`]): work, `ledger` tool calls, model calls,
//! sleeps, waits for signals, and scripted failures and panics.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::BoxFuture;

use agentq_worker::model::ModelRequest;
use agentq_worker::{JobContext, JobError, Replay, SignalOutcome};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::tools::Ledger;

mod decode;

/// Input of `script`: the steps to run, in order. Every step is checked as it is read (see
/// [`ScriptStep`]'s `Deserialize`): a refusal names the step and the field.
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScriptInput {
    pub steps: Vec<ScriptStep>,
    /// The program of other "builds" of the script's code, for tests of code changes: a worker
    /// runs `variants[AGENTQ_SCRIPT_VARIANT]` when that variable names one, else
    /// `variants[<the version the operation runs on>]` when there is one, else `steps`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub variants: BTreeMap<String, Vec<ScriptStep>>,
}

/// Test hook: the variant of its input a `script` worker runs (see [`ScriptInput::variants`]).
pub const VARIANT_VAR: &str = "AGENTQ_SCRIPT_VARIANT";

/// The longest a script step may hold its worker slot (`work_ms`, a ledger call's `after_ms`):
/// one hour. A script is for tests and demos; a longer step would only hold a slot. Sleeps and
/// waits are at most [`MAX_PARK`](agentq_worker::context::MAX_PARK). Both are checked when
/// the input is read, naming the field.
pub const MAX_STEP_MS: u64 = 3_600_000;

/// One instruction of a `script` program: an object whose key says which (`work_ms`, `tool`,
/// `model`, `sleep_ms`, `wait_signal`, `fail`, `panic`, `spawn`, `join`, `patched`). It is read
/// by that key (`decode`), so a refusal says what the step lacks or has too much of; the
/// `serde` attributes below shape its serialization and JSON Schema.
#[derive(Debug, Serialize, schemars::JsonSchema)]
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
    /// `{"spawn": "kind", "input": …}`: starts a child operation ([`JobContext::spawn`]);
    /// its output names the child.
    Spawn { spawn: String, input: Value },
    /// `{"join": true}`: waits for every child spawned since the last join
    /// ([`JobContext::join`]); its output lists how each ended.
    Join { join: bool },
    /// `{"patched": "change-id", "then": [steps], "else": [steps]}`: runs `then` where
    /// [`JobContext::patched`] says the change applies, `else` where the operation's journal
    /// was recorded before it.
    Patched {
        patched: String,
        then: Vec<ScriptStep>,
        #[serde(default, rename = "else")]
        otherwise: Vec<ScriptStep>,
    },
}

/// Tools a script may call.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolName {
    Ledger,
}

/// `safe` or `unsafe`.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReplayName {
    Safe,
    Unsafe,
}

/// What a script's wait does when its timeout passes first.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    #[default]
    Fail,
    Continue,
}

/// Failure classes a script can simulate.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailClass {
    Retryable,
    NonRetryable,
    Overloaded,
}

/// Runs a script; the output lists each step's output (a patched step's, then its branch's).
pub async fn script(ctx: JobContext, input: ScriptInput) -> Result<Value, JobError> {
    let ScriptInput {
        steps,
        mut variants,
    } = input;
    let variant = std::env::var(VARIANT_VAR)
        .ok()
        .filter(|v| variants.contains_key(v))
        .unwrap_or_else(|| ctx.info().version.clone());
    let steps = variants.remove(&variant).unwrap_or(steps);
    let mut outputs = Vec::with_capacity(steps.len());
    run_steps(&ctx, steps, &mut outputs, &mut Vec::new()).await?;
    Ok(json!({ "steps": outputs.len(), "outputs": outputs }))
}

/// Runs `steps` in order, pushing each one's output; `spawned` holds the children spawned
/// since the last join.
fn run_steps<'a>(
    ctx: &'a JobContext,
    steps: Vec<ScriptStep>,
    outputs: &'a mut Vec<Value>,
    spawned: &'a mut Vec<uuid::Uuid>,
) -> BoxFuture<'a, Result<(), JobError>> {
    Box::pin(async move {
        for step in steps {
            match step {
                ScriptStep::Spawn { spawn, input } => {
                    let child = ctx.spawn(&spawn, input).await?;
                    spawned.push(child);
                    outputs.push(json!({ "spawned": child }));
                    continue;
                }
                ScriptStep::Join { join: true } => {
                    let children = ctx.join(spawned).await?;
                    spawned.clear();
                    outputs.push(json!({ "children": children }));
                    continue;
                }
                _ => {}
            }
            if let ScriptStep::Patched {
                patched,
                then,
                otherwise,
            } = step
            {
                let applies = ctx.patched(&patched)?;
                outputs.push(json!({ "patched": patched, "applies": applies }));
                run_steps(
                    ctx,
                    if applies { then } else { otherwise },
                    outputs,
                    spawned,
                )
                .await?;
                continue;
            }
            outputs.push(run_step(ctx, step).await?);
        }
        Ok(())
    })
}

/// Runs one step of a script.
async fn run_step(ctx: &JobContext, step: ScriptStep) -> Result<Value, JobError> {
    // "The first N runs": every claim of the operation is a run (its epoch), whether it was
    // an attempt that counted or an overload park that gave the attempt back.
    let attempt = ctx.info().epoch as i32;
    let out = match step {
        ScriptStep::Work { work_ms, deferred } => {
            let work = || async move {
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
                ctx.step("work", work).await?
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
                name: format!("ledger:{label}"),
                label,
                replay: if replay == ReplayName::Safe {
                    Replay::Safe
                } else {
                    Replay::Unsafe
                },
                after_ms,
                reconcile,
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
            .wait_for_signal_about(
                &wait_signal,
                Duration::from_millis(timeout_ms),
                json!({
                    "needs": format!("a {wait_signal:?} signal"),
                    "on_timeout": match on_timeout {
                        OnTimeout::Fail => "the operation fails",
                        OnTimeout::Continue => "the script goes on",
                    },
                }),
            )
            .await?
        {
            SignalOutcome::Received { payload, sent_by } => {
                let decision = agentq_core::approval::Decision::read(&payload);
                if decision.is_rejected() {
                    return Err(JobError::NonRetryable(decision.refusal(sent_by.as_deref())));
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
            ctx.step("fail", || async move {
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
                    FailClass::Overloaded => JobError::overloaded(message, not_before),
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
        ScriptStep::Join { join: false } => json!({ "joined": false }),
        ScriptStep::Patched { .. } | ScriptStep::Spawn { .. } | ScriptStep::Join { .. } => {
            unreachable!("run_steps runs patched, spawn and join steps")
        }
    };
    Ok(out)
}
