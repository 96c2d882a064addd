//! The agent loop: model ↔ tool turns until the model answers without a tool call or the turn
//! budget is spent (`ctx.agent`).
//!
//! Everything is a journaled step, so a crash mid-loop resumes at the exact turn: each model
//! turn is a replay-safe model step (its answer, tool calls included, is the journal entry);
//! each tool call is a step through its `Tool` with the tool's replay policy and its own
//! idempotency key; a tool that requires approval first waits for the signal `approval`
//! (holding no worker), stating the tool, its arguments and the turn's text. A rejection, an approval timeout, a bad argument or a tool's
//! non-retryable error is reported back to the model as that tool's result. The transcript is
//! journaled and returned, never logged.

use std::sync::Arc;
use std::time::Duration;

use agentq_core::approval;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::context::{JobContext, SignalOutcome};
use crate::error::JobError;
use crate::model::{Message, ModelRequest, Role, ToolChoice, ToolSpec};
use crate::tool::Tool;

/// What the agent should do.
#[derive(Clone)]
pub struct AgentSpec {
    pub system: String,
    /// The conversation so far (usually one user message).
    pub messages: Vec<Message>,
    pub tools: Vec<Arc<dyn Tool>>,
    /// Model turns allowed before the operation fails.
    pub max_turns: u32,
    /// How long an approval may take before the call is reported to the model as not approved.
    pub approval_timeout: Duration,
    /// Model name for the provider (`None` → the configured one).
    pub model: Option<String>,
    /// The `tool_choice` of the turns until the model has called a tool; later turns leave the
    /// choice to the model (`auto`), so a required tool is called once, not on every turn.
    pub tool_choice: Option<ToolChoice>,
}

/// How the loop ended.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentOutcome {
    pub answer: String,
    pub turns: u32,
    pub tool_calls: u32,
    pub transcript: Vec<Message>,
}

impl JobContext {
    /// Runs the agent loop of `spec` (see the module docs).
    pub async fn agent(&self, spec: AgentSpec) -> Result<AgentOutcome, JobError> {
        let specs: Vec<ToolSpec> = spec
            .tools
            .iter()
            .map(|t| ToolSpec {
                name: t.name().to_string(),
                description: t.description().to_string(),
                parameters: t.parameters(),
            })
            .collect();
        let mut transcript = vec![Message::text(Role::System, spec.system.clone())];
        transcript.extend(spec.messages.iter().cloned());
        let mut calls_made = 0;
        for turn in 0..spec.max_turns {
            let request = ModelRequest {
                model: spec.model.clone(),
                messages: transcript.clone(),
                tools: specs.clone(),
                tool_choice: if calls_made == 0 {
                    spec.tool_choice.clone()
                } else {
                    None
                },
                ..ModelRequest::default()
            };
            let reply = self.model(&format!("turn {turn}"), request).await?;
            transcript.push(Message {
                role: Role::Assistant,
                content: reply.content.clone(),
                tool_calls: reply.tool_calls.clone(),
                tool_call_id: None,
            });
            if reply.tool_calls.is_empty() {
                return Ok(AgentOutcome {
                    answer: reply.content,
                    turns: turn + 1,
                    tool_calls: calls_made,
                    transcript,
                });
            }
            for call in &reply.tool_calls {
                calls_made += 1;
                let result = self
                    .run_tool_call(
                        &spec,
                        &call.function.name,
                        &call.function.arguments,
                        &reply.content,
                    )
                    .await?;
                transcript.push(Message {
                    role: Role::Tool,
                    content: result,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(call.id.clone()),
                });
            }
        }
        Err(JobError::NonRetryable(format!(
            "the agent used its {} turns without a final answer",
            spec.max_turns
        )))
    }

    /// One tool call, as the text the model gets back. `text` is the model turn's text that
    /// asked for it, which an approval's wait states with the tool and its arguments.
    async fn run_tool_call(
        &self,
        spec: &AgentSpec,
        name: &str,
        arguments: &str,
        text: &str,
    ) -> Result<String, JobError> {
        let Some(tool) = spec.tools.iter().find(|t| t.name() == name) else {
            return Ok(json!({ "error": format!("there is no tool named {name:?}") }).to_string());
        };
        let args: Value = match serde_json::from_str(if arguments.trim().is_empty() {
            "{}"
        } else {
            arguments
        }) {
            Ok(v) => v,
            Err(e) => {
                return Ok(
                    json!({ "error": format!("the arguments are not JSON: {e}") }).to_string(),
                );
            }
        };
        if tool.requires_approval() {
            let about = approval::tool_call_about(name, &args, text);
            match self
                .wait_for_signal_about(approval::SIGNAL, spec.approval_timeout, about)
                .await?
            {
                SignalOutcome::Received { payload, sent_by } => {
                    let decision = approval::Decision::read(&payload);
                    if !decision.is_approved() {
                        let refusal = decision.refusal(sent_by.as_deref());
                        return Ok(
                            json!({ "error": format!("the call to {name} was {refusal}") })
                                .to_string(),
                        );
                    }
                }
                SignalOutcome::TimedOut => {
                    return Ok(
                        json!({ "error": format!("the call to {name} was not approved in time") })
                            .to_string(),
                    );
                }
            }
        }
        Ok(self
            .tool_reporting_errors(tool.as_ref(), args)
            .await?
            .to_string())
    }
}
