//! Operations: enqueue, find, list and search (keyset pages over filters), and acting on one:
//! signal it, approve or reject it (the approval convention), cancel it.

use agentq_core::approval::{self, is_approval_signal};
use agentq_core::db::names::Named;
use agentq_core::db::{self, cancel, listing, signals};
use agentq_core::dispatch::Target;
use agentq_core::operation::OperationId;
use agentq_core::state::Status;
use serde_json::Value;

use crate::{App, AppError, Caller, Result, Role, page};

/// An operation as a list shows it (no input or result), which [`listed`] renders.
pub use agentq_core::db::listing::Summary;

/// Parses an operation id as a user typed it.
pub fn parse_id(s: &str) -> Result<OperationId> {
    OperationId::parse(s).map_err(|e| AppError::malformed("id", e))
}

/// A signal name: 1-128 characters of letters, digits, `_`, `-`, `.` or `:`.
pub fn check_signal_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 128
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
    {
        return Err(AppError::malformed(
            "name",
            "a signal name is 1-128 characters of letters, digits, '_', '-', '.' or ':'",
        ));
    }
    Ok(())
}

/// What a sent signal did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signalled {
    /// The operation was waiting for it: it is queued again and its pointer published.
    Delivered,
    /// Kept until the operation waits for it.
    Kept {
        status: agentq_core::operation::Status,
        waiting_for: Option<String>,
    },
}

impl Signalled {
    /// `delivered` or `kept`, as the CLI's `--json` and the API answer it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Signalled::Delivered => "delivered",
            Signalled::Kept { .. } => "kept",
        }
    }
}

/// How a signal is audited: the action (`signal`, `approve`, `reject`) and an optional reason.
#[derive(Clone, Debug)]
pub struct Audit<'a> {
    pub action: &'static str,
    pub reason: Option<&'a str>,
}

/// Sends the signal `name` with `payload` to `op` (in the caller's scope): delivered to its
/// wait, or kept for a later one. Approving or rejecting (the signals of
/// [`agentq_core::approval::APPROVAL_SIGNALS`]) needs an operator, unless the deployment lets
/// producers ([`crate::Settings::producer_may_approve`]).
pub async fn signal(
    app: &App,
    caller: &Caller,
    op: OperationId,
    name: &str,
    payload: &Value,
    audit: Audit<'_>,
) -> Result<Signalled> {
    caller.require(Role::Producer)?;
    check_signal_name(name)?;
    if is_approval_signal(name) && !app.settings.producer_may_approve {
        caller.require(Role::Operator).map_err(|_| {
            AppError::Forbidden(format!(
                "the signal {name:?} approves or rejects, which needs an operator token (or \
                 AGENTQ_PRODUCER_MAY_APPROVE=true on the server); nothing was sent"
            ))
        })?;
    }
    let sent = signals::send_signal(
        &app.pool,
        op.0,
        caller.scope(),
        name,
        payload,
        &caller.actor,
        audit.action,
        audit.reason,
    )
    .await?;
    match sent {
        signals::Sent::Woke(target) => {
            dispatch(app, &target.into()).await;
            Ok(Signalled::Delivered)
        }
        signals::Sent::Kept {
            status,
            waiting_for,
        } => Ok(Signalled::Kept {
            status,
            waiting_for,
        }),
        signals::Sent::AlreadyPending => Err(AppError::Conflict(format!(
            "a signal {name:?} was already sent to {op} and not consumed yet; nothing changed"
        ))),
        signals::Sent::Finished(status) => Err(AppError::Conflict(format!(
            "operation {op} is {status}; the signal was not delivered"
        ))),
        signals::Sent::NotFound => Err(not_found(op)),
    }
}

/// The approval convention (`agentq approve` / `reject`, the console's buttons): the signal
/// `approval` with `{"approved", "by", "reason"}`, audited as `approve` / `reject`.
pub async fn decide(
    app: &App,
    caller: &Caller,
    op: OperationId,
    approved: bool,
    reason: Option<&str>,
) -> Result<Signalled> {
    let payload = approval::Decision::new(approved, &caller.actor, reason).payload();
    let action = if approved { "approve" } else { "reject" };
    signal(
        app,
        caller,
        op,
        approval::SIGNAL,
        &payload,
        Audit { action, reason },
    )
    .await
}

