//! The console's Schedules page: every schedule the session may see with how it fires, its
//! next firings and counts, and pause / resume / delete through `agentq_app::schedules` (the
//! same flows as `agentq schedules` and `/v1/schedules`), each form with the session's CSRF
//! token. A route's `{id}` is a schedule's id or its name.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::schedules::Control;
use axum::extract::{Path, State};
use maud::{Markup, html};

use super::form::FormPost;
use super::html::{self, badge, time};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/schedules`.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let rows = app::schedules::list(&state.api.app, &session.caller, None).await?;
    let body = html! {
        h1 { "Schedules" }
        @if rows.is_empty() {
            p class="muted" {
                "No schedules. Add one with " code { "agentq schedules add" } " or "
                code { "POST /v1/schedules" } "."
            }
        } @else {
            table {
                thead { tr {
                    th { "name" } th { "tenant" } th { "kind" } th { "when" } th { "overlap" }
                    th { "status" } th { "next firings (UTC)" } th { "last firing" }
                    th class="num" { "fired" } th class="num" { "skipped" }
                    th class="num" { "missed" } th class="num" { "at cap" } th { "control" }
                } }
                tbody { @for v in &rows { (row(&session, v)) } }
            }
        }
    };
    Ok(html::page(&session, "Schedules", "/ui/schedules", body))
}

fn row(session: &Session, v: &app::schedules::ScheduleView) -> Markup {
    let s = &v.schedule;
    let id = s.schedule_id;
    let form = |action: &str, label: &str, class: Option<&str>| {
        html::form(
            session,
            &format!("/ui/schedules/{id}/{action}"),
            Some("inline"),
            html! { button type="submit" class=[class] data-action=(action) { (label) } },
        )
    };
    html! {
        tr data-schedule=(id) {
            td { a href={ "/ui/operations?schedule=" (id) } { (s.name) } }
            td { (s.tenant) }
            td { (s.kind) }
            td { (v.when()) }
            td { (s.overlap.as_str()) }
            td { (badge(if s.paused { "paused" } else { "active" })) }
            td {
                @if v.next_firings.is_empty() {
                    span class="muted" { "none" }
                }
                @for t in &v.next_firings { div class="mono" { (time(*t)) } }
            }
            td {
                @match (s.last_tick, s.last_op_id) {
                    (Some(t), Some(op)) => {
                        a class="mono" href={ "/ui/operations/" (op) } { (time(t)) }
                    }
                    _ => span class="muted" { "never" },
                }
            }
            td class="num" { (s.fired) }
            td class="num" { (s.skipped_overlap) }
            td class="num" { (s.skipped_missed) }
            td class="num" { (s.skipped_capacity) }
            td {
                @if s.paused {
                    (form("resume", "Resume", None))
                } @else {
                    (form("pause", "Pause", Some("danger")))
                }
                (form("delete", "Delete", Some("danger")))
            }
        }
    }
}

/// `POST /ui/schedules/{id}/pause`.
pub async fn pause(state: State<Arc<UiState>>, id: Path<String>, post: FormPost) -> UiResult {
    act(state, id, post, Control::Pause).await
}

/// `POST /ui/schedules/{id}/resume`.
pub async fn resume(state: State<Arc<UiState>>, id: Path<String>, post: FormPost) -> UiResult {
    act(state, id, post, Control::Resume).await
}

/// `POST /ui/schedules/{id}/delete`.
pub async fn delete(state: State<Arc<UiState>>, id: Path<String>, post: FormPost) -> UiResult {
    act(state, id, post, Control::Delete).await
}

async fn act(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
    what: Control,
) -> UiResult {
    let app = &state.api.app;
    let outcome = async {
        let id = app::names::resolve_schedule(app, post.caller(), &id, None).await?;
        app::schedules::control(app, post.caller(), id, what).await
    }
    .await
    .map(|v| {
        let said = match what {
            Control::Pause => ": nothing fires until it is resumed",
            Control::Resume => "",
            Control::Delete => "; its operations stay",
        };
        format!("{} schedule {}{said}", what.done(), v.schedule.name)
    });
    post.done(&state, outcome, "/ui/schedules")
}
