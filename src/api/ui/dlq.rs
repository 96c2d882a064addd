//! The dead-letter inbox: open dead letters grouped by class, kind and error fingerprint
//! (`db::dead_letters::stats`), each with retry, patch-and-retry, resolve and discard: the
//! same `crate::dlq::act_one` as `agentq dlq` and `POST /v1/dlq/{id}/…`, so the same audit rows.

use std::sync::Arc;

use agentq_core::db::console;
use agentq_core::db::dead_letters::{self, Action, ActionError, Actor, Outcome};
use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use super::html::{self, badge, csrf, esc, time, url};
use super::session::{Fields, Session, filled};
use super::{UiError, UiResult, UiState};

/// Most dead letters listed under the groups.
const ITEMS: i64 = 200;

#[derive(Debug, Default, Deserialize)]
pub struct InboxQuery {
    class: Option<String>,
    kind: Option<String>,
}

/// `GET /ui/dlq`.
pub async fn inbox(
    State(state): State<Arc<UiState>>,
    session: Session,
    Query(q): Query<InboxQuery>,
) -> UiResult {
    let pick = |s: &Option<String>| s.as_deref().filter(|s| !s.is_empty()).map(String::from);
    let filter = dead_letters::Filter {
        tenant: session.caller.scope().map(String::from),
        kind: pick(&q.kind),
        class: pick(&q.class),
        ..Default::default()
    };
    let pool = &state.api.pool;
    let groups = dead_letters::stats(pool, &filter).await?;
    let items = console::inbox(pool, &filter, ITEMS).await?;

    let mut body = String::from("<h1>Dead letters</h1>");
    if filter.class.is_some() || filter.kind.is_some() {
        body.push_str(&format!(
            "<p>Showing {} {} · <a href=\"/ui/dlq\">show all</a></p>",
            esc(filter.class.as_deref().unwrap_or("any class")),
            esc(filter.kind.as_deref().unwrap_or("")),
        ));
    }
    if groups.is_empty() {
        body.push_str("<p class=\"muted\">The inbox is empty: no open dead letters.</p>");
    }
    if items.len() as i64 == ITEMS {
        body.push_str(&format!(
            "<p class=\"muted\">Showing the newest {ITEMS} dead letters; filter by class or use \
             <code>agentq dlq</code> for bulk actions.</p>"
        ));
    }
    for g in &groups {
        body.push_str(&format!(
            "<section class=\"group\"><h2>{} <a href=\"/ui/dlq?class={}&amp;kind={}\">{}</a> \
             <span class=\"muted\">× {}</span></h2>\
             <p class=\"mono\">{}</p><p class=\"muted\">oldest {} · newest {}</p>",
            badge(&g.class),
            url(&g.class),
            url(g.kind.as_deref().unwrap_or("")),
            esc(g.kind.as_deref().unwrap_or("(no kind)")),
            g.count,
            esc(&g.fingerprint),
            time(g.oldest),
            time(g.newest),
        ));
        body.push_str(
            "<table><thead><tr><th>dead letter</th><th>operation</th><th>tenant</th>\
             <th class=\"num\">attempts</th><th class=\"num\">step</th><th>died</th><th>reason</th>\
             <th>act</th></tr></thead><tbody>",
        );
        for it in items
            .iter()
            .filter(|i| i.fingerprint == g.fingerprint && i.dead_letter.class == g.class)
            .filter(|i| i.dead_letter.kind == g.kind)
        {
            body.push_str(&item_row(&session, &it.dead_letter));
        }
        body.push_str("</tbody></table></section>");
    }
    Ok(html::page(&session, "Dead letters", "/ui/dlq", &body))
}

fn item_row(session: &Session, d: &dead_letters::DeadLetterView) -> String {
    let c = csrf(session);
    let id = d.id;
    let mut actions = String::from("<div class=\"actions\">");
    if d.class == "unknown_side_effect" {
        actions.push_str(&format!(
            "<details><summary>Resolve</summary>\
             <form method=\"post\" action=\"/ui/dlq/{id}/resolve\">{c}\
             <label><input type=\"radio\" name=\"happened\" value=\"true\" required> it happened; \
             its output (JSON):</label><textarea name=\"output\" placeholder=\"null\"></textarea>\
             <label><input type=\"radio\" name=\"happened\" value=\"false\"> it did not happen (run \
             it again)</label><br><input name=\"reason\" placeholder=\"reason (optional)\">\
             <button type=\"submit\" data-action=\"resolve\">Resolve</button></form></details>"
        ));
    } else if d.op_id.is_some() {
        actions.push_str(&format!(
            "<form method=\"post\" action=\"/ui/dlq/{id}/retry\" class=\"inline\">{c}\
             <button type=\"submit\" data-action=\"retry\">Retry</button></form>\
             <details><summary>Patch &amp; retry</summary>\
             <form method=\"post\" action=\"/ui/dlq/{id}/retry\">{c}\
             <label>JSON merge patch (RFC 7386) of the input\
             <textarea name=\"patch_input\" required placeholder='{{\"field\": \"new value\"}}'>\
             </textarea></label><input name=\"reason\" placeholder=\"reason (optional)\">\
             <button type=\"submit\" data-action=\"patch-retry\">Patch and retry</button></form>\
             </details>"
        ));
    }
    actions.push_str(&format!(
        "<details><summary>Discard</summary>\
         <form method=\"post\" action=\"/ui/dlq/{id}/discard\">{c}\
         <input name=\"reason\" required placeholder=\"why (required, audited)\">\
         <button type=\"submit\" class=\"danger\" data-action=\"discard\">Discard</button></form>\
         </details></div>"
    ));
    let reason: String = d.reason.chars().take(300).collect();
    format!(
        "<tr data-op=\"{}\"><td class=\"mono\">{}</td><td>{}</td><td>{}</td>\
         <td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td>\
         <td class=\"error-text\">{}</td><td>{actions}</td></tr>",
        d.op_id.map(|o| o.to_string()).unwrap_or_default(),
        &id.to_string()[..8],
        d.op_id
            .map(|o| format!("<a class=\"mono\" href=\"/ui/operations/{o}\">{o}</a>"))
            .unwrap_or_else(|| "broker message".into()),
        esc(d.tenant.as_deref().unwrap_or("")),
        d.attempts,
        d.failed_step.map(|s| s.to_string()).unwrap_or_default(),
        time(d.created_at),
        esc(&reason),
    )
}

