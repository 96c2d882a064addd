//! An OpenAI-compatible chat-completions client (`POST {base}/v1/chat/completions`), usable
//! against OpenAI, vLLM, llama.cpp's server, Ollama and similar, in plain or streaming (SSE) mode.
//!
//! Failures are classified by HTTP status and the error body's `type`/`code`, never by message
//! text. Error messages carry status, type and code only: a provider's message may
//! quote the prompt, and prompts never reach logs or the operations table.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::model::{
    FunctionCall, ModelClient, ModelError, ModelRequest, ModelResponse, ToolCall, Usage,
};

/// How long each phase of a call may take.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// TCP (and TLS) connection set-up.
    pub connect: Duration,
    /// From sending the request to the response headers.
    pub first_byte: Duration,
    /// Longest silence between two chunks of a (streamed) body.
    pub idle: Duration,
    /// The whole call.
    pub total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(10),
            first_byte: Duration::from_secs(120),
            idle: Duration::from_secs(60),
            total: Duration::from_secs(600),
        }
    }
}

/// The HTTP model client.
pub struct OpenAiClient {
    http: reqwest::Client,
    url: String,
    api_key: Option<String>,
    model: String,
    stream: bool,
    timeouts: Timeouts,
    /// `max_tokens` of a request that sets none (`AGENTQ_MODEL_MAX_TOKENS`).
    max_tokens: Option<u32>,
}

