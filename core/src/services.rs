//! Services: where remote kinds run (docs/protocol.md). A service is an HTTP server an admin
//! registered by its URL; its manifest names the kinds it serves, their versions, input
//! schemas and tools. This module holds the manifest and its checks (every role reads the same
//! `services` table, `db::services`). Compiling the input schemas is the registration's
//! (`agentq_app::services`) and the worker's (`agentq_worker::remote`), which need a JSON
//! Schema validator; this crate does not.
//!
//! Invariant kept here: a manifest is accepted only whole: every kind name, version and tool
//! in it checked.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The step protocol version this build speaks.
pub const PROTOCOL: u32 = 1;
/// The most bytes a manifest may have.
pub const MAX_MANIFEST_BYTES: usize = 1 << 20;
/// The most kinds (name and version pairs) a manifest may list.
pub const MAX_MANIFEST_KINDS: usize = 200;
/// The timeout of a call to a service when its registration names none.
pub const DEFAULT_TIMEOUT_SECS: i32 = 300;

/// A service's manifest (`GET {url}/agentq/manifest`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Manifest {
    pub protocol: u32,
    /// The service's name: registering another manifest under it replaces this one.
    pub service: String,
    pub kinds: Vec<ManifestKind>,
    /// The tools the service's kinds call, with their replay policy (what `agentq services
    /// list` shows; the worker learns an unsafe step's reconcile from each answer).
    #[serde(default)]
    pub tools: Vec<ManifestTool>,
}

/// A tool a service declares.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, schemars::JsonSchema)]
pub struct ManifestTool {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// `safe` (repeating a call is harmless) or `unsafe` (it happens once: reconciled after a
    /// crash, or stopped for a human).
    pub replay: crate::state::Replay,
    /// Whether an unsafe call whose outcome a crash lost can be asked about.
    #[serde(default)]
    pub reconcile: bool,
}

/// One kind at one version, as a manifest lists it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ManifestKind {
    pub name: String,
    pub version: String,
    #[serde(default)]
    pub description: String,
    /// A JSON Schema (draft 2020-12) every input of the kind is checked against.
    #[serde(default = "any_object")]
    pub input_schema: Value,
}

fn any_object() -> Value {
    serde_json::json!({})
}

/// Whether `name` may name a kind, a version or a service: 1–64 letters, digits, `_`, `-`, `.`.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let fits = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if fits {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?} is not a name: use 1-64 letters, digits, `_`, `-` or `.`"
        ))
    }
}

impl Manifest {
    /// How the manifest a service serves now (`live`) differs from this one, registered: each
    /// kind version served but not registered, registered but no longer served, or served with
    /// another input schema, and each tool added, removed or changed. Empty: no drift. (A
    /// description alone is no drift: nothing an operation does depends on it.)
    pub fn drift(&self, live: &Manifest) -> Vec<String> {
        let key = |k: &ManifestKind| (k.name.clone(), k.version.clone());
        let registered: std::collections::BTreeMap<_, _> =
            self.kinds.iter().map(|k| (key(k), k)).collect();
        let served: std::collections::BTreeMap<_, _> =
            live.kinds.iter().map(|k| (key(k), k)).collect();
        let mut found = Vec::new();
        for ((name, version), k) in &served {
            match registered.get(&(name.clone(), version.clone())) {
                None => found.push(format!(
                    "serves kind {name:?} version {version:?}, which is not registered"
                )),
                Some(r) if r.input_schema != k.input_schema => found.push(format!(
                    "kind {name:?} version {version:?} takes another input than registered (its \
                     input_schema changed): inputs checked at enqueue may not decode"
                )),
                Some(_) => {}
            }
        }
        for (name, version) in registered.keys() {
            if !served.contains_key(&(name.clone(), version.clone())) {
                found.push(format!(
                    "no longer serves kind {name:?} version {version:?}, which is registered"
                ));
            }
        }
        let tools = |m: &Manifest| -> std::collections::BTreeMap<String, ManifestTool> {
            m.tools
                .iter()
                .map(|t| (t.name.clone(), t.clone()))
                .collect()
        };
        let (was, now) = (tools(self), tools(live));
        for (name, t) in &now {
            match was.get(name) {
                None => found.push(format!("declares tool {name:?}, which is not registered")),
                Some(w) if (w.replay, w.reconcile) != (t.replay, t.reconcile) => found.push(
                    format!("tool {name:?} has another replay policy or reconcile than registered"),
                ),
                Some(_) => {}
            }
        }
        for name in was.keys() {
            if !now.contains_key(name) {
                found.push(format!(
                    "no longer declares tool {name:?}, which is registered"
                ));
            }
        }
        found
    }

