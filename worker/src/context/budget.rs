//! Token budgets at the model call: before a call is sent its estimate is held against every
//! budget over the operation (`db::budgets::reserve`), and when it returns its reported usage
//! is charged in place of the hold. A call a budget refuses is never sent and journals nothing:
//! the operation's own budget parks it (`waiting` for `budget`, no worker held, no attempt
//! used) until an operator raises the budget or lets one call through, or until the budget's
//! timeout, when it is dead (`budget_exceeded`); its tenant's budget for the period parks it
//! the same way until the period ends (or a raise); its batch's budget pauses the batch and
//! hands the operation back at this step boundary, like an operator's pause.

use agentq_core::db::{self, budgets::Reserved};
use chrono::Utc;
use uuid::Uuid;

use super::JobRun;
use crate::error::{Engine, JobError};
use crate::limits::{Snapshot, budget_may_be_new};
use crate::model::ModelRequest;

/// How long a call waits, holding its slot, for the holds of calls in flight to be charged.
const BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Completion tokens a request that sets no `max_tokens` is estimated to use.
pub const DEFAULT_OUTPUT_ESTIMATE: u32 = 1024;

/// A request's estimate: prompt tokens at about four bytes of its JSON (messages and tool
/// specs) each, and its `max_tokens` (else the client's cap on a request that sets none,
/// `AGENTQ_MODEL_MAX_TOKENS`, else [`DEFAULT_OUTPUT_ESTIMATE`]) of completion.
pub fn estimate(request: &ModelRequest, client_max_tokens: Option<u32>) -> (i64, i64) {
    let bytes = serde_json::to_vec(&request.messages).map_or(0, |v| v.len())
        + serde_json::to_vec(&request.tools).map_or(0, |v| v.len());
    let input = bytes.div_ceil(4) as i64;
    let max_tokens = request.max_tokens.or(client_max_tokens);
    let output = i64::from(max_tokens.unwrap_or(DEFAULT_OUTPUT_ESTIMATE));
    (input, output)
}

