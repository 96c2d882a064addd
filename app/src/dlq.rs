//! The DLQ actions on one dead letter — retry (optionally with a merge patch of the input),
//! resolve an unknown side effect, discard — and the details a person reads before acting.
//! The CLI's bulk forms call [`act`] once per selected dead letter.

use agentq_core::db::dead_letters::{self, Action, ActionError, Actor, Filter, Outcome};
use agentq_core::db::names::Named;
use agentq_core::db::{self};
use agentq_core::dispatch::Target;
use agentq_core::operation::{OperationId, input_sha256};
use agentq_core::state::DeadLetterStatus;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::{App, AppError, Caller, Result, Role, page};

/// The dead letters, their audit history and their groups, as the flows here return them.
pub use agentq_core::db::dead_letters::{ActionView, DeadLetterView, StatRow};

/// What an operator asks of a dead letter, as every front end reads it.
#[derive(Clone, Debug)]
pub enum Request {
    /// Re-queue from the failed step; `patch` is an RFC 7386 merge patch of the input;
    /// `to_version` moves it to that version of its kind (a live worker must run it), which
    /// is how a `nondeterminism` dead letter is recovered (see `crate::versions::upgrade`).
    Retry {
        patch: Option<Value>,
        to_version: Option<String>,
    },
    /// The unknown step happened (with what it returned) or did not.
    Resolve {
        happened: bool,
        output: Option<Value>,
    },
    /// Drop it for good (a reason is required).
    Discard,
}

impl Request {
    /// The past tense the front ends report: `retried`, `resolved`, `discarded`.
    pub fn done(&self) -> &'static str {
        match self {
            Request::Retry { .. } => "retried",
            Request::Resolve { .. } => "resolved",
            Request::Discard => "discarded",
        }
    }
}

/// What an action on a dead letter did: the outcome of `act`, as the API answers it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "ActionResult")]
pub struct Acted {
    /// The dead letter acted on.
    pub id: Uuid,
    /// `retried`, `resolved` or `discarded`.
    #[serde(rename = "result")]
    pub done: &'static str,
    /// The operation queued again, if the action re-queued one.
    pub op_id: Option<Uuid>,
}

/// Which dead letters a caller asks for, as a user typed it (CLI flags, query parameters,
/// form fields); every part optional.
#[derive(Clone, Copy, Debug, Default)]
pub struct Query<'a> {
    pub tenant: Option<&'a str>,
    pub kind: Option<&'a str>,
    pub class: Option<&'a str>,
    pub since: Option<&'a str>,
    pub batch: Option<&'a str>,
    pub status: Option<&'a str>,
}

/// The filter `query` means for `caller`: an operator sees only its own tenant (naming another
/// is forbidden, naming none means its own), an admin any or all. A wrong part is refused
/// naming it (`field`, the message starting with the field's name). A batch is named by its
/// id or its name (`crate::names`).
pub async fn filter_for(app: &App, caller: &Caller, query: Query<'_>) -> Result<Filter> {
    caller.require(Role::Operator)?;
    let tenant = caller.tenant_filter(query.tenant)?;
    let mut filter = build_filter(
        tenant.as_deref(),
        query.kind,
        query.class,
        query.since,
        query.status,
    )
    .map_err(|(field, message)| AppError::Malformed { field, message })?;
    if let Some(b) = query.batch {
        filter.batch = Some(
            crate::names::in_filter(app, caller, Named::Batch, b, query.tenant, "batch").await?,
        );
    }
    Ok(filter)
}

/// One keyset page of dead letters, newest first.
pub type Page = page::Page<DeadLetterView>;

/// Lists the dead letters `query` selects for `caller`, `limit` (1–[`page::MAX_PAGE`]) after
/// the cursor `after` (from a previous page's [`Page::next_cursor`]).
pub async fn list(
    app: &App,
    caller: &Caller,
    query: Query<'_>,
    limit: i64,
    after: Option<&str>,
) -> Result<Page> {
    let filter = filter_for(app, caller, query).await?;
    page::check_limit(limit)?;
    let after = page::after(after)?;
    let items = dead_letters::list_dead_letters(&app.pool, &filter, limit, after).await?;
    Ok(Page::new(items, limit, |d| (d.created_at, d.id)))
}

/// Open dead letters `query` selects for `caller`, grouped by class, kind and reason
/// fingerprint, the largest group first.
pub async fn stats(
    app: &App,
    caller: &Caller,
    query: Query<'_>,
) -> Result<Vec<dead_letters::StatRow>> {
    let filter = filter_for(app, caller, query).await?;
    Ok(dead_letters::stats(&app.pool, &filter).await?)
}

