//! Names of batches and schedules: what a name may be, and the one resolver of "an id or a
//! name" that every front end calls wherever it takes a batch or a schedule (CLI arguments,
//! API paths, console routes).
//!
//! Invariant kept here: a name never reads as a UUID ([`check`]), so a string is an id when
//! it parses as one and a name otherwise; a name is looked up only in the tenants the caller
//! may see ([`Caller::tenant_filter`]), so another tenant's name is "not found", never
//! "forbidden", and resolves to nothing.

use agentq_core::db::names::{self, Named};
use uuid::Uuid;

use crate::{App, AppError, Caller, Result, Role};

/// Longest name.
pub const MAX_LEN: usize = 128;

/// Refuses a name of a `what` (`batch`, `schedule`) that is not 1-128 letters, digits, `_`,
/// `-`, `.` or `:`, or that reads as a UUID; `field` names it as the API does.
pub fn check(name: &str, what: &str, field: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > MAX_LEN
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
    {
        return Err(AppError::invalid(
            field,
            format!("{what} name {name:?}: use 1-{MAX_LEN} letters, digits, '_', '-', '.' or ':'"),
        ));
    }
    if Uuid::parse_str(name).is_ok() {
        return Err(AppError::invalid(
            field,
            format!(
                "{what} name {name:?} reads as a UUID, which would be taken for an id; \
                 choose a name that is not one"
            ),
        ));
    }
    Ok(())
}

/// The batch `s` names for the caller: `s` itself when it is an id (the flow it goes to
/// finds it in the caller's scope or answers "not found"), else the batch of that name in
/// `tenant` (an admin's choice; a non-admin's own tenant always).
pub async fn resolve_batch(
    app: &App,
    caller: &Caller,
    s: &str,
    tenant: Option<&str>,
) -> Result<Uuid> {
    resolve(app, caller, Named::Batch, s, tenant).await
}

/// The schedule `s` names for the caller, as [`resolve_batch`] does for batches.
pub async fn resolve_schedule(
    app: &App,
    caller: &Caller,
    s: &str,
    tenant: Option<&str>,
) -> Result<Uuid> {
    resolve(app, caller, Named::Schedule, s, tenant).await
}

async fn resolve(
    app: &App,
    caller: &Caller,
    what: Named,
    s: &str,
    tenant: Option<&str>,
) -> Result<Uuid> {
    caller.require(Role::Operator)?;
    lookup(app, caller, what, s, tenant, "id").await
}

/// The batch or schedule (`what`) a filter's `field` names (an id or a name), for any caller
/// that may list: the name is looked up in the tenants the caller sees, as every filter is,
/// and a name it does not have is a wrong filter.
pub(crate) async fn in_filter(
    app: &App,
    caller: &Caller,
    what: Named,
    s: &str,
    tenant: Option<&str>,
    field: &'static str,
) -> Result<Uuid> {
    lookup(app, caller, what, s, tenant, field)
        .await
        .map_err(|e| unknown_in_filter(e, field))
}

/// A filter naming nothing is a wrong filter (naming the field), not a missing resource.
fn unknown_in_filter(e: AppError, field: &'static str) -> AppError {
    match e {
        AppError::NotFound(m) => AppError::malformed(field, m),
        other => other,
    }
}

/// `s` as an id, or the one `what` of that name in the caller's scope; `field` is what a
/// refusal names.
async fn lookup(
    app: &App,
    caller: &Caller,
    what: Named,
    s: &str,
    tenant: Option<&str>,
    field: &'static str,
) -> Result<Uuid> {
    let s = s.trim();
    if let Ok(id) = Uuid::parse_str(s) {
        return Ok(id);
    }
    let (what_name, lists) = match what {
        Named::Batch => ("batch", "agentq batch list"),
        Named::Schedule => ("schedule", "agentq schedules list"),
    };
    if check(s, what_name, field).is_err() {
        return Err(AppError::malformed(
            field,
            format!(
                "{s:?} is neither a {what_name} id (a UUID) nor a {what_name} name (see `{lists}`)"
            ),
        ));
    }
    let scope = caller.tenant_filter(tenant)?;
    let found = names::named(&app.pool, what, s, scope.as_deref()).await?;
    match found.as_slice() {
        [(id, _)] => Ok(*id),
        [] => Err(AppError::NotFound(match &scope {
            Some(t) if caller.sees_every_tenant() => {
                format!("no {what_name} named {s:?} in tenant {t:?}")
            }
            _ => format!("no {what_name} named {s:?}"),
        })),
        many => {
            let tenants: Vec<&str> = many.iter().map(|(_, t)| t.as_str()).collect();
            Err(AppError::invalid(
                field,
                format!(
                    "{what_name} name {s:?} is used in tenants {}: pass the {what_name}'s id, \
                     or name its tenant (--tenant on the command line)",
                    tenants.join(", ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_short_plain_and_never_a_uuid() {
        for good in ["nightly", "q3-migration", "a.b:c_d", &"x".repeat(MAX_LEN)] {
            assert!(check(good, "batch", "/name").is_ok(), "{good}");
        }
        let id = Uuid::new_v4();
        for bad in [
            String::new(),
            "has space".into(),
            "slash/y".into(),
            "x".repeat(MAX_LEN + 1),
            id.to_string(),
            id.simple().to_string(),
            id.urn().to_string(),
            id.to_string().to_uppercase(),
        ] {
            let e = check(&bad, "batch", "/name").unwrap_err();
            assert!(
                matches!(&e, AppError::Invalid { field, .. } if field == "/name"),
                "{bad}: {e}"
            );
        }
    }
}
