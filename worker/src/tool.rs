//! Tools: side effects a job performs through [`JobContext::tool`](crate::JobContext::tool).
//! Each tool declares whether a call may be repeated after a crash left its outcome unknown,
//! and may implement [`Tool::reconcile`] to ask the outside system whether it happened.

use async_trait::async_trait;
use serde_json::Value;

use crate::error::JobError;

/// Whether a step may run again after a crash left its outcome unknown (a typed state of
/// `agentq_core::state`, re-exported for kinds).
pub use agentq_core::state::Replay;

/// What the outside system says about an effect whose outcome was lost in a crash.
#[derive(Clone, Debug, PartialEq)]
pub enum Reconciled {
    /// It happened; this is the output the call would have returned.
    Happened(Value),
    /// It did not happen; the call may run now.
    NotHappened,
    /// This tool cannot tell: the operation goes to the DLQ as `unknown_side_effect`.
    Unsupported,
}

/// A tool callable from a job.
#[async_trait]
pub trait Tool: Send + Sync {
    /// The step name the call is journaled under.
    fn name(&self) -> &str;

    /// `Safe` if repeating a call with the same idempotency key is harmless.
    fn replay(&self) -> Replay;

    /// What the tool does, for a model choosing tools in the agent loop.
    fn description(&self) -> &str {
        ""
    }

    /// JSON Schema of the arguments, for the model.
    fn parameters(&self) -> Value {
        serde_json::json!({ "type": "object" })
    }

    /// Whether the agent loop must get a human's approval (signal `approval`) before each call.
    fn requires_approval(&self) -> bool {
        false
    }

    /// Performs the call. `idempotency_key` is stable across retries and crashes: pass it to
    /// the outside system so it can deduplicate.
    ///
    /// How an error is classed matters for an `Unsafe` tool. [`JobError::NoEffect`] says the
    /// call certainly did nothing (never sent; refused before acting), so the next attempt
    /// runs it again. A `Retryable` or `Overloaded` error (a timeout, a dropped connection)
    /// leaves the outcome unknown: the step is journaled `unknown` and the next attempt
    /// reconciles it, or fails closed. `NonRetryable` means it failed for good.
    async fn call(&self, args: &Value, idempotency_key: &str) -> Result<Value, JobError>;

    /// Asks the outside system whether the call with `idempotency_key` already happened.
    async fn reconcile(
        &self,
        _args: &Value,
        _idempotency_key: &str,
    ) -> Result<Reconciled, JobError> {
        Ok(Reconciled::Unsupported)
    }
}
