//! SQL for the step journal (`operation_steps`).
//!
//! Journal writes after a claim are fenced: they happen only while the operation is `running`
//! at the writer's epoch, and they lock the operation row for the length of the statement, so
//! a reaper or a new claim cannot slip between the check and the write.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::Result;
use crate::operation::StepView;
use crate::state::{Replay, StepKind, StepStatus};

/// One journal row to write (a step started, or a step finished).
#[derive(Clone, Debug)]
pub struct StepWrite {
    pub seq: i32,
    pub name: String,
    pub kind: StepKind,
    pub replay: Replay,
    pub idempotency_key: String,
    pub status: StepStatus,
    pub output: Option<Value>,
    pub error: Option<String>,
    pub started_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub usage: Option<Value>,
    /// When a sleep or a wait's timeout is due.
    pub wake_at: Option<DateTime<Utc>>,
}

/// Column arrays of a batch of [`StepWrite`]s, bound to `unnest(...)` so one statement writes them all.
pub(crate) struct StepColumns {
    pub seq: Vec<i32>,
    pub name: Vec<String>,
    pub kind: Vec<StepKind>,
    pub replay: Vec<Replay>,
    pub key: Vec<String>,
    pub status: Vec<StepStatus>,
    pub output: Vec<Option<Value>>,
    pub error: Vec<Option<String>>,
    pub started_at: Vec<DateTime<Utc>>,
    pub completed_at: Vec<Option<DateTime<Utc>>>,
    pub usage: Vec<Option<Value>>,
    pub wake_at: Vec<Option<DateTime<Utc>>>,
}

impl StepColumns {
    /// The columns of `steps`, each field copied once into its array.
    fn of<'a>(steps: impl IntoIterator<Item = &'a StepWrite>) -> Self {
        let mut c = StepColumns {
            seq: Vec::new(),
            name: Vec::new(),
            kind: Vec::new(),
            replay: Vec::new(),
            key: Vec::new(),
            status: Vec::new(),
            output: Vec::new(),
            error: Vec::new(),
            started_at: Vec::new(),
            completed_at: Vec::new(),
            usage: Vec::new(),
            wake_at: Vec::new(),
        };
        for s in steps {
            c.seq.push(s.seq);
            c.name.push(s.name.clone());
            c.kind.push(s.kind);
            c.replay.push(s.replay);
            c.key.push(s.idempotency_key.clone());
            c.status.push(s.status);
            c.output.push(s.output.clone());
            c.error.push(s.error.clone());
            c.started_at.push(s.started_at);
            c.completed_at.push(s.completed_at);
            c.usage.push(s.usage.clone());
            c.wake_at.push(s.wake_at);
        }
        c
    }
}

/// The journal upsert, as a CTE named `journal` fed by the one-row CTE named `$src` (the
/// operation being written, with its `id`): every statement that writes steps shares it, with
/// the step columns bound at `$1`–`$12`, the epoch at `$13` and the operation id at `$14`
/// ([`bind_journal`]); a statement's own parameters start at `$15`.
macro_rules! journal_cte {
    ($src:literal) => {
        concat!(
            "journal AS (
            ",
            $crate::db::steps::journal_insert!(),
            "
            SELECT ",
            $src,
            ".id, s.seq, s.name, s.kind, s.replay, s.key, s.status, s.output,
                   s.error, $13, s.started_at, s.completed_at, s.usage, s.wake_at
              FROM ",
            $src,
            ", unnest($1::int[], $2::text[], $3::text[], $4::text[], $5::text[],
                                $6::text[], $7::jsonb[], $8::text[], $9::timestamptz[],
                                $10::timestamptz[], $11::jsonb[], $12::timestamptz[])
                   AS s(seq, name, kind, replay, key, status, output, error, started_at,
                        completed_at, usage, wake_at)
            ",
            $crate::db::steps::journal_upsert!(),
            "
         )"
        )
    };
}
pub(crate) use journal_cte;

