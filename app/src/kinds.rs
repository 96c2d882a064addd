//! What this deployment runs: its kinds (versions, whether only webhook deliveries create
//! them, the JSON Schema of their input) and the tools its agents may name, with the versions
//! live workers run. `agentq kinds`, `GET /v1/kinds` and the console's Kinds page call
//! [`list`].

use std::collections::{BTreeMap, BTreeSet};

use agentq_core::db::versions;
use agentq_core::kinds::{KindInfo, ToolInfo};
use serde::Serialize;

use crate::{App, Caller, Result, Role};

/// One kind, as this process's registry holds it, and what live workers run of it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct KindView {
    #[serde(flatten)]
    pub kind: KindInfo,
    /// The versions of it that live workers run now, oldest first (natural order). Empty: no
    /// worker runs it at the moment, and its operations wait queued until one does.
    pub live_versions: Vec<String>,
    /// Its service's live manifest differs from the registered one, as the last check found
    /// (`agentq services list` says how): its operations may fail in the service.
    pub service_drift: bool,
}

/// The answer of `GET /v1/kinds` and `agentq kinds --json`.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Kinds {
    /// Every kind this deployment accepts, by name.
    pub kinds: Vec<KindView>,
    /// Every tool an `agent` operation may name in `tools` and `approval`, by name.
    pub tools: Vec<ToolInfo>,
}

/// The deployment's kinds and tools. Every role may read them (a producer needs the input
/// schemas to enqueue); the live workers' versions are no tenant's data.
pub async fn list(app: &App, caller: &Caller) -> Result<Kinds> {
    caller.require(Role::Producer)?;
    let mut live: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for w in versions::live_workers(&app.pool).await? {
        for (k, v) in w.kinds.into_iter().zip(w.versions) {
            live.entry(k).or_default().insert(v);
        }
    }
    let drifted: BTreeSet<String> = agentq_core::db::services::all(&app.pool)
        .await?
        .into_iter()
        .filter(|s| s.drift.is_some())
        .map(|s| s.name)
        .collect();
    let catalog = app.producer.catalog();
    let kinds = catalog
        .kinds()
        .into_iter()
        .map(|kind| {
            let mut live_versions: Vec<String> = live
                .remove(&kind.name)
                .unwrap_or_default()
                .into_iter()
                .collect();
            live_versions.sort_by(|a, b| agentq_core::version::compare(a, b));
            let service_drift = kind.service.as_ref().is_some_and(|s| drifted.contains(s));
            KindView {
                kind,
                live_versions,
                service_drift,
            }
        })
        .collect();
    Ok(Kinds {
        kinds,
        tools: catalog.tools(),
    })
}