/// The dead letter `id` as the session may see it (another tenant's is "not found").
async fn visible(
    state: &UiState,
    session: &Session,
    id: &str,
) -> UiResult<dead_letters::DeadLetterView> {
    let id = Uuid::parse_str(id).map_err(|_| UiError::not_found(format!("no dead letter {id}")))?;
    dead_letters::find_dead_letter(&state.api.pool, id, session.caller.scope())
        .await?
        .ok_or_else(|| UiError::not_found(format!("no dead letter {id}")))
}

fn reason_of(fields: &Fields) -> Option<String> {
    filled(fields, "reason").map(str::to_string)
}

/// Runs `action` through the CLI's implementation and leaves its outcome for the next page.
async fn act(
    state: &UiState,
    session: &Session,
    d: &dead_letters::DeadLetterView,
    action: Action,
    reason: Option<String>,
    done: &str,
) -> UiResult<Response> {
    let actor = Actor {
        name: session.actor(),
        reason,
    };
    let message = match crate::dlq::act_one(
        &state.api.pool,
        &state.api.dispatcher,
        d.id,
        &action,
        &actor,
    )
    .await
    {
        Ok(Some(op)) => format!(
            "{done} dead letter {}: operation {op} is queued again",
            d.id
        ),
        Ok(None) => format!("{done} dead letter {}", d.id),
        Err(ActionError::Db(e)) => return Err(e.into()),
        Err(refused) => format!("refused: {refused}"),
    };
    state.sessions.flash(&session.id, message);
    Ok(Redirect::to("/ui/dlq").into_response())
}

fn refuse(state: &UiState, session: &Session, message: String) -> UiResult<Response> {
    state
        .sessions
        .flash(&session.id, format!("refused: {message}"));
    Ok(Redirect::to("/ui/dlq").into_response())
}

/// `POST /ui/dlq/{id}/retry`, with an optional `patch_input` (an RFC 7386 merge patch).
pub async fn retry(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let d = visible(&state, &session, &id).await?;
    let patch = filled(&fields, "patch_input");
    let input = match patch {
        None => None,
        Some(text) => {
            let patch: Value = match serde_json::from_str(text) {
                Ok(v) => v,
                Err(e) => {
                    return refuse(&state, &session, format!("the patch is not JSON: {e}"));
                }
            };
            match crate::dlq::patched_input(&state.api.pool, d.id, &patch).await {
                Ok(v) => Some(v),
                Err(e) => return refuse(&state, &session, e.to_string()),
            }
        }
    };
    act(
        &state,
        &session,
        &d,
        Action::Retry { input },
        reason_of(&fields),
        "retried",
    )
    .await
}

/// `POST /ui/dlq/{id}/resolve`: `happened` (`true`/`false`) and, if it happened, the output.
pub async fn resolve(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let d = visible(&state, &session, &id).await?;
    let output = filled(&fields, "output");
    let outcome = match fields.get("happened").map(String::as_str) {
        Some("true") => match output.map(serde_json::from_str::<Value>).transpose() {
            Ok(v) => Outcome::Happened(v.unwrap_or(Value::Null)),
            Err(e) => return refuse(&state, &session, format!("the output is not JSON: {e}")),
        },
        Some("false") if output.is_none() => Outcome::DidNotHappen,
        Some("false") => {
            return refuse(
                &state,
                &session,
                "an output is the result of a step that happened; clear it or choose \"it happened\""
                    .into(),
            );
        }
        _ => {
            return refuse(&state, &session, "say whether the step happened".into());
        }
    };
    act(
        &state,
        &session,
        &d,
        Action::Resolve(outcome),
        reason_of(&fields),
        "resolved",
    )
    .await
}

/// `POST /ui/dlq/{id}/discard`: the reason is required and kept in the audit trail.
pub async fn discard(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let d = visible(&state, &session, &id).await?;
    let Some(reason) = reason_of(&fields) else {
        return refuse(
            &state,
            &session,
            "discarding needs a reason: it is kept in the audit trail".into(),
        );
    };
    act(
        &state,
        &session,
        &d,
        Action::Discard,
        Some(reason),
        "discarded",
    )
    .await
}
