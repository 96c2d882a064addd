//! The `triage` kind: a webhook-triggered job. A source configured with
//! `{"callback_url": …, "labels": […]}` wraps each delivery as [`TriageInput`]; the job asks the
//! model to summarize and classify the event (a replay-safe step), then POSTs the result to the
//! callback URL (the unsafe `callback` tool).
//!
//! Invariant kept here: the callback's effect happens once per operation. The POST carries
//! `Idempotency-Key: <the step's key>` so the receiver can drop a repeat, and after a crash the
//! tool reconciles by asking the receiver (`GET <callback_url>?idempotency_key=<key>`: 200 → it
//! happened, 404 → it did not) instead of posting blindly. Nothing here logs the event, the
//! summary or a payload.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use agentq_worker::model::{Message, ModelRequest, Role};
use agentq_worker::{JobContext, JobError, Reconciled, Replay, Tool, ToolContext};

/// Labels a source without `labels` in its config classifies into.
const DEFAULT_LABELS: [&str; 4] = ["bug", "feature", "question", "other"];

/// The label when the model names none of the source's labels and the source has no labels.
const FALLBACK_LABEL: &str = "other";

/// The most of the event (as JSON text) sent to the model.
const PROMPT_EVENT_CAP: usize = 16 * 1024;

/// The longest summary posted to the callback.
const SUMMARY_CAP: usize = 1000;

/// The largest callback answer kept in the journal.
const ANSWER_CAP: usize = 64 * 1024;

/// Timeouts of a callback request: to connect, and for the whole exchange.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Input of `triage`, as the webhook route builds it for a source with a config.
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TriageInput {
    /// The delivery's JSON body.
    pub event: Value,
    /// The webhook source's name.
    pub source: String,
    /// The delivery's `webhook-id`.
    pub webhook_id: String,
    pub config: TriageConfig,
}

/// A `triage` source's configuration (`agentq webhooks add --config`).
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TriageConfig {
    /// Where the result is POSTed; its host must be in `AGENTQ_AGENT_HTTP_ALLOW`.
    pub callback_url: CallbackUrl,
    /// The labels to classify into (default: bug, feature, question, other).
    #[serde(default)]
    pub labels: Labels,
}

/// An `http://` or `https://` URL with a host: checked when the source is added and when a
/// delivery is enqueued, so a bad one never reaches a worker.
#[derive(Clone, Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub struct CallbackUrl(#[schemars(with = "String")] Url);

impl TryFrom<String> for CallbackUrl {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let url = Url::parse(&s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
            return Err(format!(
                "{s:?} must be an http:// or https:// URL with a host"
            ));
        }
        Ok(Self(url))
    }
}

impl From<CallbackUrl> for String {
    fn from(u: CallbackUrl) -> String {
        u.0.into()
    }
}

/// The labels of a source: 1–100 non-empty names of at most 64 characters.
#[derive(Clone, Debug, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(try_from = "Vec<String>", into = "Vec<String>")]
pub struct Labels(Vec<String>);

impl TryFrom<Vec<String>> for Labels {
    type Error = String;

    fn try_from(v: Vec<String>) -> Result<Self, String> {
        if v.len() > 100 {
            return Err(format!("{} labels: at most 100", v.len()));
        }
        if let Some(bad) = v.iter().find(|l| l.trim().is_empty() || l.len() > 64) {
            return Err(format!("{bad:?} must be 1-64 characters, not blank"));
        }
        Ok(Self(v.into_iter().map(|l| l.trim().to_string()).collect()))
    }
}

impl From<Labels> for Vec<String> {
    fn from(l: Labels) -> Self {
        l.0
    }
}

/// Output of `triage`.
#[derive(Debug, Deserialize, Serialize)]
pub struct TriageOutput {
    pub label: String,
    pub summary: String,
    /// What the callback answered (`{"status", "body"}`, plus `"reconciled": true` when a
    /// recovery learned it from the receiver).
    pub callback: Value,
}

/// Summarizes and classifies the event with the model, then posts the result to the source's
/// callback URL once.
pub async fn triage(ctx: JobContext, input: TriageInput) -> Result<TriageOutput, JobError> {
    let configured: Vec<String> = input.config.labels.0;
    let labels: Vec<String> = if configured.is_empty() {
        DEFAULT_LABELS.iter().map(|l| l.to_string()).collect()
    } else {
        configured.clone()
    };
    let fallback = configured
        .first()
        .cloned()
        .unwrap_or_else(|| FALLBACK_LABEL.to_string());

    let answer = ctx
        .model(
            "classify",
            classify_request(&input.source, &input.event, &labels),
        )
        .await?;
    let label = parse_label(&answer.content, &labels).unwrap_or(fallback);
    let summary = parse_summary(&answer.content);

    let callback = Callback {
        url: input.config.callback_url,
        allow: ctx.http_allow(),
    };
    let payload = json!({
        "op_id": ctx.info().op_id.to_string(),
        "source": input.source,
        "webhook_id": input.webhook_id,
        "summary": summary,
        "label": label,
    });
    let callback = ctx.tool(&callback, payload).await?;
    Ok(TriageOutput {
        label,
        summary,
        callback,
    })
}

