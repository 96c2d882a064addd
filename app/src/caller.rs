//! Who acts: a role and a tenant scope, and the name an action is audited under. Every flow
//! of the application layer takes one and decides authorization itself, once, for every
//! front end.

use crate::error::AppError;

/// A role, in increasing power. Roles nest: `producer` runs and reads operations of its
/// tenant, `operator` also signals approvals, works the DLQ and controls batches, `admin` does
/// everything in every tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Producer,
    Operator,
    Admin,
}

impl Role {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "producer" => Some(Role::Producer),
            "operator" => Some(Role::Operator),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Producer => "producer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// The caller of a flow.
#[derive(Clone, Debug)]
pub struct Caller {
    /// The tenant a non-admin is confined to.
    pub tenant: String,
    pub role: Role,
    /// The name its actions are audited under (`token:agq_1234abcd`, or the CLI's `--as`).
    pub actor: String,
}

impl Caller {
    /// The command line: whoever holds `DATABASE_URL` is an operator of the deployment, so
    /// an admin of every tenant, audited under `actor`.
    pub fn command_line(actor: impl Into<String>) -> Self {
        Self {
            tenant: String::new(),
            role: Role::Admin,
            actor: actor.into(),
        }
    }

    /// Refuses callers below `min`, saying which role the act needs.
    pub fn require(&self, min: Role) -> Result<(), AppError> {
        if self.role >= min {
            Ok(())
        } else {
            Err(AppError::Forbidden(format!(
                "this needs a {} token (or stronger); this token is a {} token",
                min.as_str(),
                self.role.as_str()
            )))
        }
    }

    /// Whether the caller acts on every tenant (an admin): a front end shows it tenant fields.
    pub fn sees_every_tenant(&self) -> bool {
        self.scope().is_none()
    }

    /// The tenant every lookup by id is confined to: the caller's, or none for an admin.
    pub fn scope(&self) -> Option<&str> {
        (self.role != Role::Admin).then_some(self.tenant.as_str())
    }

    /// The tenant rule, the only one: which tenant a caller who named `named` (or none) acts
    /// on. A non-admin acts on its own only (naming another is forbidden, naming none means its
    /// own); an admin on the one it names, or (`None`) on every tenant.
    pub fn tenant(&self, named: Option<&str>) -> Result<Option<String>, AppError> {
        match (self.scope(), named) {
            (Some(own), Some(t)) if own != t => Err(AppError::Forbidden(format!(
                "this token acts only for tenant {own:?}, not {t:?}"
            ))),
            (Some(own), _) => Ok(Some(own.to_string())),
            (None, t) => Ok(t.map(String::from)),
        }
    }

    /// The tenant a list or search shows ([`Caller::tenant`]; `None`: every tenant).
    pub fn tenant_filter(&self, named: Option<&str>) -> Result<Option<String>, AppError> {
        self.tenant(named)
    }

    /// The one tenant something new is made for (an operation, a batch, a schedule):
    /// [`Caller::tenant`], which for an admin must be named (an admin belongs to no tenant).
    pub fn tenant_for_write(&self, named: Option<&str>) -> Result<String, AppError> {
        self.tenant(named)?.ok_or_else(|| {
            AppError::invalid(
                "/tenant",
                "an admin token belongs to no one tenant: name the tenant in \"tenant\"",
            )
        })
    }
}
