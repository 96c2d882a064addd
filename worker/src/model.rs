//! The model client interface and the built-in deterministic local model.
//!
//! `ModelClient` is shaped after OpenAI-compatible chat completions so the HTTP client of a
//! later issue implements the same trait. Errors are already classified (retryable,
//! overloaded, non-retryable) so the job layer never inspects message text.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::context::JobError;

/// Who said a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

/// A chat completion request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRequest {
    /// Model name; `None` → the client's configured default.
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
}

impl ModelRequest {
    /// A request with one user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self {
            messages: vec![Message {
                role: Role::User,
                content: text.into(),
            }],
            ..Self::default()
        }
    }
}

/// Token accounting of one call, journaled with the step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// A chat completion answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    pub content: String,
    pub model: String,
    pub finish_reason: String,
    pub usage: Usage,
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
            } => JobError::Overloaded {
                message,
                not_before: retry_after,
            },
            ModelError::NonRetryable { message } => JobError::NonRetryable(message),
        }
    }
}

/// A chat-completion provider.
#[async_trait]
pub trait ModelClient: Send + Sync {
    /// The provider's name (metrics, circuit breaking; never a secret).
    fn provider(&self) -> &str;

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
            },
            content,
            model: LOCAL_MODEL_NAME.to_string(),
            finish_reason: "stop".to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_model_echoes_the_last_user_message() {
        let mut req = ModelRequest::user("first");
        req.messages.push(Message {
            role: Role::Assistant,
            content: "ignored".into(),
        });
        req.messages.push(Message {
            role: Role::User,
            content: "hello there".into(),
        });
        let resp = LocalModel.complete(&req).await.unwrap();
        assert_eq!(resp.content, "hello there");
        assert_eq!(resp.usage.completion_tokens, 2);
        assert_eq!(resp.usage.prompt_tokens, 4);
    }
}
