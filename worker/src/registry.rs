//! The job registry: job kinds by name, each an async function `(JobContext, Input) -> Output`
//! with typed (serde) input and output.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::context::{JobContext, JobError};

type Handler =
    Arc<dyn Fn(JobContext, Value) -> BoxFuture<'static, Result<Value, JobError>> + Send + Sync>;
type Check = Arc<dyn Fn(&Value) -> Result<(), String> + Send + Sync>;

struct Kind {
    run: Handler,
    check: Check,
}

/// The job kinds a worker can run (and a producer may accept).
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Arc<Kind>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The registry with agentq's built-in kinds (`echo`).
    pub fn builtin() -> Self {
        let mut r = Self::new();
        crate::jobs::register_builtin(&mut r);
        r
    }

    /// Registers `name`. The input is decoded into `I` (a mismatch fails the operation as
    /// non-retryable, and [`Registry::check_input`] lets producers refuse it up front).
    pub fn register<I, O, F, Fut>(&mut self, name: &str, f: F) -> &mut Self
    where
        I: DeserializeOwned + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(JobContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, JobError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let kind = name.to_string();
        let run: Handler = Arc::new(move |ctx, input| {
            let f = f.clone();
            let kind = kind.clone();
            Box::pin(async move {
                let input: I = serde_json::from_value(input).map_err(|e| {
                    JobError::NonRetryable(format!("input does not fit kind {kind:?}: {e}"))
                })?;
                let out = f(ctx, input).await?;
                serde_json::to_value(out)
                    .map_err(|e| JobError::NonRetryable(format!("output is not JSON: {e}")))
            })
        });
        let check: Check = Arc::new(|v: &Value| {
            serde_json::from_value::<I>(v.clone())
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        self.kinds
            .insert(name.to_string(), Arc::new(Kind { run, check }));
        self
    }

    /// The registered kind names.
    pub fn kinds(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }

    /// Checks that `input` fits `kind` without running anything (producers call it).
    pub fn check_input(&self, kind: &str, input: &Value) -> Result<(), String> {
        match self.kinds.get(kind) {
            Some(k) => {
                (k.check)(input).map_err(|e| format!("input does not fit kind {kind:?}: {e}"))
            }
            None => Err(format!("unknown kind {kind:?}")),
        }
    }

    pub(crate) fn handler(&self, kind: &str) -> Option<Handler> {
        self.kinds.get(kind).map(|k| k.run.clone())
    }
}
