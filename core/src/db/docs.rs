//! SQL of the built-in `doc_migration` kind: reading a source document from a table and
//! upserting a migrated document into a target table, both in agentq's database.
//!
//! Table and column names come from operation inputs, so they reach SQL only as [`Ident`]s:
//! validated against `^[A-Za-z_][A-Za-z0-9_]{0,62}$` (a table optionally `schema.table`), then
//! double-quoted. Document text is only ever a bound parameter.

use sqlx::PgPool;
use uuid::Uuid;

/// A table or column name taken from an input. Quoted when used, so it is case-sensitive and
/// can never be read as SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident(String);

impl Ident {
    /// A table name: `name` or `schema.name`.
    pub fn table(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| is_plain_name(p)) {
            return Err(format!(
                "{s:?} is not a table name (letters, digits and _, not starting with a digit, at \
                 most 63 characters; optionally schema.table)"
            ));
        }
        Ok(Self(s.to_string()))
    }

    /// A column name.
    pub fn column(s: &str) -> Result<Self, String> {
        if !is_plain_name(s) {
            return Err(format!(
                "{s:?} is not a column name (letters, digits and _, not starting with a digit, \
                 at most 63 characters)"
            ));
        }
        Ok(Self(s.to_string()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as SQL: each part double-quoted (validation leaves no quote to escape).
    fn sql(&self) -> String {
        self.0
            .split('.')
            .map(|p| format!("\"{p}\""))
            .collect::<Vec<_>>()
            .join(".")
    }
}

fn is_plain_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && s.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Errors of document tables.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The table does not fit (missing, a missing column, no unique key on `doc_id`, a type
    /// mismatch, no privilege): retrying cannot help until an operator changes the schema.
    #[error("{0}")]
    Schema(String),
    /// Anything else (connection, timeout): worth retrying.
    #[error(transparent)]
    Db(#[from] super::Error),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Db(e.into())
    }
}

/// SQLSTATE class 42 (syntax error or access rule violation) and 3F000 (no such schema): the
/// statement can never succeed against this schema.
fn schema_problem(e: &sqlx::Error) -> Option<String> {
    let db = e.as_database_error()?;
    let code = db.code()?;
    (code.starts_with("42") || code == "3F000").then(|| db.message().to_string())
}

fn has_code(e: &sqlx::Error, codes: &[&str]) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| codes.contains(&c.as_ref()))
}

/// The body of every row whose `id_column` (compared as text) equals `doc_id`, at most two: the
/// caller tells "no such row" and "not unique" apart. A NULL body comes back as `None`.
pub async fn read_source(
    pool: &PgPool,
    table: &Ident,
    id_column: &Ident,
    body_column: &Ident,
    doc_id: &str,
) -> Result<Vec<Option<String>>, Error> {
    let sql = format!(
        "SELECT {body}::text FROM {table} WHERE {id}::text = $1 LIMIT 2",
        body = body_column.sql(),
        table = table.sql(),
        id = id_column.sql(),
    );
    // Safe: the names are validated identifiers, quoted; the value is bound.
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(doc_id)
        .fetch_all(pool)
        .await
        .map_err(|e| match schema_problem(&e) {
            Some(m) => Error::Schema(format!("reading source table {}: {m}", table.as_str())),
            None => e.into(),
        })
}

/// The layout a target table needs; [`create_target_table`] creates it.
pub const TARGET_COLUMNS: &str = "doc_id text PRIMARY KEY, body text NOT NULL, \
     sha256 text NOT NULL, op_id uuid NOT NULL, written_at timestamptz NOT NULL DEFAULT now()";

