//! SQL of the `kv_put` / `kv_get` tools of the built-in `agent` kind (`agent_kv`).

use serde_json::Value;
use sqlx::PgPool;

use agentq_core::db::Result;

/// Sets `key` for `tenant` (an upsert: repeating it is harmless).
pub async fn put(pool: &PgPool, tenant: &str, key: &str, value: &Value) -> Result<()> {
    sqlx::query(
        "INSERT INTO agent_kv (tenant_id, key, value) VALUES ($1, $2, $3)
         ON CONFLICT (tenant_id, key) DO UPDATE SET value = EXCLUDED.value, updated_at = now()",
    )
    .bind(tenant)
    .bind(key)
    .bind(value)
    .execute(pool)
    .await?;
    Ok(())
}

/// The value of `key` for `tenant`, if set.
pub async fn get(pool: &PgPool, tenant: &str, key: &str) -> Result<Option<Value>> {
    let v = sqlx::query_scalar("SELECT value FROM agent_kv WHERE tenant_id = $1 AND key = $2")
        .bind(tenant)
        .bind(key)
        .fetch_optional(pool)
        .await?;
    Ok(v)
}