/// Builds a dead-letter filter (all but its batch) from its parts as a user typed them,
/// saying which part is wrong: `(field, message)`, the message starting with the field's name.
fn build_filter(
    tenant: Option<&str>,
    kind: Option<&str>,
    class: Option<&str>,
    since: Option<&str>,
    status: Option<&str>,
) -> Result<Filter, (&'static str, String)> {
    let status = status
        .map(|s| {
            s.parse::<DeadLetterStatus>().map_err(|_| {
                (
                    "status",
                    format!("status {s:?}: use open, retried, resolved or discarded"),
                )
            })
        })
        .transpose()?;
    let since = since
        .map(|s| crate::time::parse_since(s, "since").map_err(|e| ("since", e)))
        .transpose()?;
    Ok(Filter {
        tenant: tenant.map(String::from),
        kind: kind.map(String::from),
        class: class.map(String::from),
        since,
        batch: None,
        status,
    })
}

/// The ids of the dead letters `query` selects for `caller`, newest first, at most `max`: what
/// a bulk retry or discard acts on, and what its dry run shows.
pub async fn select(app: &App, caller: &Caller, query: Query<'_>, max: i64) -> Result<Vec<Uuid>> {
    caller.require(Role::Operator)?;
    let filter = filter_for(app, caller, query).await?;
    Ok(dead_letters::select_ids(&app.pool, &filter, max).await?)
}

/// The dead letter `id` (or the open one of operation `id`) in the caller's scope.
pub async fn find(app: &App, caller: &Caller, id: Uuid) -> Result<DeadLetterView> {
    caller.require(Role::Operator)?;
    dead_letters::find_dead_letter(&app.pool, id, caller.scope())
        .await?
        .ok_or_else(|| not_found(id))
}

fn not_found(id: Uuid) -> AppError {
    AppError::NotFound(format!("no dead letter or operation {id}"))
}

/// Acts on the dead letter `id` (audited with the caller and `reason`) and dispatches what it
/// re-queued.
pub async fn act(
    app: &App,
    caller: &Caller,
    id: Uuid,
    request: Request,
    reason: Option<String>,
) -> Result<Acted> {
    let reason = reason.filter(|r| !r.trim().is_empty());
    match &request {
        Request::Discard if reason.is_none() => {
            return Err(AppError::invalid(
                "/reason",
                "discarding needs a reason: it is kept in the audit trail",
            ));
        }
        Request::Resolve {
            happened: false,
            output: Some(_),
        } => {
            return Err(AppError::invalid(
                "/output",
                "output is the result of a step that happened; drop it or set happened: true",
            ));
        }
        _ => {}
    }
    let d = find(app, caller, id).await?;
    // A retry or a resolve makes the operation run again: its kind must still be the
    // tenant's (a discard is always allowed).
    if let (Request::Retry { .. } | Request::Resolve { .. }, Some(tenant), Some(kind)) =
        (&request, &d.tenant, &d.kind)
    {
        let done = if matches!(request, Request::Retry { .. }) {
            "retried"
        } else {
            "resolved"
        };
        let what = format!("; dead letter {} was not {done} and stays open", d.id);
        crate::tenants::check_kind_now(app, tenant, kind, &what).await?;
    }
    let action = match request.clone() {
        Request::Discard => Action::Discard,
        Request::Resolve {
            happened: true,
            output,
        } => Action::Resolve(Outcome::Happened(output.unwrap_or(Value::Null))),
        Request::Resolve { .. } => Action::Resolve(Outcome::DidNotHappen),
        Request::Retry { patch, to_version } => {
            let version = match to_version {
                None => None,
                Some(v) => {
                    let v = crate::versions::parse_version("to_version", &v)?;
                    if let Some(kind) = &d.kind {
                        crate::versions::require_live(app, kind, &v).await?;
                    }
                    Some(v)
                }
            };
            let input = match patch {
                None => None,
                Some(patch) => Some(patched_input(app, &d, &patch).await?),
            };
            Action::Retry { input, version }
        }
    };
    let actor = Actor {
        name: caller.actor.clone(),
        reason,
    };
    let requeued = dead_letters::act(&app.pool, d.id, &action, &actor)
        .await
        .map_err(|e| match e {
            ActionError::NotFound(id) => not_found(id),
            ActionError::Db(e) => AppError::Db(e),
            refused => AppError::Conflict(refused.to_string()),
        })?;
    if let Some(r) = &requeued {
        let target = Target::from(db::dispatch::Dispatch {
            id: r.id,
            tenant_id: r.tenant_id.clone(),
            kind: r.kind.clone(),
            lane: r.lane.clone(),
            epoch: r.epoch,
            traceparent: None,
        });
        crate::operations::dispatch(app, &target).await;
    }
    Ok(Acted {
        id: d.id,
        done: request.done(),
        op_id: requeued.map(|r| r.id),
    })
}