/// What a cancel did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// It was queued, sleeping or waiting: `cancelled` now.
    Now,
    /// It is running: its worker stops it at the next step boundary.
    Requested,
}

impl Cancelled {
    /// `cancelled` or `requested`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cancelled::Now => "cancelled",
            Cancelled::Requested => "requested",
        }
    }
}

/// Cancels `op` (in the caller's scope), audited with `reason`.
pub async fn cancel(
    app: &App,
    caller: &Caller,
    op: OperationId,
    reason: Option<&str>,
) -> Result<Cancelled> {
    caller.require(Role::Producer)?;
    match cancel::cancel_operation(&app.pool, op.0, caller.scope(), &caller.actor, reason).await? {
        cancel::Cancelled::Now => Ok(Cancelled::Now),
        cancel::Cancelled::Requested => Ok(Cancelled::Requested),
        cancel::Cancelled::Finished(status) => Err(AppError::Conflict(format!(
            "operation {op} is already {status}; nothing to cancel"
        ))),
        cancel::Cancelled::NotFound => Err(not_found(op)),
    }
}

/// The operation `op` as the caller may see it.
pub async fn find(
    app: &App,
    caller: &Caller,
    op: OperationId,
) -> Result<agentq_core::operation::OperationView> {
    caller.require(Role::Producer)?;
    db::operations::find_operation(&app.pool, op, caller.scope())
        .await?
        .ok_or_else(|| not_found(op))
}

/// What an operation recorded: its row, its input and its journal, for `agentq replay` to
/// replay against other code. An operator's (the input is the producer's data); nothing here
/// prints the input.
pub struct Recorded {
    pub operation: agentq_core::operation::OperationView,
    pub input: serde_json::Value,
    pub steps: Vec<agentq_core::operation::StepView>,
}

/// `op`'s row, input and journal, within the caller's tenant.
pub async fn recorded(app: &App, caller: &Caller, op: OperationId) -> Result<Recorded> {
    caller.require(Role::Operator)?;
    let operation = find(app, caller, op).await?;
    let input = db::operations::operation_input(&app.pool, op.0)
        .await?
        .ok_or_else(|| not_found(op))?;
    let steps = db::steps::list_steps(&app.pool, op.0, caller.scope()).await?;
    Ok(Recorded {
        operation,
        input,
        steps,
    })
}

/// About how many bytes of step outputs and errors one page of a journal carries (a page
/// always has at least one step).
pub const STEPS_PAGE_BYTES: i64 = 1 << 20;

/// One page of a journal, oldest step first.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct StepsPage {
    pub steps: Vec<agentq_core::operation::StepView>,
    /// The `after` of the next page (the last step's seq); null on the last page.
    pub next_after: Option<i32>,
}

/// The page of `op`'s journal after the step `after` (none: from the first), at most `limit`
/// steps (1–[`crate::page::MAX_PAGE`]) and about [`STEPS_PAGE_BYTES`], as the caller may see it.
pub async fn steps(
    app: &App,
    caller: &Caller,
    op: OperationId,
    after: Option<i32>,
    limit: i64,
) -> Result<StepsPage> {
    caller.require(Role::Producer)?;
    crate::page::check_limit(limit)?;
    let (mut steps, more) = db::steps::steps_page(
        &app.pool,
        op.0,
        caller.scope(),
        after,
        limit,
        STEPS_PAGE_BYTES,
    )
    .await?;
    if steps.is_empty() {
        // An operation with no step (after `after`) yet, or none the caller may see.
        find(app, caller, op).await?;
    }
    crate::redact::redact_steps(app, &mut steps);
    let next_after = more.then(|| steps.last().map(|s| s.seq)).flatten();
    Ok(StepsPage { steps, next_after })
}

/// Reads the `after` of a journal page (a step's seq), naming `after` when it is not one.
pub fn steps_after(after: Option<&str>) -> Result<Option<i32>> {
    after
        .map(|a| {
            a.parse::<i32>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                AppError::malformed(
                    "after",
                    format!("after {a:?} is not a step's seq (a number from a page's next_after)"),
                )
            })
        })
        .transpose()
}

