//! The gate every model call of a worker passes: a limit of calls in flight (a number, or
//! found from the provider's pushback; waiting calls granted a tenant at a time, so one
//! tenant's batch cannot starve another's calls: `crate::limiter`), a circuit breaker, and a
//! few short in-step retries for transient errors (with a found limit, a call refused as
//! overloaded goes again once it has a slot under the lowered limit).
//!
//! The breaker (`crate::breaker`) opens after a burst of failures (overloaded, rate-limited,
//! 5xx, broken connections). While it is open, calls fail at once as `Overloaded` with the time
//! it may close, so their operations are parked (re-queued with a later `run_at`, attempt given
//! back) instead of hammering the provider.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentq_core::config::CallLimit;
use agentq_core::metrics;
use chrono::Utc;

use crate::breaker::{Admitted, Breaker, BreakerSettings, Outcome};
use crate::limiter::{Limiter, Permit};
use crate::model::{ModelClient, ModelError, ModelRequest, ModelResponse};

/// Limits and breaker settings.
#[derive(Clone, Debug)]
pub struct GateSettings {
    /// Model calls in flight per worker process.
    pub concurrency: CallLimit,
    /// Model calls in flight per tenant per worker process (`None`: no cap of its own).
    pub per_tenant: Option<usize>,
    /// Consecutive failures that open the breaker.
    pub failure_threshold: u32,
    /// First cool-down; doubles on each failed probe, up to `max_cooldown`.
    pub cooldown: Duration,
    pub max_cooldown: Duration,
    /// In-step retries of a transient failure (short, before the job-level retry takes over).
    pub retries: u32,
    /// Model name per job kind, used when a request names none (`AGENTQ_MODEL_BY_KIND`).
    pub model_by_kind: HashMap<String, String>,
}

impl Default for GateSettings {
    fn default() -> Self {
        Self {
            concurrency: CallLimit::Auto,
            per_tenant: None,
            failure_threshold: 5,
            cooldown: Duration::from_secs(5),
            max_cooldown: Duration::from_secs(60),
            retries: 2,
            model_by_kind: HashMap::new(),
        }
    }
}

/// A call slot of the process, counted as its tenant's, held until the call returns.
pub struct Slots {
    permit: Permit,
}

/// The model client behind its limits and breaker.
pub struct ModelGate {
    client: Arc<dyn ModelClient>,
    settings: GateSettings,
    limiter: Arc<Limiter>,
    breaker: Breaker,
}

impl ModelGate {
    /// Puts `client` behind a gate.
    pub fn new(client: Arc<dyn ModelClient>, settings: GateSettings) -> Self {
        let provider = provider_label(client.as_ref());
        // The first parked call must show as an increase (deploy/alerts.yml reads this counter).
        for class in ["retryable", "overloaded", "non_retryable", "parked"] {
            metrics::MODEL_CALL_ERRORS.start_at_zero(&[&provider, class]);
        }
        let breaker = {
            let label = provider.clone();
            Breaker::new(
                "model",
                client.provider().to_string(),
                BreakerSettings {
                    failure_threshold: settings.failure_threshold,
                    cooldown: settings.cooldown,
                    max_cooldown: settings.max_cooldown,
                },
                Box::new(move |state| metrics::BREAKER_STATE.set(&[&label], state)),
            )
        };
        Self {
            limiter: Limiter::new(settings.concurrency, settings.per_tenant, provider),
            client,
            settings,
            breaker,
        }
    }

    /// The breaker's state, for logs and status lines.
    pub fn breaker(&self) -> String {
        self.breaker.describe()
    }

    /// Where a call of `kind`'s `request` goes: the provider's host (`local` for the built-in
    /// model) and the model it asks for (the request's, else the kind's configured one, else
    /// the client's default), as rate limits of scope `model` name them.
    pub fn target(&self, kind: &str, request: &ModelRequest) -> (String, String) {
        let provider = provider_label(self.client.as_ref());
        let host = provider
            .split_once("://")
            .map_or(provider.as_str(), |(_, rest)| rest)
            .split(['/', '?'])
            .next()
            .unwrap_or_default();
        let host = host.rsplit_once('@').map_or(host, |(_, h)| h).to_string();
        let model = request
            .model
            .as_deref()
            .or(self.settings.model_by_kind.get(kind).map(String::as_str))
            .or(self.client.default_model())
            .unwrap_or("default")
            .to_string();
        (host, model)
    }

    /// The `max_tokens` the client sends on a request that sets none (what a call's estimate
    /// counts for its answer), if it caps them.
    pub fn max_tokens(&self) -> Option<u32> {
        self.client.default_max_tokens()
    }

