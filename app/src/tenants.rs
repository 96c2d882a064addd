//! Which kinds a tenant may use, as an admin decides (`agentq tenants kinds`,
//! `GET`/`PUT /v1/tenants/{tenant}/kinds`), and the check every way an operation is born or
//! made to run again from a caller goes through ([`check_kind`], called by
//! [`crate::capacity::admit`] and when a webhook source or a schedule is added; and
//! [`check_kind_now`], against the list as it is now, when a dead letter is retried or
//! resolved, an operation upgraded, a batch or a schedule resumed). A spawn is checked by its
//! insert in the worker (`agentq_kind_allowed`, migration 20). Operations already unfinished
//! when a list shrinks go on (docs/security.md, "When a list shrinks").
//!
//! A tenant without a list of its own follows the list of `*` (the default); without either
//! it may use every kind. Invariant kept here: a refused change writes nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use agentq_core::db::tenant_kinds::{self, Applied, DEFAULT, Policy};
use agentq_core::operation::TenantId;
use serde::Serialize;

use crate::{App, AppError, Caller, Result, Role};

/// How long a process trusts a tenant's list before reading it again: a change an admin
/// makes elsewhere applies to this process's enqueues within this time (at once in the
/// process that made it, and at once to spawns, which the database checks).
const POLICY_TTL: Duration = Duration::from_secs(1);

/// Tenants' lists, each at most a second old.
#[derive(Default)]
pub struct Policies {
    map: Mutex<HashMap<String, (Instant, Policy)>>,
}

impl Policies {
    async fn of(&self, pool: &sqlx::PgPool, tenant: &str) -> Result<Policy> {
        if let Some((at, p)) = self.map.lock().expect("policies lock").get(tenant)
            && at.elapsed() < POLICY_TTL
        {
            return Ok(p.clone());
        }
        let p = tenant_kinds::policy(pool, tenant).await?;
        let mut map = self.map.lock().expect("policies lock");
        if map.len() > 10_000 {
            map.retain(|_, (at, _)| at.elapsed() < POLICY_TTL);
        }
        map.insert(tenant.to_string(), (Instant::now(), p.clone()));
        Ok(p)
    }

    fn forget(&self) {
        self.map.lock().expect("policies lock").clear();
    }
}

/// Refuses an operation of `kind` for `tenant` when an admin's list keeps it from the tenant.
pub async fn check_kind(app: &App, tenant: &str, kind: &str) -> Result<()> {
    let policy = app.policies.of(&app.pool, tenant).await?;
    refuse(tenant, kind, &policy, "")
}

/// [`check_kind`] against the list as it is now (not a cached one): for an act that makes
/// existing work run again or on other code (a dead letter's retry or resolve, a version
/// upgrade, a batch's or a schedule's resume), so a list an admin shrank a moment ago in
/// another process already holds. `what` says what stays as it was (appended to the refusal).
pub async fn check_kind_now(app: &App, tenant: &str, kind: &str, what: &str) -> Result<()> {
    let policy = tenant_kinds::policy(&app.pool, tenant).await?;
    refuse(tenant, kind, &policy, what)
}

fn refuse(tenant: &str, kind: &str, policy: &Policy, what: &str) -> Result<()> {
    if policy.allows(kind) {
        return Ok(());
    }
    let which = if policy.own.is_some() {
        format!("tenant {tenant:?}'s list")
    } else {
        "the default list (of tenants without their own)".to_string()
    };
    Err(AppError::Forbidden(format!(
        "tenant {tenant:?} may not create operations of kind {kind:?}: {which} allows {}; \
         an admin changes it with `agentq tenants kinds {tenant} --allow …`{what}",
        listed(policy.effective().unwrap_or_default())
    )))
}

fn listed(kinds: &[String]) -> String {
    if kinds.is_empty() {
        "no kind".into()
    } else {
        kinds.join(", ")
    }
}

