//! The `agent` kind: the worker's agent loop ([`JobContext::agent`]) from JSON
//! ([`AgentInput`]), with any tools the deployment registered
//! ([`Registry::register_tool`](agentq_worker::registry::Registry::register_tool)): the built-in
//! `kv_put`, `kv_get`, `ledger` and `http_get`, and a deployment's own, any of them behind a
//! human's approval. An input naming a tool nobody registered is refused at enqueue.

use std::sync::Arc;
use std::time::Duration;

use agentq_core::operation::{Requires, ToolRef};
use agentq_worker::agent::{AgentOutcome, AgentSpec};
use agentq_worker::context::check_park_length;
use agentq_worker::model::{Message, Role, ToolChoice};
use agentq_worker::tool::with_approval;
use agentq_worker::{JobContext, JobError, Tool};
use serde::{Deserialize, Serialize};

/// Input of `agent`. A `tool_choice` naming a tool must name one of `tools` (checked when the
/// input is read, so at enqueue).
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, try_from = "Fields")]
pub struct AgentInput {
    #[serde(default = "default_system")]
    pub system: String,
    pub user: String,
    /// The registered tools it may use (`agentq kinds` lists them).
    #[serde(default)]
    pub tools: Vec<String>,
    /// Tools whose every call waits for an `approval` signal first.
    #[serde(default)]
    pub approval: Vec<String>,
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// Seconds an approval may take (default 72 h, at most
    /// [`MAX_PARK`](agentq_worker::context::MAX_PARK)).
    #[serde(
        default = "default_approval_timeout",
        deserialize_with = "approval_timeout"
    )]
    pub approval_timeout_s: u64,
    /// `auto`, `required`, `none` or the name of one of `tools`: the model's `tool_choice`
    /// until it has called a tool (small open models call one only when told to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<AgentToolChoice>,
}

/// What [`AgentInput`] is read from, before the check across its fields.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Fields {
    /// The system message (default: a careful assistant that uses its tools).
    #[serde(default = "default_system")]
    system: String,
    /// The user's message: the task.
    user: String,
    /// The registered tools it may use (`agentq kinds` lists them).
    #[serde(default)]
    tools: Vec<String>,
    /// Tools whose every call waits for an `approval` signal first.
    #[serde(default)]
    approval: Vec<String>,
    /// Model turns before the operation fails (default 8).
    #[serde(default = "default_max_turns")]
    max_turns: u32,
    /// Seconds an approval may take (default 72 h, at most 100 years); a call not approved in
    /// time is reported to the model as refused.
    #[serde(
        default = "default_approval_timeout",
        deserialize_with = "approval_timeout"
    )]
    approval_timeout_s: u64,
    /// `auto`, `required`, `none` or the name of one of `tools`: the model's `tool_choice`
    /// until it has called a tool.
    #[serde(default)]
    tool_choice: Option<AgentToolChoice>,
}

impl TryFrom<Fields> for AgentInput {
    type Error = String;

    fn try_from(f: Fields) -> Result<Self, String> {
        if let Some(AgentToolChoice::Tool(t)) = &f.tool_choice
            && !f.tools.contains(t)
        {
            return Err(format!(
                "tool_choice names {t:?}, which is not one of tools {:?}: add it to tools",
                f.tools
            ));
        }
        Ok(AgentInput {
            system: f.system,
            user: f.user,
            tools: f.tools,
            approval: f.approval,
            max_turns: f.max_turns,
            approval_timeout_s: f.approval_timeout_s,
            tool_choice: f.tool_choice,
        })
    }
}

/// The `tool_choice` of an [`AgentInput`]: a string, one of the modes or else a tool's name.
#[derive(Debug, Serialize, Clone, PartialEq, schemars::JsonSchema)]
#[serde(untagged)]
pub enum AgentToolChoice {
    Mode(ChoiceMode),
    Tool(String),
}

impl<'de> Deserialize<'de> for AgentToolChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Choice;
        impl serde::de::Visitor<'_> for Choice {
            type Value = AgentToolChoice;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"auto\", \"required\", \"none\" or the name of one of tools")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<AgentToolChoice, E> {
                Ok(match s {
                    "auto" => AgentToolChoice::Mode(ChoiceMode::Auto),
                    "required" => AgentToolChoice::Mode(ChoiceMode::Required),
                    "none" => AgentToolChoice::Mode(ChoiceMode::None),
                    tool => AgentToolChoice::Tool(tool.to_string()),
                })
            }
        }
        d.deserialize_str(Choice)
    }
}

/// `tool_choice` modes.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChoiceMode {
    Auto,
    Required,
    None,
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
    check_park_length(Duration::from_secs(secs)).map_err(serde::de::Error::custom)?;
    Ok(secs)
}

/// What an agent input needs beyond its shape: every tool it names registered.
pub fn requires(input: &AgentInput) -> Requires {
    let named = |list: &'static str, names: &[String]| {
        names
            .iter()
            .enumerate()
            .map(move |(i, name)| ToolRef {
                pointer: format!("/{list}/{i}"),
                name: name.clone(),
            })
            .collect::<Vec<_>>()
    };
    let mut tools = named("tools", &input.tools);
    tools.extend(named("approval", &input.approval));
    Requires {
        tools,
        ..Requires::default()
    }
}

/// Runs the agent loop with the registered tools the input names.
pub async fn agent(ctx: JobContext, input: AgentInput) -> Result<AgentOutcome, JobError> {
    let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
    for name in &input.tools {
        let tool = ctx.registered_tool(name).ok_or_else(|| {
            JobError::NonRetryable(format!(
                "tool {name:?} is not registered on this worker: deploy a worker whose binary \
                 registers it, then `agentq dlq retry` this operation"
            ))
        })?;
        tools.push(if input.approval.contains(name) {
            with_approval(tool)
        } else {
            tool
        });
    }
    ctx.agent(AgentSpec {
        system: input.system,
        messages: vec![Message::text(Role::User, input.user)],
        tools,
        max_turns: input.max_turns,
        approval_timeout: Duration::from_secs(input.approval_timeout_s),
        model: None,
        tool_choice: input.tool_choice.map(|c| match c {
            AgentToolChoice::Mode(ChoiceMode::Auto) => ToolChoice::Auto,
            AgentToolChoice::Mode(ChoiceMode::Required) => ToolChoice::Required,
            AgentToolChoice::Mode(ChoiceMode::None) => ToolChoice::None,
            AgentToolChoice::Tool(t) => ToolChoice::Tool(t),
        }),
    })
    .await
}
