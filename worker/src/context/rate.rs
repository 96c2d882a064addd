//! What a model call holds before it is sent, in PostgreSQL, where every worker sees it: its
//! estimate against the token budgets over its operation (`super::budget`), then a reservation
//! in every rate limit over the call (`db::rate_limits`): its provider or model, its tenant,
//! its operation's `rate_key`. When it returns, both are corrected to its reported usage.
//!
//! A call under no budget and no limit asks PostgreSQL nothing: the claim said whether a
//! budget was over the operation, and the process's snapshot of the limits (`crate::limits`)
//! says which rate limits exist.
//!
//! A window without room for the call holds it in its slot if it reopens within
//! [`SHORT_WAIT`]; otherwise the operation parks (`waiting` for `(rate limit …)`, no slot, no
//! attempt used) until shortly before the window reopens, and its next run reserves again.

use std::time::{Duration, Instant};

use agentq_core::db::{self, rate_limits::Target};
use agentq_core::metrics;
use chrono::Utc;
use uuid::Uuid;

use super::JobRun;
use super::budget::estimate;
use crate::error::{Engine, JobError};
use crate::gate::Slots;
use crate::grants::{Outcome, Share};
use crate::model::{ModelError, ModelRequest, ModelResponse};

/// The longest a call waits in its worker slot for a rate limit's window; past it, it parks.
pub const SHORT_WAIT: Duration = Duration::from_secs(2);

/// How often a refused call asks again while calls in flight in its window may make room.
const SETTLE_POLL: Duration = Duration::from_millis(100);

/// A parked operation is woken this long before its window reopens (the wake-up, claim and
/// dispatch take some of it), then waits the rest in its slot.
const WAKE_EARLY: chrono::Duration = chrono::Duration::milliseconds(1_000);

/// What a call holds until it returns.
pub(super) struct CallHolds {
    budget: Option<Uuid>,
    rate: Option<Share>,
}

impl JobRun {
    /// Holds `request`'s estimate against its operation's budgets, takes the model call slots
    /// it is sent in, and reserves it in the rate limits over it; or the stop a refusal means
    /// (nothing is held then). The reservation is made in the slots, so the call is sent the
    /// moment it is reserved: the window it was checked against is the one it arrives in.
    pub(super) async fn hold_call(
        &self,
        request: &ModelRequest,
    ) -> Result<(CallHolds, Slots), JobError> {
        // Estimated (the request serialized) only when a budget or a limit is over the call.
        let estimated = std::sync::OnceLock::new();
        let estimate =
            || *estimated.get_or_init(|| estimate(request, self.inner.services.model.max_tokens()));
        let mut holds = CallHolds {
            budget: None,
            rate: None,
        };
        let info = &self.inner.info;
        let gate = &self.inner.services.model;
        let limits = self
            .inner
            .services
            .call_limits
            .current()
            .await
            .map_err(|e| JobError::no_effect(format!("reading the model call limits: {e}")))?;
        holds.budget = self.hold_budget(estimate, &limits).await?;
        if limits.targets.is_empty() {
            return Ok((holds, gate.slots(&info.tenant).await));
        }
        let (host, model) = gate.target(&info.kind, request);
        let rate_key = self.inner.claim.rate_key.as_deref();
        let over: Vec<&Target> = limits
            .targets
            .iter()
            .filter(|t| t.covers(&info.tenant, rate_key, &host, &model))
            .collect();
        if over.is_empty() {
            return Ok((holds, gate.slots(&info.tenant).await));
        }
        let (input, output) = estimate();
        match self.reserve_rate(&over, input + output).await {
            Ok((held, slots)) => {
                holds.rate = held;
                Ok((holds, slots))
            }
            Err(e) => {
                if let Some(call_id) = holds.budget {
                    self.release_budget(call_id).await;
                }
                Err(e)
            }
        }
    }

