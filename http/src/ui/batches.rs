//! The console's Batches page (`GET /ui/batches`, through `agentq_app::batches::list`, the
//! list `agentq batch list` and `GET /v1/batches` show): the newest batches with their
//! progress and times, and the pause / resume / cancel forms and actions of `agentq batch`
//! (`agentq_app::batches`). A route's `{id}` is a batch's id or its name.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::batches::Listed;
use axum::extract::{Path, State};
use maud::{Markup, html};
use uuid::Uuid;

use super::form::FormPost;
use super::html::{self, badge, reason_field, short, time};
use super::session::Session;
use super::{UiResult, UiState};

/// Most batches listed.
const LIMIT: i64 = 100;

/// `GET /ui/batches`: the newest batches with progress and pause / resume.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let query = app::batches::ListQuery::default();
    let rows = app::batches::list(&state.api.app, &session.caller, &query, LIMIT, None)
        .await?
        .items;
    let body = html! {
        h1 { "Batches" }
        @if rows.is_empty() {
            p class="muted" {
                "No batches. Start one with " code { "agentq batch start" } "."
            }
        } @else {
            table {
                thead { tr {
                    th { "batch" } th { "name" } th { "tenant" } th { "kind" } th { "status" }
                    th { "progress" } th class="num" { "succeeded" } th class="num" { "failed" }
                    th class="num" { "unfinished" } th { "started" } th { "finished" }
                    th { "control" }
                } }
                tbody { @for b in &rows { (row(&session, b)) } }
            }
        }
    };
    Ok(html::page(&session, "Batches", "/ui/batches", body))
}

fn row(session: &Session, b: &Listed) -> Markup {
    let total = i64::from(b.documents).max(b.enqueued).max(1);
    let done = b.succeeded + b.failed;
    let form = |action: &str, fields: Markup| {
        let action = format!("/ui/batches/{}/{action}", b.batch_id);
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
    // The controls `agentq batch pause` / `resume` / `cancel` allow in each state (a
    // completed or cancelled batch takes none).
    let control = match b.status.as_str() {
        "running" => html! { (pause) (cancel) },
        "canary" => html! { (pause) (resume) (cancel) },
        "paused" => html! { (resume) (cancel) },
        _ => html! {},
    };
    html! {
        tr data-batch=(b.batch_id) {
            td { a class="mono" href={ "/ui/operations?batch=" (b.batch_id) } { (short(b.batch_id)) } }
            td { (b.name.as_deref().unwrap_or("")) }
            td { (b.tenant) }
            td { (b.kind) }
            td {
                (badge(b.status.as_str()))
                @if let Some(r) = &b.paused_reason { div class="muted" { (r) } }
            }
            td { progress value=(done) max=(total) {} " " (done) "/" (total) }
            td class="num" { (b.succeeded) }
            td class="num" { (b.failed) }
            td class="num" { (b.unfinished) }
            td { (time(b.started_at)) }
            td { @if let Some(f) = b.finished_at { (time(f)) } }
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
    let app = &state.api.app;
    let outcome = async {
        let id = resolve(&state, &post, &id).await?;
        app::batches::pause(app, post.caller(), id, post.filled("reason")).await?;
        Ok(format!(
            "paused batch {id}: nothing new starts; running operations finish their current run"
        ))
    }
    .await;
    post.done(&state, outcome, "/ui/batches")
}

/// `POST /ui/batches/{id}/resume`: `agentq batch resume` (a paused batch, or the rest of a
/// canary), through the application layer.
pub async fn resume(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let app = &state.api.app;
    let outcome = async {
        let id = resolve(&state, &post, &id).await?;
        let r = app::batches::resume(app, post.caller(), id, &app::batches::Quiet).await?;
        Ok(format!(
            "resumed batch {id} (was {}): {} enqueued, {} queued operations re-dispatched",
            r.was, r.enqueued, r.redispatched
        ))
    }
    .await;
    post.done(&state, outcome, "/ui/batches")
}

/// `POST /ui/batches/{id}/cancel`: `agentq batch cancel`, through the application layer.
pub async fn cancel(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let app = &state.api.app;
    let outcome = async {
        let id = resolve(&state, &post, &id).await?;
        let c = app::batches::cancel(app, post.caller(), id, post.filled("reason")).await?;
        Ok(format!(
            "cancelled batch {id}: {} operations cancelled, {} running ones stop at their next \
             step",
            c.now, c.requested
        ))
    }
    .await;
    post.done(&state, outcome, "/ui/batches")
}

/// The batch a route's `{id}` names: its id, or its name in the session's tenants.
async fn resolve(state: &UiState, post: &FormPost, id: &str) -> app::Result<Uuid> {
    app::names::resolve_batch(&state.api.app, post.caller(), id, None).await
}