impl std::fmt::Debug for OpenAiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiClient")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl OpenAiClient {
    /// A client for `base_url` (e.g. `https://api.openai.com` or `http://127.0.0.1:8000`).
    pub fn new(
        base_url: &str,
        api_key: Option<String>,
        model: &str,
        stream: bool,
        timeouts: Timeouts,
    ) -> Result<Self, String> {
        let base = base_url.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "AGENTQ_MODEL_BASE_URL {base_url:?} must start with http:// or https://"
            ));
        }
        let base = base.strip_suffix("/v1").unwrap_or(base);
        let http = reqwest::Client::builder()
            .connect_timeout(timeouts.connect)
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        Ok(Self {
            http,
            url: format!("{base}/v1/chat/completions"),
            api_key,
            model: model.to_string(),
            stream,
            timeouts,
            max_tokens: None,
        })
    }

    /// Caps the answer of every request that sets no `max_tokens` of its own: without a cap a
    /// small model can write until its context is full (minutes on a CPU).
    pub fn with_max_tokens(mut self, max_tokens: Option<u32>) -> Self {
        self.max_tokens = max_tokens;
        self
    }

    async fn call(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let mut body = json!({
            "model": request.model.clone().unwrap_or_else(|| self.model.clone()),
            "messages": request.messages,
        });
        if let Some(n) = request.max_tokens.or(self.max_tokens) {
            body["max_tokens"] = json!(n);
        }
        if let Some(t) = request.temperature {
            body["temperature"] = json!(t);
        }
        if !request.tools.is_empty() {
            body["tools"] = request
                .tools
                .iter()
                .map(|t| json!({ "type": "function", "function": { "name": t.name, "description": t.description, "parameters": t.parameters } }))
                .collect();
            if let Some(choice) = &request.tool_choice {
                body["tool_choice"] = choice.to_openai();
            }
        }
        if self.stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({ "include_usage": true });
        }
        let mut post = self.http.post(&self.url).json(&body);
        if let Some(key) = &self.api_key {
            post = post.bearer_auth(key);
        }
        let response = match tokio::time::timeout(self.timeouts.first_byte, post.send()).await {
            Err(_) => {
                return Err(retryable(format!(
                    "no response headers within {:?} (first-byte timeout)",
                    self.timeouts.first_byte
                )));
            }
            Ok(Err(e)) => return Err(transport_error(&e)),
            Ok(Ok(r)) => r,
        };
        let status = response.status();
        if !status.is_success() {
            let retry_after = retry_after(response.headers());
            let body = read_all(response, self.timeouts.idle)
                .await
                .unwrap_or_default();
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            return Err(classify(status, &body, retry_after));
        }
        let reply = if self.stream {
            self.read_stream(response).await?
        } else {
            let bytes = read_all(response, self.timeouts.idle).await?;
            let v: Value = serde_json::from_slice(&bytes)
                .map_err(|e| retryable(format!("the answer is not JSON ({e})")))?;
            parse_completion(&v)?
        };
        if reply.finish_reason == "content_filter" {
            return Err(ModelError::NonRetryable {
                message: "the provider's content filter stopped the answer (finish_reason content_filter)"
                    .into(),
            });
        }
        Ok(reply)
    }

    /// Reads an SSE stream to its `[DONE]` terminator; a stream that ends before it is a
    /// retryable failure, not a success with half an answer.
    async fn read_stream(&self, response: reqwest::Response) -> Result<ModelResponse, ModelError> {
        let mut stream = response.bytes_stream();
        let mut buf = Vec::new();
        let mut content = String::new();
        let mut finish_reason = String::new();
        let mut model = self.model.clone();
        // Stays "unreported" unless a chunk carries usage (`stream_options.include_usage`).
        let mut usage = Usage::unreported();
        let mut calls: Vec<ToolCall> = Vec::new();
        loop {
            let chunk = match tokio::time::timeout(self.timeouts.idle, stream.next()).await {
                Err(_) => {
                    return Err(retryable(format!(
                        "the stream went silent for {:?} (idle timeout)",
                        self.timeouts.idle
                    )));
                }
                Ok(None) => return Err(retryable("the stream ended before [DONE]".into())),
                Ok(Some(Err(e))) => return Err(transport_error(&e)),
                Ok(Some(Ok(c))) => c,
            };
            buf.extend_from_slice(&chunk);
            while let Some(end) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim_end().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return Ok(ModelResponse {
                        content,
                        model,
                        finish_reason: if finish_reason.is_empty() {
                            "stop".into()
                        } else {
                            finish_reason
                        },
                        usage,
                        tool_calls: calls,
                    });
                }
                let Ok(event) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if event.get("error").is_some() {
                    return Err(classify(StatusCode::INTERNAL_SERVER_ERROR, &event, None));
                }
                if let Some(m) = event.get("model").and_then(Value::as_str) {
                    model = m.to_string();
                }
                if let Some(choice) = event.get("choices").and_then(|c| c.get(0)) {
                    if let Some(piece) = choice.pointer("/delta/content").and_then(Value::as_str) {
                        content.push_str(piece);
                    }
                    // Tool calls arrive in pieces, keyed by index: id and name first, then the
                    // arguments' text in fragments.
                    for d in choice
                        .pointer("/delta/tool_calls")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        let i = d.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                        while calls.len() <= i {
                            calls.push(ToolCall {
                                id: String::new(),
                                kind: "function".into(),
                                function: FunctionCall::default(),
                            });
                        }
                        let call = &mut calls[i];
                        if let Some(id) = d.get("id").and_then(Value::as_str) {
                            call.id = id.to_string();
                        }
                        if let Some(n) = d.pointer("/function/name").and_then(Value::as_str)
                            // OpenAI sends the name once; llama.cpp's server repeats it in
                            // every chunk of the call: a repeat of the whole name is no part.
                            && call.function.name != n
                        {
                            call.function.name.push_str(n);
                        }
                        if let Some(a) = d.pointer("/function/arguments").and_then(Value::as_str) {
                            call.function.arguments.push_str(a);
                        }
                    }
                    if let Some(r) = choice.get("finish_reason").and_then(Value::as_str) {
                        finish_reason = r.to_string();
                    }
                }
                if let Some(u) = event.get("usage").filter(|u| !u.is_null()) {
                    usage = parse_usage(u);
                }
            }
        }
    }
}

#[async_trait]
impl ModelClient for OpenAiClient {
    fn provider(&self) -> &str {
        &self.url
    }

    fn default_model(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn default_max_tokens(&self) -> Option<u32> {
        self.max_tokens
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        match tokio::time::timeout(self.timeouts.total, self.call(request)).await {
            Ok(r) => r,
            Err(_) => Err(retryable(format!(
                "the call took longer than {:?} (total timeout)",
                self.timeouts.total
            ))),
        }
    }
}

fn retryable(message: String) -> ModelError {
    ModelError::Retryable {
        message,
        retry_after: None,
    }
}

fn transport_error(e: &reqwest::Error) -> ModelError {
    let what = if e.is_connect() {
        "connecting to the provider failed"
    } else if e.is_timeout() {
        "the provider timed out"
    } else if e.is_body() || e.is_decode() {
        "the connection broke while reading the answer"
    } else {
        "the request to the provider failed"
    };
    retryable(what.to_string())
}

async fn read_all(response: reqwest::Response, idle: Duration) -> Result<Vec<u8>, ModelError> {
    let mut stream = response.bytes_stream();
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(idle, stream.next()).await {
            Err(_) => {
                return Err(retryable(format!(
                    "the answer stalled for {idle:?} (idle timeout)"
                )));
            }
            Ok(None) => return Ok(out),
            Ok(Some(Err(e))) => return Err(transport_error(&e)),
            Ok(Some(Ok(c))) => out.extend_from_slice(&c),
        }
    }
}

