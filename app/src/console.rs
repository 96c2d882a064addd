//! The operator console's read views, each taking the [`Caller`] (an operator's or an admin's;
//! a non-admin sees only its own tenant, another tenant's id is "not found"): the overview,
//! one operation with its journal, events, children and audit trail (and, after an audited
//! reveal, its payloads), the pending approvals, and the dead-letter inbox (its batches page
//! lists through `batches::list`, as the API does).
//!
//! The SQL is the engine's tables' queries in `agentq_core::db` (`db::console` and the shared
//! ones); the console names none of it, only the row types re-exported here.

use agentq_core::db::{children, console, dead_letters, events, listing, operations, steps};
use agentq_core::operation::{OperationId, OperationView, StepView};

use crate::{App, AppError, Caller, Result, Role};

pub use agentq_core::db::children::Node;
pub use agentq_core::db::console::{InboxItem, Minute, Payloads};
pub use agentq_core::db::dead_letters::{ActionView, DeadLetterView, Filter, StatRow};
pub use agentq_core::db::events::Event;
pub use agentq_core::db::listing::Summary;

/// What the overview shows, in the caller's scope.
pub struct Overview {
    /// Operations by status.
    pub counts: Vec<(String, i64)>,
    /// Open dead letters by class, the largest class first.
    pub dead_by_class: Vec<(String, i64)>,
    /// Seconds the oldest due queued operation has waited, by lane.
    pub oldest_queued: Vec<(String, f64)>,
    /// The last minutes, oldest first, every minute present (zeros where idle).
    pub minutes: Vec<Minute>,
}

/// The overview: counts, open dead letters, queue age, and the last `minutes` minutes.
pub async fn overview(app: &App, caller: &Caller, minutes: i32) -> Result<Overview> {
    caller.require(Role::Operator)?;
    let scope = caller.scope();
    Ok(Overview {
        counts: console::status_counts(&app.pool, scope).await?,
        dead_by_class: console::open_dead_letters_by_class(&app.pool, scope).await?,
        oldest_queued: console::oldest_queued(&app.pool, scope).await?,
        minutes: console::minutes(&app.pool, scope, minutes).await?,
    })
}

/// Most steps of a journal an operation's page shows (the rest: `agentq steps` or the API).
pub const JOURNAL_STEPS: i64 = 500;
/// Most events an operation's page shows.
pub const EVENTS: i64 = 500;
/// Most descendants an operation's page shows.
pub const CHILDREN: i64 = 200;

/// One operation as its console page shows it.
pub struct Operation {
    pub operation: OperationView,
    /// What it waits for, when it waits for a signal.
    pub waiting: Option<crate::decision::Pending>,
    /// The first page of its journal (at most [`JOURNAL_STEPS`], about four API pages of
    /// bytes), oldest first; outputs are there even when the page hides them.
    pub steps: Vec<StepView>,
    /// The journal goes on after `steps`.
    pub more_steps: bool,
    /// Its first [`EVENTS`] events.
    pub events: Vec<Event>,
    /// Its input and result: only after a reveal, which is audited.
    pub payloads: Option<Payloads>,
    /// Its audit trail, oldest first.
    pub actions: Vec<ActionView>,
    /// Its children, grandchildren…: depth first, in the order they were spawned, at most
    /// [`CHILDREN`].
    pub children: Vec<Node>,
    /// It has more descendants than `children`.
    pub more_children: bool,
}

/// The operation `op` for its page, with its pending decision. With `reveal`, its payloads
/// too ([`crate::decision::reveal`]: audited as `reveal_payloads` under the caller's name before they are
/// read).
pub async fn operation(
    app: &App,
    caller: &Caller,
    op: OperationId,
    reveal: bool,
) -> Result<Operation> {
    caller.require(Role::Operator)?;
    let pool = &app.pool;
    let scope = caller.scope();
    let operation = operations::find_operation(pool, op, scope)
        .await?
        .ok_or_else(|| AppError::NotFound(format!("no operation {op}")))?;
    let (steps, more_steps) = steps::steps_page(
        pool,
        op.0,
        scope,
        None,
        JOURNAL_STEPS,
        4 * crate::operations::STEPS_PAGE_BYTES,
    )
    .await?;
    let mut steps = steps;
    crate::redact::redact_steps(app, &mut steps);
    let mut events = events::events_after(pool, op.0, 0, EVENTS).await?;
    for e in &mut events {
        crate::redact::redact_event(app, &mut e.data);
    }
    let payloads = if reveal {
        crate::decision::reveal(app, caller, &operation, "console").await?
    } else {
        None
    };
    let waiting = crate::decision::pending(app, &operation).await?;
    let actions = console::operation_actions(pool, op.0).await?;
    let (children, more_children) = children::descendants(pool, op.0, CHILDREN).await?;
    Ok(Operation {
        operation,
        waiting,
        steps,
        more_steps,
        events,
        payloads,
        actions,
        children,
        more_children,
    })
}

/// An operation waiting for an approval, with what it waits for.
pub struct Approval {
    pub summary: Summary,
    /// The pending decision (the agent's tool call, or what the job said it needs); `None`
    /// when its wait step has not been recorded.
    pub pending: Option<crate::decision::Pending>,
}

/// The operations waiting for an `approval` signal, newest first, at most `limit`, each with
/// its pending decision.
pub async fn approvals(app: &App, caller: &Caller, limit: i64) -> Result<Vec<Approval>> {
    caller.require(Role::Operator)?;
    let filter = listing::Filter {
        tenant: caller.tenant_filter(None)?,
        waiting_for: Some("approval".into()),
        ..Default::default()
    };
    let rows = listing::list(&app.pool, &filter, limit, None).await?;
    let ids: Vec<_> = rows.iter().map(|r| r.op_id).collect();
    let mut pending = crate::decision::pending_of(app, &ids).await?;
    Ok(rows
        .into_iter()
        .map(|summary| Approval {
            pending: pending.remove(&summary.op_id),
            summary,
        })
        .collect())
}

/// The dead-letter inbox `query` selects.
pub struct Inbox {
    /// The filter the query means for the caller.
    pub filter: Filter,
    /// Open dead letters grouped by class, kind and reason fingerprint, the largest first.
    pub groups: Vec<StatRow>,
    /// The newest open dead letters, each with its fingerprint.
    pub items: Vec<InboxItem>,
}

/// The inbox of open dead letters `query` selects for the caller: its groups, and its newest
/// `limit` items.
pub async fn inbox(
    app: &App,
    caller: &Caller,
    query: crate::dlq::Query<'_>,
    limit: i64,
) -> Result<Inbox> {
    let filter = crate::dlq::filter_for(app, caller, query).await?;
    let groups = dead_letters::stats(&app.pool, &filter).await?;
    let items = console::inbox(&app.pool, &filter, limit).await?;
    Ok(Inbox {
        filter,
        groups,
        items,
    })
}
