//! SQL of the kinds a tenant may use (migration 20): an admin's list per tenant, and the list
//! of `*` for tenants without one of their own. No list at all: every kind.

use serde::Serialize;
use sqlx::PgPool;

use super::Result;
use super::access::audit;

/// The row that applies to tenants without one of their own.
pub const DEFAULT: &str = "*";

/// A tenant's kinds as stored: its own list and the default list, either absent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Policy {
    /// The tenant's own list, if an admin set one.
    pub own: Option<Vec<String>>,
    /// The list of `*`, for tenants without their own, if an admin set one.
    pub default: Option<Vec<String>>,
}

impl Policy {
    /// The kinds the tenant may use: its own list, else the default list; `None`: every kind.
    pub fn effective(&self) -> Option<&[String]> {
        self.own.as_deref().or(self.default.as_deref())
    }

    /// Whether the tenant may create operations of `kind`.
    pub fn allows(&self, kind: &str) -> bool {
        self.effective()
            .is_none_or(|kinds| kinds.iter().any(|k| k == kind))
    }
}

/// The lists that apply to `tenant` (for [`DEFAULT`] itself, `own` is the default list).
pub async fn policy(pool: &PgPool, tenant: &str) -> Result<Policy> {
    let (own, default): (Option<Vec<String>>, Option<Vec<String>>) = sqlx::query_as(
        "SELECT (SELECT kinds FROM tenant_kinds WHERE tenant_id = $1),
                (SELECT kinds FROM tenant_kinds WHERE tenant_id = $2)",
    )
    .bind(tenant)
    .bind(DEFAULT)
    .fetch_one(pool)
    .await?;
    Ok(Policy { own, default })
}

/// What [`set`] changed beyond the list.
#[derive(Clone, Debug, Default, Serialize, schemars::JsonSchema)]
pub struct Applied {
    /// Schedules paused because their kind is no longer allowed to their tenant (resuming one
    /// is refused until it is).
    pub paused_schedules: Vec<uuid::Uuid>,
}

/// Sets `tenant`'s list (`None`: removes it), pausing in the same transaction every schedule
/// whose tenant may no longer use its kind; audited as `tenant_kinds_set`.
pub async fn set(
    pool: &PgPool,
    tenant: &str,
    kinds: Option<&[String]>,
    actor: &str,
) -> Result<Applied> {
    let mut tx = pool.begin().await?;
    match kinds {
        Some(kinds) => {
            sqlx::query(
                "INSERT INTO tenant_kinds (tenant_id, kinds, updated_by) VALUES ($1, $2, $3)
                 ON CONFLICT (tenant_id) DO UPDATE
                    SET kinds = EXCLUDED.kinds, updated_by = EXCLUDED.updated_by,
                        updated_at = now()",
            )
            .bind(tenant)
            .bind(kinds)
            .bind(actor)
            .execute(&mut *tx)
            .await?;
        }
        None => {
            sqlx::query("DELETE FROM tenant_kinds WHERE tenant_id = $1")
                .bind(tenant)
                .execute(&mut *tx)
                .await?;
        }
    }
    let paused_schedules: Vec<uuid::Uuid> = sqlx::query_scalar(
        "UPDATE schedules SET paused = true, updated_at = now()
          WHERE NOT paused AND NOT agentq_kind_allowed(tenant_id, kind)
         RETURNING id",
    )
    .fetch_all(&mut *tx)
    .await?;
    audit(
        &mut tx,
        actor,
        "tenant_kinds_set",
        serde_json::json!({
            "tenant": tenant,
            "kinds": kinds,
            "paused_schedules": paused_schedules,
        }),
    )
    .await?;
    tx.commit().await?;
    Ok(Applied { paused_schedules })
}
