//! SQL of the human DLQ (`dead_letters`) and its audit trail (`operator_actions`).
//!
//! Every operator action runs in one short transaction that locks the dead letter first, so a
//! dead letter is handled once even when two operators act on it at the same time; the action,
//! the status before and after, who and why are written in the same transaction.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{FromRow, PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::Result;
use crate::state::transition::{from_sql, to_sql};
use crate::state::{DeadLetterStatus, DlqAction, ErrorClass, Status, StepStatus};

/// Largest raw message body kept for a poison message.
pub const RAW_MESSAGE_CAP: usize = 64 * 1024;

/// A dead letter as listed and shown.
#[derive(Clone, Debug, Serialize, FromRow, schemars::JsonSchema)]
pub struct DeadLetterView {
    pub id: Uuid,
    /// Its operation (none for a poison message).
    pub op_id: Option<Uuid>,
    pub tenant: Option<String>,
    pub kind: Option<String>,
    /// The error class that killed it.
    pub class: String,
    pub reason: String,
    pub attempts: i32,
    /// The journal entry (`seq`) that failed, if a step did.
    pub failed_step: Option<i32>,
    pub created_at: DateTime<Utc>,
    pub status: DeadLetterStatus,
    /// Who retried, resolved or discarded it.
    pub resolved_by: Option<String>,
    pub resolved_at: Option<DateTime<Utc>>,
    pub note: Option<String>,
    pub batch_id: Option<Uuid>,
    /// The operation that spawned its operation (`ctx.spawn`), whose join sees it dead.
    pub parent_id: Option<Uuid>,
    /// Bytes of the raw message kept (poison messages only).
    pub raw_bytes: Option<i32>,
}

/// Which dead letters a list, stats or bulk action covers.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub tenant: Option<String>,
    pub kind: Option<String>,
    pub class: Option<String>,
    pub since: Option<DateTime<Utc>>,
    pub batch: Option<Uuid>,
    /// `open` unless asked otherwise.
    pub status: Option<DeadLetterStatus>,
}

impl Filter {
    /// The status the filter covers: `open` unless asked otherwise.
    pub fn status(&self) -> DeadLetterStatus {
        self.status.unwrap_or(DeadLetterStatus::Open)
    }

    fn push_where(&self, q: &mut QueryBuilder<Postgres>) {
        q.push(" WHERE d.status = ");
        q.push_bind(self.status());
        if let Some(t) = &self.tenant {
            q.push(" AND d.tenant_id = ").push_bind(t.clone());
        }
        if let Some(k) = &self.kind {
            q.push(" AND d.kind = ").push_bind(k.clone());
        }
        if let Some(c) = &self.class {
            q.push(" AND d.class = ").push_bind(c.clone());
        }
        if let Some(s) = self.since {
            q.push(" AND d.created_at >= ").push_bind(s);
        }
        if let Some(b) = self.batch {
            q.push(" AND o.batch_id = ").push_bind(b);
        }
    }
}

/// The columns of a [`DeadLetterView`], over `dead_letters d LEFT JOIN operations o`: every
/// query that reads one (here and the console's inbox) selects exactly these.
macro_rules! view_fields {
    () => {
        "d.id, d.op_id, d.tenant_id AS tenant, d.kind, d.class, d.reason, d.attempts,
         d.failed_step, d.created_at, d.status, d.resolved_by, d.resolved_at, d.note,
         o.batch_id, o.parent_id, octet_length(d.raw_message) AS raw_bytes"
    };
}
pub(crate) use view_fields;

const VIEW_COLUMNS: &str = concat!(
    "SELECT ",
    view_fields!(),
    " FROM dead_letters d LEFT JOIN operations o ON o.id = d.op_id"
);

fn list_query(
    filter: &Filter,
    limit: i64,
    after: Option<(DateTime<Utc>, Uuid)>,
) -> QueryBuilder<Postgres> {
    let mut q = QueryBuilder::new(VIEW_COLUMNS);
    filter.push_where(&mut q);
    if let Some((at, id)) = after {
        q.push(" AND (d.created_at, d.id) < (")
            .push_bind(at)
            .push(", ")
            .push_bind(id)
            .push(")");
    }
    q.push(" ORDER BY d.created_at DESC, d.id DESC LIMIT ")
        .push_bind(limit);
    q
}

