//! The model client interface and the built-in deterministic local model.
//!
//! `ModelClient` is shaped after OpenAI-compatible chat completions so the HTTP client of a
//! later issue implements the same trait. Errors are already classified (retryable,
//! overloaded, non-retryable) so the job layer never inspects message text.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::{Engine, JobError};

/// Who said a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// One chat message (OpenAI's shape, so it is sent as is).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(default)]
    pub content: String,
    /// The tools an assistant message asks to call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Which call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message with text only.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A tool call the model asked for (OpenAI's `tool_calls[]` shape).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function half of a tool call: its name and JSON-encoded arguments.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

fn function_type() -> String {
    "function".into()
}

/// A tool offered to the model (sent as `tools: [{"type": "function", "function": …}]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: serde_json::Value,
}

/// A chat completion request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// Model name; `None` → the client's configured default.
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    /// Tools the model may call.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolSpec>,
    /// Whether (and which) tool the model must call; `None` leaves it to the provider's
    /// default (`auto` when tools are offered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
}

/// OpenAI's `tool_choice`: small open models (and some providers) call a tool only when the
/// request requires one or names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// The model must call some tool.
    Required,
    /// The model must not call a tool.
    None,
    /// The model must call this tool.
    Tool(String),
}

impl ToolChoice {
    /// The value of the request's `tool_choice` field.
    pub fn to_openai(&self) -> serde_json::Value {
        match self {
            ToolChoice::Auto => serde_json::json!("auto"),
            ToolChoice::Required => serde_json::json!("required"),
            ToolChoice::None => serde_json::json!("none"),
            ToolChoice::Tool(name) => {
                serde_json::json!({ "type": "function", "function": { "name": name } })
            }
        }
    }
}

impl ModelRequest {
    /// A request with one user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self {
            messages: vec![Message::text(Role::User, text)],
            ..Self::default()
        }
    }
}

/// A prompt is a request with one user message: `ctx.model("draft", prompt)`.
impl From<String> for ModelRequest {
    fn from(prompt: String) -> Self {
        ModelRequest::user(prompt)
    }
}

/// A prompt is a request with one user message: `ctx.model("draft", "Say hello.")`.
impl From<&str> for ModelRequest {
    fn from(prompt: &str) -> Self {
        ModelRequest::user(prompt)
    }
}

/// Token accounting of one call, journaled with the step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The provider said nothing of the tokens (llama.cpp's server, for one, sends no usage in
    /// a stream even when asked to): the zeros above are unknown, not free. Journaled so that
    /// `agentq usage` can say how many calls it could not count.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unreported: bool,
}

impl Usage {
    /// The usage of an answer that carried none.
    pub fn unreported() -> Self {
        Self {
            unreported: true,
            ..Self::default()
        }
    }
}

/// A chat completion answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    pub content: String,
    pub model: String,
    pub finish_reason: String,
    pub usage: Usage,
    /// Tools the model asks to call before it answers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

impl ModelResponse {
    /// A plain answer, as a scripted model in a test gives it
    /// (the replay tester's `ModelScript`).
    pub fn text(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            model: "scripted".into(),
            finish_reason: "stop".into(),
            usage: Usage::default(),
            tool_calls: Vec::new(),
        }
    }

    /// An answer that calls the tool `name` with `arguments` (a JSON object), as a scripted
    /// model in a test gives it.
    pub fn tool_call(name: &str, arguments: serde_json::Value) -> Self {
        Self {
            content: String::new(),
            model: "scripted".into(),
            finish_reason: "tool_calls".into(),
            usage: Usage::default(),
            tool_calls: vec![ToolCall {
                id: format!("call_{name}"),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.to_string(),
                    arguments: arguments.to_string(),
                },
            }],
        }
    }
}

/// A classified model failure.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ModelError {
    /// Transient (rate limit, 5xx, connection reset): try again, not before `retry_after`.
    #[error("model call failed, retryable: {message}")]
    Retryable {
        message: String,
        retry_after: Option<DateTime<Utc>>,
    },
    /// The provider is overloaded: back off harder without burning attempts.
    #[error("model provider overloaded: {message}")]
    Overloaded {
        message: String,
        retry_after: Option<DateTime<Utc>>,
    },
    /// The request can never succeed as sent (bad request, auth, quota, context length).
    #[error("model call refused: {message}")]
    NonRetryable { message: String },
}

impl From<ModelError> for JobError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Retryable {
                message,
                retry_after,
            } => JobError::Retryable {
                message,
                not_before: retry_after,
            },
            ModelError::Overloaded {
                message,
                retry_after,
            } => JobError::from(Engine::Overloaded {
                message,
                not_before: retry_after,
            }),
            ModelError::NonRetryable { message } => JobError::NonRetryable(message),
        }
    }
}

impl ModelError {
    /// The stable snake_case class, for the model call's span.
    #[doc(hidden)]
    pub fn class(&self) -> &'static str {
        match self {
            ModelError::Retryable { .. } => "retryable",
            ModelError::Overloaded { .. } => "overloaded",
            ModelError::NonRetryable { .. } => "non_retryable",
        }
    }
}

/// A chat-completion provider.
#[async_trait]
pub trait ModelClient: Send + Sync {
    /// The provider's name (metrics, circuit breaking; never a secret).
    fn provider(&self) -> &str;

    /// The model a request that names none is sent to, if the client knows it (rate limits
    /// of scope `model` match calls by it).
    fn default_model(&self) -> Option<&str> {
        None
    }

    /// The `max_tokens` it sends on a request that sets none, if it caps them.
    fn default_max_tokens(&self) -> Option<u32> {
        None
    }

    /// Runs one completion.
    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError>;
}

/// The built-in model: deterministic, offline, free. It answers with the last user message, so
/// demos, tests and benchmarks run without a network or a key.
#[derive(Clone, Debug, Default)]
pub struct LocalModel;

/// The name the local model reports.
pub const LOCAL_MODEL_NAME: &str = "agentq-local-echo";

#[async_trait]
impl ModelClient for LocalModel {
    fn provider(&self) -> &str {
        "local"
    }

    fn default_model(&self) -> Option<&str> {
        Some(LOCAL_MODEL_NAME)
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let content = request
            .messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .map(|m| m.content.clone())
            .unwrap_or_default();
        let words = |s: &str| s.split_whitespace().count() as u64;
        Ok(ModelResponse {
            usage: Usage {
                prompt_tokens: request.messages.iter().map(|m| words(&m.content)).sum(),
                completion_tokens: words(&content),
                unreported: false,
            },
            content,
            model: LOCAL_MODEL_NAME.to_string(),
            finish_reason: "stop".to_string(),
            tool_calls: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_model_echoes_the_last_user_message() {
        let mut req = ModelRequest::user("first");
        req.messages.push(Message::text(Role::Assistant, "ignored"));
        req.messages.push(Message::text(Role::User, "hello there"));
        let resp = LocalModel.complete(&req).await.unwrap();
        assert_eq!(resp.content, "hello there");
        assert_eq!(resp.usage.completion_tokens, 2);
        assert_eq!(resp.usage.prompt_tokens, 4);
    }
}
