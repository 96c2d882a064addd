//! SQL of signals: storing one for an operation and, if it waits for exactly that signal,
//! waking it ([`transition::SIGNAL`]), audited.
//!
//! [`transition::SIGNAL`]: crate::state::transition::SIGNAL

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::Result;
use super::dispatch::Dispatch;
use crate::state::Status;
use crate::state::transition::{from_sql, to_sql};

/// What sending a signal did.
#[derive(Clone, Debug, PartialEq)]
pub enum Sent {
    /// The operation was waiting for it and is queued again (dispatch it).
    Woke(Dispatch),
    /// Kept for a later wait of that name (the operation is not waiting for it now).
    Kept {
        status: Status,
        waiting_for: Option<String>,
    },
    /// A signal of that name is already pending (not consumed yet); nothing changed.
    AlreadyPending,
    /// The operation is finished; nothing was kept.
    Finished(Status),
    /// No such operation (in this tenant).
    NotFound,
}

/// Sends the signal `name` to an operation, audited as `action` by `actor`. One short
/// transaction: lock the operation, store the signal (a consumed one of the same name is
/// replaced), wake the operation if it waits for exactly this signal, write the audit row.
#[allow(clippy::too_many_arguments)]
pub async fn send_signal(
    pool: &PgPool,
    op: Uuid,
    tenant: Option<&str>,
    name: &str,
    payload: &Value,
    actor: &str,
    action: &str,
    reason: Option<&str>,
) -> Result<Sent> {
    let mut tx = pool.begin().await?;
    let row: Option<(Status, Option<String>)> = sqlx::query_as(
        "SELECT status, waiting_for FROM operations
          WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2) FOR UPDATE",
    )
    .bind(op)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((status, waiting_for)) = row else {
        return Ok(Sent::NotFound);
    };
    if status.is_terminal() {
        return Ok(Sent::Finished(status));
    }
    let stored = sqlx::query(
        "INSERT INTO signals (op_id, name, payload, sent_by) VALUES ($1, $2, $3, $4)
         ON CONFLICT (op_id, name) DO UPDATE
            SET payload = EXCLUDED.payload, sent_by = EXCLUDED.sent_by,
                received_at = now(), consumed_at = NULL
          WHERE signals.consumed_at IS NOT NULL",
    )
    .bind(op)
    .bind(name)
    .bind(payload)
    .bind(actor)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if stored == 0 {
        return Ok(Sent::AlreadyPending);
    }
    let woke: Option<Dispatch> = sqlx::query_as(concat!(
        "UPDATE operations
            SET status = ",
        to_sql!(SIGNAL),
        ", waiting_for = NULL, attempt = attempt - 1,
                run_at = now(), dispatched_at = NULL, updated_at = now()
          WHERE id = $1 AND status IN ",
        from_sql!(SIGNAL),
        " AND waiting_for = $2
      RETURNING id, tenant_id, kind, lane, epoch"
    ))
    .bind(op)
    .bind(name)
    .fetch_optional(&mut *tx)
    .await?;
    let after = if woke.is_some() {
        Status::Queued
    } else {
        status
    };
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, reason, status_before, status_after, details)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(actor)
    .bind(action)
    .bind(op)
    .bind(reason)
    .bind(status)
    .bind(after)
    .bind(serde_json::json!({ "signal": name }))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(match woke {
        Some(d) => Sent::Woke(d),
        None => Sent::Kept {
            status,
            waiting_for,
        },
    })
}
