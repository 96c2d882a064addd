//! SQL of services (`services`): the remote kinds' servers an admin registered, read by every
//! role (`agentq_worker::remote` keeps a snapshot), written by `agentq services`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool};

use super::Result;

/// A registered service, with its secret (only the worker and the registration read it).
#[derive(Clone, Debug, FromRow)]
pub struct ServiceRow {
    pub name: String,
    pub url: String,
    pub secret: String,
    pub timeout_secs: i32,
    pub manifest: Value,
    /// Its URL may lead to a link-local or cloud metadata address (an admin said so).
    pub allow_link_local: bool,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// How its live manifest differs from the registered one, one difference a line, when the
    /// last check found it did ([`set_checked`]).
    pub drift: Option<String>,
    /// When its live manifest was last fetched and compared.
    pub checked_at: Option<DateTime<Utc>>,
}

/// Every registered service, by name.
pub async fn all(pool: &PgPool) -> Result<Vec<ServiceRow>> {
    Ok(sqlx::query_as(
        "SELECT name, url, secret, timeout_secs, manifest, allow_link_local, created_at,
                updated_at, drift, checked_at
         FROM services ORDER BY name",
    )
    .fetch_all(pool)
    .await?)
}

/// What [`register`] wrote: the service's row, and whether it was registered before.
#[derive(Debug, FromRow)]
pub struct Registered {
    #[sqlx(flatten)]
    pub row: ServiceRow,
    pub replaced: bool,
}

/// A service as registered.
#[derive(Debug)]
pub struct NewService<'a> {
    pub name: &'a str,
    pub url: &'a str,
    /// Its signing secret; `None` keeps a registered one's.
    pub secret: Option<&'a str>,
    pub timeout_secs: i32,
    pub manifest: &'a Value,
    pub allow_link_local: bool,
}

/// Registers the service `s.name` (a second registration replaces the first's URL, manifest,
/// timeout and link-local choice, and its secret when one is given), audited as
/// `service_register` by `actor`.
pub async fn register(pool: &PgPool, s: &NewService<'_>, actor: &str) -> Result<Registered> {
    let (name, manifest) = (s.name, s.manifest);
    let mut tx = pool.begin().await?;
    // `xmax <> 0`: the row was updated, not inserted.
    let registered: Registered = sqlx::query_as(
        "INSERT INTO services (name, url, secret, timeout_secs, manifest, allow_link_local)
         VALUES ($1, $2, COALESCE($3, ''), $4, $5, $6)
         ON CONFLICT (name) DO UPDATE SET
             url = EXCLUDED.url,
             secret = COALESCE($3, services.secret),
             timeout_secs = EXCLUDED.timeout_secs,
             manifest = EXCLUDED.manifest,
             allow_link_local = EXCLUDED.allow_link_local,
             updated_at = now(),
             drift = NULL,
             checked_at = NULL
         RETURNING name, url, secret, timeout_secs, manifest, allow_link_local, created_at,
                   updated_at, drift, checked_at, (xmax <> 0) AS replaced",
    )
    .bind(name)
    .bind(s.url)
    .bind(s.secret)
    .bind(s.timeout_secs)
    .bind(manifest)
    .bind(s.allow_link_local)
    .fetch_one(&mut *tx)
    .await?;
    let kinds: Vec<Value> = manifest["kinds"]
        .as_array()
        .map(|ks| {
            ks.iter()
                .map(|k| serde_json::json!([k["name"], k["version"]]))
                .collect()
        })
        .unwrap_or_default();
    super::access::audit(
        &mut tx,
        actor,
        "service_register",
        serde_json::json!({ "service": name, "url": s.url, "kinds": kinds,
                            "secret_changed": s.secret.is_some(),
                            "allow_link_local": s.allow_link_local }),
    )
    .await?;
    tx.commit().await?;
    Ok(registered)
}

/// Records a check of the service `name`'s live manifest against its registration of
/// `registered_at` (its `updated_at`): `drift`, the differences (`None`: none). A registration
/// since then wins (nothing is written). Leaves `updated_at` alone. Whether it was written.
pub async fn set_checked(
    pool: &PgPool,
    name: &str,
    registered_at: DateTime<Utc>,
    drift: Option<&str>,
) -> Result<bool> {
    Ok(sqlx::query(
        "UPDATE services SET drift = $3, checked_at = now() WHERE name = $1 AND updated_at = $2",
    )
    .bind(name)
    .bind(registered_at)
    .bind(drift)
    .execute(pool)
    .await?
    .rows_affected()
        > 0)
}

/// Removes the service `name`, audited as `service_remove`; whether there was one.
pub async fn remove(pool: &PgPool, name: &str, actor: &str) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let gone = sqlx::query("DELETE FROM services WHERE name = $1")
        .bind(name)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        > 0;
    if gone {
        super::access::audit(
            &mut tx,
            actor,
            "service_remove",
            serde_json::json!({ "service": name }),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(gone)
}