/// The instructions go in the system message and the event alone in the user message, so the
/// built-in local model (which echoes the last user message) classifies by the event's words.
fn classify_request(source: &str, event: &Value, labels: &[String]) -> ModelRequest {
    let mut text = event.to_string();
    if text.len() > PROMPT_EVENT_CAP {
        let mut end = PROMPT_EVENT_CAP;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str(" …(truncated)");
    }
    ModelRequest {
        messages: vec![
            Message::text(
                Role::System,
                format!(
                    "You triage events that the webhook source {source:?} sends. Answer with two \
                     lines:\nlabel: <exactly one of: {}>\nsummary: <one sentence saying what \
                     happened>",
                    labels.join(", ")
                ),
            ),
            Message::text(Role::User, text),
        ],
        temperature: Some(0.0),
        ..ModelRequest::default()
    }
}

/// The label the answer names: a `label:` line if it names one of `labels`, else the label
/// mentioned (as a whole word) earliest in the answer. Case-insensitive; returns the label as
/// configured.
fn parse_label(answer: &str, labels: &[String]) -> Option<String> {
    let pick = |text: &str| {
        labels
            .iter()
            .filter_map(|l| find_word(text, l).map(|at| (at, l)))
            .min_by_key(|(at, _)| *at)
            .map(|(_, l)| l.clone())
    };
    answer
        .lines()
        .find_map(|line| strip_prefix_ci(line.trim(), "label:"))
        .and_then(pick)
        .or_else(|| pick(answer))
}

/// The answer's `summary:` line, else the whole answer on one line; capped.
fn parse_summary(answer: &str) -> String {
    let text = answer
        .lines()
        .find_map(|line| strip_prefix_ci(line.trim(), "summary:"))
        .unwrap_or(answer);
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match one_line.char_indices().nth(SUMMARY_CAP) {
        Some((end, _)) => format!("{}…", &one_line[..end]),
        None => one_line,
    }
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| s[prefix.len()..].trim())
}

/// Byte position of the first case-insensitive occurrence of `word` in `text` not inside a
/// longer word.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let (text, word) = (text.to_lowercase(), word.to_lowercase());
    if word.is_empty() {
        return None;
    }
    let inside = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut from = 0;
    while let Some(at) = text[from..].find(&word).map(|i| i + from) {
        let end = at + word.len();
        if !inside(text[..at].chars().next_back()) && !inside(text[end..].chars().next()) {
            return Some(at);
        }
        from = at + text[at..].chars().next().map_or(1, char::len_utf8);
    }
    None
}

/// The `callback` tool: POST the result to the source's callback URL. Unsafe (the receiver acts
/// on it), made exactly-once by its `Idempotency-Key` and by asking the receiver on recovery.
struct Callback {
    url: CallbackUrl,
    /// `AGENTQ_AGENT_HTTP_ALLOW`: the origins a worker may call.
    allow: Arc<crate::outbound::Origins>,
}

impl Callback {
    /// The URL if its origin is allowed; else a non-retryable error saying how to allow it.
    fn allowed_url(&self) -> Result<Url, JobError> {
        let url = self.url.0.clone();
        self.allow.check(&url).map_err(|why| {
            JobError::NonRetryable(format!(
                "callback refused: {why}, then `agentq dlq retry` this operation"
            ))
        })?;
        Ok(url)
    }

    fn client() -> Result<crate::outbound::Client, JobError> {
        crate::outbound::Client::new(REQUEST_TIMEOUT, Some(CONNECT_TIMEOUT))
            .map_err(|e| JobError::retryable(format!("building the callback client: {e}")))
    }
}

