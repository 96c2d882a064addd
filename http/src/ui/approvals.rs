//! The console's pending approvals (`GET /ui/approvals`, through
//! `agentq_app::console::approvals`), each with what it asks to decide (the agent's tool call
//! and its arguments, redacted, and the model's text), and the approve / reject forms and actions, the approval
//! convention of `agentq approve` / `reject` (`agentq_app::operations::decide`).

use std::sync::Arc;

use agentq_app as app;
use agentq_core::OperationId;
use axum::extract::{Path, State};
use maud::{Markup, html};
use uuid::Uuid;

use super::form::{FormPost, parse_id};
use super::html::{self, reason_field, time};
use super::session::Session;
use super::{UiResult, UiState};

/// Most pending approvals listed.
const LIMIT: i64 = 200;

/// `GET /ui/approvals`: operations waiting for an `approval` signal.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let rows = app::console::approvals(&state.api.app, &session.caller, LIMIT).await?;
    let body = html! {
        h1 { "Pending approvals" }
        @if rows.is_empty() {
            p class="muted" { "Nothing waits for an approval." }
        } @else {
            table {
                thead { tr {
                    th { "operation" } th { "tenant" } th { "kind" } th { "waiting since" }
                    th { "to decide" } th { "decide" }
                } }
                tbody {
                    @for a in &rows {
                        @let r = &a.summary;
                        tr data-op=(r.op_id) {
                            td { a class="mono" href={ "/ui/operations/" (r.op_id) } { (r.op_id) } }
                            td { (r.tenant) }
                            td { (r.kind) }
                            td { (time(r.updated_at)) }
                            td { (pending(a.pending.as_ref())) }
                            td { (approval_forms(&session, r.op_id, "/ui/approvals")) }
                        }
                    }
                }
            }
        }
    };
    Ok(html::page(&session, "Approvals", "/ui/approvals", body))
}

/// What a waiting operation asks a person to decide (`agentq_app::decision::Pending`,
/// redacted there): the agent's tool call (tool, arguments, the model's text), or what the job
/// said it needs, and when the wait times out.
pub(super) fn pending(p: Option<&app::decision::Pending>) -> Markup {
    let Some(p) = p else {
        return html! { span class="muted" { "(its wait is not recorded yet)" } };
    };
    html! {
        div class="pending" data-signal=(p.signal) {
            @if let Some(call) = &p.tool_call {
                div { "call " strong class="mono" data-tool=(call.tool) { (call.tool) } }
                (html::json_block(&call.arguments))
                @if !call.text.is_empty() {
                    blockquote class="model-text" { (call.text) }
                }
            } @else if let Some(about) = &p.about {
                div { "signal " span class="mono" { (p.signal) } }
                (html::json_block(about))
            } @else {
                div { "signal " span class="mono" { (p.signal) } " (the job said nothing more)" }
            }
            div class="meta" { "times out " (time(p.timeout_at)) }
        }
    }
}

/// The approve and reject forms of an operation waiting for an approval; after the action the
/// browser goes to `next`.
pub(super) fn approval_forms(session: &Session, op: Uuid, next: &str) -> Markup {
    let form = |action: &str, button: Markup| {
        let fields = html! { (reason_field()) (button) };
        html::operation_form(session, op, action, next, fields)
    };
    html! {
        div class="actions" {
            (form("approve", html! {
                button type="submit" data-action="approve" { "Approve" }
            }))
            (form("reject", html! {
                button type="submit" class="danger" data-action="reject" { "Reject" }
            }))
        }
    }
}

/// `POST /ui/operations/{id}/approve`.
pub async fn approve(state: State<Arc<UiState>>, id: Path<String>, post: FormPost) -> UiResult {
    decide(state, id, post, true).await
}

/// `POST /ui/operations/{id}/reject`.
pub async fn reject(state: State<Arc<UiState>>, id: Path<String>, post: FormPost) -> UiResult {
    decide(state, id, post, false).await
}

/// The approval convention of `agentq approve` / `reject`, through the application layer.
async fn decide(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
    approved: bool,
) -> UiResult {
    let op = OperationId(parse_id(&id, "operation")?);
    let verb = if approved { "approved" } else { "rejected" };
    let reason = post.filled("reason");
    let outcome = app::operations::decide(&state.api.app, post.caller(), op, approved, reason)
        .await
        .map(|sent| match sent {
            app::operations::Signalled::Delivered => format!("{verb} {op}: it resumes now"),
            app::operations::Signalled::Kept { status, .. } => {
                format!("{verb} {op}: it is {status}; the decision is kept for its wait")
            }
        });
    post.done(&state, outcome, "/ui/approvals")
}