/// A tenant's kinds, as `agentq tenants kinds T --json` and `GET /v1/tenants/{t}/kinds` show them.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct TenantKinds {
    /// The tenant, or `*` for the default list.
    pub tenant: String,
    /// The kinds it may create operations of; `null`: every kind.
    pub allowed: Option<Vec<String>>,
    /// Where that comes from: `own` (the tenant's list), `default` (the list of `*`) or
    /// `none` (no list: every kind).
    pub source: String,
    /// Schedules the change paused because their kind is no longer allowed (only in the
    /// answer of a change).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paused_schedules: Vec<uuid::Uuid>,
}

fn view(tenant: &str, p: &Policy, applied: Applied) -> TenantKinds {
    let source = match (&p.own, &p.default) {
        (Some(_), _) => "own",
        (None, Some(_)) => "default",
        (None, None) => "none",
    };
    TenantKinds {
        tenant: tenant.to_string(),
        allowed: p.effective().map(<[String]>::to_vec),
        source: source.into(),
        paused_schedules: applied.paused_schedules,
    }
}

/// The lists that apply to `tenant` (`*` has only its own).
async fn stored(app: &App, tenant: &str) -> Result<Policy> {
    let p = tenant_kinds::policy(&app.pool, tenant).await?;
    Ok(if tenant == DEFAULT {
        Policy {
            own: p.own,
            default: None,
        }
    } else {
        p
    })
}

fn tenant_or_default(t: &str) -> Result<()> {
    if t == DEFAULT {
        return Ok(());
    }
    TenantId::parse(t)
        .map(|_| ())
        .map_err(|e| AppError::invalid("tenant", e))
}

/// `tenant`'s kinds: an admin may read any tenant's (and `*`), a producer or operator its own.
pub async fn kinds(app: &App, caller: &Caller, tenant: &str) -> Result<TenantKinds> {
    caller.require(Role::Producer)?;
    tenant_or_default(tenant)?;
    caller.tenant(Some(tenant))?;
    Ok(view(
        tenant,
        &stored(app, tenant).await?,
        Applied::default(),
    ))
}

/// What an admin sets a tenant's kinds to.
#[derive(Clone, Debug)]
pub enum Allow {
    /// Exactly these kinds (each one this deployment runs; none: no kind at all).
    Kinds(Vec<String>),
    /// Every kind this deployment runs that is not for tests, as of now.
    Production,
    /// No list of its own: the default list applies (for `*`: every kind).
    Unset,
}

/// Sets `tenant`'s kinds (`*`: the default), pausing the schedules of kinds no longer allowed;
/// audited. Every kind named must be one this deployment runs.
pub async fn set_kinds(
    app: &App,
    caller: &Caller,
    tenant: &str,
    allow: Allow,
) -> Result<TenantKinds> {
    caller.require(Role::Admin)?;
    tenant_or_default(tenant)?;
    let catalog = app.producer.catalog();
    let kinds = match allow {
        Allow::Unset => None,
        Allow::Production => Some(
            catalog
                .kinds()
                .into_iter()
                .filter(|k| !k.for_tests)
                .map(|k| k.name)
                .collect::<Vec<_>>(),
        ),
        Allow::Kinds(named) => {
            let mut kinds: Vec<String> = Vec::with_capacity(named.len());
            for (i, k) in named.into_iter().enumerate() {
                if !catalog.has_kind(&k) {
                    return Err(AppError::invalid(
                        &format!("/kinds/{i}"),
                        format!(
                            "{k:?} is not a kind this deployment runs ({}); see `agentq kinds`",
                            agentq_core::kinds::names(catalog.as_ref())
                        ),
                    ));
                }
                if !kinds.contains(&k) {
                    kinds.push(k);
                }
            }
            Some(kinds)
        }
    };
    let applied = tenant_kinds::set(&app.pool, tenant, kinds.as_deref(), &caller.actor).await?;
    app.policies.forget();
    Ok(view(tenant, &stored(app, tenant).await?, applied))
}