fn parse_usage(u: &Value) -> Usage {
    Usage {
        prompt_tokens: u.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0),
        completion_tokens: u
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        unreported: false,
    }
}

/// Reads a non-streamed completion leniently: extra fields are ignored, optional ones may be
/// missing, a null content is an empty answer.
pub fn parse_completion(v: &Value) -> Result<ModelResponse, ModelError> {
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| retryable("the answer has no choices".into()))?;
    Ok(ModelResponse {
        content: choice
            .pointer("/message/content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        model: v
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .unwrap_or("stop")
            .to_string(),
        usage: v
            .get("usage")
            .filter(|u| !u.is_null())
            .map(parse_usage)
            .unwrap_or_else(Usage::unreported),
        tool_calls: choice
            .pointer("/message/tool_calls")
            .and_then(|c| serde_json::from_value(c.clone()).ok())
            .unwrap_or_default(),
    })
}

/// The longest a provider's `Retry-After` is honoured: a longer (or absurd) value is read as
/// this, so a provider cannot park operations for years or overflow the wake time.
pub const MAX_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// Now + `secs`, clamped to `0..=MAX_RETRY_AFTER`; `None` for a value that is not a number.
fn after_secs(secs: f64) -> Option<DateTime<Utc>> {
    if secs.is_nan() {
        return None;
    }
    let ms = (secs.clamp(0.0, MAX_RETRY_AFTER.as_secs_f64()) * 1000.0) as i64;
    Some(Utc::now() + chrono::Duration::milliseconds(ms))
}

/// `Retry-After` in seconds or as an HTTP date, or OpenAI's `retry-after-ms`; at most
/// [`MAX_RETRY_AFTER`] from now.
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<DateTime<Utc>> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
    {
        return after_secs(ms / 1000.0);
    }
    let v = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    parse_retry_after(v)
}

/// Parses a `Retry-After` value: delay-seconds or an HTTP date (RFC 9110), at most
/// [`MAX_RETRY_AFTER`] from now.
pub fn parse_retry_after(v: &str) -> Option<DateTime<Utc>> {
    if let Ok(secs) = v.parse::<f64>() {
        return after_secs(secs);
    }
    let at = DateTime::parse_from_rfc2822(v).ok()?.with_timezone(&Utc);
    let now = Utc::now();
    let latest = now + chrono::Duration::from_std(MAX_RETRY_AFTER).unwrap_or_default();
    Some(at.clamp(now, latest))
}

