//! What a person decides on: the pending decision of a waiting operation (the signal it waits
//! for, when the wait times out, what the job said it needs and, for the built-in agent's
//! approval-gated tools, the tool call: tool, arguments and the model turn's text), and an
//! operation shown with it and, for an operator, with its input (the read audited). One
//! function each, used by `agentq status`, `GET /v1/operations/{id}`, the console's approvals
//! and operation pages and the event stream; every one of them redacts the keys of
//! `AGENTQ_CONSOLE_REDACT` ([`crate::Settings::redact`]) with [`crate::redact`].

use std::collections::HashMap;

use agentq_core::approval;
use agentq_core::db::{self, console, steps};
use agentq_core::operation::{OperationId, OperationView};
use agentq_core::state::Status;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::redact::redact;
use crate::{App, AppError, Caller, Result, Role};

/// A pending tool call of the built-in agent, waiting for an approval.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct ToolCall {
    /// The tool the model asked for.
    pub tool: String,
    /// Its arguments (keys of `AGENTQ_CONSOLE_REDACT` shown as `[redacted]`).
    pub arguments: Value,
    /// The text of the model turn that asked for the call (may be empty).
    pub text: String,
}

/// What a waiting operation waits for, as the person deciding sees it.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Pending {
    /// The signal it waits for (`approval` for an approval).
    pub signal: String,
    /// The wait's step in the journal.
    pub step: i32,
    /// When the wait times out.
    pub timeout_at: DateTime<Utc>,
    /// What the job said it needs (`ctx.wait_for_signal_about`), redacted; null when it said
    /// nothing.
    pub about: Option<Value>,
    /// For the built-in agent's approval-gated tools: the call waiting for the approval.
    pub tool_call: Option<ToolCall>,
}

impl Pending {
    /// The decision of one wait, its `about` redacted with `keys`.
    fn of(w: steps::PendingWait, keys: &[String]) -> Self {
        let about = approval::about_of(w.output.as_ref()).cloned().map(|mut a| {
            redact(&mut a, keys);
            a
        });
        let tool_call = about
            .as_ref()
            .filter(|_| w.signal == approval::SIGNAL)
            .and_then(|a| {
                Some(ToolCall {
                    tool: a.get("tool")?.as_str()?.to_string(),
                    arguments: a.get("arguments").cloned().unwrap_or(Value::Null),
                    text: a
                        .get("text")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                })
            });
        Pending {
            signal: w.signal,
            step: w.seq,
            timeout_at: w.timeout_at,
            about,
            tool_call,
        }
    }
}

/// The pending decisions of the operations `ids` (already found in the caller's scope), by
/// operation: those waiting for a signal whose wait step is recorded.
pub async fn pending_of(app: &App, ids: &[Uuid]) -> Result<HashMap<Uuid, Pending>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let waits = db::within(steps::pending_waits(&app.pool, ids)).await?;
    Ok(waits
        .into_iter()
        .map(|w| (w.op_id, Pending::of(w, &app.settings.redact)))
        .collect())
}

/// The pending decision of `view` (an operation found in the caller's scope): `None` unless it
/// waits for a signal.
pub async fn pending(app: &App, view: &OperationView) -> Result<Option<Pending>> {
    if view.status != Status::Waiting || view.waiting_for.is_none() {
        return Ok(None);
    }
    Ok(pending_of(app, &[view.op_id.0])
        .await?
        .remove(&view.op_id.0))
}

/// The payloads of `operation` (found in the caller's scope) for an operator: the read is
/// audited as `reveal_payloads` under the caller's name, with `via` (`console`, `api`, `cli`),
/// before it is made; keys of `AGENTQ_CONSOLE_REDACT` are redacted.
pub async fn reveal(
    app: &App,
    caller: &Caller,
    operation: &OperationView,
    via: &str,
) -> Result<Option<console::Payloads>> {
    caller.require(Role::Operator)?;
    let (pool, op) = (&app.pool, operation.op_id.0);
    console::audit_reveal(pool, op, &caller.actor, operation.status.as_str(), via).await?;
    let mut payloads = console::payloads(pool, op, caller.scope()).await?;
    if let Some(p) = &mut payloads {
        let keys = &app.settings.redact;
        redact(&mut p.input, keys);
        if let Some(r) = &mut p.result {
            redact(r, keys);
        }
    }
    Ok(payloads)
}

