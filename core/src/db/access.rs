//! SQL of API tokens and webhook sources. Token creation, revocation, source creation and
//! secret rotation are audited in `operator_actions`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;

/// The roles a token can have.
pub const ROLES: [&str; 3] = ["producer", "operator", "admin"];

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

/// A token as listed (never the token itself).
#[derive(Clone, Debug, Serialize, FromRow)]
pub struct TokenView {
    pub id: Uuid,
    pub prefix: String,
    pub tenant: String,
    pub role: String,
    pub created_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// Creates a token for `tenant` with `role`; returns its id and the token (≥ 128 random bits,
/// prefixed `agq_`), which is not stored anywhere.
pub async fn create_token(
    pool: &PgPool,
    tenant: &str,
    role: &str,
    actor: &str,
) -> Result<(Uuid, String)> {
    let token = format!(
        "agq_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let id = Uuid::new_v4();
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO api_tokens (id, token_sha256, prefix, tenant_id, role, created_by)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(sha256_hex(&token))
    .bind(&token[..12])
    .bind(tenant)
    .bind(role)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    audit(
        &mut tx,
        actor,
        "token_create",
        serde_json::json!({ "token_id": id, "tenant": tenant, "role": role }),
    )
    .await?;
    tx.commit().await?;
    Ok((id, token))
}

/// Tokens, newest first, of one tenant or all.
pub async fn list_tokens(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<TokenView>> {
    let rows = sqlx::query_as(
        "SELECT id, prefix, tenant_id AS tenant, role, created_by, created_at, revoked_at
           FROM api_tokens WHERE ($1::text IS NULL OR tenant_id = $1)
          ORDER BY created_at DESC, id",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Revokes a token; false if there is no such unrevoked token.
pub async fn revoke_token(pool: &PgPool, id: Uuid, actor: &str) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let n = sqlx::query(
        "UPDATE api_tokens SET revoked_at = now(), revoked_by = $2 WHERE id = $1 AND revoked_at IS NULL",
    )
    .bind(id)
    .bind(actor)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if n == 1 {
        audit(
            &mut tx,
            actor,
            "token_revoke",
            serde_json::json!({ "token_id": id }),
        )
        .await?;
    }
    tx.commit().await?;
    Ok(n == 1)
}

/// The tenant and role of a valid (unrevoked) token, found by its hash.
pub async fn authenticate(pool: &PgPool, token: &str) -> Result<Option<(String, String)>> {
    authenticate_hash(pool, &token_hash(token)).await
}

/// The SHA-256 (hex) a token is stored and looked up under.
pub fn token_hash(token: &str) -> String {
    sha256_hex(token)
}

/// [`authenticate`] by the token's hash: for re-checking a caller whose request lasts (an
/// event stream) without keeping the token itself.
pub async fn authenticate_hash(pool: &PgPool, hash: &str) -> Result<Option<(String, String)>> {
    let row = sqlx::query_as(
        "SELECT tenant_id, role FROM api_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL",
    )
    .bind(hash)
    .fetch_optional(pool)
    .await?;
    Ok(row)
}

/// A webhook source as listed (never its secrets).
#[derive(Clone, Debug, Serialize, FromRow)]
pub struct SourceView {
    pub id: Uuid,
    pub tenant: String,
    pub name: String,
    pub kind: String,
    pub created_at: DateTime<Utc>,
    pub active_secrets: i64,
    /// Per-source configuration handed to each operation (`None`: the body is the input).
    pub config: Option<serde_json::Value>,
    /// Its debounce (`agentq_app::debounce::SourceDebounce`), if any.
    pub debounce: Option<serde_json::Value>,
    /// The token budget each delivery's operation is born with (a [`super::budgets::Spec`]).
    pub budget: Option<serde_json::Value>,
}

/// A webhook source to create.
#[derive(Clone, Copy, Debug)]
pub struct NewSource<'a> {
    pub tenant: &'a str,
    pub name: &'a str,
    pub kind: &'a str,
    /// Handed to each operation of its deliveries.
    pub config: Option<&'a serde_json::Value>,
    /// Its debounce (`agentq_app::debounce::SourceDebounce`).
    pub debounce: Option<&'a serde_json::Value>,
    /// The token budget each delivery's operation is born with.
    pub budget: Option<super::budgets::Spec>,
}

/// Creates a source with its first secret, its configuration, its debounce and its budget (if
/// any); false
/// if the tenant already has one of that name.
pub async fn add_source(
    pool: &PgPool,
    source: NewSource<'_>,
    secret: &str,
    actor: &str,
) -> Result<bool> {
    let NewSource {
        tenant,
        name,
        kind,
        config,
        debounce,
        budget,
    } = source;
    let budget = budget.map(sqlx::types::Json);
    let mut tx = pool.begin().await?;
    let id: Option<Uuid> = sqlx::query_scalar(
        "INSERT INTO webhook_sources (id, tenant_id, name, kind, config, debounce, budget)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (tenant_id, name) DO NOTHING RETURNING id",
    )
    .bind(Uuid::new_v4())
    .bind(tenant)
    .bind(name)
    .bind(kind)
    .bind(config)
    .bind(debounce)
    .bind(budget)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = id else {
        return Ok(false);
    };
    add_secret(&mut tx, id, secret).await?;
    audit(
        &mut tx,
        actor,
        "webhook_add",
        serde_json::json!({ "tenant": tenant, "source": name, "kind": kind, "config": config.is_some(), "debounce": debounce, "budget": budget }),
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// Adds `secret` to a source; its current secrets stay valid for `grace`. False if no such source.
pub async fn rotate_secret(
    pool: &PgPool,
    tenant: &str,
    name: &str,
    secret: &str,
    grace: chrono::Duration,
    actor: &str,
) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let id: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM webhook_sources WHERE tenant_id = $1 AND name = $2 FOR UPDATE",
    )
    .bind(tenant)
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(id) = id else {
        return Ok(false);
    };
    let until = Utc::now() + grace;
    sqlx::query(
        "UPDATE webhook_secrets SET expires_at = LEAST(COALESCE(expires_at, $2), $2)
          WHERE source_id = $1",
    )
    .bind(id)
    .bind(until)
    .execute(&mut *tx)
    .await?;
    add_secret(&mut tx, id, secret).await?;
    audit(
        &mut tx,
        actor,
        "webhook_rotate",
        serde_json::json!({ "tenant": tenant, "source": name, "old_valid_until": until }),
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// The secrets of a source that verify deliveries now, newest first, and the kind it creates.
pub async fn active_secrets(
    pool: &PgPool,
    tenant: &str,
    name: &str,
) -> Result<Option<(String, Vec<String>)>> {
    let kind: Option<String> =
        sqlx::query_scalar("SELECT kind FROM webhook_sources WHERE tenant_id = $1 AND name = $2")
            .bind(tenant)
            .bind(name)
            .fetch_optional(pool)
            .await?;
    let Some(kind) = kind else {
        return Ok(None);
    };
    let secrets = sqlx::query_scalar(
        "SELECT w.secret FROM webhook_secrets w JOIN webhook_sources s ON s.id = w.source_id
          WHERE s.tenant_id = $1 AND s.name = $2 AND (w.expires_at IS NULL OR w.expires_at > now())
          ORDER BY w.created_at DESC",
    )
    .bind(tenant)
    .bind(name)
    .fetch_all(pool)
    .await?;
    Ok(Some((kind, secrets)))
}

/// A source as a delivery sees it: its tenant, the kind it creates, its valid secrets, its
/// configuration.
#[derive(Clone, Debug)]
pub struct DeliveryTarget {
    pub tenant: String,
    pub kind: String,
    /// Valid now, newest first.
    pub secrets: Vec<String>,
    /// `Some`: each operation's input wraps the body with this configuration.
    pub config: Option<serde_json::Value>,
    /// `Some`: deliveries are debounced on the key their body holds at its pointer.
    pub debounce: Option<serde_json::Value>,
    /// `Some`: each delivery's operation is born with this token budget.
    pub budget: Option<super::budgets::Spec>,
}

/// Every tenant's source named `name`, with the secrets valid now (a delivery belongs to the
/// one whose secret verifies it).
pub async fn sources_named(pool: &PgPool, name: &str) -> Result<Vec<DeliveryTarget>> {
    type Row = (
        String,
        String,
        Vec<String>,
        Option<serde_json::Value>,
        Option<serde_json::Value>,
        Option<sqlx::types::Json<super::budgets::Spec>>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT s.tenant_id, s.kind,
                COALESCE(array_agg(w.secret ORDER BY w.created_at DESC)
                         FILTER (WHERE w.secret IS NOT NULL), '{}'),
                s.config, s.debounce, s.budget
           FROM webhook_sources s
           LEFT JOIN webhook_secrets w
             ON w.source_id = s.id AND (w.expires_at IS NULL OR w.expires_at > now())
          WHERE s.name = $1
          GROUP BY s.id",
    )
    .bind(name)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(tenant, kind, secrets, config, debounce, budget)| DeliveryTarget {
                tenant,
                kind,
                secrets,
                config,
                debounce,
                budget: budget.map(|b| b.0),
            },
        )
        .collect())
}

/// Webhook sources of one tenant or all.
pub async fn list_sources(pool: &PgPool, tenant: Option<&str>) -> Result<Vec<SourceView>> {
    let rows = sqlx::query_as(
        "SELECT s.id, s.tenant_id AS tenant, s.name, s.kind, s.created_at, s.config, s.debounce,
                s.budget,
                (SELECT count(*) FROM webhook_secrets w
                  WHERE w.source_id = s.id AND (w.expires_at IS NULL OR w.expires_at > now())) AS active_secrets
           FROM webhook_sources s WHERE ($1::text IS NULL OR s.tenant_id = $1)
          ORDER BY s.tenant_id, s.name",
    )
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

async fn add_secret(tx: &mut sqlx::PgConnection, source: Uuid, secret: &str) -> Result<()> {
    sqlx::query("INSERT INTO webhook_secrets (source_id, secret) VALUES ($1, $2)")
        .bind(source)
        .bind(secret)
        .execute(tx)
        .await?;
    Ok(())
}

/// Writes one row of the audit trail (`operator_actions`) in the caller's transaction.
pub(super) async fn audit(
    tx: &mut sqlx::PgConnection,
    actor: &str,
    action: &str,
    details: serde_json::Value,
) -> Result<()> {
    sqlx::query("INSERT INTO operator_actions (actor, action, details) VALUES ($1, $2, $3)")
        .bind(actor)
        .bind(action)
        .bind(details)
        .execute(tx)
        .await?;
    Ok(())
}

/// Which of `hashes` are valid (unrevoked) tokens: one query re-checks the tokens of every
/// open event stream.
pub async fn valid_token_hashes(pool: &PgPool, hashes: &[String]) -> Result<Vec<String>> {
    let rows = sqlx::query_scalar(
        "SELECT token_sha256 FROM api_tokens WHERE token_sha256 = ANY($1) AND revoked_at IS NULL",
    )
    .bind(hashes)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
