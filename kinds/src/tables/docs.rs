//! SQL of the built-in `doc_migration` kind: reading a source document from a table and
//! upserting a migrated document into a target table, both in agentq's database.
//!
//! Table and column names reach SQL only as checked, quoted [`Ident`]s. Document text is only
//! ever a bound parameter.

use agentq_core::db::batch_source::{Error, Ident, schema_problem};
use sqlx::PgPool;
use uuid::Uuid;

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
