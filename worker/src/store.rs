//! The store a job context writes to instead of PostgreSQL when the replay tester
//! ([`crate::testing`]) runs it: the journal, waits and joins kept in memory, and every step
//! and effect watched. Only the tester implements it; a worker's contexts have none.

use agentq_core::db::children::Join;
use agentq_core::db::steps::StepWrite;
use agentq_core::db::timers::Wait;
use agentq_core::state::{Replay, StepKind};
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::error::JobError;
use crate::tool::Reconciled;

/// What a job context asks of its store in the replay tester (each method stands for the
/// PostgreSQL statement named on it).
pub(crate) trait Store: Send + Sync {
    /// A durable journal write (the group commit's statement).
    fn write(&self, rows: Vec<StepWrite>);
    /// A step about to run its body, or a park about to be recorded: `Err` stops the run.
    fn step_runs(&self, seq: i32, kind: StepKind) -> Result<(), JobError>;
    /// A recovery about to ask a tool whether an unsafe call happened: `Err` stops the run.
    fn before_reconcile(&self) -> Result<(), JobError>;
    /// A step's body (a tool call, an unsafe closure) about to run with the step's key,
    /// after what must be durable before it is.
    fn effect_begins(&self, key: &str, name: &str, replay: Replay) -> Result<(), JobError>;
    /// A step's body returned: its effect happened.
    fn effect_happened(&self, key: &str, output: &Value);
    /// A reconcile of the step `name` at `seq` with `key` answered.
    fn reconciled(&self, seq: i32, name: &str, key: &str, answer: &Reconciled);
    /// A child's insert (`db::children::spawn`): its id.
    fn spawn(&self, key: &str, kind: &str, input: &Value) -> uuid::Uuid;
    /// `db::timers::resolve_wait`.
    fn resolve_wait(&self, seq: i32, name: &str, deadline: DateTime<Utc>) -> Wait;
    /// `db::children::resolve_join`.
    fn resolve_join(&self, seq: i32, ids: &[uuid::Uuid]) -> Join;
}
