//! SQL of names: the batches or schedules of a tenant that carry a name (each unique in its
//! tenant, so a tenant has at most one; every tenant together may have several).

use sqlx::PgPool;
use uuid::Uuid;

use super::Result;

/// What carries a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    Batch,
    Schedule,
}

impl Named {
    /// What a person calls it: `batch`, `schedule`.
    pub fn as_str(self) -> &'static str {
        match self {
            Named::Batch => "batch",
            Named::Schedule => "schedule",
        }
    }
}

/// The `what`s of a tenant (every tenant's for `None`) named `name`, as (id, tenant), by tenant.
pub async fn named(
    pool: &PgPool,
    what: Named,
    name: &str,
    tenant: Option<&str>,
) -> Result<Vec<(Uuid, String)>> {
    let sql = match what {
        Named::Batch => {
            "SELECT id, tenant_id FROM batches
              WHERE name = $1 AND ($2::text IS NULL OR tenant_id = $2)
              ORDER BY tenant_id LIMIT 10"
        }
        Named::Schedule => {
            "SELECT id, tenant_id FROM schedules
              WHERE name = $1 AND ($2::text IS NULL OR tenant_id = $2)
              ORDER BY tenant_id LIMIT 10"
        }
    };
    let rows = sqlx::query_as(sql)
        .bind(name)
        .bind(tenant)
        .fetch_all(pool)
        .await?;
    Ok(rows)
}
