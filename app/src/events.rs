//! The event log of operations as the event streams read it: the events after a cursor, one
//! read of many operations at once (what the API's stream poller asks every tick), and the
//! outcome a terminal event carries. Each read runs under the call deadline. Who may follow
//! which operation is decided before (an operation found in the caller's scope,
//! [`crate::operations::find`]).

use agentq_core::db;
use agentq_core::operation::OperationId;
use uuid::Uuid;

use crate::{App, Result};

pub use agentq_core::db::events::{Event, News, Outcome};

/// Up to `limit` events of `op` after event `after`, in order.
pub async fn after(app: &App, op: OperationId, after: i64, limit: i64) -> Result<Vec<Event>> {
    Ok(db::within(db::events::events_after(&app.pool, op.0, after, limit)).await?)
}

/// One read of many operations: for each `(op, cursor)` its status, its highest event id
/// and up to `limit` events after the cursor (a `None` cursor starts at the head).
pub async fn of_many(app: &App, ops: &[(Uuid, Option<i64>)], limit: i64) -> Result<Vec<News>> {
    Ok(db::within(db::events::events_of_many(&app.pool, ops, limit)).await?)
}

/// The outcome (result and finish time) of `op` if its status is still `status`; `None` when
/// it moved on or is gone. For a terminal event read without its outcome.
pub async fn outcome_if(app: &App, op: OperationId, status: &str) -> Result<Option<Outcome>> {
    let found = db::within(db::operations::find_operation(&app.pool, op, None)).await?;
    Ok(found
        .filter(|v| v.status.as_str() == status)
        .map(|v| Outcome {
            result: v.result,
            finished_at: v.finished_at,
        }))
}
