//! The `agent` kind: the worker's agent loop ([`JobContext::agent`]) from JSON
//! ([`AgentInput`]), with the built-in tools `kv_put`, `kv_get`, `ledger` and `http_get`, any of
//! them behind a human's approval.

use std::sync::Arc;
use std::time::Duration;

use agentq_worker::agent::{AgentOutcome, AgentSpec};
use agentq_worker::context::check_park;
use agentq_worker::model::{Message, Role, ToolChoice};
use agentq_worker::{JobContext, JobError, Replay, Tool};
use serde::{Deserialize, Serialize};

use crate::tools::{HttpGet, Kv, Ledger};

/// Input of `agent`. A `tool_choice` naming a tool must name one of `tools` (checked when the
/// input is read, so at enqueue).
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, try_from = "Fields")]
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
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields {
    #[serde(default = "default_system")]
    system: String,
    user: String,
    #[serde(default)]
    tools: Vec<AgentTool>,
    #[serde(default)]
    approval: Vec<AgentTool>,
    #[serde(default = "default_max_turns")]
    max_turns: u32,
    #[serde(
        default = "default_approval_timeout",
        deserialize_with = "approval_timeout"
    )]
    approval_timeout_s: u64,
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

/// The `tool_choice` of an [`AgentInput`].
#[derive(Debug, Deserialize, Serialize, Clone, Copy, PartialEq)]
#[serde(untagged)]
pub enum AgentToolChoice {
    Mode(ChoiceMode),
    Tool(AgentTool),
}

/// `tool_choice` modes.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum ChoiceMode {
    Auto,
    Required,
    None,
}

impl AgentTool {
    /// The tool's name as the model sees it.
    pub fn name(self) -> &'static str {
        match self {
            AgentTool::KvPut => "kv_put",
            AgentTool::KvGet => "kv_get",
            AgentTool::Ledger => "ledger",
            AgentTool::HttpGet => "http_get",
        }
    }
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
pub async fn agent(ctx: JobContext, input: AgentInput) -> Result<AgentOutcome, JobError> {
    let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
    for name in &input.tools {
        let approval = input.approval.contains(name);
        let tool: Arc<dyn Tool> = match name {
            AgentTool::KvPut | AgentTool::KvGet => Arc::new(Kv {
                pool: ctx.pool().clone(),
                tenant: ctx.info().tenant.clone(),
                put: *name == AgentTool::KvPut,
                approval,
            }),
            AgentTool::Ledger => Arc::new(Ledger {
                pool: ctx.pool().clone(),
                op_id: ctx.info().op_id.0,
                name: "ledger".into(),
                label: "agent".into(),
                replay: Replay::Unsafe,
                after_ms: 0,
                reconcile: true,
                approval,
            }),
            AgentTool::HttpGet => Arc::new(HttpGet {
                allow: ctx.http_allow(),
                approval,
            }),
        };
        tools.push(tool);
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
            AgentToolChoice::Tool(t) => ToolChoice::Tool(t.name().to_string()),
        }),
    })
    .await
}
