//! Stores: the directories and tables an admin registered for a tenant, by name, with what
//! operations may do with them (read, write, or both). Kinds that touch host resources
//! (`doc_migration`) name a store in their input; the producer refuses an input naming a store
//! the tenant lacks (or lacks the access for) before anything is written, and the worker
//! resolves the name again when it runs, so a path or a table never comes from an input.
//!
//! agentq's own tables can never be a store ([`check_table`]).

use std::path::{Path, PathBuf};

use sqlx::{PgConnection, PgPool};

pub use crate::operation::{Access, Need};

use super::Result;
use super::access::audit;
use super::batch_source::Ident;

/// The tables agentq's migrations create (and sqlx's own): never readable or writable as a
/// store, whatever the schema they are named with. A test compares it with the migrated schema.
pub const AGENTQ_TABLES: &[&str] = &[
    "_sqlx_migrations",
    "agent_kv",
    "api_tokens",
    "batch_outcomes",
    "batches",
    "budget_holds",
    "budgets",
    "concurrency_keys",
    "dead_letters",
    "debounced_deliveries",
    "join_deltas",
    "ledger_effects",
    "operation_events",
    "operation_steps",
    "operation_steps_superseded",
    "operations",
    "operator_actions",
    "pauses",
    "rate_limits",
    "rate_usage",
    "rate_waiters",
    "schedules",
    "services",
    "signals",
    "stores",
    "tenant_kinds",
    "webhook_secrets",
    "webhook_sources",
    "workers",
];

/// Schemas no store may live in: PostgreSQL's catalogs.
const SYSTEM_SCHEMAS: &[&str] = &["pg_catalog", "information_schema", "pg_toast"];

/// Where a store is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// An absolute directory; a document is a relative path inside it.
    Dir(PathBuf),
    /// A table of agentq's database; a document is the row whose `id_column` (as text) equals
    /// its id. A missing target table is created on first write (`agentq-kinds`' `tables::docs`).
    Table {
        table: Ident,
        id_column: Ident,
        body_column: Ident,
    },
}

impl Location {
    /// As stored: the kind (`dir`, `table`), the place (a directory or a table name) and a
    /// table's id and body columns.
    pub fn parts(&self) -> (&'static str, String, Option<&str>, Option<&str>) {
        match self {
            Location::Dir(dir) => ("dir", dir.display().to_string(), None, None),
            Location::Table {
                table,
                id_column,
                body_column,
            } => (
                "table",
                table.as_str().to_string(),
                Some(id_column.as_str()),
                Some(body_column.as_str()),
            ),
        }
    }

    /// How the location is shown (`dir:/srv/in`, `table:docs_in`).
    pub fn describe(&self) -> String {
        match self {
            Location::Dir(dir) => format!("dir:{}", dir.display()),
            Location::Table { table, .. } => format!("table:{}", table.as_str()),
        }
    }
}

/// A registered store.
#[derive(Clone, Debug)]
pub struct Store {
    pub tenant: String,
    pub name: String,
    pub location: Location,
    pub access: Access,
    pub created_by: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// A store name: 1-64 letters, digits, `_`, `-`, `.`.
pub fn check_name(name: &str) -> Result<(), String> {
    check_plain_name("store name", name)
}

/// A name an admin gives a store or a webhook source: 1-64 letters, digits, `_`, `-`, `.`;
/// the error starts with `what`.
pub fn check_plain_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        return Err(format!(
            "{what} {name:?}: use 1-64 characters of letters, digits, '_', '-', '.'"
        ));
    }
    Ok(())
}

/// A directory a store may be: absolute, without `.` or `..` segments, not the root.
pub fn check_dir(dir: &str) -> Result<PathBuf, String> {
    let path = Path::new(dir);
    if !path.is_absolute() {
        return Err(format!("directory {dir:?} must be an absolute path"));
    }
    if dir.split('/').any(|s| s == "." || s == "..") {
        return Err(format!(
            "directory {dir:?} must not contain \".\" or \"..\" segments"
        ));
    }
    if path.parent().is_none() {
        return Err(
            "the file-system root cannot be a store; name the directory of the documents".into(),
        );
    }
    Ok(path.to_path_buf())
}

/// A table a store may be: a valid name that is none of agentq's tables (in any schema) and
/// not in a system schema.
pub fn check_table(table: &Ident) -> Result<(), String> {
    let name = table.as_str();
    let (schema, relation) = match name.split_once('.') {
        Some((s, r)) => (Some(s), r),
        None => (None, name),
    };
    if AGENTQ_TABLES.contains(&relation) {
        return Err(format!(
            "table {name:?} is one of agentq's own tables, which are never a store; name a \
             table of your documents"
        ));
    }
    if let Some(s) = schema
        && (SYSTEM_SCHEMAS.contains(&s) || s.starts_with("pg_"))
    {
        return Err(format!(
            "table {name:?} is in PostgreSQL's system schema {s:?}, which is never a store"
        ));
    }
    Ok(())
}

#[derive(sqlx::FromRow)]
struct Row {
    tenant_id: String,
    name: String,
    kind: String,
    location: String,
    id_column: Option<String>,
    body_column: Option<String>,
    access: String,
    created_by: String,
    created_at: chrono::DateTime<chrono::Utc>,
}

impl TryFrom<Row> for Store {
    type Error = String;

