//! SQL of an operator's cancel of one operation ([`transition::CANCEL`] when no worker holds it,
//! a request its worker acts on otherwise), audited.
//!
//! [`transition::CANCEL`]: crate::state::transition::CANCEL

use sqlx::PgPool;
use uuid::Uuid;

use super::Result;
use crate::state::Status;
use crate::state::transition::{CANCEL, from_sql, to_sql};

/// What a cancel request did.
#[derive(Clone, Debug, PartialEq)]
pub enum Cancelled {
    /// It was queued, sleeping or waiting: cancelled now.
    Now,
    /// It is running: its worker stops it at the next step boundary.
    Requested,
    /// It had already finished (its status); nothing changed.
    Finished(Status),
    /// No such operation (in this tenant).
    NotFound,
}

/// Cancels an operation, audited: at once unless a worker runs it, in which case the worker
/// learns of it through its next heartbeat and stops at a step boundary.
pub async fn cancel_operation(
    pool: &PgPool,
    op: Uuid,
    tenant: Option<&str>,
    actor: &str,
    reason: Option<&str>,
) -> Result<Cancelled> {
    let mut tx = pool.begin().await?;
    let status: Option<Status> = sqlx::query_scalar(
        "SELECT status FROM operations WHERE id = $1 AND ($2::text IS NULL OR tenant_id = $2) FOR UPDATE",
    )
    .bind(op)
    .bind(tenant)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(status) = status else {
        return Ok(Cancelled::NotFound);
    };
    let outcome = match status {
        // A running operation is stopped by its worker, which writes the transition.
        Status::Running => {
            sqlx::query("UPDATE operations SET cancel_requested = true WHERE id = $1")
                .bind(op)
                .execute(&mut *tx)
                .await?;
            Cancelled::Requested
        }
        s if CANCEL.starts_from(s) => {
            sqlx::query(concat!(
                "UPDATE operations
                    SET status = ",
                to_sql!(CANCEL),
                ", error_class = 'cancelled', error_message = $2,
                        waiting_for = NULL, finished_at = now(), updated_at = now()
                  WHERE id = $1 AND status IN ",
                from_sql!(CANCEL)
            ))
            .bind(op)
            .bind(format!(
                "cancelled by {actor}{}",
                reason.map(|r| format!(": {r}")).unwrap_or_default()
            ))
            .execute(&mut *tx)
            .await?;
            Cancelled::Now
        }
        other => return Ok(Cancelled::Finished(other)),
    };
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, reason, status_before, status_after)
         VALUES ($1, 'cancel', $2, $3, $4, $5)",
    )
    .bind(actor)
    .bind(op)
    .bind(reason)
    .bind(status)
    .bind(if outcome == Cancelled::Now {
        Status::Cancelled
    } else {
        Status::Running
    })
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(outcome)
}
