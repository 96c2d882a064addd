//! The one interface a kind's [`JobContext`](super::JobContext) handle calls
//! (`agentq_sdk::context::Backend`), implemented by [`JobRun`]: each method is the runner's
//! own (steps, model and tool calls, parks, children), here only named for the handle.

use std::sync::Arc;

use agentq_core::origins::Origins;
use agentq_core::state::StepStatus;
use agentq_sdk::context::{Backend, Step};
use agentq_sdk::provided::Provided;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{ChildOutcome, JobRun, OperationInfo, SignalOutcome};
use crate::error::JobError;
use crate::model::{ModelRequest, ModelResponse};
use crate::tool::Tool;

#[async_trait]
impl Backend for JobRun {
    fn info(&self) -> &OperationInfo {
        JobRun::info(self)
    }

    fn http_allow(&self) -> Arc<Origins> {
        self.services().http_allow.clone()
    }

    fn provided(&self) -> &Provided {
        &self.services().provided
    }

    fn registered_tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.services().tools.get(name).cloned()
    }

    fn idempotency_key(&self) -> Option<String> {
        JobRun::idempotency_key(self)
    }

    fn peek_recorded(&self) -> Option<(String, StepStatus)> {
        JobRun::peek_recorded(self)
    }

    fn skip_recorded(&self) -> bool {
        JobRun::skip_recorded(self)
    }

    fn patched(&self, change_id: &str) -> Result<bool, JobError> {
        JobRun::patched(self, change_id)
    }

    async fn step<'r, 'b>(&'b self, step: Step<'r, 'b>) -> Result<Option<Value>, JobError> {
        self.own_step(step).await
    }

    async fn model(&self, name: &str, request: ModelRequest) -> Result<ModelResponse, JobError> {
        JobRun::model(self, name, request).await
    }

    async fn tool<'a>(
        &'a self,
        tool: &'a dyn Tool,
        args: Value,
        report_errors: bool,
    ) -> Result<Value, JobError> {
        self.tool_step(tool, args, report_errors).await
    }

    async fn now(&self) -> Result<DateTime<Utc>, JobError> {
        JobRun::now(self).await
    }

    async fn uuid(&self) -> Result<uuid::Uuid, JobError> {
        JobRun::uuid(self).await
    }

    async fn sleep_until(&self, until: DateTime<Utc>) -> Result<(), JobError> {
        JobRun::sleep_until(self, until).await
    }

    async fn wait_for_signal(
        &self,
        name: &str,
        timeout: std::time::Duration,
        about: Value,
    ) -> Result<SignalOutcome, JobError> {
        self.wait_for_signal_about(name, timeout, about).await
    }

    async fn spawn(&self, kind: &str, input: Value) -> Result<uuid::Uuid, JobError> {
        JobRun::spawn(self, kind, input).await
    }

    async fn join(&self, children: &[uuid::Uuid]) -> Result<Vec<ChildOutcome>, JobError> {
        JobRun::join(self, children).await
    }
}