/// Like [`journal_cte!`] for many operations at once: the rows at `$1`–`$12` carry their
/// operation in the uuid array `$owners`, and each is written only if its operation is in
/// `$src` (the operations fenced and locked by the statement, with `id` and `epoch`).
macro_rules! journal_many_cte {
    ($src:literal, $owners:literal) => {
        $crate::db::steps::journal_many_cte!($src, $owners, "")
    };
    // `$returning`: a `RETURNING` clause, for a statement that must wait for the rows.
    ($src:literal, $owners:literal, $returning:literal) => {
        concat!(
            "journal AS (
            ",
            $crate::db::steps::journal_insert!(),
            "
            SELECT ",
            $src,
            ".id, s.seq, s.name, s.kind, s.replay, s.key, s.status, s.output,
                   s.error, ",
            $src,
            ".epoch, s.started_at, s.completed_at, s.usage, s.wake_at
              FROM unnest(",
            $owners,
            "::uuid[], $1::int[], $2::text[], $3::text[], $4::text[],
                          $5::text[], $6::text[], $7::jsonb[], $8::text[], $9::timestamptz[],
                          $10::timestamptz[], $11::jsonb[], $12::timestamptz[])
                   AS s(op_id, seq, name, kind, replay, key, status, output, error, started_at,
                        completed_at, usage, wake_at)
              JOIN ",
            $src,
            " ON ",
            $src,
            ".id = s.op_id
            ",
            $crate::db::steps::journal_upsert!(),
            " ",
            $returning,
            "
         )"
        )
    };
}
pub(crate) use journal_many_cte;

/// The `INSERT` head of a journal write: shared by [`journal_cte!`] and [`journal_many_cte!`].
macro_rules! journal_insert {
    () => {
        "INSERT INTO operation_steps (op_id, seq, name, kind, replay, idempotency_key, status,
                                     output, error, epoch, started_at, completed_at, usage,
                                     wake_at)"
    };
}
pub(crate) use journal_insert;

/// What a journal write does to a row it finds (a replay rewrites a step's outcome): shared by
/// [`journal_cte!`] and the batched completion. A step that runs again (its row `failed` or
/// `unknown` from an earlier run, or an unsafe call's `started` row written again by a new
/// run) takes the new run's start, so its duration is its own run's; a sleep or wait resolved
/// later (a `started` row with a wake time) keeps the time it began.
macro_rules! journal_upsert {
    () => {
        "ON CONFLICT (op_id, seq) DO UPDATE
               SET name = EXCLUDED.name, kind = EXCLUDED.kind, replay = EXCLUDED.replay,
                   idempotency_key = EXCLUDED.idempotency_key,
                   status = EXCLUDED.status, output = EXCLUDED.output, error = EXCLUDED.error,
                   started_at = CASE
                       WHEN operation_steps.status IN ('failed', 'unknown')
                         OR (operation_steps.status = 'started' AND EXCLUDED.status = 'started'
                             AND operation_steps.wake_at IS NULL)
                       THEN EXCLUDED.started_at ELSE operation_steps.started_at END,
                   epoch = EXCLUDED.epoch, completed_at = EXCLUDED.completed_at,
                   usage = EXCLUDED.usage,
                   wake_at = COALESCE(EXCLUDED.wake_at, operation_steps.wake_at)"
    };
}
pub(crate) use journal_upsert;

/// A scalar query of this crate.
pub(crate) type Scalar<'q, O> =
    sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>;

/// Binds `$1`–`$14` of a statement built with [`journal_cte!`]: the rows, the epoch, the id.
pub(crate) fn bind_journal<'q, O>(
    q: Scalar<'q, O>,
    steps: &[StepWrite],
    epoch: i64,
    id: Uuid,
) -> Scalar<'q, O> {
    bind_steps(q, steps).bind(epoch).bind(id)
}

/// Binds the twelve step columns of `steps` as arrays, in [`journal_cte!`]'s order (`$1`–`$12`).
pub(crate) fn bind_steps<'q, 'a, O>(
    q: Scalar<'q, O>,
    steps: impl IntoIterator<Item = &'a StepWrite>,
) -> Scalar<'q, O> {
    let c = StepColumns::of(steps);
    q.bind(c.seq)
        .bind(c.name)
        .bind(c.kind)
        .bind(c.replay)
        .bind(c.key)
        .bind(c.status)
        .bind(c.output)
        .bind(c.error)
        .bind(c.started_at)
        .bind(c.completed_at)
        .bind(c.usage)
        .bind(c.wake_at)
}