/// The dead letter's operation input with an RFC 7386 merge patch applied, and its new hash.
async fn patched_input(app: &App, d: &DeadLetterView, patch: &Value) -> Result<(Value, String)> {
    let refuse = |m: String| AppError::Conflict(m);
    let op = d
        .op_id
        .ok_or_else(|| refuse(format!("dead letter {} has no operation to patch", d.id)))?;
    let mut input = db::operations::operation_input(&app.pool, op)
        .await?
        .ok_or_else(|| refuse(format!("operation {op} is gone")))?;
    merge_patch(&mut input, patch);
    // Checked as an enqueue is (kind, input, size), before the retry is accepted.
    if let Some(kind) = &d.kind {
        app.producer
            .check_input(kind, &input)
            .map_err(crate::operations::refused_enqueue)
            .map_err(|e| match e {
                AppError::Invalid { field, message } => AppError::Invalid {
                    field: field.replacen("/input", "/patch_input", 1),
                    message: format!("the patched input does not fit: {message}"),
                },
                other => other,
            })?;
        agentq_core::operation::check_input_size(&input)
            .map_err(|e| AppError::invalid("/patch_input", e))?;
    }
    let sha = input_sha256(&input);
    Ok((input, sha))
}

/// RFC 7386 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("made an object above");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// Everything about one dead letter: what `dlq show`, `GET /v1/dlq/{id}` and the console
/// present.
#[derive(serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "DeadLetterDetails")]
pub struct Details {
    pub dead_letter: Listed,
    /// Its operation (none for a poison message).
    pub operation: Option<agentq_core::operation::OperationView>,
    pub steps: Vec<agentq_core::operation::StepView>,
    /// The operator actions on it or its operation, oldest first.
    pub history: Vec<dead_letters::ActionView>,
    /// The first 512 bytes of a poison message's body.
    pub raw_message_preview: Option<String>,
}

/// The details of the dead letter `id` in the caller's scope.
pub async fn details(app: &App, caller: &Caller, id: Uuid) -> Result<Details> {
    let d = find(app, caller, id).await?;
    let pool = &app.pool;
    let (operation, steps) = match d.op_id {
        Some(o) => (
            db::operations::find_operation(pool, OperationId(o), None).await?,
            db::steps::list_steps(pool, o, None).await?,
        ),
        None => (None, Vec::new()),
    };
    let history = dead_letters::history(pool, d.id, d.op_id).await?;
    let raw = if d.op_id.is_none() {
        dead_letters::raw_message(pool, d.id).await?
    } else {
        None
    };
    Ok(Details {
        dead_letter: listed(&d),
        operation,
        steps,
        history,
        raw_message_preview: raw
            .map(|r| String::from_utf8_lossy(&r[..r.len().min(512)]).into_owned()),
    })
}

/// A dead letter with its keyset cursor, as lists show it.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "DeadLetter")]
pub struct Listed {
    #[serde(flatten)]
    pub dead_letter: DeadLetterView,
    /// Pass it as `after` to list what comes after this one.
    pub cursor: String,
}

/// `d` with its keyset cursor, as lists show it.
pub fn listed(d: &DeadLetterView) -> Listed {
    Listed {
        dead_letter: d.clone(),
        cursor: cursor(d),
    }
}

/// The keyset cursor of a dead letter.
pub fn cursor(d: &DeadLetterView) -> String {
    page::cursor((d.created_at, d.id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut t = json!({ "a": "b", "c": { "d": "e", "f": "g" }, "keep": [1] });
        merge_patch(&mut t, &json!({ "a": "z", "c": { "f": null }, "new": 1 }));
        assert_eq!(
            t,
            json!({ "a": "z", "c": { "d": "e" }, "keep": [1], "new": 1 })
        );
        let mut arr = json!({ "steps": [1, 2] });
        merge_patch(&mut arr, &json!({ "steps": [3] }));
        assert_eq!(arr, json!({ "steps": [3] }));
        merge_patch(&mut arr, &json!("x"));
        assert_eq!(arr, json!("x"));
    }
}
