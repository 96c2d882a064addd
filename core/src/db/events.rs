//! SQL of the operation event log and of API admission control.
//!
//! An operation's event log is its status and signal events (`operation_events`, written by
//! triggers: see migration `20261130000008_operation_events.sql`), its creation event, served
//! from the operation's row when it was enqueued `queued` and due at once (migration
//! `20261208000001_creation_event_from_row.sql`), its `succeeded` event, served from the row
//! when the completion wrote it (migration `20261208000002_finished_event_from_row.sql`), and
//! its step events, which are the journal rows themselves, each carrying the id and time of its
//! current status's event (earlier statuses of a row are archived into `operation_events`:
//! migration `20261207000001_step_events_from_journal.sql`). `event_log!` is the union every
//! reader reads.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;

/// The event log of every operation (`op_id, seq, at, type, data`) as a subquery: filter it
/// by `op_id` (the filter reaches all three parts). Ids increase in commit order within an
/// operation but are not consecutive (one sequence numbers the events of all operations).
/// The creation event built from the row is what the insert trigger wrote before: the row's
/// status, attempt and `run_at` as inserted, which the migration's condition fixes. The
/// `succeeded` event built from the row is what the status trigger wrote: the row's columns,
/// which are archived with the event before any of them changes.
macro_rules! event_log {
    () => {
        "(SELECT op_id, seq, at, type, data FROM operation_events
          UNION ALL
          SELECT id, created_event_id, created_at, 'status',
                 agentq_status_event_data('queued', 0, created_at, NULL, NULL, NULL)
            FROM operations WHERE created_event_id IS NOT NULL
          UNION ALL
          SELECT id, finished_event_id, finished_event_at, 'status',
                 agentq_status_event_data(status, attempt, run_at, waiting_for, error_class,
                                          error_message)
            FROM operations WHERE finished_event_id IS NOT NULL
          UNION ALL
          SELECT op_id, event_id, event_at, 'step',
                 agentq_step_event_data(seq, name, kind, status, output)
            FROM operation_steps WHERE event_id IS NOT NULL)"
    };
}

/// `event_log!` for readers outside this crate (a test's dump of an operation's events).
pub const EVENT_LOG: &str = event_log!();

/// One event of an operation's life: `status`, `step` or `signal`. Ids increase within an
/// operation, in the order its events were committed, with gaps.
#[derive(Clone, Debug, Serialize, FromRow)]
pub struct Event {
    pub seq: i64,
    pub at: DateTime<Utc>,
    #[sqlx(rename = "type")]
    #[serde(rename = "type")]
    pub kind: String,
    pub data: Value,
}

/// Up to `limit` events of operation `op` after event `after`, in order.
pub async fn events_after(pool: &PgPool, op: Uuid, after: i64, limit: i64) -> Result<Vec<Event>> {
    let rows = sqlx::query_as(concat!(
        "SELECT seq, at, type, data FROM ",
        event_log!(),
        " e WHERE op_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
    ))
    .bind(op)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// An operation's outcome, read in the same statement as a status event that names the status
/// the operation still has (the terminal event carries it).
#[derive(Clone, Debug)]
pub struct Outcome {
    pub result: Option<Value>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// What one read of [`events_of_many`] found for one operation.
#[derive(Clone, Debug)]
pub struct News {
    pub op: Uuid,
    /// Its status at the read; `None` when the operation no longer exists.
    pub status: Option<String>,
    /// Its highest event id at the read (0: none yet).
    pub head: i64,
    /// The events after the cursor given for it, in order, each status event naming the
    /// operation's status at the read with that [`Outcome`].
    pub events: Vec<(Event, Option<Outcome>)>,
}

#[derive(FromRow)]
struct NewsRow {
    id: Uuid,
    status: Option<String>,
    head: i64,
    seq: Option<i64>,
    at: Option<DateTime<Utc>>,
    #[sqlx(rename = "type")]
    kind: Option<String>,
    data: Option<Value>,
    current: bool,
    result: Option<Value>,
    finished_at: Option<DateTime<Utc>>,
}

/// For each `(operation, after)`: its status, its highest event id and up to `limit` of
/// its events after `after` (none for `None`: the caller starts at the head), all in one
/// statement, so one snapshot. The event streams' shared poller: one query per tick however
/// many operations have a stream open.
pub async fn events_of_many(
    pool: &PgPool,
    ops: &[(Uuid, Option<i64>)],
    limit: i64,
) -> Result<Vec<News>> {
    let ids: Vec<Uuid> = ops.iter().map(|(op, _)| *op).collect();
    let afters: Vec<Option<i64>> = ops.iter().map(|(_, after)| *after).collect();
    let rows: Vec<NewsRow> = sqlx::query_as(concat!(
        "SELECT u.id, o.status, COALESCE(h.head, 0) AS head,
                e.seq, e.at, e.type, e.data,
                COALESCE(e.type = 'status' AND e.data->>'status' = o.status, false) AS current,
                CASE WHEN e.type = 'status' AND e.data->>'status' = o.status
                     THEN o.result END AS result,
                CASE WHEN e.type = 'status' AND e.data->>'status' = o.status
                     THEN o.finished_at END AS finished_at
           FROM unnest($1::uuid[], $2::int8[]) AS u(id, after)
           LEFT JOIN operations o ON o.id = u.id
          CROSS JOIN LATERAL (SELECT max(seq) AS head FROM ",
        event_log!(),
        " l WHERE op_id = u.id) h
           LEFT JOIN LATERAL (SELECT seq, at, type, data FROM ",
        event_log!(),
        " l WHERE op_id = u.id AND seq > u.after
                               ORDER BY seq LIMIT $3) e ON true
          ORDER BY u.id, e.seq"
    ))
    .bind(&ids)
    .bind(&afters)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let mut news: Vec<News> = Vec::new();
    for r in rows {
        if news.last().is_none_or(|n| n.op != r.id) {
            news.push(News {
                op: r.id,
                status: r.status,
                head: r.head,
                events: Vec::new(),
            });
        }
        let (Some(seq), Some(at), Some(kind), Some(data)) = (r.seq, r.at, r.kind, r.data) else {
            continue;
        };
        let outcome = r.current.then_some(Outcome {
            result: r.result,
            finished_at: r.finished_at,
        });
        if let Some(n) = news.last_mut() {
            n.events.push((
                Event {
                    seq,
                    at,
                    kind,
                    data,
                },
                outcome,
            ));
        }
    }
    Ok(news)
}