/// One keyset page of dead letters, newest first, after the cursor `after`.
pub async fn list_dead_letters(
    pool: &PgPool,
    filter: &Filter,
    limit: i64,
    after: Option<(DateTime<Utc>, Uuid)>,
) -> Result<Vec<DeadLetterView>> {
    let rows = list_query(filter, limit, after)
        .build_query_as()
        .fetch_all(pool)
        .await?;
    Ok(rows)
}

/// The plan PostgreSQL picks for a page (tests check it uses an index).
pub async fn explain_list(pool: &PgPool, filter: &Filter, limit: i64) -> Result<String> {
    // The same SQL as a page, with the same values bound in the same order.
    let sql = format!("EXPLAIN {}", list_query(filter, limit, None).sql().as_str());
    let mut query = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(sql));
    query = query.bind(filter.status());
    for v in [&filter.tenant, &filter.kind, &filter.class]
        .into_iter()
        .flatten()
    {
        query = query.bind(v.clone());
    }
    if let Some(s) = filter.since {
        query = query.bind(s);
    }
    if let Some(b) = filter.batch {
        query = query.bind(b);
    }
    let lines: Vec<String> = query.bind(limit).fetch_all(pool).await?;
    Ok(lines.join("\n"))
}

/// Ids of the open dead letters a bulk action covers (oldest first), at most `limit`.
pub async fn select_ids(pool: &PgPool, filter: &Filter, limit: i64) -> Result<Vec<Uuid>> {
    let mut q = QueryBuilder::new(
        "SELECT d.id FROM dead_letters d LEFT JOIN operations o ON o.id = d.op_id",
    );
    filter.push_where(&mut q);
    q.push(" ORDER BY d.created_at, d.id LIMIT ")
        .push_bind(limit);
    let ids = q.build_query_scalar().fetch_all(pool).await?;
    Ok(ids)
}

/// A dead letter by its own id or by its operation's id (the open one first, else the newest);
/// with `tenant`, another tenant's dead letter is not found.
pub async fn find_dead_letter(
    pool: &PgPool,
    id: Uuid,
    tenant: Option<&str>,
) -> Result<Option<DeadLetterView>> {
    let sql = format!(
        "{VIEW_COLUMNS} WHERE (d.id = $1 OR d.op_id = $1) AND ($2::text IS NULL OR d.tenant_id = $2)
          ORDER BY (d.status = 'open') DESC, d.created_at DESC LIMIT 1"
    );
    let row = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .bind(tenant)
        .fetch_optional(pool)
        .await?;
    Ok(row)
}

/// The raw body of a poison message (capped at [`RAW_MESSAGE_CAP`]).
pub async fn raw_message(pool: &PgPool, id: Uuid) -> Result<Option<Vec<u8>>> {
    let raw = sqlx::query_scalar("SELECT raw_message FROM dead_letters WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await?;
    Ok(raw.flatten())
}

/// Open dead letters grouped by class, kind and error fingerprint (the reason with ids, keys
/// and numbers replaced, so the same failure with different ids groups together).
#[derive(Clone, Debug, Serialize, FromRow, schemars::JsonSchema)]
#[schemars(rename = "DeadLetterGroup")]
pub struct StatRow {
    pub class: String,
    pub kind: Option<String>,
    /// The reason with ids, long hex strings and numbers replaced.
    pub fingerprint: String,
    pub count: i64,
    pub oldest: DateTime<Utc>,
    pub newest: DateTime<Utc>,
}

/// The error fingerprint of a dead letter `d`: its reason with ids, long hex strings and numbers
/// replaced, so the same failure with different ids groups together.
pub const FINGERPRINT: &str = "left(regexp_replace(regexp_replace(regexp_replace(d.reason,
    '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', '<id>', 'gi'),
    '[0-9a-f]{16,}', '<hex>', 'gi'),
    '[0-9]+', '<n>', 'g'), 160)";