    /// Whether the call is sent with the gate's in-step retries: not under a rate limit, where
    /// each send is reserved (a transient failure is retried by the operation, which reserves
    /// again).
    pub(super) fn retry_in_step(holds: &CallHolds) -> bool {
        holds.rate.is_none()
    }

    async fn reserve_rate(
        &self,
        over: &[&Target],
        tokens: i64,
    ) -> Result<(Option<Share>, Slots), JobError> {
        let ids: Vec<Uuid> = over.iter().map(|t| t.id).collect();
        let named = |id: Uuid| *over.iter().find(|t| t.id == id).unwrap_or(&over[0]);
        let waiting_since = Instant::now();
        loop {
            let slots = self
                .inner
                .services
                .model
                .slots(&self.inner.info.tenant)
                .await;
            let grants = &self.inner.services.call_limits.grants;
            let reserved = grants
                .reserve(&self.inner.info.tenant, &ids, tokens)
                .await
                .map_err(|e| JobError::no_effect(format!("reserving in its rate limits: {e}")))?;
            let (limit, reopens_at, settling) = match reserved {
                Outcome::Held(share) => return Ok((Some(share), slots)),
                Outcome::Gone => return Ok((None, slots)),
                Outcome::Never { limit, reserved } => {
                    let limit = named(limit);
                    metrics::RATE_LIMITED.inc(&[limit.scope.as_str(), "never"]);
                    return Err(JobError::NonRetryable(format!(
                        "a model call reserving about {reserved} tokens is more than rate limit \
                         {} {} allows in a whole window: it can never be sent under it; raise \
                         the limit (agentq limits set) or ask for fewer tokens (max_tokens)",
                        limit.scope.as_str(),
                        limit.label()
                    )));
                }
                Outcome::Refused {
                    limit,
                    reopens_at,
                    settling,
                } => (named(limit), reopens_at, settling),
            };
            drop(slots); // a waiting call holds no model call slot
            if settling && waiting_since.elapsed() < SHORT_WAIT {
                // Calls in flight reserved more than they may use: their correction can make
                // room long before the window's oldest calls leave it.
                metrics::RATE_LIMITED.inc(&[limit.scope.as_str(), "waited"]);
                tokio::time::sleep(SETTLE_POLL).await;
                continue;
            }
            let wait = (reopens_at - Utc::now()).to_std().unwrap_or_default();
            if waiting_since.elapsed() + wait <= SHORT_WAIT {
                metrics::RATE_LIMITED.inc(&[limit.scope.as_str(), "waited"]);
                tokio::time::sleep(wait.max(Duration::from_millis(5))).await;
                continue;
            }
            metrics::RATE_LIMITED.inc(&[limit.scope.as_str(), "parked"]);
            let wake = (reopens_at - WAKE_EARLY).max(Utc::now());
            let waiting_for = db::rate_limits::waiting_for(limit, reopens_at);
            self.run_state().suspend = Some((wake, Some(waiting_for)));
            return Err(JobError::from(Engine::Suspended));
        }
    }

    /// Charges what a held call used: its reported usage; its estimate when none was reported,
    /// or when a transient failure may have been charged by the provider; nothing when the
    /// provider refused it. A failure to write leaves the holds as they were: a budget's is
    /// charged by estimate on the operation's next call, a rate reservation stays at estimate.
    pub(super) async fn settle_call(
        &self,
        holds: CallHolds,
        called: &Result<ModelResponse, ModelError>,
    ) {
        let used = match called {
            Ok(r) if r.usage.unreported => None,
            Ok(r) => Some((
                r.usage.prompt_tokens as i64,
                r.usage.completion_tokens as i64,
            )),
            Err(ModelError::Retryable { .. }) => None,
            Err(_) => Some((0, 0)),
        };
        if let Some(call_id) = holds.budget {
            self.charge_budget(call_id, used).await;
        }
        if let Some(share) = holds.rate {
            let used = used.map_or(share.estimate(), |(i, o)| i + o);
            let grants = &self.inner.services.call_limits.grants;
            grants.settle_call(share, used).await;
        }
    }
}
