//! The console's Batches page (`GET /ui/batches`, through `agentq_app::console::batches`):
//! the newest batches with their progress, and the pause / resume / cancel forms and actions
//! of `agentq batch` (`agentq_app::batches`).

use std::sync::Arc;

use agentq_app as app;
use agentq_app::console::BatchRow;
use axum::extract::{Path, State};
use maud::{Markup, html};

use super::form::{FormPost, parse_id};
use super::html::{self, badge, reason_field, short, time};
use super::session::Session;
use super::{UiResult, UiState};

/// Most batches listed.
const LIMIT: i64 = 100;

/// `GET /ui/batches`: the newest batches with progress and pause / resume.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let rows = app::console::batches(&state.api.app, &session.caller, LIMIT).await?;
    let body = html! {
        h1 { "Batches" }
        @if rows.is_empty() {
            p class="muted" {
                "No batches. Start one with " code { "agentq batch start" } "."
            }
        } @else {
            table {
                thead { tr {
                    th { "batch" } th { "tenant" } th { "kind" } th { "status" } th { "progress" }
                    th class="num" { "succeeded" } th class="num" { "failed" }
                    th class="num" { "unfinished" } th { "created" } th { "control" }
                } }
                tbody { @for b in &rows { (row(&session, b)) } }
            }
        }
    };
    Ok(html::page(&session, "Batches", "/ui/batches", body))
}

fn row(session: &Session, b: &BatchRow) -> Markup {
    let total = i64::from(b.documents).max(b.enqueued).max(1);
    let done = b.succeeded + b.failed;
    let form = |action: &str, fields: Markup| {
        let action = format!("/ui/batches/{}/{action}", b.id);
        html::form(session, &action, Some("inline"), fields)
    };
    let pause = form(
        "pause",
        html! {
            (reason_field())
            button type="submit" class="danger" data-action="pause" { "Pause" }
        },
    );
    let resume = form(
        "resume",
        html! { button type="submit" data-action="resume" { "Resume" } },
    );
    let cancel = form(
        "cancel",
        html! {
            (reason_field())
            button type="submit" class="danger" data-action="cancel" { "Cancel" }
        },
    );
    // The controls `agentq batch pause` / `resume` / `cancel` allow in each state.
    let control = match b.status.as_str() {
        "running" => html! { (pause) (cancel) },
        "canary" => html! { (pause) (resume) (cancel) },
        "paused" => html! { (resume) (cancel) },
        _ => html! {},
    };
    html! {
        tr data-batch=(b.id) {
            td { a class="mono" href={ "/ui/operations?batch=" (b.id) } { (short(b.id)) } }
            td { (b.tenant_id) }
            td { (b.kind) }
            td {
                (badge(b.status.as_str()))
                @if let Some(r) = &b.paused_reason { div class="muted" { (r) } }
            }
            td { progress value=(done) max=(total) {} " " (done) "/" (total) }
            td class="num" { (b.succeeded) }
            td class="num" { (b.failed) }
            td class="num" { (b.unfinished) }
            td { (time(b.created_at)) }
            td { (control) }
        }
    }
}

/// `POST /ui/batches/{id}/pause`: `agentq batch pause`, through the application layer.
pub async fn pause(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let id = parse_id(&id, "batch")?;
    let outcome = app::batches::pause(&state.api.app, post.caller(), id, post.filled("reason"))
        .await
        .map(|()| {
            format!(
                "paused batch {id}: nothing new starts; running operations finish their current run"
            )
        });
    post.done(&state, outcome, "/ui/batches")
}

/// `POST /ui/batches/{id}/resume`: `agentq batch resume` (a paused batch, or the rest of a
/// canary), through the application layer.
pub async fn resume(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let id = parse_id(&id, "batch")?;
    let outcome = app::batches::resume(&state.api.app, post.caller(), id, &app::batches::Quiet)
        .await
        .map(|r| {
            format!(
                "resumed batch {id} (was {}): {} enqueued, {} queued operations re-dispatched",
                r.was, r.enqueued, r.redispatched
            )
        });
    post.done(&state, outcome, "/ui/batches")
}

/// `POST /ui/batches/{id}/cancel`: `agentq batch cancel`, through the application layer.
pub async fn cancel(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let id = parse_id(&id, "batch")?;
    let outcome = app::batches::cancel(&state.api.app, post.caller(), id, post.filled("reason"))
        .await
        .map(|c| {
            format!(
                "cancelled batch {id}: {} operations cancelled, {} running ones stop at their \
                 next step",
                c.now, c.requested
            )
        });
    post.done(&state, outcome, "/ui/batches")
}
