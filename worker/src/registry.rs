//! The job registry: job kinds by name, each an async function `(JobContext, Input) -> Output`
//! with typed (serde) input and output.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use agentq_core::operation::Requires;

use crate::context::JobContext;
use crate::error::JobError;

type Handler =
    Arc<dyn Fn(JobContext, Value) -> BoxFuture<'static, Result<Value, JobError>> + Send + Sync>;
type Check = Arc<dyn Fn(&Value) -> Result<Requires, String> + Send + Sync>;

struct Kind {
    run: Handler,
    check: Check,
}

/// The job kinds a worker can run (and a producer may accept). agentq's built-in kinds are
/// registered by the `agentq-kinds` crate (`agentq_kinds::registry()`), a deployment's own
/// kinds next to them with [`Registry::register`].
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Arc<Kind>>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
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
                .map(|_| Requires::default())
                .map_err(|e| e.to_string())
        });
        self.kinds
            .insert(name.to_string(), Arc::new(Kind { run, check }));
        self
    }

    /// Registers `name` like [`Registry::register`], for a kind whose input needs more than
    /// its shape: `requires` says what (the stores it names, whether only webhook deliveries
    /// may create it), and producers refuse an enqueue that does not have it.
    pub fn register_requiring<I, O, F, Fut>(
        &mut self,
        name: &str,
        f: F,
        requires: fn(&I) -> Requires,
    ) -> &mut Self
    where
        I: DeserializeOwned + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(JobContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, JobError>> + Send + 'static,
    {
        self.register(name, f);
        let check: Check = Arc::new(move |v: &Value| {
            serde_json::from_value::<I>(v.clone())
                .map(|i| requires(&i))
                .map_err(|e| e.to_string())
        });
        let kind = self.kinds.get_mut(name).expect("just registered");
        *kind = Arc::new(Kind {
            run: kind.run.clone(),
            check,
        });
        self
    }

    /// The registered kind names.
    pub fn kinds(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }

    /// Checks that `input` fits `kind` without running anything.
    pub fn check_input(&self, kind: &str, input: &Value) -> Result<(), String> {
        self.requires(kind, input).map(|_| ())
    }

    /// Checks that `input` fits `kind` and returns what it requires beyond its shape (stores,
    /// a webhook origin): producers call it and check those before writing anything.
    pub fn requires(&self, kind: &str, input: &Value) -> Result<Requires, String> {
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
