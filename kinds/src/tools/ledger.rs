//! The `ledger` tool: a stand-in for an outside system with side effects, a row in
//! `ledger_effects` per effect. The safe variant is idempotent on the step's key, the unsafe one
//! inserts every time it runs; recovery may ask the ledger whether an effect happened.

use std::time::Duration;

use agentq_worker::{EnginePool, JobError, Reconciled, Replay, Tool, ToolContext};
use async_trait::async_trait;
use serde_json::{Value, json};

/// The `ledger` tool: a stand-in for an outside system with side effects, recording each
/// effect under the operation's id and the step's idempotency key.
pub(crate) struct Ledger {
    /// The step name calls are journaled under.
    pub(crate) name: String,
    /// The effect's label; the agent's model passes it as the `label` argument instead.
    pub(crate) label: String,
    pub(crate) replay: Replay,
    /// How long the call takes after its effect happened.
    pub(crate) after_ms: u64,
    /// Whether recovery may ask the ledger if the effect happened.
    pub(crate) reconcile: bool,
}

impl Ledger {
    /// The `ledger` tool the `agent` kind offers: unsafe, reconciled, its label the model's.
    pub(crate) fn for_agents() -> Self {
        Ledger {
            name: "ledger".into(),
            label: "agent".into(),
            replay: Replay::Unsafe,
            after_ms: 0,
            reconcile: true,
        }
    }
}

#[async_trait]
impl Tool for Ledger {
    fn name(&self) -> &str {
        &self.name
    }

    fn replay(&self) -> Replay {
        self.replay
    }

    fn description(&self) -> &str {
        "Record a side effect in the ledger (like sending an email or charging a card)."
    }

    fn parameters(&self) -> Value {
        json!({ "type": "object", "properties": { "label": { "type": "string" } }, "required": ["label"] })
    }

    async fn call(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
        let label = args
            .get("label")
            .and_then(Value::as_str)
            .unwrap_or(&self.label);
        // Under the call deadline like every engine call: a silent server must not hold the
        // run forever (a lost answer leaves the effect unknown, as `ledger_error` says).
        let id = agentq_core::db::within(crate::tables::ledger::record_effect(
            &cx.state::<EnginePool>()?.0,
            cx.info().op_id.0,
            label,
            cx.idempotency_key(),
            self.replay == Replay::Safe,
        ))
        .await
        .map_err(ledger_error)?;
        // The effect has happened; its answer takes a while to arrive.
        tokio::time::sleep(Duration::from_millis(self.after_ms)).await;
        Ok(json!({ "effect_id": id }))
    }

    async fn reconcile(&self, cx: &ToolContext<'_>, _args: &Value) -> Result<Reconciled, JobError> {
        if !self.reconcile {
            return Ok(Reconciled::Unsupported);
        }
        let found = agentq_core::db::within(crate::tables::ledger::find_effect(
            &cx.state::<EnginePool>()?.0,
            cx.idempotency_key(),
        ))
        .await
        .map_err(|e| JobError::retryable(format!("ledger unavailable: {e}")))?;
        Ok(match found {
            Some(id) => Reconciled::Happened(json!({ "effect_id": id })),
            None => Reconciled::NotHappened,
        })
    }
}

/// How a failed ledger write fails the call. No connection to send it on, or PostgreSQL
/// rejecting the statement, means the effect did not happen. A connection lost after the
/// statement was sent leaves it unknown (it may have committed), and so does a server shutting
/// down (SQLSTATE class 57: the session may be ended just after the commit).
fn ledger_error(e: agentq_core::db::Error) -> JobError {
    use agentq_core::db::Error;
    let message = format!("ledger unavailable: {e}");
    let no_effect = match &e {
        Error::Sqlx(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) => true,
        Error::Sqlx(sqlx::Error::Database(db)) => !db
            .code()
            .is_some_and(|c| c.starts_with("57") || c.starts_with("08")),
        _ => false,
    };
    if no_effect {
        JobError::no_effect(message)
    } else {
        JobError::retryable(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_error_says_whether_the_effect_may_have_happened() {
        use agentq_core::db::Error;
        let never_sent = ledger_error(Error::Sqlx(sqlx::Error::PoolTimedOut));
        assert!(
            matches!(never_sent, JobError::NoEffect(_)),
            "{never_sent:?}"
        );
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let answer_lost = ledger_error(Error::Sqlx(sqlx::Error::Io(reset)));
        assert!(
            matches!(answer_lost, JobError::Retryable { .. }),
            "{answer_lost:?}"
        );
    }
}
