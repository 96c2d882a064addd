//! Remote kinds: kinds whose code runs in a service an admin registered (`agentq services
//! add`), called over the step protocol (docs/protocol.md). The worker runs a remote operation
//! exactly as it runs a Rust kind (the same claim, lease, fence, journal and model gate): the
//! service only says, call by call, what the code asks for next (`run`).
//!
//! Every role's [`ServedKinds`](crate::ServedKinds) holds a [`RemoteKinds`] snapshot of the
//! `services` table beside its registry's Rust kinds, refreshed every [`REFRESH_EVERY`] by
//! [`watch`], so an enqueue, a webhook, a schedule, `agentq kinds`, the console and the worker
//! all see a service's kinds within seconds of its registration.
//!
//! Invariants kept here:
//! - the worker calls a service only at the URL an admin registered, signed with its secret,
//!   and acts on an answer only once its signature (bound to the request's id) verifies;
//! - nothing a service answers is journaled except through the `JobContext` call its answer
//!   names, at the position the journal is at: an answer for another position is refused.

mod client;
mod run;
mod schema;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use agentq_core::db;
use agentq_core::kinds::{InputError, KindInfo};
use agentq_core::services::Manifest;
use agentq_core::version;
use agentq_core::webhook::Secret;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use client::MAX_ANSWER_BYTES;
pub(crate) use client::ServiceDef;
pub(crate) use run::run;
pub use schema::InputSchema;

/// How often every role reads the `services` table again.
pub const REFRESH_EVERY: Duration = Duration::from_secs(2);

/// One remote kind: each version's service, and the newest version's schema and description.
struct RemoteKind {
    versions: BTreeMap<String, Arc<ServiceDef>>,
    schema: InputSchema,
    description: String,
    /// The service of the newest version.
    service: String,
}

#[derive(Default)]
struct Snapshot {
    kinds: BTreeMap<String, RemoteKind>,
    /// What the snapshot was built from: each service's name and last registration.
    stamp: Vec<(String, chrono::DateTime<chrono::Utc>)>,
}

/// The remote kinds a process knows, as the `services` table held them at its last read.
#[derive(Default)]
pub struct RemoteKinds {
    snapshot: RwLock<Arc<Snapshot>>,
    /// Told when the snapshot changes (the worker registers its versions again at once).
    changed: tokio::sync::Notify,
}

impl std::fmt::Debug for RemoteKinds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteKinds").finish_non_exhaustive()
    }
}

impl RemoteKinds {
    fn now(&self) -> Arc<Snapshot> {
        self.snapshot.read().expect("remote kinds lock").clone()
    }

    /// Reads the `services` table and rebuilds the snapshot if it changed; the kinds named in
    /// `shadowed` (the binary's own Rust kinds) are never served remotely. Returns whether the
    /// snapshot changed.
    pub async fn load(&self, pool: &PgPool, shadowed: &[String]) -> db::Result<bool> {
        let rows = db::within(db::services::all(pool)).await?;
        let stamp: Vec<_> = rows
            .iter()
            .map(|r| (r.name.clone(), r.updated_at))
            .collect();
        if stamp == self.now().stamp {
            return Ok(false);
        }
        let mut kinds: BTreeMap<String, RemoteKind> = BTreeMap::new();
        for row in rows {
            let manifest: Manifest = match serde_json::from_value(row.manifest.clone()) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(service = %row.name, error = %e, "a stored manifest does not decode; its kinds are not served");
                    continue;
                }
            };
            let Ok(secret) = Secret::parse(&row.secret) else {
                tracing::warn!(service = %row.name, "a stored service secret does not parse; its kinds are not served");
                continue;
            };
            let timeout = Duration::from_secs(u64::try_from(row.timeout_secs).unwrap_or(300));
            let reach = agentq_core::outbound::Reach::service(row.allow_link_local);
            let http = match agentq_core::outbound::Client::reaching(
                timeout,
                Some(Duration::from_secs(10)),
                reach,
            ) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(service = %row.name, error = %e, "building an HTTP client failed");
                    continue;
                }
            };
            let service = Arc::new(ServiceDef::new(
                row.name.clone(),
                row.url.clone(),
                secret,
                timeout,
                http,
            ));
            for k in manifest.kinds {
                if shadowed.contains(&k.name) {
                    tracing::warn!(service = %row.name, kind = %k.name, "the binary registers this kind itself; the service's is not served");
                    continue;
                }
                let Ok(schema) = InputSchema::compile(&k.input_schema) else {
                    continue;
                };
                let entry = kinds.entry(k.name.clone()).or_insert_with(|| RemoteKind {
                    versions: BTreeMap::new(),
                    schema: schema.clone(),
                    description: k.description.clone(),
                    service: row.name.clone(),
                });
                let newest = version::newest(entry.versions.keys().map(String::as_str))
                    .is_none_or(|n| version::compare(&k.version, n).is_gt());
                if newest {
                    entry.schema = schema;
                    entry.description = k.description.clone();
                    entry.service = row.name.clone();
                }
                entry.versions.insert(k.version, service.clone());
            }
        }
        *self.snapshot.write().expect("remote kinds lock") = Arc::new(Snapshot { kinds, stamp });
        self.changed.notify_waiters();
        Ok(true)
    }

    /// Resolves when the snapshot next changes.
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }

    pub(crate) fn has_kind(&self, kind: &str) -> bool {
        self.now().kinds.contains_key(kind)
    }

    pub(crate) fn kind_names(&self) -> Vec<String> {
        self.now().kinds.keys().cloned().collect()
    }

    pub(crate) fn versions(&self) -> Vec<(String, String)> {
        self.now()
            .kinds
            .iter()
            .flat_map(|(k, r)| r.versions.keys().map(|v| (k.clone(), v.clone())))
            .collect()
    }

    pub(crate) fn newest(&self, kind: &str) -> Option<String> {
        let snap = self.now();
        let k = snap.kinds.get(kind)?;
        version::newest(k.versions.keys().map(String::as_str)).map(str::to_string)
    }

    /// The service that serves `version` of `kind`.
    pub(crate) fn service(&self, kind: &str, version: &str) -> Option<Arc<ServiceDef>> {
        self.now().kinds.get(kind)?.versions.get(version).cloned()
    }

    /// Checks `input` against the newest version's schema; `None` when `kind` is not remote.
    pub(crate) fn check(&self, kind: &str, input: &Value) -> Option<Result<(), InputError>> {
        let snap = self.now();
        snap.kinds.get(kind).map(|k| k.schema.check(input))
    }

    pub(crate) fn infos(&self) -> Vec<KindInfo> {
        self.now()
            .kinds
            .iter()
            .map(|(name, k)| {
                let mut versions: Vec<String> = k.versions.keys().cloned().collect();
                versions.sort_by(|a, b| version::compare(a, b));
                KindInfo {
                    name: name.clone(),
                    versions,
                    webhook_only: false,
                    for_tests: false,
                    description: k.description.clone(),
                    input_schema: k.schema.schema().clone(),
                    service: Some(k.service.clone()),
                }
            })
            .collect()
    }
}

/// Reads the `services` table into `kinds` every [`REFRESH_EVERY`] until `stop`. A failed
/// read keeps the snapshot it had (a service removed meanwhile is still called until the
/// next read succeeds).
pub async fn watch(kinds: crate::ServedKinds, pool: PgPool, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(REFRESH_EVERY) => {}
        }
        if let Err(e) = kinds.load_services(&pool).await {
            tracing::warn!(error = %e, "reading the registered services failed; keeping the last read");
        }
    }
}
