//! One call of the step protocol: a signed `POST {url}/agentq/invoke`, the answer read within
//! the service's timeout and [`MAX_ANSWER_BYTES`], its signature checked against the request's
//! id, its body decoded into an [`Answer`]. Every failure is a [`CallError`] that says what
//! happened in words an operator can act on, whether the request may have reached the
//! service (what an unsafe step's outcome depends on), and whether the service is down.
//!
//! A service is down when it cannot be connected to, its connection breaks before it has
//! answered, or a proxy in front of it answers 502, 503 or 504 (429: it says it is
//! overloaded). Each service has a circuit breaker ([`crate::breaker`]) that hears of every
//! call: a down call is a failure, any answer a success. A down call, and every call while the
//! breaker is open, parks its operation with its attempt given back (class `overloaded`, the
//! message [`agentq_core::retry::service_parked`]): an operation dies only for what the
//! service answers. A service that accepts the call and does not answer within its timeout is
//! not down but failing (that operation's call may be what hangs): retryable, as are a refused
//! signature, a malformed or oversized answer and any other HTTP status.

use std::time::Duration;

use agentq_core::metrics;
use agentq_core::outbound::Error::{Http, Refused, UnapprovedPeer};
use agentq_core::webhook::{self, Secret};
use agentq_sdk::error::Engine;
use chrono::Utc;
use serde::Deserialize;
use serde_json::Value;

use crate::breaker::{Breaker, BreakerSettings, Outcome};
use crate::error::JobError;

/// The most bytes an answer may have.
pub const MAX_ANSWER_BYTES: usize = 4 << 20;

/// A registered service, as the worker calls it.
pub(crate) struct ServiceDef {
    pub(crate) name: String,
    pub(crate) url: String,
    pub(crate) secret: Secret,
    pub(crate) timeout: Duration,
    /// Reaches only the addresses a service's may lead to (`agentq_core::outbound::Reach`).
    pub(crate) http: agentq_core::outbound::Client,
    /// This worker's breaker for the service.
    pub(crate) breaker: Breaker,
}

impl std::fmt::Debug for ServiceDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceDef")
            .field("name", &self.name)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// What a service answered (docs/protocol.md, "The answer").
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub(crate) enum Answer {
    Step {
        seq: i32,
        name: String,
        #[serde(default)]
        output: Option<Value>,
        #[serde(default)]
        error: Option<StepFailure>,
    },
    Unsafe {
        seq: i32,
        name: String,
        #[serde(default)]
        reconcile: bool,
    },
    Model {
        seq: i32,
        name: String,
        request: crate::model::ModelRequest,
    },
    Sleep {
        seq: i32,
        seconds: f64,
    },
    Signal {
        seq: i32,
        name: String,
        timeout_seconds: f64,
    },
    Spawn {
        seq: i32,
        kind: String,
        input: Value,
    },
    Join {
        seq: i32,
        children: Vec<uuid::Uuid>,
    },
    Now {
        seq: i32,
    },
    Uuid {
        seq: i32,
    },
    /// A `patched` call's first execution: journal its marker.
    Patch {
        seq: i32,
        name: String,
    },
    Reconciled {
        seq: i32,
        #[serde(default)]
        happened: bool,
        #[serde(default)]
        output: Option<Value>,
        #[serde(default)]
        unsupported: bool,
    },
    Output {
        output: Value,
    },
    Error {
        class: String,
        message: String,
    },
    Resend {},
}

impl Answer {
    /// The journal position the answer is for, if it is for one.
    pub(crate) fn seq(&self) -> Option<i32> {
        match self {
            Answer::Step { seq, .. }
            | Answer::Unsafe { seq, .. }
            | Answer::Model { seq, .. }
            | Answer::Sleep { seq, .. }
            | Answer::Signal { seq, .. }
            | Answer::Spawn { seq, .. }
            | Answer::Join { seq, .. }
            | Answer::Now { seq }
            | Answer::Uuid { seq }
            | Answer::Patch { seq, .. }
            | Answer::Reconciled { seq, .. } => Some(*seq),
            Answer::Output { .. } | Answer::Error { .. } | Answer::Resend {} => None,
        }
    }
}

/// How a step the service ran failed.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub(crate) struct StepFailure {
    pub(crate) message: String,
    #[serde(default = "yes")]
    pub(crate) retryable: bool,
    #[serde(default)]
    pub(crate) no_effect: bool,
}

fn yes() -> bool {
    true
}

/// Why a call failed.
#[derive(Debug)]
pub(crate) struct CallError {
    /// For an operator: names the service and what happened.
    pub(crate) message: String,
    /// The request certainly never reached the service (the connection was refused).
    pub(crate) not_sent: bool,
    /// The service is down (see the module docs): its operation parks.
    pub(crate) down: bool,
    /// When the service's breaker may let a call through again, if it is open.
    pub(crate) open_until: Option<chrono::DateTime<Utc>>,
}

