//! The `http_get` tool: a GET of an allowed origin through [`crate::outbound`].

use std::time::Duration;

use agentq_worker::{JobError, Replay, ToolContext, TypedTool};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::outbound;

/// Largest body `http_get` hands to the model.
const HTTP_GET_CAP: usize = 64 * 1024;

/// Arguments of `http_get`.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
pub(crate) struct Args {
    /// An absolute http(s) URL on an allowed origin.
    url: String,
}

/// What `http_get` answers.
#[derive(Serialize, Deserialize)]
pub(crate) struct Fetched {
    status: u16,
    body: String,
    truncated: bool,
}

/// The `http_get` tool: GET a URL of an allowed origin (`AGENTQ_AGENT_HTTP_ALLOW`), body
/// capped at 64 KiB while it streams, no redirects. Replay-safe (a GET).
pub(crate) struct HttpGet;

#[async_trait]
impl TypedTool for HttpGet {
    const NAME: &str = "http_get";
    const DESCRIPTION: &str = "Fetch a URL (GET) from an allow-listed host; returns the status and the start of the body.";
    const REPLAY: Replay = Replay::Safe;
    type Args = Args;
    type Output = Fetched;

    async fn call(&self, cx: &ToolContext<'_>, args: Args) -> Result<Fetched, JobError> {
        let url = args.url;
        let parsed = reqwest::Url::parse(&url)
            .map_err(|e| JobError::NonRetryable(format!("{url:?} is not a URL: {e}")))?;
        let host = parsed.host_str().unwrap_or_default().to_string();
        cx.http_allow()
            .check(&parsed)
            .map_err(|why| JobError::NonRetryable(format!("http_get refused {url:?}: {why}")))?;
        let client = outbound::Client::new(Duration::from_secs(20), None)
            .map_err(|e| JobError::retryable(format!("http client: {e}")))?;
        let response = client.send(client.get(parsed)).await.map_err(|e| match e {
            // Where the name leads is the operator's to change, not a retry's.
            outbound::Error::Refused(why) | outbound::Error::UnapprovedPeer(why) => {
                JobError::NonRetryable(format!("http_get refused: {why}"))
            }
            outbound::Error::Http(_) => JobError::retryable(format!("fetching from {host} failed")),
        })?;
        let status = response.status().as_u16();
        let (bytes, truncated) = outbound::read_capped(response, HTTP_GET_CAP)
            .await
            .map_err(|_| JobError::retryable(format!("reading from {host} failed")))?;
        let body = String::from_utf8_lossy(&bytes).into_owned();
        Ok(Fetched {
            status,
            body,
            truncated,
        })
    }
}
