//! The console's Schedules page: every schedule the session may see with how it fires, its
//! next firings and counts, and pause / resume / delete through `agentq_app::schedules` (the
//! same flows as `agentq schedules` and `/v1/schedules`), each form with the session's CSRF
//! token.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::schedules::Control;
use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, State};

use super::html::{self, badge, csrf, esc, time};
use super::pages::{back, parse_uuid};
use super::session::{Fields, Session};
use super::{UiResult, UiState};

/// `GET /ui/schedules`.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let rows = app::schedules::list(&state.api.app, &session.caller.app(), None).await?;
    let mut body = String::from("<h1>Schedules</h1>");
    if rows.is_empty() {
        body.push_str(
            "<p class=\"muted\">No schedules. Add one with <code>agentq schedules add</code> or \
             <code>POST /v1/schedules</code>.</p>",
        );
        return Ok(html::page(&session, "Schedules", "/ui/schedules", &body));
    }
    body.push_str(
        "<table><thead><tr><th>name</th><th>tenant</th><th>kind</th><th>when</th>\
         <th>overlap</th><th>status</th><th>next firings (UTC)</th><th>last firing</th>\
         <th class=\"num\">fired</th><th class=\"num\">skipped</th><th class=\"num\">missed</th>\
         <th class=\"num\">at cap</th>\
         <th>control</th></tr></thead><tbody>",
    );
    let c = csrf(&session);
    for v in &rows {
        let s = &v.schedule;
        let id = s.schedule_id;
        let form = |action: &str, label: &str, class: &str| {
            format!(
                "<form method=\"post\" action=\"/ui/schedules/{id}/{action}\" class=\"inline\">{c}\
                 <button type=\"submit\"{class} data-action=\"{action}\">{label}</button></form>"
            )
        };
        let toggle = if s.paused {
            form("resume", "Resume", "")
        } else {
            form("pause", "Pause", " class=\"danger\"")
        };
        let delete = form("delete", "Delete", " class=\"danger\"");
        let next = if v.next_firings.is_empty() {
            "<span class=\"muted\">none</span>".to_string()
        } else {
            v.next_firings
                .iter()
                .map(|t| format!("<div class=\"mono\">{}</div>", time(*t)))
                .collect()
        };
        let last = match (s.last_tick, s.last_op_id) {
            (Some(t), Some(op)) => format!(
                "<a class=\"mono\" href=\"/ui/operations/{op}\">{}</a>",
                time(t)
            ),
            _ => "<span class=\"muted\">never</span>".into(),
        };
        body.push_str(&format!(
            "<tr data-schedule=\"{id}\"><td><a href=\"/ui/operations?schedule={id}\">{}</a></td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{next}</td><td>{last}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td>{toggle}{delete}</td></tr>",
            esc(&s.name),
            esc(&s.tenant),
            esc(&s.kind),
            esc(&v.when()),
            esc(s.overlap.as_str()),
            badge(if s.paused { "paused" } else { "active" }),
            s.fired,
            s.skipped_overlap,
            s.skipped_missed,
            s.skipped_capacity,
        ));
    }
    body.push_str("</tbody></table>");
    Ok(html::page(&session, "Schedules", "/ui/schedules", &body))
}

/// `POST /ui/schedules/{id}/pause`.
pub async fn pause(
    state: State<Arc<UiState>>,
    session: Session,
    id: Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    act(state, session, id, form, Control::Pause).await
}

/// `POST /ui/schedules/{id}/resume`.
pub async fn resume(
    state: State<Arc<UiState>>,
    session: Session,
    id: Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    act(state, session, id, form, Control::Resume).await
}

/// `POST /ui/schedules/{id}/delete`.
pub async fn delete(
    state: State<Arc<UiState>>,
    session: Session,
    id: Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    act(state, session, id, form, Control::Delete).await
}

async fn act(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
    what: Control,
) -> UiResult {
    let fields = session.check(form)?;
    let id = parse_uuid(&id, "schedule")?;
    let outcome = app::schedules::control(&state.api.app, &session.caller.app(), id, what)
        .await
        .map(|v| {
            let said = match what {
                Control::Pause => ": nothing fires until it is resumed",
                Control::Resume => "",
                Control::Delete => "; its operations stay",
            };
            format!("{} schedule {}{said}", what.done(), v.schedule.name)
        });
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/schedules"))
}