impl CallError {
    /// The run's error for this failure outside a step: parked when the service is down,
    /// else retryable.
    pub(crate) fn into_job_error(self) -> JobError {
        if self.down {
            JobError::from(Engine::Overloaded {
                message: self.message,
                not_before: self.open_until,
            })
        } else {
            JobError::retryable(self.message)
        }
    }

    /// The run's error for this failure of an unsafe step's call: one that never reached the
    /// service had no effect (a down service's parks, and the step runs again); one that may
    /// have reached it leaves the step to be reconciled.
    pub(crate) fn into_step_error(self) -> JobError {
        match (self.not_sent, self.down) {
            (true, true) => JobError::from(Engine::Unreached {
                message: self.message,
                not_before: self.open_until,
            }),
            (true, false) => JobError::no_effect(self.message),
            (false, _) => self.into_job_error(),
        }
    }
}

/// What a failed call did, for the breaker and the error.
#[derive(Clone, Copy, PartialEq)]
enum Failed {
    /// The service is down.
    Down,
    /// The service answered, or is up and failing (a hang): no news of an outage.
    Up,
}

impl ServiceDef {
    /// A service as the worker calls it, its breaker closed.
    pub(crate) fn new(
        name: String,
        url: String,
        secret: Secret,
        timeout: Duration,
        http: agentq_core::outbound::Client,
    ) -> Self {
        let breaker = {
            let label = name.clone();
            Breaker::new(
                "service",
                name.clone(),
                BreakerSettings::default(),
                Box::new(move |state| metrics::SERVICE_BREAKER_STATE.set(&[&label], state)),
            )
        };
        Self {
            name,
            url,
            secret,
            timeout,
            http,
            breaker,
        }
    }

    fn fail(&self, outcome: &str, not_sent: bool, what: String) -> CallError {
        self.failed(outcome, not_sent, Failed::Up, what)
    }

    fn failed(&self, outcome: &str, not_sent: bool, failed: Failed, what: String) -> CallError {
        metrics::REMOTE_CALLS.inc(&[&self.name, outcome]);
        let down = failed == Failed::Down;
        CallError {
            message: if down {
                agentq_core::retry::service_parked(&self.name, &what)
            } else {
                format!("remote service {:?}: {what}", self.name)
            },
            not_sent,
            down,
            open_until: None,
        }
    }