/// Groups of open dead letters, largest first.
pub async fn stats(pool: &PgPool, filter: &Filter) -> Result<Vec<StatRow>> {
    let mut q = QueryBuilder::new("SELECT d.class, d.kind, ");
    q.push(FINGERPRINT).push(
        " AS fingerprint,
                count(*) AS count, min(d.created_at) AS oldest, max(d.created_at) AS newest
           FROM dead_letters d LEFT JOIN operations o ON o.id = d.op_id",
    );
    filter.push_where(&mut q);
    q.push(" GROUP BY 1, 2, 3 ORDER BY count(*) DESC, 1, 2, 3");
    let rows = q.build_query_as().fetch_all(pool).await?;
    Ok(rows)
}

/// One entry of the audit trail.
#[derive(Clone, Debug, Serialize, FromRow, schemars::JsonSchema)]
#[schemars(rename = "OperatorAction")]
pub struct ActionView {
    pub actor: String,
    pub action: String,
    pub op_id: Option<Uuid>,
    pub dead_letter_id: Option<Uuid>,
    pub reason: Option<String>,
    pub status_before: Option<String>,
    pub status_after: Option<String>,
    pub details: Option<Value>,
    pub created_at: DateTime<Utc>,
}

/// The operator actions on a dead letter or its operation, oldest first.
pub async fn history(
    pool: &PgPool,
    dead_letter: Uuid,
    op_id: Option<Uuid>,
) -> Result<Vec<ActionView>> {
    let rows = sqlx::query_as(
        "SELECT actor, action, op_id, dead_letter_id, reason, status_before, status_after,
                details, created_at
           FROM operator_actions
          WHERE dead_letter_id = $1 OR ($2::uuid IS NOT NULL AND op_id = $2)
          ORDER BY created_at, id",
    )
    .bind(dead_letter)
    .bind(op_id)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Records an undecodable (or delivery-limited) broker message as a `poison_message` dead
/// letter. If it is a valid pointer to a queued operation, that operation is re-dispatched (its
/// pointer died, the operation did not).
pub async fn record_poison(
    pool: &PgPool,
    raw: &[u8],
    reason: &str,
    pointer_to: Option<Uuid>,
) -> Result<Uuid> {
    let kept = &raw[..raw.len().min(RAW_MESSAGE_CAP)];
    let id: Uuid = sqlx::query_scalar(
        "WITH redispatch AS (
            UPDATE operations SET dispatched_at = NULL, epoch = epoch + 1
             WHERE id = $3 AND status = 'queued'
         RETURNING id
         )
         INSERT INTO dead_letters (id, class, reason, raw_message)
         SELECT gen_random_uuid(), 'poison_message',
                $2 || CASE WHEN EXISTS (SELECT 1 FROM redispatch)
                           THEN '; its operation is still queued and was dispatched again'
                           ELSE '' END,
                $1
         RETURNING id",
    )
    .bind(kept)
    .bind(reason)
    .bind(pointer_to)
    .fetch_one(pool)
    .await?;
    Ok(id)
}

/// Why an operator action was refused; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    #[error("no dead letter or operation {0}")]
    NotFound(Uuid),
    #[error("dead letter {id} is already {status}{}", by.as_ref().map(|b| format!(" (by {b})")).unwrap_or_default())]
    NotOpen {
        id: Uuid,
        status: DeadLetterStatus,
        by: Option<String>,
    },
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Db(#[from] super::Error),
}

impl From<sqlx::Error> for ActionError {
    fn from(e: sqlx::Error) -> Self {
        ActionError::Db(e.into())
    }
}

/// Who does an operator action, and why.
#[derive(Clone, Debug)]
pub struct Actor {
    pub name: String,
    pub reason: Option<String>,
}

/// What an operator decided about the unknown step of an `unknown_side_effect`.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// It happened; this is what the step returned.
    Happened(Value),
    /// It did not happen; run it.
    DidNotHappen,
}