    /// Parses and checks a manifest as a service answered it: the protocol version, every
    /// name and version, no `(kind, version)` twice, every schema compiles.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        if body.len() > MAX_MANIFEST_BYTES {
            return Err(format!("the manifest is over {} bytes", MAX_MANIFEST_BYTES));
        }
        let manifest: Manifest = serde_json::from_slice(body).map_err(|e| {
            format!(
                "the manifest is not {{\"protocol\", \"service\", \"kinds\": [{{\"name\", \"version\", \"input_schema\"}}]}}: {e}"
            )
        })?;
        manifest.check()?;
        Ok(manifest)
    }

    /// The checks of [`Manifest::parse`] on a manifest already decoded (as stored).
    pub fn check(&self) -> Result<(), String> {
        if self.protocol != PROTOCOL {
            return Err(format!(
                "the manifest speaks step protocol {}; this agentq speaks {PROTOCOL}",
                self.protocol
            ));
        }
        check_name("service", &self.service)?;
        if self.kinds.is_empty() {
            return Err("the manifest lists no kinds".into());
        }
        if self.kinds.len() > MAX_MANIFEST_KINDS {
            return Err(format!(
                "the manifest lists {} kinds; at most {MAX_MANIFEST_KINDS}",
                self.kinds.len()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for k in &self.kinds {
            check_name("kind", &k.name)?;
            crate::version::check(&k.version).map_err(|e| format!("kind {:?}: {e}", k.name))?;
            if !seen.insert((k.name.as_str(), k.version.as_str())) {
                return Err(format!(
                    "the manifest lists kind {:?} version {:?} twice",
                    k.name, k.version
                ));
            }
            if !(k.input_schema.is_object() || k.input_schema.is_boolean()) {
                return Err(format!(
                    "kind {:?}'s input_schema is not a JSON Schema (an object)",
                    k.name
                ));
            }
        }
        let mut tools = std::collections::BTreeSet::new();
        for t in &self.tools {
            check_name("tool", &t.name)?;
            if !tools.insert(t.name.as_str()) {
                return Err(format!("the manifest lists tool {:?} twice", t.name));
            }
        }
        Ok(())
    }
}

/// Checks a service's base URL: `http` or `https`, with a host, no query or fragment, no
/// user or password in it. Returns it without a trailing `/`.
pub fn check_url(url: &str) -> Result<String, String> {
    let parsed = url::Url::parse(url)
        .map_err(|e| format!("{url:?} is not a URL ({e}); give http(s)://host[:port][/path]"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("{url:?}: a service is reached over http or https"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(format!("{url:?} names no host"));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!("{url:?}: a service's URL has no query or fragment"));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(format!(
            "{url:?}: a service's URL carries no credentials (requests are signed with its secret)"
        ));
    }
    Ok(url.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn manifest(kinds: Value) -> Manifest {
        serde_json::from_value(serde_json::json!({
            "protocol": 1, "service": "billing", "kinds": kinds,
            "tools": [{ "name": "refund", "replay": "unsafe", "reconcile": true }]
        }))
        .unwrap()
    }

    #[test]
    fn drift_names_each_kind_version_and_tool_that_changed() {
        let registered = manifest(serde_json::json!([
            { "name": "refund", "version": "1", "input_schema": { "type": "object" } },
            { "name": "old", "version": "1" },
        ]));
        assert!(registered.drift(&registered).is_empty());
        let mut described = registered.clone();
        described.kinds[0].description = "Refunds.".into();
        assert!(
            registered.drift(&described).is_empty(),
            "a description is no drift"
        );
        let mut live = manifest(serde_json::json!([
            { "name": "refund", "version": "1", "input_schema": { "type": "object", "required": ["order"] } },
            { "name": "refund", "version": "2" },
        ]));
        live.tools[0].reconcile = false;
        let drift = registered.drift(&live);
        assert_eq!(drift.len(), 4, "{drift:#?}");
        assert!(
            drift[0].contains("\"refund\" version \"1\" takes another input"),
            "{drift:#?}"
        );
        assert!(drift[1].contains("serves kind \"refund\" version \"2\", which is not registered"));
        assert!(drift[2].contains("no longer serves kind \"old\" version \"1\""));
        assert!(drift[3].contains("tool \"refund\" has another replay policy"));
    }

    #[test]
    fn a_manifest_is_checked_whole() {
        let good = json!({"protocol": 1, "service": "billing", "kinds": [
            {"name": "refund", "version": "1", "input_schema": {"type": "object", "required": ["order"]}}
        ]});
        let m = Manifest::parse(good.to_string().as_bytes()).unwrap();
        assert_eq!(m.kinds[0].name, "refund");
        let bad = |v: Value| Manifest::parse(v.to_string().as_bytes()).unwrap_err();
        assert!(bad(json!({"protocol": 2, "service": "b", "kinds": []})).contains("protocol 2"));
        assert!(bad(json!({"protocol": 1, "service": "b c", "kinds": []})).contains("not a name"));
        assert!(bad(json!({"protocol": 1, "service": "b", "kinds": []})).contains("no kinds"));
        let twice = json!({"protocol": 1, "service": "b", "kinds": [
            {"name": "k", "version": "1"}, {"name": "k", "version": "1"}]});
        assert!(bad(twice).contains("twice"));
        let schema = json!({"protocol": 1, "service": "b", "kinds": [
            {"name": "k", "version": "1", "input_schema": "string"}]});
        assert!(bad(schema).contains("input_schema"));
        assert!(Manifest::parse(b"<html>").unwrap_err().contains("not"));
        let tools = json!({"protocol": 1, "service": "b", "kinds": [{"name": "k", "version": "1"}],
            "tools": [{"name": "pay", "replay": "unsafe", "reconcile": true}]});
        let m = Manifest::parse(tools.to_string().as_bytes()).unwrap();
        assert!(m.tools[0].reconcile);
        let bad_tool = json!({"protocol": 1, "service": "b", "kinds": [{"name": "k", "version": "1"}],
            "tools": [{"name": "pay", "replay": "maybe"}]});
        assert!(bad(bad_tool).contains("maybe"));
    }

    #[test]
    fn urls_are_plain_http() {
        assert_eq!(
            check_url("http://127.0.0.1:8000/").unwrap(),
            "http://127.0.0.1:8000"
        );
        assert!(check_url("ftp://x").is_err());
        assert!(check_url("http://u:p@x").is_err());
        assert!(check_url("http://x/?a=1").is_err());
        assert!(check_url("nonsense").is_err());
    }
}
