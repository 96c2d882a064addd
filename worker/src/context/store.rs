//! The store a job context keeps its operation's state in: the journal, its waits, joins and
//! children. One interface, two implementations: [`Postgres`], the worker's (the group-committed
//! journal, the fenced statements of `agentq_core::db`), and the replay tester's memory
//! (`crate::testing`), which also watches every step and effect through the hooks below (no-ops
//! for PostgreSQL). The context calls the store and nothing else for these; it never asks which
//! one it has.

use agentq_core::db;
use agentq_core::db::children::Join;
use agentq_core::db::settle::RunWrite;
use agentq_core::db::steps::StepBatch;
use agentq_core::db::timers::Wait;
use agentq_core::group_commit::Written;
use agentq_core::operation::Requires;
use agentq_core::state::{Replay, StepKind};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::Services;
use crate::error::JobError;
use crate::tool::Reconciled;
use agentq_sdk::OperationInfo;

/// What a job context asks of its store (each method stands for the PostgreSQL statement it
/// runs in [`Postgres`]).
#[async_trait]
pub(crate) trait Store: Send + Sync {
    /// A durable journal write of one operation's rows (the group commit's statement):
    /// whether the claim still held, or the rows back, unwritten.
    async fn write(&self, services: &Services, batch: StepBatch) -> Written<RunWrite>;
    /// `db::timers::resolve_wait`.
    async fn resolve_wait(
        &self,
        services: &Services,
        info: &OperationInfo,
        seq: i32,
        name: &str,
        deadline: DateTime<Utc>,
    ) -> db::Result<Wait>;
    /// `db::children::resolve_join`.
    async fn resolve_join(
        &self,
        services: &Services,
        info: &OperationInfo,
        seq: i32,
        ids: &[uuid::Uuid],
    ) -> db::Result<Join>;
    /// A child stored with the step's `key` (checked already as an enqueue checks): its id.
    async fn spawn(
        &self,
        services: &Services,
        info: &OperationInfo,
        key: &str,
        kind: &str,
        input: &Value,
        requires: &Requires,
    ) -> Result<uuid::Uuid, JobError>;

    /// A step about to run its body, or a park about to be recorded: `Err` stops the run.
    fn step_runs(&self, _seq: i32, _kind: StepKind) -> Result<(), JobError> {
        Ok(())
    }
    /// A recovery about to ask a reconcile whether an unsafe call happened: `Err` stops the run.
    fn before_reconcile(&self) -> Result<(), JobError> {
        Ok(())
    }
    /// A step's body (a tool call, an unsafe closure) about to run with the step's key,
    /// after what must be durable before it is.
    fn effect_begins(&self, _key: &str, _name: &str, _replay: Replay) -> Result<(), JobError> {
        Ok(())
    }
    /// A step's body returned: its effect happened.
    fn effect_happened(&self, _key: &str, _output: &Value) {}
    /// A reconcile of the step `name` at `seq` with `key` answered.
    fn reconciled(&self, _seq: i32, _name: &str, _key: &str, _answer: &Reconciled) {}
}

/// The worker's store: agentq's PostgreSQL database.
pub(crate) struct Postgres;

#[async_trait]
impl Store for Postgres {
    async fn write(&self, services: &Services, batch: StepBatch) -> Written<RunWrite> {
        services
            .journal
            .write(&services.pool, RunWrite::Steps(batch))
            .await
    }

    async fn resolve_wait(
        &self,
        services: &Services,
        info: &OperationInfo,
        seq: i32,
        name: &str,
        deadline: DateTime<Utc>,
    ) -> db::Result<Wait> {
        let (id, epoch) = (info.op_id.0, info.epoch);
        db::within(db::timers::resolve_wait(
            &services.pool,
            id,
            epoch,
            seq,
            name,
            deadline,
        ))
        .await
    }

    async fn resolve_join(
        &self,
        services: &Services,
        info: &OperationInfo,
        seq: i32,
        ids: &[uuid::Uuid],
    ) -> db::Result<Join> {
        let (id, epoch) = (info.op_id.0, info.epoch);
        db::within(db::children::resolve_join(
            &services.pool,
            id,
            epoch,
            seq,
            ids,
        ))
        .await
    }

    async fn spawn(
        &self,
        services: &Services,
        info: &OperationInfo,
        key: &str,
        kind: &str,
        input: &Value,
        requires: &Requires,
    ) -> Result<uuid::Uuid, JobError> {
        services
            .spawn_stored(info, key, kind, input, requires)
            .await
    }
}