/// Which operations a caller asks for, as a user typed it (query parameters, CLI flags, form
/// fields); every part optional. Times are RFC 3339 or an age (`2h`, `7d`); `*_after` is
/// inclusive, `*_before` exclusive.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    /// An admin's choice of tenant; a non-admin may name only its own.
    pub tenant: Option<String>,
    /// Statuses, each one or a comma-separated list: any of them matches.
    pub status: Vec<String>,
    pub kind: Option<String>,
    /// A batch id or name.
    pub batch: Option<String>,
    /// A schedule id or name: the operations it fired.
    pub schedule: Option<String>,
    /// An operation id: the children it spawned.
    pub parent: Option<String>,
    pub created_after: Option<String>,
    pub created_before: Option<String>,
    /// Only finished operations match a finished range.
    pub finished_after: Option<String>,
    pub finished_before: Option<String>,
}

/// Longest kind (or tenant) a list filter takes.
const MAX_NAME: usize = 128;

/// The filter `query` means for `caller` (a non-admin sees only its own tenant), each wrong
/// part refused naming it: the message starts with the parameter's name. A batch or a
/// schedule is named by its id or its name (`crate::names`).
pub async fn list_filter(app: &App, caller: &Caller, query: &ListQuery) -> Result<listing::Filter> {
    caller.require(Role::Producer)?;
    let tenant = caller.tenant_filter(query.tenant.as_deref())?;
    if let Some(t) = &tenant {
        agentq_core::operation::TenantId::parse(t)
            .map_err(|e| AppError::malformed("tenant", format!("tenant {t:?}: {e}")))?;
    }
    let mut statuses = Vec::new();
    for s in query.status.iter().flat_map(|s| s.split(',')) {
        let status = s.trim().parse::<Status>().map_err(|_| {
            AppError::malformed(
                "status",
                format!("status {s:?}: use {}", Status::NAMES.join(", ")),
            )
        })?;
        if !statuses.contains(&status) {
            statuses.push(status);
        }
    }
    if let Some(k) = &query.kind
        && (k.is_empty() || k.len() > MAX_NAME)
    {
        return Err(AppError::malformed(
            "kind",
            format!("kind must be 1-{MAX_NAME} characters"),
        ));
    }
    let parent = query
        .parent
        .as_deref()
        .map(|s| {
            uuid::Uuid::parse_str(s).map_err(|_| {
                AppError::malformed(
                    "parent",
                    format!("parent {s:?} is not an operation id (a UUID)"),
                )
            })
        })
        .transpose()?;
    let named = query.tenant.as_deref();
    let batch = match &query.batch {
        Some(b) => {
            Some(crate::names::in_filter(app, caller, Named::Batch, b, named, "batch").await?)
        }
        None => None,
    };
    let schedule = match &query.schedule {
        Some(s) => {
            Some(crate::names::in_filter(app, caller, Named::Schedule, s, named, "schedule").await?)
        }
        None => None,
    };
    let time = |v: &Option<String>, field: &'static str| {
        v.as_deref()
            .map(|s| crate::time::parse_since(s, field).map_err(|e| AppError::malformed(field, e)))
            .transpose()
    };
    let filter = listing::Filter {
        tenant,
        statuses,
        kind: query.kind.clone(),
        batch,
        schedule,
        parent,
        created_after: time(&query.created_after, "created_after")?,
        created_before: time(&query.created_before, "created_before")?,
        finished_after: time(&query.finished_after, "finished_after")?,
        finished_before: time(&query.finished_before, "finished_before")?,
        waiting_for: None,
    };
    for (from, to, field) in [
        (
            filter.created_after,
            filter.created_before,
            "created_before",
        ),
        (
            filter.finished_after,
            filter.finished_before,
            "finished_before",
        ),
    ] {
        if let (Some(from), Some(to)) = (from, to)
            && to <= from
        {
            return Err(AppError::malformed(
                field,
                format!(
                    "{field} is not later than {}",
                    field.replace("before", "after")
                ),
            ));
        }
    }
    Ok(filter)
}

/// One keyset page of operations, newest first.
pub type Page = page::Page<listing::Summary>;