    fn parked(&self, open_for: Duration) -> CallError {
        let until = Utc::now() + chrono::Duration::from_std(open_for).unwrap_or_default();
        let mut e = self.failed(
            "parked",
            true,
            Failed::Down,
            format!(
                "its circuit is open after repeated failures, until {}",
                until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
        );
        e.open_until = Some(until);
        e
    }

    /// Sends `body` (a request's JSON) signed, and returns the checked, decoded answer;
    /// through the service's breaker, which hears how the call ended.
    pub(crate) async fn call(&self, body: Vec<u8>) -> Result<Answer, CallError> {
        let admitted = self.breaker.admit().map_err(|d| self.parked(d))?;
        let result = self.send(body).await;
        admitted.settle(match &result {
            Ok(_) => Outcome::Succeeded,
            Err(e) if e.down => Outcome::Failed,
            // The service answered (a refusal, a malformed answer), or is up and hangs.
            Err(_) => Outcome::Neutral,
        });
        result
    }

    async fn send(&self, body: Vec<u8>) -> Result<Answer, CallError> {
        let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
        let timestamp = Utc::now().timestamp();
        let signature = self.secret.sign(&id, timestamp, &body);
        let Ok(url) = format!("{}/agentq/invoke", self.url).parse() else {
            return Err(self.fail(
                "unreachable",
                true,
                format!("{}/agentq/invoke is not a URL", self.url),
            ));
        };
        metrics::REMOTE_BYTES_SENT.add(&[&self.name], body.len() as f64);
        let request = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .timeout(self.timeout)
            .body(body);
        let sent = self.http.send(request).await;
        let timeout_secs = self.timeout.as_secs();
        let mut response = match sent {
            Ok(r) => r,
            // A link-local or metadata address it was not registered for: nothing was sent.
            Err(Refused(why)) => return Err(self.fail("unreachable", true, why)),
            Err(UnapprovedPeer(why)) => return Err(self.fail("unreachable", false, why)),
            Err(Http(e)) if e.is_connect() => {
                return Err(self.failed(
                    "unreachable",
                    true,
                    Failed::Down,
                    format!("connecting to {} failed: {}", self.url, source_of(&e)),
                ));
            }
            Err(Http(e)) if e.is_timeout() => {
                return Err(self.fail(
                    "timeout",
                    false,
                    format!("did not answer within {timeout_secs} s"),
                ));
            }
            // The connection broke before an answer: the service went away mid-call.
            Err(Http(e)) => {
                return Err(self.failed(
                    "unreachable",
                    false,
                    Failed::Down,
                    format!("the call failed: {}", source_of(&e)),
                ));
            }
        };
        let status = response.status();
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let (a_id, a_ts, a_sig) = (
            header("webhook-id"),
            header("webhook-timestamp"),
            header("webhook-signature"),
        );
        // Read at most MAX_ANSWER_BYTES, within what is left of the timeout.
        let mut answer = Vec::new();
        let read = tokio::time::timeout(self.timeout, async {
            while let Some(chunk) = response.chunk().await? {
                if answer.len() + chunk.len() > MAX_ANSWER_BYTES {
                    return Ok::<bool, reqwest::Error>(false);
                }
                answer.extend_from_slice(&chunk);
            }
            Ok(true)
        })
        .await;
        match read {
            Err(_) => {
                return Err(self.fail(
                    "timeout",
                    false,
                    format!("did not finish its answer within {timeout_secs} s"),
                ));
            }
            Ok(Err(e)) => {
                return Err(self.failed(
                    "unreachable",
                    false,
                    Failed::Down,
                    format!("reading the answer failed: {}", source_of(&e)),
                ));
            }
            Ok(Ok(false)) => {
                return Err(self.fail(
                    "oversized",
                    false,
                    format!("answered more than {} MiB", MAX_ANSWER_BYTES >> 20),
                ));
            }
            Ok(Ok(true)) => {}
        }
        if status == reqwest::StatusCode::UNAUTHORIZED {
            return Err(self.fail(
                "refused",
                false,
                "refused agentq's signature (HTTP 401): is it started with the secret `agentq \
                 services add` printed (AGENTQ_SERVICE_SECRET)?"
                    .into(),
            ));
        }
        if !status.is_success() {
            let text = String::from_utf8_lossy(&answer);
            let head: String = text.chars().take(200).collect();
            // A proxy's "no upstream", or the service saying it is overloaded.
            let down = matches!(status.as_u16(), 429 | 502 | 503 | 504);
            return Err(self.failed(
                "status",
                false,
                if down { Failed::Down } else { Failed::Up },
                format!("answered HTTP {}: {head}", status.as_u16()),
            ));
        }
        if a_id.as_deref() != Some(id.as_str()) {
            return Err(self.fail(
                "signature",
                false,
                "answer's signature does not verify: its webhook-id is not the request's".into(),
            ));
        }
        if let Err(e) = webhook::verify(
            std::slice::from_ref(&self.secret),
            a_id.as_deref(),
            a_ts.as_deref(),
            a_sig.as_deref(),
            &answer,
            Utc::now(),
        ) {
            return Err(self.fail(
                "signature",
                false,
                format!("answer's signature does not verify: {e}"),
            ));
        }
        match serde_json::from_slice::<Answer>(&answer) {
            Ok(a) => {
                let outcome = if matches!(a, Answer::Resend {}) {
                    "resend"
                } else {
                    "ok"
                };
                metrics::REMOTE_CALLS.inc(&[&self.name, outcome]);
                Ok(a)
            }
            Err(e) => Err(self.fail(
                "malformed",
                false,
                format!("answered something that is not a step protocol answer: {e}"),
            )),
        }
    }
}

/// The innermost cause of a reqwest error, which says what happened (refused, reset, DNS).
fn source_of(e: &reqwest::Error) -> String {
    let mut cause: &dyn std::error::Error = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[cfg(test)]
mod tests {
    use agentq_core::state::failure::Failure;

    use super::*;

    fn error(not_sent: bool, down: bool) -> CallError {
        CallError {
            message: "m".into(),
            not_sent,
            down,
            open_until: None,
        }
    }

    /// Only a down service parks; an unsafe step's call that never left had no effect, one
    /// that may have arrived is reconciled (its error leaves the outcome unknown).
    #[test]
    fn a_down_service_parks_and_an_unsafe_call_is_settled_by_what_was_sent() {
        let parks = |e: &JobError| matches!(e.failure(), Some(Failure::Overloaded { .. }));
        let outside = error(false, true).into_job_error();
        assert!(parks(&outside) && outside.outcome_unknown());
        let up = error(false, false).into_job_error();
        assert!(!parks(&up) && up.outcome_unknown());

        let never_left = error(true, true).into_step_error();
        assert!(parks(&never_left) && !never_left.outcome_unknown());
        let refused_up = error(true, false).into_step_error();
        assert!(matches!(refused_up.failure(), Some(Failure::NoEffect)));
        let died_mid_call = error(false, true).into_step_error();
        assert!(parks(&died_mid_call) && died_mid_call.outcome_unknown());
        let hung = error(false, false).into_step_error();
        assert!(!parks(&hung) && hung.outcome_unknown());
    }
}