impl JobRun {
    /// Holds a call's estimate (`estimate`, asked only when a budget is over the operation)
    /// against the operation's budgets: the hold's id (none when no budget is over it), or the
    /// stop a refusal means.
    pub(super) async fn hold_budget(
        &self,
        estimate: impl FnOnce() -> (i64, i64),
        limits: &Snapshot,
    ) -> Result<Option<Uuid>, JobError> {
        if !self.under_budget(limits).await? {
            return Ok(None);
        }
        let info = &self.inner.info;
        let (input, output) = estimate();
        let waiting_since = std::time::Instant::now();
        let reserved = loop {
            let reserved = db::within(db::budgets::reserve(
                &self.inner.services.pool,
                info.op_id.0,
                info.epoch,
                input,
                output,
            ))
            .await
            .map_err(|e| JobError::no_effect(format!("checking the token budget: {e}")))?;
            if reserved != Reserved::Busy {
                break reserved;
            }
            // Calls in flight hold the room: wait for their charges, briefly, holding the slot;
            // past that, the operation goes back to the queue (its attempt given back).
            if waiting_since.elapsed() >= BUSY_WAIT {
                return Err(JobError::from(Engine::Overloaded {
                    message: "its token budget's room is held by model calls in flight; \
                              retrying once they are charged"
                        .into(),
                    not_before: Some(Utc::now() + chrono::Duration::seconds(2)),
                }));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        };
        match reserved {
            Reserved::Busy => unreachable!("waited for above"),
            Reserved::Unbudgeted => Ok(None),
            Reserved::Held { call_id } => Ok(Some(call_id)),
            Reserved::LeaseLost => {
                self.inner
                    .lost
                    .store(true, std::sync::atomic::Ordering::Release);
                Err(JobError::from(Engine::LeaseLost))
            }
            Reserved::Batch { .. } => {
                agentq_core::metrics::BUDGET_REFUSALS.inc(&["batch"]);
                self.run_state().budget_pause = true;
                Err(JobError::from(Engine::Suspended))
            }
            Reserved::Tenant { period_ends, .. } => {
                agentq_core::metrics::BUDGET_REFUSALS.inc(&["tenant"]);
                let until = period_ends.max(Utc::now());
                self.run_state().suspend =
                    Some((until, Some(db::budgets::WAITING_FOR.to_string())));
                Err(JobError::from(Engine::Suspended))
            }
            Reserved::Operation {
                budget,
                needed,
                exceeded_at,
            } => {
                agentq_core::metrics::BUDGET_REFUSALS.inc(&["operation"]);
                let until = exceeded_at + chrono::Duration::seconds(i64::from(budget.timeout_secs));
                if until <= Utc::now() {
                    return Err(JobError::from(Engine::BudgetExceeded(format!(
                        "its token budget ({} of {} {} tokens spent, {} held) cannot cover a \
                         model call of about {needed}, and was not raised within {} s",
                        budget.spent_tokens,
                        budget.limit_tokens,
                        budget.measure,
                        budget.held_tokens,
                        budget.timeout_secs
                    ))));
                }
                self.run_state().suspend =
                    Some((until, Some(db::budgets::WAITING_FOR.to_string())));
                Err(JobError::from(Engine::Suspended))
            }
        }
    }

    /// Whether a budget may be over the operation: its claim found one, or one was born apart
    /// since (`crate::limits`) and a look finds it over this operation. Asks PostgreSQL only
    /// in that second case, once per such birth.
    async fn under_budget(&self, limits: &Snapshot) -> Result<bool, JobError> {
        let seen = {
            let state = self.run_state();
            if state.budgeted {
                return Ok(true);
            }
            if !budget_may_be_new(limits.newest_budget, self.inner.claim.claimed_at)
                || state.budget_seen == limits.newest_budget
            {
                return Ok(false);
            }
            limits.newest_budget
        };
        let over = db::within(db::budgets::any_over(
            &self.inner.services.pool,
            self.inner.info.op_id.0,
        ))
        .await
        .map_err(|e| JobError::no_effect(format!("checking the token budget: {e}")))?;
        let mut state = self.run_state();
        state.budgeted = over;
        state.budget_seen = seen;
        Ok(over)
    }

    /// Charges a held call `used` tokens (in, out), or its estimate when `None`. A failure to
    /// write the charge leaves the hold, which still counts (and is charged by estimate on the
    /// operation's next call).
    pub(super) async fn charge_budget(&self, call_id: Uuid, used: Option<(i64, i64)>) {
        let charged = db::within(db::budgets::charge(
            &self.inner.services.pool,
            call_id,
            used,
        ));
        if let Err(e) = charged.await {
            tracing::warn!(op_id = %self.inner.info.op_id, error = %e, "charging a model call to its budget failed; its hold stays counted");
        }
    }

    /// Gives back a hold whose call was never sent (a rate limit held it back).
    pub(super) async fn release_budget(&self, call_id: Uuid) {
        self.charge_budget(call_id, Some((0, 0))).await;
    }

    /// Whether the job stopped because its batch's budget is spent (the batch is paused): the
    /// run is handed back at this step boundary.
    pub(crate) fn take_budget_pause(&self) -> bool {
        std::mem::take(&mut self.run_state().budget_pause)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_counts_the_requests_max_tokens_else_the_clients_cap_else_the_default() {
        let mut request = ModelRequest::user("x".repeat(400));
        let (input, output) = estimate(&request, None);
        assert!(
            (100..120).contains(&input),
            "about four bytes a token: {input}"
        );
        assert_eq!(output, i64::from(DEFAULT_OUTPUT_ESTIMATE));
        assert_eq!(
            estimate(&request, Some(64)).1,
            64,
            "AGENTQ_MODEL_MAX_TOKENS"
        );
        request.max_tokens = Some(200);
        assert_eq!(
            estimate(&request, Some(64)).1,
            200,
            "the request's own wins"
        );
    }
}