/// Lists the operations `query` selects for `caller`, newest first, `limit`
/// (1–[`page::MAX_PAGE`]) after the cursor `after` (a previous page's
/// [`page::Page::next_cursor`]). Items are compact: no input, result or error message.
pub async fn list(
    app: &App,
    caller: &Caller,
    query: &ListQuery,
    limit: i64,
    after: Option<&str>,
) -> Result<Page> {
    let filter = list_filter(app, caller, query).await?;
    page::check_limit(limit)?;
    let after = page::after(after)?;
    let items = listing::list(&app.pool, &filter, limit, after).await?;
    Ok(Page::new(items, limit, |o| (o.created_at, o.op_id)))
}

/// An operation with its keyset cursor, as lists show it.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "ListedOperation")]
pub struct Listed {
    #[serde(flatten)]
    pub operation: listing::Summary,
    /// Pass it as `after` to list what comes after this one.
    pub cursor: String,
}

/// `o` with its keyset cursor, as lists show it.
pub fn listed(o: &listing::Summary) -> Listed {
    Listed {
        operation: o.clone(),
        cursor: page::cursor((o.created_at, o.op_id)),
    }
}

/// The request of an enqueue, as a front end fills it in from its flags or its body.
pub use agentq_producer::EnqueueRequest;

/// Enqueues `req` for the caller (`req.tenant` must be one [`Caller::tenant_for_write`]
/// allows): stored, then its pointer published. Refusals name the field at fault (a run time
/// over a year away, a deadline already past, a dedupe key in a namespace agentq derives keys
/// in: `Idempotency-Key`, as the API names it); a dedupe key naming an operation with another
/// input is [`AppError::KeyReused`]. Every rule of a producer's enqueue is here, so no front
/// end can forget one.
pub async fn enqueue(
    app: &App,
    caller: &Caller,
    req: agentq_producer::EnqueueRequest,
) -> Result<agentq_producer::Enqueued> {
    check_enqueue(caller, &req)?;
    crate::capacity::admit(app, &req.tenant, &req.kind, 1).await?;
    app.producer.enqueue(req).await.map_err(refused_enqueue)
}

/// The checks of a producer's enqueue before the producer's own (who may, the tenant, a run
/// time within a year, a deadline not past, a dedupe key outside agentq's namespaces): shared
/// by [`enqueue`] and a debounced one (`crate::debounce::enqueue`).
pub(crate) fn check_enqueue(caller: &Caller, req: &agentq_producer::EnqueueRequest) -> Result<()> {
    caller.require(Role::Producer)?;
    caller.tenant_for_write(Some(&req.tenant))?;
    agentq_core::operation::TenantId::parse(&req.tenant)
        .map_err(|e| AppError::invalid("/tenant", e))?;
    let now = chrono::Utc::now();
    if req
        .run_at
        .is_some_and(|at| at > now + chrono::Duration::days(366))
    {
        return Err(AppError::invalid(
            "/run_at",
            "run_at is more than a year away",
        ));
    }
    if req.deadline.is_some_and(|d| d <= now) {
        return Err(AppError::invalid("/deadline", "deadline is in the past"));
    }
    if let Some(key) = &req.dedupe_key {
        agentq_core::operation::check_producer_key(key)
            .map_err(|e| AppError::invalid("Idempotency-Key", e))?;
    }
    Ok(())
}

/// The application error of a refused or failed enqueue.
pub fn refused_enqueue(e: agentq_producer::Error) -> AppError {
    match e {
        agentq_producer::Error::Invalid { field, message } => AppError::Invalid { field, message },
        agentq_producer::Error::Db(e) => AppError::Db(e),
        agentq_producer::Error::KeyConflict { key, op_id } => AppError::KeyReused {
            key,
            op_id: op_id.0,
        },
    }
}

pub(crate) fn not_found(op: OperationId) -> AppError {
    AppError::NotFound(format!("no operation {op}"))
}

/// Publishes a re-queued operation's pointer; if that fails, the scheduler's sweeper does.
pub(crate) async fn dispatch(app: &App, target: &Target) {
    if let Err(e) = app.dispatcher.dispatch(target).await {
        tracing::warn!(op_id = %target.op_id, error = %e, "queued; the scheduler will dispatch it");
    }
}