    /// Runs one model call for `tenant`'s operation of `kind` through the limits, the breaker and
    /// in-step retries.
    pub async fn call(
        &self,
        tenant: &str,
        kind: &str,
        request: &ModelRequest,
    ) -> Result<ModelResponse, ModelError> {
        let slots = self.slots(tenant).await;
        self.send(slots, kind, request, true).await
    }

    /// Waits for a call slot for `tenant`'s call. A call under a rate limit takes it before
    /// it reserves its tokens, so that it is sent as soon as it is reserved.
    pub async fn slots(&self, tenant: &str) -> Slots {
        Slots {
            permit: self.limiter.acquire(tenant).await,
        }
    }

    /// Sends one model call in the `slots` it holds, through the breaker, with in-step retries
    /// of transient errors if `retry_in_step` (a call under a rate limit is sent once per
    /// reservation: its retry reserves again).
    pub async fn send(
        &self,
        slots: Slots,
        kind: &str,
        request: &ModelRequest,
        retry_in_step: bool,
    ) -> Result<ModelResponse, ModelError> {
        let mut permit = slots.permit;
        let overridden;
        let request = match (&request.model, self.settings.model_by_kind.get(kind)) {
            (None, Some(model)) => {
                overridden = ModelRequest {
                    model: Some(model.clone()),
                    ..request.clone()
                };
                &overridden
            }
            _ => request,
        };
        let mut attempt = 0;
        let provider = provider_label(self.client.as_ref());
        loop {
            let admitted = match self.admit() {
                Ok(admitted) => admitted,
                Err(e) => {
                    metrics::MODEL_CALL_ERRORS.inc(&[&provider, "parked"]);
                    return Err(e);
                }
            };
            let called = Instant::now();
            let result = self.client.complete(request).await;
            metrics::MODEL_CALL_DURATION.observe(&[&provider], called.elapsed().as_secs_f64());
            match &result {
                Ok(resp) => {
                    metrics::MODEL_TOKENS.add(&[kind, "prompt"], resp.usage.prompt_tokens as f64);
                    let completion = resp.usage.completion_tokens as f64;
                    metrics::MODEL_TOKENS.add(&[kind, "completion"], completion);
                }
                Err(e) => metrics::MODEL_CALL_ERRORS.inc(&[&provider, error_class(e)]),
            }
            // The limit hears every answer; the breaker a failure only when it is news: a
            // found limit's overshoot (calls sent before it came down) is no outage.
            let outcome = match &result {
                Ok(_) => {
                    permit.returned();
                    Outcome::Succeeded
                }
                Err(ModelError::NonRetryable { .. }) => Outcome::Neutral,
                Err(_) if permit.pushed_back() => Outcome::Failed,
                Err(_) => Outcome::Neutral,
            };
            admitted.settle(outcome);
            match &result {
                Err(ModelError::Retryable { retry_after, .. })
                    if retry_in_step && attempt < self.settings.retries =>
                {
                    let backoff = Duration::from_millis(200 * 4u64.pow(attempt));
                    let wait = retry_after
                        .and_then(|t| (t - Utc::now()).to_std().ok())
                        .unwrap_or(backoff)
                        .max(backoff);
                    if wait > Duration::from_secs(2) {
                        return result; // too long to hold a slot: the job-level retry waits instead
                    }
                    attempt += 1;
                    tokio::time::sleep(wait).await;
                }
                // A found limit came down for this overload (or an earlier one of its round
                // trip): the call waits for a slot under the new limit and goes again, rather
                // than parking its operation for seconds. The breaker still hears the news.
                Err(ModelError::Overloaded { retry_after, .. })
                    if retry_in_step
                        && attempt < self.settings.retries
                        && self.settings.concurrency == CallLimit::Auto
                        && retry_after.is_none_or(|t| t <= Utc::now()) =>
                {
                    attempt += 1;
                    permit = permit.again().await;
                }
                _ => return result,
            }
        }
    }

    fn admit(&self) -> Result<Admitted<'_>, ModelError> {
        self.breaker.admit().map_err(|for_| self.parked(for_))
    }

    fn parked(&self, for_: Duration) -> ModelError {
        let until = Utc::now() + chrono::Duration::from_std(for_).unwrap_or_default();
        ModelError::Overloaded {
            message: agentq_core::retry::breaker_parked(self.client.provider(), until),
            retry_after: Some(until),
        }
    }
}

/// The provider as a metric label: its name or URL, without a query and with any password
/// replaced.
fn provider_label(client: &dyn ModelClient) -> String {
    let provider = client.provider();
    agentq_core::config::redact_url(provider.split('?').next().unwrap_or(provider))
}

