//! The `kv_put` / `kv_get` tools: a key-value table per tenant.

use agentq_worker::{JobError, Replay, Tool};
use async_trait::async_trait;
use serde_json::{Value, json};
use sqlx::PgPool;

/// The `kv_put` / `kv_get` tools: a key-value table per tenant. Both are replay-safe (an upsert
/// and a read).
pub(crate) struct Kv {
    pub(crate) pool: PgPool,
    /// Whose table: every key is read and written under this tenant.
    pub(crate) tenant: String,
    /// `kv_put` (true) or `kv_get`.
    pub(crate) put: bool,
    pub(crate) approval: bool,
}

#[async_trait]
impl Tool for Kv {
    fn name(&self) -> &str {
        if self.put { "kv_put" } else { "kv_get" }
    }

    fn replay(&self) -> Replay {
        Replay::Safe
    }

    fn description(&self) -> &str {
        if self.put {
            "Store a JSON value under a key."
        } else {
            "Read the JSON value stored under a key (null if none)."
        }
    }

    fn parameters(&self) -> Value {
        if self.put {
            json!({ "type": "object", "properties": { "key": { "type": "string" }, "value": {} }, "required": ["key", "value"] })
        } else {
            json!({ "type": "object", "properties": { "key": { "type": "string" } }, "required": ["key"] })
        }
    }

    fn requires_approval(&self) -> bool {
        self.approval
    }

    async fn call(&self, args: &Value, _key: &str) -> Result<Value, JobError> {
        let key = args
            .get("key")
            .and_then(Value::as_str)
            .ok_or_else(|| JobError::NonRetryable("`key` (a string) is required".into()))?;
        let unavailable =
            |e: agentq_core::db::Error| JobError::retryable(format!("kv unavailable: {e}"));
        if self.put {
            let value = args.get("value").cloned().unwrap_or(Value::Null);
            agentq_core::db::kv::put(&self.pool, &self.tenant, key, &value)
                .await
                .map_err(unavailable)?;
            Ok(json!({ "ok": true }))
        } else {
            let value = agentq_core::db::kv::get(&self.pool, &self.tenant, key)
                .await
                .map_err(unavailable)?;
            Ok(json!({ "value": value }))
        }
    }
}