/// Reads a JSON answer (at most [`ANSWER_CAP`], cut while it streams); anything else is `null`.
async fn answer_body(response: reqwest::Response) -> Value {
    match crate::outbound::read_capped(response, ANSWER_CAP).await {
        Ok((b, false)) => serde_json::from_slice(&b).unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

/// How a callback status that is not a success fails the step: 408, 429 and 5xx are worth
/// retrying; any other answer will not change. 408, 429 and 503 say the receiver did not act;
/// after another 5xx it may have, so the outcome is unknown (the next attempt reconciles).
fn status_error(what: &str, host: &str, status: StatusCode) -> JobError {
    let message = format!("{what} to {host} answered {}", status.as_u16());
    if status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
    {
        JobError::no_effect(message)
    } else if status.is_server_error() {
        JobError::retryable(message)
    } else {
        JobError::NonRetryable(format!(
            "{message}; the receiver refused the callback (redirects are not followed)"
        ))
    }
}

#[async_trait]
impl Tool for Callback {
    fn name(&self) -> &str {
        "callback"
    }

    fn replay(&self) -> Replay {
        Replay::Unsafe
    }

    fn description(&self) -> &str {
        "POST the triage result to the source's callback URL."
    }

    async fn call(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
        let key = cx.idempotency_key();
        let url = self.allowed_url()?;
        let host = url.host_str().unwrap_or_default().to_string();
        let client = Self::client()?;
        let request = client.post(url).header("Idempotency-Key", key).json(args);
        let response = client.send(request).await.map_err(|e| match e {
            crate::outbound::Error::Refused(why) | crate::outbound::Error::UnapprovedPeer(why) => {
                // Refused: nothing was sent. An unapproved peer got the request, but the
                // receiver drops a repeat of its `Idempotency-Key`.
                JobError::NonRetryable(format!(
                    "callback refused: {why}, then `agentq dlq retry` this operation"
                ))
            }
            crate::outbound::Error::Http(e) if e.is_connect() => {
                // No connection, so nothing was sent.
                JobError::no_effect(format!("the callback to {host} could not connect"))
            }
            crate::outbound::Error::Http(e) => {
                let why = if e.is_timeout() {
                    "timed out"
                } else {
                    "failed"
                };
                JobError::retryable(format!("the callback to {host} {why}"))
            }
        })?;
        let status = response.status();
        if !status.is_success() {
            return Err(status_error("the callback", &host, status));
        }
        Ok(json!({ "status": status.as_u16(), "body": answer_body(response).await }))
    }

    async fn reconcile(&self, cx: &ToolContext<'_>, _args: &Value) -> Result<Reconciled, JobError> {
        let key = cx.idempotency_key();
        let mut url = self.allowed_url()?;
        let host = url.host_str().unwrap_or_default().to_string();
        url.query_pairs_mut().append_pair("idempotency_key", key);
        let client = Self::client()?;
        let response = client.send(client.get(url)).await.map_err(|e| match e {
            crate::outbound::Error::Refused(why) | crate::outbound::Error::UnapprovedPeer(why) => {
                JobError::NonRetryable(format!(
                    "checking whether the callback arrived was refused: {why}, then `agentq dlq \
                     retry` this operation"
                ))
            }
            crate::outbound::Error::Http(_) => {
                JobError::retryable(format!("asking {host} whether the callback arrived failed"))
            }
        })?;
        let status = response.status();
        if status == StatusCode::NOT_FOUND {
            return Ok(Reconciled::NotHappened);
        }
        if status.is_server_error()
            || status == StatusCode::REQUEST_TIMEOUT
            || status == StatusCode::TOO_MANY_REQUESTS
        {
            return Err(status_error(
                "asking whether the callback arrived",
                &host,
                status,
            ));
        }
        if status != StatusCode::OK {
            // The receiver cannot answer lookups: fail closed, a human decides.
            return Ok(Reconciled::Unsupported);
        }
        match answer_body(response).await {
            Value::Null => Ok(Reconciled::Unsupported),
            body => Ok(Reconciled::Happened(
                json!({ "status": 200, "body": body, "reconciled": true }),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(l: &[&str]) -> Vec<String> {
        l.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_callback_status_says_whether_the_receiver_may_have_acted() {
        let class = |code: u16| match status_error(
            "the callback",
            "h",
            StatusCode::from_u16(code).unwrap(),
        ) {
            JobError::NoEffect(_) => "no effect",
            JobError::Retryable { .. } => "unknown",
            JobError::NonRetryable(_) => "refused",
            other => panic!("{other:?}"),
        };
        for code in [408, 429, 503] {
            assert_eq!(class(code), "no effect", "{code}");
        }
        for code in [500, 502, 504] {
            assert_eq!(class(code), "unknown", "{code}");
        }
        for code in [400, 404, 409] {
            assert_eq!(class(code), "refused", "{code}");
        }
    }

    #[test]
    fn a_label_line_wins_over_words_elsewhere() {
        let l = labels(&["bug", "question"]);
        assert_eq!(
            parse_label("This is a bug report.\nLabel: Question\n", &l).as_deref(),
            Some("question")
        );
        assert_eq!(
            parse_label(r#"{"title":"a question about a bug"}"#, &l).as_deref(),
            Some("question")
        );
        assert_eq!(parse_label("debugging questions", &l), None);
        assert_eq!(parse_label("label: nonsense", &l), None);
    }

    #[test]
    fn the_summary_is_its_line_or_the_answer_on_one_line() {
        assert_eq!(
            parse_summary("label: bug\nsummary:  login crashes \n"),
            "login crashes"
        );
        assert_eq!(parse_summary("a\n  b"), "a b");
        assert_eq!(
            parse_summary(&"x".repeat(2000)).chars().count(),
            SUMMARY_CAP + 1
        );
    }

    #[test]
    fn a_config_needs_an_http_callback_url() {
        let ok: Result<TriageConfig, _> =
            serde_json::from_value(json!({ "callback_url": "https://hooks.example.com/t" }));
        assert!(ok.is_ok());
        for bad in [
            json!({}),
            json!({ "callback_url": "ftp://example.com" }),
            json!({ "callback_url": "not a url" }),
            json!({ "callback_url": "http://x.example", "labels": [""] }),
            json!({ "callback_url": "http://x.example", "label": ["bug"] }),
        ] {
            assert!(
                serde_json::from_value::<TriageConfig>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }
}