/// A model error's class as a metric label.
fn error_class(e: &ModelError) -> &'static str {
    match e {
        ModelError::Retryable { .. } => "retryable",
        ModelError::Overloaded { .. } => "overloaded",
        ModelError::NonRetryable { .. } => "non_retryable",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Flaky {
        calls: AtomicU32,
        fail_first: u32,
    }

    #[async_trait]
    impl ModelClient for Flaky {
        fn provider(&self) -> &str {
            "flaky"
        }
        async fn complete(&self, r: &ModelRequest) -> Result<ModelResponse, ModelError> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            if n < self.fail_first {
                Err(ModelError::Overloaded {
                    message: "529".into(),
                    retry_after: None,
                })
            } else {
                crate::model::LocalModel.complete(r).await
            }
        }
    }

    #[tokio::test]
    async fn the_breaker_opens_parks_and_closes_through_a_ramp() {
        let client = Arc::new(Flaky {
            calls: AtomicU32::new(0),
            fail_first: 5,
        });
        let gate = ModelGate::new(
            client.clone(),
            GateSettings {
                cooldown: Duration::from_millis(200),
                ..Default::default()
            },
        );
        let req = ModelRequest::user("hi");
        for _ in 0..5 {
            assert!(matches!(
                gate.call("t", "k", &req).await,
                Err(ModelError::Overloaded { .. })
            ));
        }
        // Open: calls are parked without reaching the provider.
        let parked = gate.call("t", "k", &req).await;
        assert!(matches!(
            parked,
            Err(ModelError::Overloaded {
                retry_after: Some(_),
                ..
            })
        ));
        assert_eq!(client.calls.load(Ordering::SeqCst), 5);
        assert!(gate.breaker().starts_with("open"));
        tokio::time::sleep(Duration::from_millis(250)).await;
        for _ in 0..crate::breaker::CLOSE_AFTER {
            assert!(gate.call("t", "k", &req).await.is_ok());
        }
        assert!(gate.breaker().starts_with("closed"), "{}", gate.breaker());
    }

    /// Fails its first `fail_first` calls, then hangs every call until `release` is notified.
    struct Hanging {
        calls: AtomicU32,
        fail_first: u32,
        entered: tokio::sync::Notify,
    }

    #[async_trait]
    impl ModelClient for Hanging {
        fn provider(&self) -> &str {
            "hanging"
        }
        async fn complete(&self, r: &ModelRequest) -> Result<ModelResponse, ModelError> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            if n < self.fail_first {
                return Err(ModelError::Overloaded {
                    message: "529".into(),
                    retry_after: None,
                });
            }
            if n == self.fail_first {
                // The probe: it never answers (its job is dropped while it waits).
                self.entered.notify_one();
                std::future::pending::<()>().await;
            }
            crate::model::LocalModel.complete(r).await
        }
    }

    #[tokio::test]
    async fn a_dropped_probe_gives_its_slot_back_and_the_next_call_is_admitted() {
        let client = Arc::new(Hanging {
            calls: AtomicU32::new(0),
            fail_first: 5,
            entered: tokio::sync::Notify::new(),
        });
        let gate = Arc::new(ModelGate::new(
            client.clone(),
            GateSettings {
                cooldown: Duration::from_millis(50),
                retries: 0,
                ..Default::default()
            },
        ));
        let req = ModelRequest::user("hi");
        for _ in 0..5 {
            assert!(gate.call("t", "k", &req).await.is_err());
        }
        assert!(gate.breaker().starts_with("open"), "{}", gate.breaker());
        // Wait out the cool-down by polling the state, not by sleeping a fixed time.
        let end = Instant::now() + Duration::from_secs(10);
        while gate.admit().map(drop).is_err() {
            assert!(Instant::now() < end, "the breaker never half-opened");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // (That admission was a probe, settled as neutral when dropped: one is allowed again.)
        assert!(
            gate.breaker().starts_with("half-open (0"),
            "{}",
            gate.breaker()
        );

        // The probe's job is dropped in the middle of its call (its operation was cancelled
        // or its lease lost): the gate is held at the provider, then the future goes away.
        let probe = {
            let gate = gate.clone();
            let req = req.clone();
            tokio::spawn(async move { gate.call("t", "k", &req).await })
        };
        client.entered.notified().await;
        assert!(
            gate.breaker().starts_with("half-open (1"),
            "{}",
            gate.breaker()
        );
        // While the probe is in flight, nothing else is let through.
        assert!(matches!(
            gate.call("t", "k", &req).await,
            Err(ModelError::Overloaded { .. })
        ));
        probe.abort();
        assert!(probe.await.unwrap_err().is_cancelled());
        assert!(
            gate.breaker().starts_with("half-open (0"),
            "{}",
            gate.breaker()
        );

        // The next call is admitted and reaches the provider.
        let before = client.calls.load(Ordering::SeqCst);
        assert!(gate.call("t", "k", &req).await.is_ok());
        assert_eq!(client.calls.load(Ordering::SeqCst), before + 1);
    }
}
