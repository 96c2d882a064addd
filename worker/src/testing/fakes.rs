//! The stand-ins a tester's run uses for the outside world: the scripted model
//! ([`ModelScript`]) and fake tools ([`FakeTool`]), each bound to one run's memory so a fake's
//! reconcile sees what happened before the crash that run starts from.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use super::memory::Memory;
use crate::error::JobError;
use crate::model::{ModelClient, ModelError, ModelRequest, ModelResponse};
use crate::tool::{Reconciled, Replay, Tool, ToolContext};

/// A scripted model's answer to a request, from the request and the model step's number.
pub type ModelFn = Arc<dyn Fn(&ModelRequest, usize) -> ModelResponse + Send + Sync>;

/// What a scripted model answers.
#[derive(Clone)]
pub enum ModelScript {
    /// The `n`-th model step of the operation (counted from 0 in journal order, whatever run
    /// makes it) gets the `n`-th answer; past the end, the last one.
    Replies(Vec<ModelResponse>),
    /// Each call answered by a function of the request and of the model step's number.
    Function(ModelFn),
    /// The built-in local model: it answers with the last user message.
    Echo,
}

impl ModelScript {
    /// Answers in order (see [`ModelScript::Replies`]).
    pub fn replies(replies: impl IntoIterator<Item = ModelResponse>) -> Self {
        ModelScript::Replies(replies.into_iter().collect())
    }

    /// Answers from a function of the request and the model step's number.
    pub fn function(
        f: impl Fn(&ModelRequest, usize) -> ModelResponse + Send + Sync + 'static,
    ) -> Self {
        ModelScript::Function(Arc::new(f))
    }
}

/// A tool standing in for a real one of the same name while the tester runs: it answers from
/// a function of its arguments, and, where it [`FakeTool::reconciles`], says an effect
/// happened exactly when one happened before the crash the tester is simulating.
#[derive(Clone)]
pub struct FakeTool {
    pub(super) name: String,
    replay: Replay,
    reconciles: bool,
    approval: bool,
    respond: Arc<dyn Fn(&Value) -> Value + Send + Sync>,
}

impl FakeTool {
    /// A fake of the tool `name` with `replay`'s policy, answering `respond(args)`.
    pub fn new(
        name: &str,
        replay: Replay,
        respond: impl Fn(&Value) -> Value + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.to_string(),
            replay,
            reconciles: false,
            approval: false,
            respond: Arc::new(respond),
        }
    }

    /// It can be reconciled (the real tool implements [`Tool::reconcile`]).
    pub fn reconciles(mut self) -> Self {
        self.reconciles = true;
        self
    }

    /// Every call waits for a human's approval first (the real tool's `requires_approval`).
    pub fn requires_approval(mut self) -> Self {
        self.approval = true;
        self
    }
}

/// A fake tool bound to one run's memory, so its reconcile sees that run's scenario.
pub(super) struct BoundFake {
    pub(super) fake: FakeTool,
    pub(super) memory: Arc<Memory>,
}

#[async_trait]
impl Tool for BoundFake {
    fn name(&self) -> &str {
        &self.fake.name
    }

    fn replay(&self) -> Replay {
        self.fake.replay
    }

    fn requires_approval(&self) -> bool {
        self.fake.approval
    }

    async fn call(&self, _cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
        Ok((self.fake.respond)(args))
    }

    async fn reconcile(&self, cx: &ToolContext<'_>, _args: &Value) -> Result<Reconciled, JobError> {
        if !self.fake.reconciles {
            return Ok(Reconciled::Unsupported);
        }
        let st = self.memory.state();
        Ok(match st.happened.get(cx.idempotency_key()) {
            Some(output) => Reconciled::Happened(output.clone()),
            None => Reconciled::NotHappened,
        })
    }
}

/// The scripted model of one run.
pub(super) struct Scripted {
    pub(super) script: ModelScript,
    pub(super) memory: Arc<Memory>,
}

#[async_trait]
impl ModelClient for Scripted {
    fn provider(&self) -> &str {
        "replay-tester"
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let n = self.memory.model_step();
        match &self.script {
            ModelScript::Replies(replies) => {
                replies
                    .get(n)
                    .or(replies.last())
                    .cloned()
                    .ok_or_else(|| ModelError::NonRetryable {
                        message: "the model script has no replies".into(),
                    })
            }
            ModelScript::Function(f) => Ok(f(request, n)),
            ModelScript::Echo => crate::model::LocalModel.complete(request).await,
        }
    }
}
