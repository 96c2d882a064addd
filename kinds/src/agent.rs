//! The `agent` kind: the worker's agent loop ([`JobContext::agent`]) from JSON
//! ([`AgentInput`]), with the built-in tools `kv_put`, `kv_get`, `ledger` and `http_get`, any of
//! them behind a human's approval.

use std::sync::Arc;
use std::time::Duration;

use agentq_worker::agent::{AgentOutcome, AgentSpec};
use agentq_worker::context::check_park;
use agentq_worker::model::{Message, Role};
use agentq_worker::{JobContext, JobError, Replay, Tool};
use serde::{Deserialize, Serialize};

use crate::tools::{HttpGet, Kv, Ledger};

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
    /// Seconds an approval may take (default 72 h, at most
    /// [`MAX_PARK`](agentq_worker::context::MAX_PARK)).
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
    })
    .await
}
