//! The dead-letter inbox: open dead letters grouped by class, kind and error fingerprint
//! (`db::dead_letters::stats`), each with retry, patch-and-retry, resolve and discard: the
//! same `agentq_app::dlq::act` as `agentq dlq` and `POST /v1/dlq/{id}/…`, so the same audit rows.

use std::sync::Arc;

use agentq_app as app;
use agentq_core::db::console;
use agentq_core::db::dead_letters;
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
    fn pick(s: &Option<String>) -> Option<&str> {
        s.as_deref().filter(|s| !s.is_empty())
    }
    let query = app::dlq::Query {
        kind: pick(&q.kind),
        class: pick(&q.class),
        ..Default::default()
    };
    let caller = session.caller.app();
    let groups = app::dlq::stats(&state.api.app, &caller, query).await?;
    let filter = app::dlq::filter_for(&caller, query)?;
    let items = console::inbox(&state.api.app.pool, &filter, ITEMS).await?;

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
             </details>\
             <details><summary>Retry on a version</summary>\
             <form method=\"post\" action=\"/ui/dlq/{id}/retry\">{c}\
             <label>version of the kind (a live worker must run it; the journal is rebased where \
             it diverges)<input name=\"to_version\" required placeholder=\"2\"></label>\
             <input name=\"reason\" placeholder=\"reason (optional)\">\
             <button type=\"submit\" data-action=\"version-retry\">Retry on it</button></form>\
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
            .map(|o| {
                let parent = d.parent_id.map_or(String::new(), |p| {
                    format!(
                        "<br><span class=\"muted\">child of \
                         <a class=\"mono\" href=\"/ui/operations/{p}\">{}</a></span>",
                        &p.to_string()[..8]
                    )
                });
                format!("<a class=\"mono\" href=\"/ui/operations/{o}\">{o}</a>{parent}")
            })
            .unwrap_or_else(|| "broker message".into()),
        esc(d.tenant.as_deref().unwrap_or("")),
        d.attempts,
        d.failed_step.map(|s| s.to_string()).unwrap_or_default(),
        time(d.created_at),
        esc(&reason),
    )
}

fn reason_of(fields: &Fields) -> Option<String> {
    filled(fields, "reason").map(str::to_string)
}

/// Runs `request` through the application layer (as the CLI and the API do) and leaves its
/// outcome for the next page.
async fn act(
    state: &UiState,
    session: &Session,
    id: &str,
    request: app::dlq::Request,
    reason: Option<String>,
) -> UiResult<Response> {
    let id = Uuid::parse_str(id).map_err(|_| UiError::not_found(format!("no dead letter {id}")))?;
    let outcome = app::dlq::act(&state.api.app, &session.caller.app(), id, request, reason)
        .await
        .map(|a| match a.op_id {
            Some(op) => format!(
                "{} dead letter {}: operation {op} is queued again",
                a.done, a.id
            ),
            None => format!("{} dead letter {}", a.done, a.id),
        });
    super::flash(state, session, outcome)?;
    Ok(Redirect::to("/ui/dlq").into_response())
}

fn refuse(state: &UiState, session: &Session, message: String) -> UiResult<Response> {
    state
        .sessions
        .flash(&session.id, format!("refused: {message}"));
    Ok(Redirect::to("/ui/dlq").into_response())
}

/// `POST /ui/dlq/{id}/retry`, with an optional `patch_input` (an RFC 7386 merge patch) and an
/// optional `to_version`.
pub async fn retry(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let patch = match filled(&fields, "patch_input").map(serde_json::from_str::<Value>) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => return refuse(&state, &session, format!("the patch is not JSON: {e}")),
    };
    let to_version = filled(&fields, "to_version").map(str::to_string);
    let request = app::dlq::Request::Retry { patch, to_version };
    act(&state, &session, &id, request, reason_of(&fields)).await
}

/// `POST /ui/dlq/{id}/resolve`: `happened` (`true`/`false`) and, if it happened, the output.
pub async fn resolve(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let output = match filled(&fields, "output").map(serde_json::from_str::<Value>) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => return refuse(&state, &session, format!("the output is not JSON: {e}")),
    };
    let happened = match fields.get("happened").map(String::as_str) {
        Some("true") => true,
        Some("false") => false,
        _ => return refuse(&state, &session, "say whether the step happened".into()),
    };
    let request = app::dlq::Request::Resolve { happened, output };
    act(&state, &session, &id, request, reason_of(&fields)).await
}

/// `POST /ui/dlq/{id}/discard`: the reason is required and kept in the audit trail.
pub async fn discard(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let request = app::dlq::Request::Discard;
    act(&state, &session, &id, request, reason_of(&fields)).await
}