    fn try_from(r: Row) -> Result<Self, String> {
        let location = match r.kind.as_str() {
            "dir" => Location::Dir(check_dir(&r.location)?),
            "table" => {
                let table = Ident::table(&r.location)?;
                check_table(&table)?;
                Location::Table {
                    table,
                    id_column: Ident::column(r.id_column.as_deref().unwrap_or("id"))?,
                    body_column: Ident::column(r.body_column.as_deref().unwrap_or("body"))?,
                }
            }
            other => return Err(format!("unknown store kind {other:?}")),
        };
        Ok(Store {
            tenant: r.tenant_id,
            name: r.name,
            location,
            access: Access::parse(&r.access)?,
            created_by: r.created_by,
            created_at: r.created_at,
        })
    }
}

const COLUMNS: &str = "tenant_id, name, kind, location, id_column, body_column, access, \
                       created_by, created_at";

/// A stored row that no longer passes the checks (edited by hand): reported, never used.
fn corrupt(e: String) -> super::Error {
    super::Error::Sqlx(sqlx::Error::Decode(e.into()))
}

/// Registers a store (audited as `store_add`); false if the tenant has one of that name.
pub async fn add(
    pool: &PgPool,
    tenant: &str,
    name: &str,
    location: &Location,
    access: Access,
    actor: &str,
) -> Result<bool> {
    let (kind, place, id_column, body_column) = location.parts();
    let mut tx = pool.begin().await?;
    let n = sqlx::query(
        "INSERT INTO stores (tenant_id, name, kind, location, id_column, body_column, access, created_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(tenant)
    .bind(name)
    .bind(kind)
    .bind(&place)
    .bind(id_column)
    .bind(body_column)
    .bind(access.as_str())
    .bind(actor)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if n == 1 {
        audit(
            &mut tx,
            actor,
            "store_add",
            serde_json::json!({
                "tenant": tenant, "store": name, "kind": kind, "location": place,
                "access": access.as_str(),
            }),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(n == 1)
}

/// Removes a store (audited as `store_remove`); false if there is none. Operations that name it
/// and have not yet read or written it then fail (non-retryable) when they run.
pub async fn remove(pool: &PgPool, tenant: &str, name: &str, actor: &str) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let n = sqlx::query("DELETE FROM stores WHERE tenant_id = $1 AND name = $2")
        .bind(tenant)
        .bind(name)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if n == 1 {
        audit(
            &mut tx,
            actor,
            "store_remove",
            serde_json::json!({ "tenant": tenant, "store": name }),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(n == 1)
}

/// The stores of one tenant or all, by tenant and name.
pub async fn list(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<Store>> {
    let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM stores WHERE ($1::text IS NULL OR tenant_id = $1)
          ORDER BY tenant_id, name"
    )))
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    rows.into_iter()
        .map(|r| Store::try_from(r).map_err(corrupt))
        .collect()
}

/// The tenant's store `name`, if registered.
pub async fn get(pool: &PgPool, tenant: &str, name: &str) -> Result<Option<Store>> {
    let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM stores WHERE tenant_id = $1 AND name = $2"
    )))
    .bind(tenant)
    .bind(name)
    .fetch_optional(pool)
    .await?;
    row.map(|r| Store::try_from(r).map_err(corrupt)).transpose()
}

/// Checks that `tenant` has every store `needs` names, with the access it needs: `Ok(None)`
/// when it does, `Ok(Some(why))` with what to register when not. One query.
pub async fn refusal(
    conn: &mut PgConnection,
    tenant: &str,
    needs: &[Need],
) -> Result<Option<String>> {
    if needs.is_empty() {
        return Ok(None);
    }
    let names: Vec<&str> = needs.iter().map(|n| n.store.as_str()).collect();
    let found: Vec<(String, String)> =
        sqlx::query_as("SELECT name, access FROM stores WHERE tenant_id = $1 AND name = ANY($2)")
            .bind(tenant)
            .bind(&names)
            .fetch_all(conn)
            .await?;
    for need in needs {
        let access = found
            .iter()
            .find(|(name, _)| *name == need.store)
            .map(|(_, a)| Access::parse(a).map_err(corrupt))
            .transpose()?;
        let verb = match need.access {
            Access::Write => "write",
            _ => "read",
        };
        match access {
            None => {
                return Ok(Some(format!(
                    "{}: tenant {tenant} has no store {:?}; an admin registers one with \
                     `agentq stores add --tenant {tenant} --name {} --dir /path (or --table NAME) \
                     --access {verb}`",
                    need.field, need.store, need.store
                )));
            }
            Some(a) if !a.grants(need.access) => {
                return Ok(Some(format!(
                    "{}: store {:?} of tenant {tenant} is registered for {} only; this input \
                     needs to {verb} it (an admin re-adds it with --access read_write)",
                    need.field,
                    need.store,
                    a.as_str()
                )));
            }
            Some(_) => {}
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agentq_tables_and_system_schemas_are_never_stores() {
        for t in [
            "operations",
            "public.operations",
            "webhook_secrets",
            "other.api_tokens",
            "_sqlx_migrations",
            "pg_catalog.pg_authid",
            "information_schema.tables",
            "pg_temp_3.x",
        ] {
            assert!(check_table(&Ident::table(t).unwrap()).is_err(), "{t}");
        }
        for t in ["docs_in", "migr.docs_out", "Operations"] {
            check_table(&Ident::table(t).unwrap()).unwrap();
        }
    }

    #[test]
    fn directories_are_absolute_and_plain() {
        check_dir("/srv/docs").unwrap();
        for d in ["srv/docs", "/srv/../etc", "/srv/./x", "/", ""] {
            assert!(check_dir(d).is_err(), "{d}");
        }
        assert!(Access::ReadWrite.grants(Access::Write));
        assert!(!Access::Read.grants(Access::Write));
        assert!(Access::parse("rw").is_err());
        check_name("legacy-docs_2024.v1").unwrap();
        assert!(check_name("a/b").is_err());
        assert!(check_name("").is_err());
    }
}
