//! The console's Pauses page (`/ui/pauses`): the pauses in force, each with a Resume form, and
//! a form to pause a kind, a tenant, a lane, a schedule or everything (with a preview that
//! counts what it would hold); and the pause / resume forms of one operation's page. All
//! through `agentq_app::pauses`, the flows of `agentq pause` / `resume` / `pauses` and
//! `/v1/pauses`, each form with the session's CSRF token.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::page::MAX_PAGE;
use agentq_app::pauses::{PauseView, Target};
use agentq_core::operation::Lane;
use axum::extract::{Path, State};
use maud::{Markup, html};
use uuid::Uuid;

use super::form::{FormPost, parse_id};
use super::html::{self, time};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/pauses`.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let page = app::pauses::list(&state.api.app, &session.caller, None, None, MAX_PAGE).await?;
    let rows = page.items;
    let body = html! {
        h1 { "Pauses" }
        p class="muted" {
            "A paused operation is not started; a running one stops at its next step boundary "
            "and waits in the queue with its journal. Resuming dispatches what the pause held."
        }
        @if rows.is_empty() {
            p class="muted" { "No pauses in force." }
        } @else {
            @if page.next_cursor.is_some() {
                p class="muted" {
                    "The oldest " (rows.len()) " pauses in force; `agentq pauses` lists them all."
                }
            }
            table {
                thead { tr {
                    th { "holds" } th { "reason" } th { "by" } th { "since (UTC)" }
                    th { "control" }
                } }
                tbody { @for p in &rows { (row(&session, p)) } }
            }
        }
        h2 { "Pause" }
        (new_pause(&session))
    };
    Ok(html::page(&session, "Pauses", "/ui/pauses", body))
}

fn row(session: &Session, p: &PauseView) -> Markup {
    let id = p.pause_id;
    html! {
        tr data-pause=(id) {
            td {
                (p.describe())
                @if let Some(op) = p.scope.op_id {
                    " " a class="mono" href={ "/ui/operations/" (op) } { "open" }
                }
            }
            td { (p.reason) }
            td { (p.paused_by) }
            td class="mono" { (time(p.paused_at)) }
            td {
                (html::form(session, &format!("/ui/pauses/{id}/resume"), Some("inline"), html! {
                    (html::reason_field())
                    button type="submit" data-action="resume" { "Resume" }
                }))
            }
        }
    }
}

/// The form that pauses a scope: each field filled narrows it; none, with "everything", is
/// everything the session may pause.
fn new_pause(session: &Session) -> Markup {
    html::form(
        session,
        "/ui/pauses",
        None,
        html! {
            div class="actions" {
                input name="kind" placeholder="kind";
                input name="tenant" placeholder="tenant";
                select name="lane" {
                    option value="" { "any lane" }
                    option value="interactive" { "interactive" }
                    option value="batch" { "batch" }
                }
                input name="schedule" placeholder="schedule (id or name)";
                label { input type="checkbox" name="everything" value="1"; " everything (drain mode)" }
            }
            div class="actions" {
                input name="reason" placeholder="reason (required)" required;
                button type="submit" name="dry_run" value="1" data-action="preview" { "Preview" }
                button type="submit" class="danger" data-action="pause" { "Pause" }
            }
        },
    )
}

/// `POST /ui/pauses`: `agentq pause` with the form's filters (a preview with `dry_run`).
pub async fn create(State(state): State<Arc<UiState>>, post: FormPost) -> UiResult {
    let outcome = match target_of(&post) {
        Ok(target) => pause(&state, &post, &target).await,
        Err(refused) => Err(refused),
    };
    post.done(&state, outcome, "/ui/pauses")
}

/// `POST /ui/pauses/{id}/resume`: `agentq resume --pause ID`.
pub async fn resume(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let id = parse_id(&id, "pause")?;
    let outcome = app::pauses::resume(&state.api.app, post.caller(), id, post.filled("reason"))
        .await
        .map(|r| r.summary());
    post.done(&state, outcome, "/ui/pauses")
}

/// `POST /ui/operations/{id}/pause`: `agentq pause OP`.
pub async fn pause_operation(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let target = operation(&id)?;
    let outcome = pause(&state, &post, &target).await;
    post.done(&state, outcome, "/ui/pauses")
}

/// `POST /ui/operations/{id}/resume`: `agentq resume OP`.
pub async fn resume_operation(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let target = operation(&id)?;
    let outcome = app::pauses::resume_target(
        &state.api.app,
        post.caller(),
        &target,
        post.filled("reason"),
    )
    .await
    .map(|r| r.summary());
    post.done(&state, outcome, "/ui/pauses")
}

/// The pause and resume forms of operation `op`'s page: Resume when a pause of that operation
/// holds it, a link to the pause when a wider one does, else Pause for an unfinished one.
pub fn operation_forms(
    session: &Session,
    op: Uuid,
    holding: Option<&PauseView>,
    finished: bool,
    next: &str,
) -> Markup {
    let form = |action: &str, fields| html::operation_form(session, op, action, next, fields);
    match holding {
        Some(p) if p.scope.op_id == Some(op) => html! {
            div class="actions" {
                (form("resume", html! {
                    (html::reason_field())
                    button type="submit" data-action="resume" { "Resume" }
                }))
            }
        },
        Some(p) => html! {
            p class="muted" {
                "Held by the pause of " (p.describe()) ": lift it on the "
                a href="/ui/pauses" { "Pauses" } " page."
            }
        },
        None if finished => html! {},
        None => html! {
            div class="actions" {
                (form("pause", html! {
                    input name="reason" placeholder="reason (required)" required;
                    button type="submit" class="danger" data-action="pause" { "Pause" }
                }))
            }
        },
    }
}

async fn pause(state: &UiState, post: &FormPost, target: &Target) -> app::Result<String> {
    let reason = post.filled("reason").unwrap_or_default();
    let dry_run = post.filled("dry_run").is_some();
    app::pauses::pause(&state.api.app, post.caller(), target, reason, dry_run)
        .await
        .map(|p| p.summary())
}

fn operation(id: &str) -> UiResult<Target> {
    Ok(Target {
        op_id: Some(parse_id(id, "operation")?),
        ..Target::default()
    })
}

/// The scope the Pause form names (a schedule by its id or its name); a malformed lane is
/// refused.
fn target_of(post: &FormPost) -> app::Result<Target> {
    let lane = post
        .filled("lane")
        .map(|l| {
            l.parse::<Lane>()
                .map_err(|e| app::AppError::invalid("lane", e))
        })
        .transpose()?;
    Ok(Target {
        op_id: None,
        tenant: post.filled("tenant").map(str::to_string),
        kind: post.filled("kind").map(str::to_string),
        lane,
        schedule: post.filled("schedule").map(str::to_string),
        everything: post.filled("everything").is_some(),
    })
}
