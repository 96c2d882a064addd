//! SQL of the `ledger` demo tool (`ledger_effects`): an outside system with side effects,
//! used by the `script` kind, crash tests and benchmarks.

use sqlx::PgPool;
use uuid::Uuid;

use agentq_core::db::Result;

/// Performs one effect. A safe effect happens at most once per idempotency key; an unsafe one
/// happens every time this is called. Returns the effect's row id (the existing one for a
/// repeated safe call).
pub async fn record_effect(
    pool: &PgPool,
    op_id: Uuid,
    label: &str,
    key: &str,
    safe: bool,
) -> Result<i64> {
    if safe {
        let id: Option<i64> = sqlx::query_scalar(
            "WITH ins AS (
                INSERT INTO ledger_effects (op_id, label, idempotency_key, replay)
                VALUES ($1, $2, $3, 'safe')
                ON CONFLICT (idempotency_key) WHERE replay = 'safe' DO NOTHING
                RETURNING id)
             SELECT id FROM ins
             UNION ALL
             SELECT id FROM ledger_effects WHERE idempotency_key = $3 AND replay = 'safe'
             LIMIT 1",
        )
        .bind(op_id)
        .bind(label)
        .bind(key)
        .fetch_optional(pool)
        .await?;
        match id {
            Some(id) => Ok(id),
            // A concurrent insert of the same key committed after this statement's snapshot.
            None => Ok(find_effect(pool, key).await?.unwrap_or_default()),
        }
    } else {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO ledger_effects (op_id, label, idempotency_key, replay)
             VALUES ($1, $2, $3, 'unsafe') RETURNING id",
        )
        .bind(op_id)
        .bind(label)
        .bind(key)
        .fetch_one(pool)
        .await?;
        Ok(id)
    }
}

/// The effect recorded under `key`, if any (what `reconcile` asks the outside world).
pub async fn find_effect(pool: &PgPool, key: &str) -> Result<Option<i64>> {
    let id = sqlx::query_scalar(
        "SELECT id FROM ledger_effects WHERE idempotency_key = $1 ORDER BY id LIMIT 1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await?;
    Ok(id)
}