/// What to show of an operation besides its row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Include {
    /// Its input: an operator's, audited as a read.
    pub input: bool,
}

/// The values `include` takes.
pub const INCLUDES: [&str; 2] = ["input", "result"];

impl Include {
    /// Parses `include` (`input`, `result`, comma-separated; the result is always shown).
    pub fn parse(list: Option<&str>) -> Result<Self> {
        let mut include = Include::default();
        for part in list.unwrap_or_default().split(',').map(str::trim) {
            match part {
                "" | "result" => {}
                "input" => include.input = true,
                other => {
                    return Err(AppError::malformed(
                        "include",
                        format!(
                            "{other:?} is not something an operation can include: use {}",
                            INCLUDES.join(" or ")
                        ),
                    ));
                }
            }
        }
        Ok(include)
    }
}

/// An operation as `agentq status` and `GET /v1/operations/{id}` show it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[schemars(rename = "OperationDetail")]
pub struct Shown {
    #[serde(flatten)]
    pub operation: OperationView,
    /// What it waits for, when it waits for a signal (null otherwise).
    pub waiting: Option<Pending>,
    /// Its input, when asked for (`include=input`, `--show-input`; an operator's, audited),
    /// keys of `AGENTQ_CONSOLE_REDACT` shown as `[redacted]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<Value>,
    /// The token budgets over it: its own, then its batch's (none: no field).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<agentq_core::db::budgets::BudgetView>,
}

/// The operation `op` in the caller's scope, with its pending decision and, with
/// `include.input`, its input: that needs an operator (a producer is refused, nothing read)
/// and the read is audited as `reveal_payloads` through `via` before it is made.
pub async fn show(
    app: &App,
    caller: &Caller,
    op: OperationId,
    include: Include,
    via: &str,
) -> Result<Shown> {
    if include.input {
        caller.require(Role::Operator).map_err(|_| {
            AppError::Forbidden(
                "reading an operation's input needs an operator or admin token (this one is a \
                 producer's); nothing was read"
                    .into(),
            )
        })?;
    }
    let operation = crate::operations::find(app, caller, op).await?;
    let waiting = pending(app, &operation).await?;
    let input = if include.input {
        reveal(app, caller, &operation, via).await?.map(|p| p.input)
    } else {
        None
    };
    let budgets = agentq_core::db::budgets::over(&app.pool, op.0).await?;
    Ok(Shown {
        operation,
        waiting,
        input,
        budgets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_takes_input_and_result_and_names_anything_else() {
        assert_eq!(Include::parse(None).unwrap(), Include::default());
        assert!(Include::parse(Some("input,result")).unwrap().input);
        let e = Include::parse(Some("secrets")).unwrap_err().to_string();
        assert!(
            e.contains("\"secrets\"") && e.contains("input or result"),
            "{e}"
        );
    }

    #[test]
    fn an_agents_approval_reads_as_its_tool_call_redacted() {
        let about = approval::tool_call_about(
            "kv_put",
            &serde_json::json!({ "key": "k", "api_key": "sk-1" }),
            "I will save it",
        );
        let w = steps::PendingWait {
            op_id: Uuid::nil(),
            seq: 3,
            signal: "approval".into(),
            timeout_at: Utc::now(),
            output: approval::about_output(about),
        };
        let p = Pending::of(w.clone(), &["api_key".to_string()]);
        let call = p.tool_call.unwrap();
        assert_eq!(call.tool, "kv_put");
        assert_eq!(call.arguments["api_key"], "[redacted]");
        assert_eq!(call.text, "I will save it");
        assert_eq!(p.about.unwrap()["arguments"]["api_key"], "[redacted]");
        let other = Pending::of(
            steps::PendingWait {
                signal: "review".into(),
                ..w
            },
            &[],
        );
        assert!(other.tool_call.is_none() && other.about.is_some());
    }
}