/// An operator action on one dead letter.
#[derive(Clone, Debug)]
pub enum Action {
    /// Re-queue from the failed step (completed steps are replayed, not re-run), optionally
    /// with a new input, optionally on another version of its kind (an upgrade: where that
    /// version first asks for another step than the journal recorded, the rest of the journal
    /// is set aside and runs anew; how a `nondeterminism` dead letter is recovered).
    Retry {
        input: Option<(Value, String)>,
        version: Option<String>,
    },
    /// State the outcome of an `unknown_side_effect` step, then re-queue.
    Resolve(Outcome),
    /// Drop it for good.
    Discard,
}

impl Action {
    /// Which action it is, for the decisions of [`DlqAction`] and the audit trail.
    pub fn kind(&self) -> DlqAction {
        match self {
            Action::Retry { .. } => DlqAction::Retry,
            Action::Resolve(_) => DlqAction::Resolve,
            Action::Discard => DlqAction::Discard,
        }
    }
}

/// A re-queued operation, for the caller to dispatch.
#[derive(Clone, Debug, FromRow)]
pub struct Requeued {
    pub id: Uuid,
    pub tenant_id: String,
    pub kind: String,
    pub lane: String,
    pub epoch: i64,
}

#[derive(FromRow)]
struct Locked {
    id: Uuid,
    op_id: Option<Uuid>,
    class: ErrorClass,
    status: DeadLetterStatus,
    failed_step: Option<i32>,
    resolved_by: Option<String>,
}

