//! What a batch shows: its progress (`agentq batch status`, `GET /v1/batches/{id}`), the list
//! of batches and its per-document report. Reads only; starting and the controls are the
//! parent module's.

use std::collections::{BTreeMap, HashSet};

use agentq_core::db::batches::{self, Failure, Listed};
use agentq_core::state::BatchStatus;
use serde_json::Value;
use uuid::Uuid;

use super::{find, list_documents};
use crate::page::{self, After};
use crate::{App, AppError, Caller, Result, Role};

/// A batch's progress: totals by status, times, rate, ETA, token usage and the top failure
/// reasons (`GET /v1/batches/{id}`, `agentq batch status`).
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchStatus")]
pub struct Overview {
    pub batch_id: Uuid,
    /// Unique in its tenant, accepted wherever the id is.
    pub name: Option<String>,
    pub tenant: String,
    pub kind: String,
    /// `completed` once every document it enqueued has an outcome (dead ones count, as
    /// failures: see `by_status`).
    pub status: BatchStatus,
    /// Why it was paused (an operator's reason or the auto-pause).
    pub paused_reason: Option<String>,
    /// How many documents run before an operator promotes a canary.
    pub canary: Option<i32>,
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// When it completed or was cancelled.
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Seconds it has spent running: not paused, not a canary waiting for its promotion.
    pub running_secs: f64,
    /// Documents in its source store when it started.
    pub documents: i32,
    /// Operations enqueued so far.
    pub enqueued: i64,
    /// Its operations counted by status.
    pub by_status: BTreeMap<String, i64>,
    /// Queued, running, sleeping or waiting operations.
    pub unfinished: i64,
    /// Operations succeeded per second of running time.
    pub succeeded_per_s: f64,
    /// Seconds until every document is done at that rate: only while it is `running` (not
    /// paused, not a canary waiting) and something has succeeded.
    pub eta_secs: Option<i64>,
    pub usage: Usage,
    /// Its token budget (its operations together), if it has one: when it cannot cover a
    /// model call, the batch pauses.
    pub budget: Option<agentq_core::db::budgets::BudgetView>,
    /// The most common failures of its unfinished or dead operations.
    pub top_failures: Vec<Failure>,
}

/// A batch's completed model calls and their tokens.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchUsage")]
pub struct Usage {
    pub model_calls: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

/// The batch's progress.
pub async fn status(app: &App, caller: &Caller, id: Uuid) -> Result<Overview> {
    let b = find(app, caller, id).await?;
    let pool = &app.pool;
    let counts: BTreeMap<String, i64> = batches::counts(pool, id).await?.into_iter().collect();
    let get = |s: &str| counts.get(s).copied().unwrap_or(0);
    let unfinished = get("queued") + get("running") + get("sleeping") + get("waiting");
    let enqueued: i64 = counts.values().sum();
    let (rate, eta) = pace(
        b.status,
        get("succeeded"),
        b.running_secs,
        unfinished + (i64::from(b.documents) - enqueued).max(0),
    );
    let (model_calls, prompt_tokens, completion_tokens) = batches::usage(pool, id).await?;
    let top_failures = batches::top_failures(pool, id, 5).await?;
    Ok(Overview {
        batch_id: id,
        name: b.name,
        tenant: b.tenant,
        kind: b.kind,
        status: b.status,
        paused_reason: b.paused_reason,
        canary: b.canary,
        started_at: b.started_at,
        finished_at: b.finished_at,
        running_secs: (b.running_secs * 10.0).round() / 10.0,
        documents: b.documents,
        enqueued,
        by_status: counts,
        unfinished,
        succeeded_per_s: (rate * 100.0).round() / 100.0,
        eta_secs: eta,
        usage: Usage {
            model_calls,
            prompt_tokens,
            completion_tokens,
        },
        budget: agentq_core::db::budgets::of_batch(pool, id).await?,
        top_failures,
    })
}

/// A batch's rate (operations succeeded per second of running time) and, only while it runs,
/// the seconds its `remaining` documents take at that rate.
fn pace(
    status: BatchStatus,
    succeeded: i64,
    running_secs: f64,
    remaining: i64,
) -> (f64, Option<i64>) {
    let rate = if running_secs >= 1.0 {
        succeeded as f64 / running_secs
    } else {
        0.0
    };
    let eta = (status == BatchStatus::Running && rate > 0.0)
        .then(|| (remaining as f64 / rate).round() as i64);
    (rate, eta)
}

/// Which batches a list shows, as a user typed it.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    /// An admin's choice of tenant; a non-admin may name only its own.
    pub tenant: Option<String>,
    /// One status (`running`, `completed`…).
    pub status: Option<String>,
}

/// One keyset page of batches, newest first.
pub type Page = page::Page<Listed>;

/// A listed batch with its keyset cursor, as `GET /v1/batches` and `batch list --json` show it.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchListItem")]
pub struct Item {
    #[serde(flatten)]
    pub batch: Listed,
    /// Pass it as `after` to list what comes after this one.
    pub cursor: String,
}

