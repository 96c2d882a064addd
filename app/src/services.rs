//! Services: the servers remote kinds run in (docs/protocol.md). Registered, listed and
//! removed by the same flows for `agentq services` and `/v1/services`; only an admin may,
//! since a service's URL is an origin the workers will call and its kinds are code they run.
//!
//! Registering fetches the service's manifest (`GET {url}/agentq/manifest`) and checks it
//! whole before anything is written: the names, versions and schemas, and that no kind it
//! lists is the binary's own or a version another service serves. Every role reads the
//! `services` table again within `agentq_worker::remote::REFRESH_EVERY`.
//!
//! Drift: a service deployed with a changed manifest and not registered again still has its
//! old manifest checked at enqueue, so its operations pass and then fail in the service one by
//! one. [`check`] (`agentq services check`) and the scheduler's [`watch_drift`] (every
//! [`DRIFT_CHECK_EVERY`]) fetch each live manifest and record how it differs
//! (`Manifest::drift`), which `agentq services list`, `/v1/services`, the console's kinds page,
//! the scheduler's log and `agentq_service_drift` show until the service is registered again.

use std::time::Duration;

use agentq_core::db::services as db;
use agentq_core::outbound;
use agentq_core::services::{DEFAULT_TIMEOUT_SECS, MAX_MANIFEST_BYTES, Manifest, check_url};
use agentq_core::webhook::Secret;
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{App, AppError, Caller, Result, Role};

/// How long registering waits for a service's manifest.
const MANIFEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the scheduler compares each service's live manifest with its registration.
pub const DRIFT_CHECK_EVERY: Duration = Duration::from_secs(60);

/// A registration as asked for.
#[derive(Clone, Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceRequest {
    /// The service's base URL: agentq calls `{url}/agentq/manifest` and `{url}/agentq/invoke`
    pub url: String,
    /// The signing secret (`whsec_…`) the service was started with; left out: a new service
    /// gets a new one (shown once, in the answer), a registered one keeps its own
    pub secret: Option<String>,
    /// How long a call may take before it fails as retryable, 1 to 86400 seconds; default 300
    pub timeout_secs: Option<i32>,
    /// Let its URL lead to a link-local or cloud metadata address (169.254.169.254 and the
    /// like), which agentq otherwise never calls
    #[serde(default)]
    pub allow_link_local: bool,
}

/// A kind at a version, as a service serves it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct ServedKind {
    pub name: String,
    pub version: String,
}

/// A registered service (never its secret).
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct ServiceView {
    pub name: String,
    pub url: String,
    pub timeout_secs: i32,
    /// Its URL may lead to a link-local or cloud metadata address (registered so).
    pub allow_link_local: bool,
    pub kinds: Vec<ServedKind>,
    /// The tools its manifest declares, with their replay policy and whether they reconcile.
    pub tools: Vec<agentq_core::services::ManifestTool>,
    pub registered_at: DateTime<Utc>,
    /// When its manifest was last registered.
    pub updated_at: DateTime<Utc>,
    /// How the manifest it serves now differs from the registered one, as the last check found
    /// (empty: it matched, or it was not checked since it was registered). Register it again
    /// to serve what it serves now.
    pub drift: Vec<String>,
    /// When its live manifest was last fetched and compared.
    pub checked_at: Option<DateTime<Utc>>,
}

/// What a check of one service's live manifest found.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Checked {
    pub name: String,
    /// How its live manifest differs from the registered one (empty: it matches).
    pub drift: Vec<String>,
    /// Why its manifest could not be fetched (nothing was recorded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreachable: Option<String>,
}

/// What a registration did.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Registered {
    pub service: ServiceView,
    /// A service of that name was registered already: its manifest and URL are replaced.
    pub replaced: bool,
    /// The new signing secret, when agentq made one: shown this once. Start the service with
    /// it (`AGENTQ_SERVICE_SECRET`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