/// Performs `action` on the dead letter `id` (or the open one of operation `id`). Returns the
/// re-queued operation, if any. What the action does to the dead letter and its operation, and
/// which classes it fits, is [`DlqAction`]'s.
pub async fn act(
    pool: &PgPool,
    id: Uuid,
    action: &Action,
    actor: &Actor,
) -> Result<Option<Requeued>, ActionError> {
    let mut tx = pool.begin().await?;
    let dl: Option<Locked> = sqlx::query_as(
        "SELECT id, op_id, class, status, failed_step, resolved_by FROM dead_letters
          WHERE id = $1 OR op_id = $1
          ORDER BY (status = 'open') DESC, created_at DESC
          LIMIT 1
            FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let dl = dl.ok_or(ActionError::NotFound(id))?;
    if dl.status != DeadLetterStatus::Open {
        return Err(ActionError::NotOpen {
            id: dl.id,
            status: dl.status,
            by: dl.resolved_by,
        });
    }
    let kind = action.kind();
    let new_status = kind.dead_letter_after();
    if !kind.fits(dl.class) {
        return Err(ActionError::Refused(match kind {
            DlqAction::Retry => format!(
                "dead letter {} is an unknown_side_effect: a retry would stop at the same unknown step; \
                 say what happened with `agentq dlq resolve {} --happened|--did-not-happen`",
                dl.id, dl.id
            ),
            _ => format!(
                "dead letter {} is {}, not unknown_side_effect: resolve is for unknown steps; use retry or discard",
                dl.id, dl.class
            ),
        }));
    }
    if dl.op_id.is_none() && !matches!(action, Action::Discard) {
        return Err(ActionError::Refused(format!(
            "dead letter {} is a broker message with no operation: it can only be discarded",
            dl.id
        )));
    }

    let mut requeued = None;
    let mut details = serde_json::json!({});
    if let Some(op_id) = dl.op_id {
        let row: Option<(Status, Option<Uuid>)> =
            sqlx::query_as("SELECT status, batch_id FROM operations WHERE id = $1 FOR UPDATE")
                .bind(op_id)
                .fetch_optional(&mut *tx)
                .await?;
        let (status, batch) = (row.map(|r| r.0), row.and_then(|r| r.1));
        if status != Some(Status::Dead) {
            return Err(ActionError::Refused(format!(
                "operation {op_id} is {}, not dead",
                status.map_or("gone", Status::as_str)
            )));
        }
        if let Action::Resolve(outcome) = action {
            let seq = dl.failed_step.ok_or_else(|| {
                ActionError::Refused(format!("dead letter {} names no failed step", dl.id))
            })?;
            let (step_status, output, error) = match outcome {
                Outcome::Happened(v) => (StepStatus::Completed, Some(v.clone()), None),
                Outcome::DidNotHappen => (
                    StepStatus::Failed,
                    None,
                    Some(format!("operator {}: did not happen", actor.name)),
                ),
            };
            let n = sqlx::query(
                "UPDATE operation_steps
                    SET status = $3, output = $4, error = $5, completed_at = now()
                  WHERE op_id = $1 AND seq = $2 AND status = 'unknown'",
            )
            .bind(op_id)
            .bind(seq)
            .bind(step_status)
            .bind(&output)
            .bind(&error)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 0 {
                return Err(ActionError::Refused(format!(
                    "step {seq} of operation {op_id} is not unknown any more"
                )));
            }
            details = serde_json::json!({ "step": seq, "happened": matches!(outcome, Outcome::Happened(_)), "output": output });
        }
        match action {
            Action::Discard => {
                sqlx::query(concat!(
                    "UPDATE operations SET status = ",
                    to_sql!(DISCARD),
                    ", updated_at = now() WHERE id = $1 AND status IN ",
                    from_sql!(DISCARD)
                ))
                .bind(op_id)
                .execute(&mut *tx)
                .await?;
            }
            Action::Retry { .. } | Action::Resolve(_) => {
                // The operation is unfinished again: a completed batch of it is reopened in
                // this transaction, holding the batch's row lock until it commits.
                if let Some(batch) = batch {
                    super::batches::reopen(&mut tx, batch, &actor.name).await?;
                }
                let (input, sha) = match action {
                    Action::Retry {
                        input: Some((v, sha)),
                        ..
                    } => {
                        details["patched_input"] = true.into();
                        (Some(v.clone()), Some(sha.clone()))
                    }
                    _ => (None, None),
                };
                let version = match action {
                    Action::Retry {
                        version: Some(v), ..
                    } => {
                        details["to_version"] = v.as_str().into();
                        Some(v.clone())
                    }
                    _ => None,
                };
                let row: Requeued = sqlx::query_as(concat!(
                    "UPDATE operations o
                        SET status = ",
                    to_sql!(RETRY),
                    ", attempt = 0, restarts = 0, run_at = now(),
                            dispatched_at = NULL, finished_at = NULL, updated_at = now(),
                            -- An operator retrying it decided it runs: a passed deadline is lifted.
                            deadline = CASE WHEN deadline <= now() THEN NULL ELSE deadline END,
                            input = COALESCE($2, input), input_sha256 = COALESCE($3, input_sha256),
                            version_parked = false,
                            kind_version = COALESCE($4, kind_version),
                            upgrade_through = CASE WHEN $4::text IS NULL THEN upgrade_through
                                ELSE (SELECT max(seq) FROM operation_steps s WHERE s.op_id = o.id) END
                      WHERE id = $1 AND status IN ",
                    from_sql!(RETRY),
                    "
                  RETURNING id, tenant_id, kind, lane, epoch"
                ))
                .bind(op_id)
                .bind(&input)
                .bind(&sha)
                .bind(&version)
                .fetch_one(&mut *tx)
                .await?;
                requeued = Some(row);
            }
        }
    }
    sqlx::query(
        "UPDATE dead_letters SET status = $2, resolved_by = $3, resolved_at = now(), note = $4
          WHERE id = $1",
    )
    .bind(dl.id)
    .bind(new_status)
    .bind(&actor.name)
    .bind(&actor.reason)
    .execute(&mut *tx)
    .await?;
    // The audit names the operation's statuses, or the dead letter's when it has no operation.
    let (status_before, status_after) = match dl.op_id {
        Some(_) => (Status::Dead.as_str(), kind.operation_after().as_str()),
        None => (DeadLetterStatus::Open.as_str(), new_status.as_str()),
    };
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, op_id, dead_letter_id, reason,
                                       status_before, status_after, details)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&actor.name)
    .bind(kind.as_str())
    .bind(dl.op_id)
    .bind(dl.id)
    .bind(&actor.reason)
    .bind(status_before)
    .bind(status_after)
    .bind(&details)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(requeued)
}