/// Creates a target table with [`TARGET_COLUMNS`] unless it exists (left as it is if it does).
/// Safe to race: `IF NOT EXISTS` is not atomic in PostgreSQL, so losing the race to a
/// concurrent creation (duplicate table or type) counts as success.
pub async fn create_target_table(pool: &PgPool, table: &Ident) -> Result<(), Error> {
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {} ({TARGET_COLUMNS})",
        table.sql()
    );
    // Concurrent `CREATE TABLE IF NOT EXISTS` of one name can still fail on the catalog's
    // unique index ("type … already exists"): creators of one table take turns.
    let created = async {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('agentq:create_target:' || $1))")
            .bind(table.as_str())
            .execute(&mut *tx)
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    };
    match created.await {
        Ok(_) => Ok(()),
        Err(e) if has_code(&e, &["42P07", "42710", "23505"]) => Ok(()),
        Err(e) => Err(match schema_problem(&e) {
            Some(m) => Error::Schema(format!("creating target table {}: {m}", table.as_str())),
            None => e.into(),
        }),
    }
}

/// Writes the migrated document of `doc_id`: an upsert on the primary key, so writing it again
/// (a replay, or a later operation for the same document) replaces the row rather than adding
/// one. A missing table is created first ([`create_target_table`]).
pub async fn upsert_target(
    pool: &PgPool,
    table: &Ident,
    doc_id: &str,
    body: &str,
    sha256: &str,
    op_id: Uuid,
) -> Result<(), Error> {
    let sql = format!(
        "INSERT INTO {} (doc_id, body, sha256, op_id, written_at) VALUES ($1, $2, $3, $4, now())
         ON CONFLICT (doc_id) DO UPDATE
            SET body = EXCLUDED.body, sha256 = EXCLUDED.sha256, op_id = EXCLUDED.op_id,
                written_at = EXCLUDED.written_at",
        table.sql()
    );
    let upsert = || {
        sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
            .bind(doc_id)
            .bind(body)
            .bind(sha256)
            .bind(op_id)
            .execute(pool)
    };
    let result = match upsert().await {
        Err(e) if has_code(&e, &["42P01"]) => {
            create_target_table(pool, table).await?;
            upsert().await
        }
        other => other,
    };
    result.map_err(|e| match schema_problem(&e) {
        Some(m) => Error::Schema(format!(
            "writing target table {}: {m} (a target table needs {TARGET_COLUMNS})",
            table.as_str()
        )),
        None => e.into(),
    })?;
    Ok(())
}

/// Every id of a source table (as text, sorted): the documents of a batch.
pub async fn list_ids(pool: &PgPool, table: &str, id_column: &str) -> Result<Vec<String>, Error> {
    let (table, id) = (
        Ident::table(table).map_err(Error::Schema)?,
        Ident::column(id_column).map_err(Error::Schema)?,
    );
    let sql = format!(
        "SELECT {id}::text FROM {table} WHERE {id} IS NOT NULL ORDER BY 1",
        id = id.sql(),
        table = table.sql()
    );
    // Safe: the names are validated identifiers, quoted.
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_all(pool)
        .await
        .map_err(|e| match schema_problem(&e) {
            Some(m) => Error::Schema(format!("listing source table {}: {m}", table.as_str())),
            None => e.into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated_then_quoted() {
        assert_eq!(Ident::table("docs_in").unwrap().sql(), "\"docs_in\"");
        assert_eq!(
            Ident::table("migr.Docs_2").unwrap().sql(),
            "\"migr\".\"Docs_2\""
        );
        assert_eq!(Ident::column("_body").unwrap().sql(), "\"_body\"");
        for bad in [
            "",
            "1docs",
            "docs-in",
            "docs in",
            "a.b.c",
            ".docs",
            "docs.",
            "docs\"; DROP TABLE operations; --",
            "dócs",
            &"x".repeat(64),
        ] {
            assert!(Ident::table(bad).is_err(), "{bad:?} accepted as a table");
            assert!(Ident::column(bad).is_err(), "{bad:?} accepted as a column");
        }
        assert!(Ident::table(&"x".repeat(63)).is_ok());
        assert!(Ident::column("s.t").is_err(), "a column is never qualified");
    }
}