fn view(row: &db::ServiceRow) -> ServiceView {
    let (kinds, tools) = serde_json::from_value::<Manifest>(row.manifest.clone())
        .map(|m| {
            let kinds = m
                .kinds
                .into_iter()
                .map(|k| ServedKind {
                    name: k.name,
                    version: k.version,
                })
                .collect();
            (kinds, m.tools)
        })
        .unwrap_or_default();
    ServiceView {
        name: row.name.clone(),
        url: row.url.clone(),
        timeout_secs: row.timeout_secs,
        allow_link_local: row.allow_link_local,
        kinds,
        tools,
        registered_at: row.created_at,
        updated_at: row.updated_at,
        drift: drift_lines(row.drift.as_deref()),
        checked_at: row.checked_at,
    }
}

fn drift_lines(drift: Option<&str>) -> Vec<String> {
    drift
        .map(|d| d.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Fetches and checks the manifest at `url`, reaching a link-local or cloud metadata address
/// only when `allow_link_local`.
async fn fetch_manifest(url: &str, allow_link_local: bool) -> Result<Manifest> {
    let bad = |m: String| AppError::invalid("/url", m);
    let client = outbound::Client::reaching(
        MANIFEST_TIMEOUT,
        None,
        outbound::Reach::service(allow_link_local),
    )
    .map_err(|e| bad(format!("building an HTTP client failed: {e}")))?;
    let at = format!("{url}/agentq/manifest");
    let parsed = at
        .parse()
        .map_err(|e| bad(format!("{at} is not a URL: {e}")))?;
    let mut response = client.send(client.get(parsed)).await.map_err(|e| match e {
        outbound::Error::Refused(why) => bad(format!("{why} (the service's URL {url})")),
        e => bad(format!(
            "fetching {at} failed ({e}): is the service running there, and reachable from \
                 here?"
        )),
    })?;
    if !response.status().is_success() {
        return Err(bad(format!(
            "{at} answered HTTP {}: is an agentq SDK serving there (docs/protocol.md)?",
            response.status().as_u16()
        )));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| bad(format!("reading {at} failed: {e}")))?
    {
        if body.len() + chunk.len() > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "{at} answered more than {MAX_MANIFEST_BYTES} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    let manifest = Manifest::parse(&body).map_err(|e| bad(format!("{at}: {e}")))?;
    for k in &manifest.kinds {
        jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .build(&k.input_schema)
            .map_err(|e| {
                bad(format!(
                    "{at}: kind {:?}'s input_schema is not a JSON Schema: {e}",
                    k.name
                ))
            })?;
    }
    Ok(manifest)
}

/// Registers the service at `request.url` (or registers its new manifest), audited. Refused
/// unless the caller is an admin, and when the manifest is not one this agentq can serve.
pub async fn register(app: &App, caller: &Caller, request: &ServiceRequest) -> Result<Registered> {
    caller.require(Role::Admin)?;
    let url = check_url(request.url.trim()).map_err(|e| AppError::invalid("/url", e))?;
    let timeout_secs = request.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS);
    if !(1..=86_400).contains(&timeout_secs) {
        return Err(AppError::invalid(
            "/timeout_secs",
            format!("a timeout is 1 to 86400 seconds (got {timeout_secs})"),
        ));
    }
    let given = match &request.secret {
        Some(s) => Some(
            Secret::parse(s.trim())
                .map_err(|e| AppError::invalid("/secret", format!("{e} (whsec_ and base64)")))?,
        ),
        None => None,
    };
    let manifest = fetch_manifest(&url, request.allow_link_local).await?;
    let catalog = app.producer.catalog();
    let others = db::all(&app.pool).await?;
    for k in &manifest.kinds {
        if catalog
            .kinds()
            .iter()
            .any(|own| own.name == k.name && own.service.is_none())
        {
            return Err(AppError::Conflict(format!(
                "kind {:?} is one of this binary's own kinds: a service cannot serve it (rename \
                 the service's kind)",
                k.name
            )));
        }
        let taken = others
            .iter()
            .filter(|o| o.name != manifest.service)
            .find(|o| {
                serde_json::from_value::<Manifest>(o.manifest.clone()).is_ok_and(|m| {
                    m.kinds
                        .iter()
                        .any(|ok| ok.name == k.name && ok.version == k.version)
                })
            });
        if let Some(o) = taken {
            return Err(AppError::Conflict(format!(
                "kind {:?} version {:?} is served by service {:?} already: bump the version, or \
                 remove that service first (`agentq services remove {}`)",
                k.name, k.version, o.name, o.name
            )));
        }
    }
    let known = others.iter().any(|o| o.name == manifest.service);
    // A new service without a secret gets one; a registered one keeps its own.
    let generated = (given.is_none() && !known).then(Secret::generate);
    let secret = given.as_ref().or(generated.as_ref()).map(Secret::expose);
    let stored =
        serde_json::to_value(&manifest).map_err(|e| AppError::invalid("/url", e.to_string()))?;
    let written = db::register(
        &app.pool,
        &db::NewService {
            name: &manifest.service,
            url: &url,
            secret: secret.as_deref(),
            timeout_secs,
            manifest: &stored,
            allow_link_local: request.allow_link_local,
        },
        &caller.actor,
    )
    .await?;
    Ok(Registered {
        service: view(&written.row),
        replaced: written.replaced,
        secret: generated.map(|s| s.expose()),
    })
}

/// Every registered service. Admin only (their URLs are the deployment's internals).
pub async fn list(app: &App, caller: &Caller) -> Result<Vec<ServiceView>> {
    caller.require(Role::Admin)?;
    Ok(db::all(&app.pool).await?.iter().map(view).collect())
}

/// Removes the service `name`, audited: its kinds are no longer accepted, and operations of
/// them wait (`version_parked`) until a service serves them again.
pub async fn remove(app: &App, caller: &Caller, name: &str) -> Result<()> {
    caller.require(Role::Admin)?;
    if db::remove(&app.pool, name, &caller.actor).await? {
        Ok(())
    } else {
        Err(AppError::NotFound(format!(
            "no service named {name:?}: `agentq services list` shows them"
        )))
    }
}

/// Compares the live manifest of the service `name` (every service when `None`) with its
/// registration and records what differs. Admin only: it calls the services' URLs.
pub async fn check(app: &App, caller: &Caller, name: Option<&str>) -> Result<Vec<Checked>> {
    caller.require(Role::Admin)?;
    let rows: Vec<db::ServiceRow> = db::all(&app.pool)
        .await?
        .into_iter()
        .filter(|r| name.is_none_or(|n| r.name == n))
        .collect();
    if let (Some(name), true) = (name, rows.is_empty()) {
        return Err(AppError::NotFound(format!(
            "no service named {name:?}: `agentq services list` shows them"
        )));
    }
    let mut checked = Vec::with_capacity(rows.len());
    for row in &rows {
        checked.push(check_row(app, row).await?);
    }
    Ok(checked)
}

/// Checks every registered service every [`DRIFT_CHECK_EVERY`] until `stop` (the scheduler
/// runs it). A failed round is logged and tried again at the next.
pub async fn watch_drift(app: App, stop: tokio_util::sync::CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(DRIFT_CHECK_EVERY) => {}
        }
        let rows = match db::all(&app.pool).await {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "reading the services to check their manifests failed");
                continue;
            }
        };
        for row in &rows {
            if let Err(e) = check_row(&app, row).await {
                tracing::warn!(service = %row.name, error = %e, "checking a service's manifest failed");
            }
        }
    }
}

async fn check_row(app: &App, row: &db::ServiceRow) -> Result<Checked> {
    let live = match fetch_manifest(&row.url, row.allow_link_local).await {
        Ok(live) => live,
        Err(e) => {
            return Ok(Checked {
                name: row.name.clone(),
                drift: Vec::new(),
                unreachable: Some(e.to_string()),
            });
        }
    };
    let drift = match serde_json::from_value::<Manifest>(row.manifest.clone()) {
        Ok(registered) => registered.drift(&live),
        Err(e) => vec![format!("its registered manifest does not decode ({e})")],
    };
    let text = (!drift.is_empty()).then(|| drift.join("\n"));
    db::set_checked(&app.pool, &row.name, row.updated_at, text.as_deref()).await?;
    agentq_core::metrics::SERVICE_DRIFT.set(&[&row.name], drift.len() as f64);
    if !drift.is_empty() && row.drift != text {
        tracing::warn!(
            service = %row.name,
            drift = %drift.join("; "),
            "a service's live manifest differs from its registration: register it again (agentq services add --url …)"
        );
    }
    Ok(Checked {
        name: row.name.clone(),
        drift,
        unreachable: None,
    })
}
