//! The kinds a process serves: the deployment's [`Registry`] (its binary's own kinds and
//! tools, `agentq-sdk`) and the kinds of the services an admin registered
//! ([`RemoteKinds`], read from the database at run time). Every role takes a [`ServedKinds`]
//! as its catalog (the worker to run operations, the producer, the API, the scheduler and the
//! console to check inputs), so a service's kinds are enqueued, listed and run like the
//! binary's own.
//!
//! Invariant kept here: a binary's own kind shadows a service's kind of the same name; a
//! service's kinds are served only while its registration is in the `services` table.

use std::sync::Arc;

use agentq_core::kinds::{Catalog, InputError, KindInfo, ToolInfo};
use agentq_core::operation::Requires;
use futures_util::future::BoxFuture;
use serde_json::Value;
use sqlx::PgPool;

use crate::context::JobRun;
use crate::error::JobError;
use crate::remote::{RemoteKinds, ServiceDef};
use agentq_sdk::Registry;

/// The deployment's registry and the registered services' kinds. Cheap to clone; every clone
/// sees the same services.
#[derive(Clone, Default)]
pub struct ServedKinds {
    registry: Arc<Registry>,
    remote: Arc<RemoteKinds>,
}

impl From<Registry> for ServedKinds {
    fn from(registry: Registry) -> Self {
        Self {
            registry: Arc::new(registry),
            remote: Arc::default(),
        }
    }
}

/// What the replay tester and a journal replay run: a deployment's [`Registry`], or the kinds
/// a process serves (the registered services' among them).
pub trait Serves {
    /// The kinds, as a process would serve them.
    fn served(&self) -> ServedKinds;
}

impl Serves for Registry {
    fn served(&self) -> ServedKinds {
        ServedKinds::from(self.clone())
    }
}

impl Serves for ServedKinds {
    fn served(&self) -> ServedKinds {
        self.clone()
    }
}

/// What runs a version of a kind: the binary's own function, or a registered service.
pub(crate) enum Handler {
    Own(agentq_sdk::registry::Handler),
    Remote(Arc<ServiceDef>),
}

impl Handler {
    /// Runs `input` as `run`'s operation.
    pub(crate) fn call(
        &self,
        run: JobRun,
        input: Value,
    ) -> BoxFuture<'static, Result<Value, JobError>> {
        match self {
            Handler::Own(f) => f(run.handle(), input),
            Handler::Remote(service) => Box::pin(crate::remote::run(service.clone(), run, input)),
        }
    }
}

impl ServedKinds {
    /// The deployment's registry: its own kinds, tools and state.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Reads the services an admin registered (`agentq services add`) and serves their kinds
    /// next to the registry's own, in every clone; returns whether they changed. Every role
    /// does it once when it connects and then every few seconds ([`crate::remote::watch`]).
    pub async fn load_services(&self, pool: &PgPool) -> agentq_core::db::Result<bool> {
        self.remote.load(pool, &self.registry.kind_names()).await
    }

    /// The remote kinds served.
    pub(crate) fn remote(&self) -> &Arc<RemoteKinds> {
        &self.remote
    }

    /// Every kind name served, the remote kinds' among them.
    pub fn kind_names(&self) -> Vec<String> {
        let mut names = self.registry.kind_names();
        names.extend(self.remote.kind_names());
        names.sort();
        names
    }

    /// Whether the binary registers `kind` itself (a remote kind may not take its name).
    pub fn is_own_kind(&self, kind: &str) -> bool {
        self.registry.has_kind(kind)
    }

    /// Every `(kind, version)` served, the remote kinds' among them.
    pub fn versions(&self) -> Vec<(String, String)> {
        let mut all = self.registry.versions();
        all.extend(self.remote.versions());
        all
    }

    /// The newest version of `kind` served.
    pub fn newest(&self, kind: &str) -> Option<String> {
        if self.is_own_kind(kind) {
            self.registry.newest(kind)
        } else {
            self.remote.newest(kind)
        }
    }

    /// What runs `version` of `kind`.
    pub(crate) fn handler(&self, kind: &str, version: &str) -> Option<Handler> {
        if self.is_own_kind(kind) {
            return self.registry.handler(kind, version).map(Handler::Own);
        }
        self.remote.service(kind, version).map(Handler::Remote)
    }

    /// Checks that `input` fits `kind` without running anything; the error says where and why.
    pub fn check_input(&self, kind: &str, input: &Value) -> Result<(), String> {
        Catalog::requires(self, kind, input)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// What `input` requires as a `kind`'s input, or why it is refused, in words (a spawn's
    /// check).
    pub(crate) fn requires_or_why(&self, kind: &str, input: &Value) -> Result<Requires, String> {
        match Catalog::requires(self, kind, input) {
            Ok(r) => Ok(r),
            Err(e) if self.has_kind(kind) => Err(format!("input does not fit kind {kind:?}: {e}")),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Catalog for ServedKinds {
    fn kinds(&self) -> Vec<KindInfo> {
        let mut all = Catalog::kinds(&*self.registry);
        all.extend(self.remote.infos());
        all
    }

    fn has_kind(&self, kind: &str) -> bool {
        self.is_own_kind(kind) || self.remote.has_kind(kind)
    }

    fn tools(&self) -> Vec<ToolInfo> {
        Catalog::tools(&*self.registry)
    }

    fn requires(&self, kind: &str, input: &Value) -> Result<Requires, InputError> {
        if self.is_own_kind(kind) {
            return Catalog::requires(&*self.registry, kind, input);
        }
        match self.remote.check(kind, input) {
            Some(checked) => checked.map(|()| Requires::default()),
            None => Err(InputError::whole(format!(
                "unknown kind {kind:?}; this deployment runs: {}",
                self.kind_names().join(", ")
            ))),
        }
    }
}