/// Maps an error response to a failure class by status and the body's `error.type` /
/// `error.code` (never by its message).
pub fn classify(
    status: StatusCode,
    body: &Value,
    retry_after: Option<DateTime<Utc>>,
) -> ModelError {
    let err = body.get("error").unwrap_or(&Value::Null);
    let text = |k: &str| match err.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    };
    let (etype, code) = (text("type"), text("code"));
    let is = |needle: &str| etype == needle || code == needle;
    let tag = if etype.is_empty() && code.is_empty() {
        format!("HTTP {}", status.as_u16())
    } else {
        format!("HTTP {} type={etype:?} code={code:?}", status.as_u16())
    };
    let refuse = |why: &str| ModelError::NonRetryable {
        message: format!("{why} ({tag})"),
    };
    match status.as_u16() {
        429 if is("insufficient_quota") => refuse(
            "the provider account is out of quota: add credit or raise the limit, then retry from the DLQ",
        ),
        429 => ModelError::Retryable {
            message: format!("rate limited by the provider ({tag})"),
            retry_after,
        },
        400 if is("context_length_exceeded") => refuse(
            "the prompt is longer than the model's context window: shorten the input or use a larger model",
        ),
        400 if is("content_filter") || is("content_policy_violation") => {
            refuse("the provider's content filter refused the request")
        }
        400 | 422 => refuse("the provider refused the request as malformed"),
        401 => refuse("the provider rejected the API key: check AGENTQ_MODEL_API_KEY"),
        403 => refuse("the provider forbids this request for this key"),
        404 => refuse(
            "the model or endpoint does not exist: check AGENTQ_MODEL and AGENTQ_MODEL_BASE_URL",
        ),
        408 => ModelError::Retryable {
            message: format!("the provider timed out the request ({tag})"),
            retry_after,
        },
        503 | 529 => ModelError::Overloaded {
            message: format!("the provider is overloaded ({tag})"),
            retry_after,
        },
        s if s >= 500 || is("overloaded_error") => {
            if is("overloaded_error") {
                ModelError::Overloaded {
                    message: format!("the provider is overloaded ({tag})"),
                    retry_after,
                }
            } else {
                ModelError::Retryable {
                    message: format!("the provider failed ({tag})"),
                    retry_after,
                }
            }
        }
        _ => refuse("the provider refused the request"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Timelike;

    fn class(status: u16, body: Value) -> &'static str {
        match classify(StatusCode::from_u16(status).unwrap(), &body, None) {
            ModelError::Retryable { .. } => "retryable",
            ModelError::Overloaded { .. } => "overloaded",
            ModelError::NonRetryable { .. } => "non_retryable",
        }
    }

    #[test]
    fn classification_follows_status_and_error_type_not_text() {
        let e = |t: &str, c: &str| json!({ "error": { "type": t, "code": c, "message": "overloaded quota whatever" } });
        assert_eq!(
            class(429, e("requests", "rate_limit_exceeded")),
            "retryable"
        );
        assert_eq!(
            class(429, e("insufficient_quota", "insufficient_quota")),
            "non_retryable"
        );
        assert_eq!(class(400, e("invalid_request_error", "")), "non_retryable");
        assert_eq!(
            class(400, e("invalid_request_error", "context_length_exceeded")),
            "non_retryable"
        );
        assert_eq!(
            class(400, e("invalid_request_error", "content_filter")),
            "non_retryable"
        );
        assert_eq!(class(401, Value::Null), "non_retryable");
        assert_eq!(class(403, Value::Null), "non_retryable");
        assert_eq!(class(404, Value::Null), "non_retryable");
        assert_eq!(class(408, Value::Null), "retryable");
        assert_eq!(class(500, e("server_error", "")), "retryable");
        assert_eq!(class(502, Value::Null), "retryable");
        assert_eq!(class(503, Value::Null), "overloaded");
        assert_eq!(class(529, e("overloaded_error", "")), "overloaded");
        // The message text says "overloaded" and "quota"; it must not matter.
        assert_eq!(class(500, e("server_error", "")), "retryable");
    }

    #[test]
    fn retry_after_in_seconds_and_as_a_date() {
        let in_2s = parse_retry_after("2").unwrap();
        assert!((in_2s - Utc::now()).num_milliseconds() > 1500);
        let in_10m = (Utc::now() + chrono::Duration::minutes(10))
            .with_nanosecond(0)
            .unwrap();
        let date = parse_retry_after(&in_10m.to_rfc2822()).unwrap();
        assert!(
            (date - in_10m).num_milliseconds().abs() < 1000,
            "{date} ≠ {in_10m}"
        );
        // A date past is "now"; absurd values are clamped to an hour, never overflow.
        let past = parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT").unwrap();
        assert!((past - Utc::now()).num_seconds().abs() <= 1);
        let hour = chrono::Duration::from_std(MAX_RETRY_AFTER).unwrap();
        for far in [
            "1e300",
            "99999999999999999999",
            "Fri, 31 Dec 9999 23:59:59 GMT",
        ] {
            let at = parse_retry_after(far).unwrap();
            assert!(
                (at - Utc::now() - hour).num_seconds().abs() <= 1,
                "{far}: {at}"
            );
        }
        assert!(parse_retry_after("-5").unwrap() <= Utc::now());
        assert!(parse_retry_after("soon").is_none());
        assert!(parse_retry_after("NaN").is_none());
    }

    #[test]
    fn completions_parse_leniently() {
        let v = json!({ "id": "x", "extra": 1, "choices": [{ "message": { "role": "assistant", "content": null } }] });
        let r = parse_completion(&v).unwrap();
        assert_eq!(
            (
                r.content.as_str(),
                r.finish_reason.as_str(),
                r.usage.prompt_tokens
            ),
            ("", "stop", 0)
        );
    }
}
