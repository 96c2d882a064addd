//! The job registry: job kinds by name and version, each an async function
//! `(JobContext, Input) -> Output` with typed (serde) input and output.
//!
//! A kind's version is a string its author bumps when the kind's step sequence changes (steps
//! added, removed, renamed or reordered), so that an operation recorded by one version is never
//! replayed by another: an operation runs on the version its first claim pinned, and a worker
//! claims only the versions it has. One registry may hold several versions of a kind (the old
//! code kept next to the new until the old operations are gone: `agentq versions` tells when).
//! Versions compare in natural order (`agentq_core::version`); a new operation runs on the
//! newest version a live worker runs.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use agentq_core::operation::Requires;
use agentq_core::version;

use crate::context::JobContext;
use crate::error::JobError;

type Handler =
    Arc<dyn Fn(JobContext, Value) -> BoxFuture<'static, Result<Value, JobError>> + Send + Sync>;
type Check = Arc<dyn Fn(&Value) -> Result<Requires, String> + Send + Sync>;

#[derive(Clone)]
struct Kind {
    /// The handler of each version.
    versions: BTreeMap<String, Handler>,
    /// The input check of the newest version: what producers check an enqueue against.
    check: Check,
}

/// The job kinds a worker can run (and a producer may accept). agentq's built-in kinds are
/// registered by the `agentq-kinds` crate (`agentq_kinds::registry()`), a deployment's own
/// kinds next to them with [`Registry::register`] or [`Registry::register_version`].
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Kind>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `name` at version [`version::DEFAULT`] (`"1"`). The input is decoded into `I`
    /// (a mismatch fails the operation as non-retryable, and [`Registry::check_input`] lets
    /// producers refuse it up front).
    pub fn register<I, O, F, Fut>(&mut self, name: &str, f: F) -> &mut Self
    where
        I: DeserializeOwned + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(JobContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, JobError>> + Send + 'static,
    {
        self.register_version(name, version::DEFAULT, f)
    }

    /// Registers `version` of `name`: bump it whenever the kind's step sequence changes (for a
    /// change that only some operations may see, see [`JobContext::patched`]). Operations
    /// started on an older version keep running on it wherever a worker registered it; keep
    /// the old function registered next to the new one until `agentq versions` shows none
    /// left. The input check of the kind is the newest version's.
    ///
    /// # Panics
    /// When `version` is not 1–64 characters of letters, digits, `.`, `_` and `-`, or is
    /// already registered for `name`: a programming error, found when the worker starts.
    pub fn register_version<I, O, F, Fut>(&mut self, name: &str, version: &str, f: F) -> &mut Self
    where
        I: DeserializeOwned + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(JobContext, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, JobError>> + Send + 'static,
    {
        if let Err(e) = version::check(version) {
            panic!("kind {name:?}: {e}");
        }
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
        let entry = self.kinds.entry(name.to_string()).or_insert_with(|| Kind {
            versions: BTreeMap::new(),
            check: check.clone(),
        });
        assert!(
            !entry.versions.contains_key(version),
            "kind {name:?}: version {version:?} is registered twice"
        );
        let newest = version::newest(entry.versions.keys().map(String::as_str))
            .is_none_or(|n| version::compare(version, n).is_gt());
        if newest {
            entry.check = check;
        }
        entry.versions.insert(version.to_string(), run);
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
        self.kinds.get_mut(name).expect("just registered").check = check;
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

    /// Every `(kind, version)` registered.
    pub fn versions(&self) -> Vec<(String, String)> {
        self.kinds
            .iter()
            .flat_map(|(k, kind)| kind.versions.keys().map(|v| (k.clone(), v.clone())))
            .collect()
    }

    /// The newest version of `kind` registered here.
    pub fn newest(&self, kind: &str) -> Option<&str> {
        self.kinds
            .get(kind)
            .and_then(|k| version::newest(k.versions.keys().map(String::as_str)))
    }

    pub(crate) fn handler(&self, kind: &str, version: &str) -> Option<Handler> {
        self.kinds.get(kind)?.versions.get(version).cloned()
    }
}