/// The rows of many operations, flattened, and the operation of each (for [`journal_many_cte!`]).
pub(crate) fn owned_rows<'a>(
    batch: impl Iterator<Item = (Uuid, &'a [StepWrite])>,
) -> (Vec<&'a StepWrite>, Vec<Uuid>) {
    let mut steps = Vec::new();
    let mut owners = Vec::new();
    for (id, rows) in batch {
        steps.extend(rows);
        owners.extend(std::iter::repeat_n(id, rows.len()));
    }
    (steps, owners)
}

/// One running operation's journal rows, written by [`super::settle::write_runs`].
#[derive(Clone, Debug)]
pub struct StepBatch {
    pub id: Uuid,
    pub epoch: i64,
    pub steps: Vec<StepWrite>,
}

/// A journal row as replay needs it.
#[derive(Clone, Debug, FromRow)]
pub struct JournalEntry {
    pub seq: i32,
    pub name: String,
    pub kind: StepKind,
    pub replay: Replay,
    pub status: StepStatus,
    pub output: Option<Value>,
    pub error: Option<String>,
    pub wake_at: Option<DateTime<Utc>>,
}

/// Loads the journal of an operation in sequence order (replay reads it once per claim). A row
/// with a kind, policy or status this build does not know is an error: nothing may replay it.
pub async fn load_journal(pool: &PgPool, id: Uuid) -> Result<Vec<JournalEntry>> {
    let rows = sqlx::query_as(
        "SELECT seq, name, kind, replay, status, output, error, wake_at
           FROM operation_steps WHERE op_id = $1 ORDER BY seq",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The rows of an operation's journal that can have changed since a run loaded it whole up to
/// `after` (a seq): those after it and those at `open` (rows that were not `completed`), in
/// sequence order. The worker's journal cache reads these instead of the whole journal.
pub async fn load_journal_changes(
    pool: &PgPool,
    id: Uuid,
    after: i32,
    open: &[i32],
) -> Result<Vec<JournalEntry>> {
    let rows = sqlx::query_as(
        "SELECT seq, name, kind, replay, status, output, error, wake_at
           FROM operation_steps WHERE op_id = $1 AND (seq > $2 OR seq = ANY($3))
          ORDER BY seq",
    )
    .bind(id)
    .bind(after)
    .bind(open)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

#[derive(FromRow)]
struct StepRow {
    seq: i32,
    name: String,
    kind: StepKind,
    replay: Replay,
    status: StepStatus,
    idempotency_key: String,
    epoch: i64,
    started_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
    wake_at: Option<DateTime<Utc>>,
    output: Option<Value>,
    error: Option<String>,
    usage: Option<Value>,
}

/// Lists the whole journal of an operation (a replay reads it whole; it is capped by
/// `AGENTQ_JOURNAL_MAX_STEPS` and `_BYTES`), filtered by tenant when one is given. To show a
/// journal, read it by [`steps_page`].
pub async fn list_steps(pool: &PgPool, id: Uuid, tenant: Option<&str>) -> Result<Vec<StepView>> {
    let rows: Vec<StepRow> = sqlx::query_as(
        "SELECT s.seq, s.name, s.kind, s.replay, s.status, s.idempotency_key, s.epoch,
                s.started_at, s.completed_at, s.wake_at, s.output, s.error, s.usage
           FROM operation_steps s JOIN operations o ON o.id = s.op_id
          WHERE s.op_id = $1 AND ($2::text IS NULL OR o.tenant_id = $2)
          ORDER BY s.seq",
    )
    .bind(id)
    .bind(tenant)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(StepView::from).collect())
}

/// One page of an operation's journal for display: the steps after `after` (a seq), at most
/// `limit` of them and, past the first, no more than about `max_bytes` of outputs and errors
/// (as JSON text), so one page of a journal of large outputs stays small. Filtered by tenant
/// when one is given. Returns the steps and whether more follow.
pub async fn steps_page(
    pool: &PgPool,
    id: Uuid,
    tenant: Option<&str>,
    after: Option<i32>,
    limit: i64,
    max_bytes: i64,
) -> Result<(Vec<StepView>, bool)> {
    #[derive(FromRow)]
    struct Paged {
        #[sqlx(flatten)]
        row: StepRow,
        upto: i64,
    }
    // The running sum streams with the scan in seq order: only the page's rows are rendered.
    let rows: Vec<Paged> = sqlx::query_as(
        "SELECT s.seq, s.name, s.kind, s.replay, s.status, s.idempotency_key, s.epoch,
                s.started_at, s.completed_at, s.wake_at, s.output, s.error, s.usage,
                (sum(COALESCE(octet_length(s.output::text), 0) + COALESCE(octet_length(s.error), 0))
                    OVER (ORDER BY s.seq))::bigint AS upto
           FROM operation_steps s JOIN operations o ON o.id = s.op_id
          WHERE s.op_id = $1 AND ($2::text IS NULL OR o.tenant_id = $2) AND s.seq > $3
          ORDER BY s.seq
          LIMIT $4",
    )
    .bind(id)
    .bind(tenant)
    .bind(after.unwrap_or(-1))
    .bind(limit.saturating_add(1))
    .fetch_all(pool)
    .await?;
    let total = rows.len();
    let page: Vec<StepView> = rows
        .into_iter()
        .enumerate()
        .take_while(|(i, r)| (*i as i64) < limit && (*i == 0 || r.upto <= max_bytes))
        .map(|(_, r)| r.row.into())
        .collect();
    let more = page.len() < total;
    Ok((page, more))
}

impl From<StepRow> for StepView {
    fn from(r: StepRow) -> Self {
        StepView {
            seq: r.seq,
            name: r.name,
            kind: r.kind,
            replay: r.replay,
            status: r.status,
            idempotency_key: r.idempotency_key,
            epoch: r.epoch,
            started_at: r.started_at,
            completed_at: r.completed_at,
            wake_at: r.wake_at,
            output: r.output,
            error: r.error,
            usage: r.usage,
        }
    }
}

/// Model token usage summed per tenant and kind.
#[derive(Clone, Debug, serde::Serialize, FromRow)]
pub struct UsageRow {
    pub tenant: String,
    pub kind: String,
    pub operations: i64,
    pub model_calls: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    /// Model calls whose provider reported no usage (their tokens are not in the sums).
    pub unreported_calls: i64,
}

/// Sums the token usage journaled with completed model steps, per tenant and kind.
pub async fn usage(
    pool: &PgPool,
    tenant: Option<&str>,
    since: Option<DateTime<Utc>>,
) -> Result<Vec<UsageRow>> {
    let rows = sqlx::query_as(
        "SELECT o.tenant_id AS tenant, o.kind, count(DISTINCT o.id) AS operations,
                count(*) AS model_calls,
                COALESCE(sum((s.usage->>'prompt_tokens')::bigint), 0)::bigint AS prompt_tokens,
                COALESCE(sum((s.usage->>'completion_tokens')::bigint), 0)::bigint AS completion_tokens,
                count(*) FILTER (WHERE (s.usage->>'unreported')::boolean) AS unreported_calls
           FROM operation_steps s JOIN operations o ON o.id = s.op_id
          WHERE s.kind = 'model' AND s.status = 'completed' AND s.usage IS NOT NULL
            AND ($1::text IS NULL OR o.tenant_id = $1)
            AND ($2::timestamptz IS NULL OR s.completed_at >= $2)
          GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(tenant)
    .bind(since)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// The wait an operation is parked on, as a person deciding it sees it: its step, the signal,
/// when it times out and what the job said it needs.
#[derive(Clone, Debug, FromRow)]
pub struct PendingWait {
    pub op_id: Uuid,
    /// The wait step's place in the journal.
    pub seq: i32,
    /// The signal waited for (the operation's `waiting_for`).
    pub signal: String,
    /// When the wait times out (the operation's `run_at` while it waits).
    pub timeout_at: DateTime<Utc>,
    /// The wait step's output while it waits: `{"about": …}`
    /// (`agentq_core::approval::about_of` reads it), or null.
    pub output: Option<Value>,
}

/// The pending waits for a signal of the operations `ids` that are `waiting` on one (not on
/// a join): the newest started wait step of each, in one read. An operation parked on a
/// signal before its wait step recorded anything has no row.
pub async fn pending_waits(pool: &PgPool, ids: &[Uuid]) -> Result<Vec<PendingWait>> {
    let rows = sqlx::query_as(
        "SELECT DISTINCT ON (o.id) o.id AS op_id, s.seq, o.waiting_for AS signal,
                o.run_at AS timeout_at, s.output
           FROM operations o
           JOIN operation_steps s ON s.op_id = o.id AND s.kind = 'signal' AND s.status = 'started'
                                 AND s.name = 'signal:' || o.waiting_for
          WHERE o.id = ANY($1) AND o.status = 'waiting'
          ORDER BY o.id, s.seq DESC",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
