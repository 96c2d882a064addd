//! A table a batch reads its documents from (a table store's source): the checked SQL
//! identifier a store's table and columns are held as ([`Ident`]), and the listing of a source
//! table's ids ([`list_ids`]), both the engine's (stores, batches). The built-in
//! `doc_migration` kind reads and writes such tables with its own SQL (`agentq-kinds`,
//! `tables::docs`), through the same [`Ident`] and [`Error`].
//!
//! Table and column names come from an admin's store registration, so they reach SQL only as
//! [`Ident`]s: validated against `^[A-Za-z_][A-Za-z0-9_]{0,62}$` (a table optionally
//! `schema.table`), then double-quoted.

use sqlx::PgPool;

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
    pub fn sql(&self) -> String {
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

/// Errors of reading or writing a table named by a store: the schema, or the database.
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
pub fn schema_problem(e: &sqlx::Error) -> Option<String> {
    let db = e.as_database_error()?;
    let code = db.code()?;
    (code.starts_with("42") || code == "3F000").then(|| db.message().to_string())
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