impl Item {
    /// `b` with its cursor.
    pub fn of(b: &Listed) -> Self {
        Self {
            batch: b.clone(),
            cursor: page::cursor((b.created_at, b.batch_id)),
        }
    }
}

/// The batches `query` selects for the caller, newest first: `limit` (1–[`page::MAX_PAGE`])
/// after the cursor `after` (a previous page's [`page::Page::next_cursor`]). The one list of
/// `agentq batch list`, `GET /v1/batches` and the console's batches page.
pub async fn list(
    app: &App,
    caller: &Caller,
    query: &ListQuery,
    limit: i64,
    after: Option<&str>,
) -> Result<Page> {
    caller.require(Role::Operator)?;
    let tenant = caller.tenant_filter(query.tenant.as_deref())?;
    let status = query
        .status
        .as_deref()
        .map(|s| {
            s.trim().parse::<BatchStatus>().map_err(|_| {
                AppError::malformed(
                    "status",
                    format!("status {s:?}: use {}", BatchStatus::NAMES.join(", ")),
                )
            })
        })
        .transpose()?;
    page::check_limit(limit)?;
    let after: After = page::after(after)?;
    let filter = batches::Filter { tenant, status };
    let items = batches::list(&app.pool, &filter, limit, after).await?;
    Ok(Page::new(items, limit, |b| (b.created_at, b.batch_id)))
}

/// One document of a batch's report: its operation's outcome, or `not_enqueued`.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchReportLine")]
pub struct ReportLine {
    pub doc_id: String,
    pub op_id: Option<Uuid>,
    /// Its operation's status, or `not_enqueued`.
    pub status: String,
    pub attempt: Option<i32>,
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    /// The hash of what was written, for a document that succeeded.
    pub sha256: Option<String>,
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// A batch's per-document outcomes (`agentq batch report`, `GET /v1/batches/{id}/report`).
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchReport")]
pub struct Report {
    pub batch_id: Uuid,
    /// Every document of the source (and any other the batch enqueued), sorted by id.
    pub documents: Vec<ReportLine>,
    /// Documents counted by status.
    pub totals: BTreeMap<String, usize>,
}

/// Operations read per statement of a report.
const REPORT_PAGE: i64 = 5000;

/// The report of the batch `id`: one line per document of its source store, enqueued or not
/// (a source no longer readable reports what was enqueued).
pub async fn report(app: &App, caller: &Caller, id: Uuid) -> Result<Report> {
    let b = find(app, caller, id).await?;
    let mut rows: BTreeMap<String, batches::ReportRow> = BTreeMap::new();
    let mut after = None;
    loop {
        let page = batches::report_page(&app.pool, id, after, REPORT_PAGE).await?;
        let Some(last) = page.last() else { break };
        after = Some(last.op_id);
        for r in page {
            rows.insert(r.doc_id.clone().unwrap_or_else(|| r.op_id.to_string()), r);
        }
    }
    let source: Value = serde_json::from_str(&b.source).unwrap_or(Value::Null);
    let mut docs: Vec<String> = list_documents(app, &b.tenant, &source)
        .await
        .unwrap_or_default();
    let listed: HashSet<String> = docs.iter().cloned().collect();
    docs.extend(rows.keys().filter(|d| !listed.contains(*d)).cloned());
    docs.sort();
    let mut totals: BTreeMap<String, usize> = BTreeMap::new();
    let documents = docs
        .into_iter()
        .map(|doc| {
            let r = rows.remove(&doc);
            let status = r
                .as_ref()
                .map(|r| r.status.clone())
                .unwrap_or_else(|| "not_enqueued".into());
            *totals.entry(status.clone()).or_default() += 1;
            match r {
                Some(r) => ReportLine {
                    doc_id: doc,
                    op_id: Some(r.op_id),
                    status,
                    attempt: Some(r.attempt),
                    error_class: r.error_class,
                    error_message: r.error_message,
                    sha256: r.sha256,
                    finished_at: r.finished_at,
                },
                None => ReportLine {
                    doc_id: doc,
                    op_id: None,
                    status,
                    attempt: None,
                    error_class: None,
                    error_message: None,
                    sha256: None,
                    finished_at: None,
                },
            }
        })
        .collect();
    Ok(Report {
        batch_id: id,
        documents,
        totals,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_is_over_running_time_and_the_eta_only_while_running() {
        // 100 succeeded in 50 s of running time, 300 to go: 2/s, 150 s.
        assert_eq!(pace(BatchStatus::Running, 100, 50.0, 300), (2.0, Some(150)));
        for waiting in [
            BatchStatus::Canary,
            BatchStatus::Paused,
            BatchStatus::Completed,
        ] {
            assert_eq!(pace(waiting, 100, 50.0, 300), (2.0, None), "{waiting}");
        }
        // Nothing run yet: no rate, no ETA.
        assert_eq!(pace(BatchStatus::Running, 0, 0.0, 300), (0.0, None));
        assert_eq!(pace(BatchStatus::Running, 5, 0.2, 300), (0.0, None));
    }
}
