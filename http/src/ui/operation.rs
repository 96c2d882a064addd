//! One operation's console page (`/ui/operations/{id}`): its row, what it waits for (the
//! agent's pending tool call, or what the job needs), why it is not running
//! (`agentq_app::why`, the answer of `agentq why`), its children, its payloads (each view
//! audited), its journal as a timeline, its events and its audit trail; and the signal and
//! cancel forms of an unfinished one, through
//! `agentq_app::operations` (the flows of `agentq signal` / `cancel`), and its pause or resume
//! form (`agentq_app::pauses`).

use std::sync::Arc;

use agentq_app as app;
use agentq_app::console::{self, ActionView};
use agentq_core::OperationId;
use axum::extract::{Path, State};
use maud::{Markup, html};
use uuid::Uuid;

use super::approvals::{approval_forms, pending};
use super::form::{FormPost, parse_id};
use super::html::{self, badge, reason_field, secs, short, time};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/operations/{id}`: the operation, what it waits for, its payloads (the console's
/// sessions are operators': shown, each view audited as `reveal_payloads`), its journal as a
/// timeline, its events and audit trail.
pub async fn show(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
) -> UiResult {
    page(&state, &session, &id).await
}

/// `POST /ui/operations/{id}/reveal`: the same page (kept for forms of earlier pages).
pub async fn reveal(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    page(&state, &post.session, &id).await
}

async fn page(state: &UiState, session: &Session, id: &str) -> UiResult {
    let op_id = parse_id(id, "operation")?;
    let o =
        app::console::operation(&state.api.app, &session.caller, OperationId(op_id), true).await?;
    // What it does now, or the one gate that holds it: the answer of `agentq why`.
    let why = app::why::why(&state.api.app, &session.caller, OperationId(op_id)).await?;
    let holding = app::pauses::holding(&state.api.app, OperationId(op_id)).await?;
    let budgets =
        app::budgets::over_operation(&state.api.app, &session.caller, OperationId(op_id)).await?;
    let op = &o.operation;
    let path = format!("/ui/operations/{op_id}");
    let body = html! {
        h1 { "Operation " span class="mono" { (op_id) } " " (badge(op.status.as_str())) }
        dl class="kv" {
            dt { "tenant" } dd { (op.tenant) }
            dt { "kind" } dd { (op.kind) }
            dt { "version" }
            dd {
                @match (&op.kind_version, op.version_parked) {
                    (None, _) => "not run yet (its first claim pins the newest live version)",
                    (Some(v), false) => (v),
                    (Some(v), true) => {
                        (v) " "
                        span class="muted" {
                            "(waiting for a worker that runs it: "
                            a href="/ui/versions" { "versions" } ")"
                        }
                    }
                }
            }
            dt { "lane" } dd { (op.lane.as_str()) }
            dt { "attempt" }
            dd { (op.attempt) " of " (op.max_attempts) " (restarts " (op.restarts) ")" }
            dt { "created" } dd { (time(op.created_at)) }
            dt { "updated" } dd { (time(op.updated_at)) }
            dt { "finished" } dd { (op.finished_at.map(time).unwrap_or_else(|| "–".into())) }
            @if let Some(w) = &op.waiting_for {
                dt { "waiting for" }
                dd {
                    @if w == app::budgets::WAITING_FOR { "a token budget (see below)" }
                    @else if let Some((scope, limit, at)) = app::rate_limits::parse_waiting_for(w) {
                        "rate limit " (scope) " " span class="mono" { (limit) }
                        ", whose window reopens " (time(at))
                    }
                    @else { "signal " (w) }
                }
            }
            @if let Some(p) = &o.waiting {
                dt { "to decide" } dd { (pending(Some(p))) }
            }
            @if let Some(p) = op.parent_id {
                dt { "parent" } dd { a class="mono" href={ "/ui/operations/" (p) } { (p) } }
            }
            @if let Some(k) = &op.ordering_key {
                dt { "ordering key" } dd class="mono" { (k) }
            }
            @if let (Some(k), Some(n)) = (&op.concurrency_key, op.concurrency_limit) {
                dt { "concurrency key" }
                dd { span class="mono" { (k) } " (at most " (n) " at once)" }
            }
            @if let Some(b) = op.batch_id {
                dt { "batch" } dd { a class="mono" href={ "/ui/operations?batch=" (b) } { (b) } }
            }
            @if let Some(c) = &op.error_class {
                dt { "error" }
                dd {
                    (badge(c)) " "
                    span class="error-text" { (op.error_message.as_deref().unwrap_or("")) }
                }
            }
        }
        section id="why" {
            h2 { "Why" }
            p { strong { (why.headline) } }
            @if !why.evidence.is_empty() {
                ul { @for line in &why.evidence { li { (line) } } }
            }
        }
        @if op.waiting_for.as_deref() == Some("approval") && op.status.as_str() == "waiting" {
            (approval_forms(session, op_id, &path))
        }
        (super::budgets::section(
            session,
            op_id,
            &budgets,
            op.status.is_terminal(),
            &path,
        ))
        (super::pauses::operation_forms(
            session,
            op_id,
            holding.as_ref(),
            op.status.is_terminal(),
            &path,
        ))
        @if !op.status.is_terminal() {
            (control_forms(session, op_id, &path))
        }
        @if op.status.as_str() == "dead" {
            p { a href="/ui/dlq" { "This operation is dead: act on it in the dead-letter inbox" } }
        }
        (children(op_id, &o.children, o.more_children))
        h2 { "Payloads" }
        @match &o.payloads {
            Some(p) => {
                p class="muted" {
                    "Shown to you as an operator; each view is recorded in the audit trail."
                }
                h3 { "input" }
                (html::json_block(&p.input))
                @if let Some(r) = &p.result {
                    h3 { "result" }
                    (html::json_block(r))
                }
            }
            None => p class="muted" { "Not found." }
        }
        (journal(op_id, &o, o.payloads.is_some()))
        h2 { "Events" }
        table {
            thead { tr { th class="num" { "#" } th { "at" } th { "type" } th { "what" } } }
            tbody {
                @for e in &o.events {
                    tr {
                        td class="num" { (e.seq) }
                        td { (e.at.format("%H:%M:%S%.3f")) }
                        td { (e.kind) }
                        td class="mono" { (e.data) }
                    }
                }
            }
        }
        (audit_table(&o.actions))
    };
    Ok(html::page(session, "Operation", "/ui/operations", body))
}

/// Its children, grandchildren…: depth first, in the order they were spawned.
fn children(op_id: Uuid, tree: &[console::Node], more: bool) -> Markup {
    if tree.is_empty() {
        return html! {};
    }
    html! {
        h2 { "Children" }
        p { a href={ "/ui/operations?parent=" (op_id) } { "List its children" } }
        ul class="tree" {
            @for n in tree {
                li style={ "margin-left:" ((n.depth - 1) * 2) "em" } {
                    a class="mono" href={ "/ui/operations/" (n.id) } { (short(n.id)) }
                    " " (n.kind) " " (badge(n.status.as_str()))
                    @if let Some(c) = &n.error_class { " " (badge(c)) }
                }
            }
        }
        @if more {
            p class="muted" { "The first " (console::CHILDREN) " are shown." }
        }
    }
}

/// The journal as a timeline; step outputs only when `revealed`.
fn journal(op_id: Uuid, o: &console::Operation, revealed: bool) -> Markup {
    html! {
        h2 { "Journal" }
        @if o.steps.is_empty() {
            p class="muted" { "No steps yet." }
        } @else {
            ol class="timeline" {
                @for s in &o.steps {
                    @let took = s
                        .completed_at
                        .map(|c| secs((c - s.started_at).num_milliseconds() as f64 / 1000.0))
                        .unwrap_or_else(|| "–".into());
                    li class=(s.status.as_str()) {
                        strong { "#" (s.seq) " " (s.name) }
                        " " span class="muted" { (s.kind.as_str()) " · " (s.replay.as_str()) }
                        " " (badge(s.status.as_str()))
                        @if s.reconciled() { " " (badge("reconciled")) }
                        div class="meta" {
                            "started " (time(s.started_at)) " · took " (took) " · epoch " (s.epoch)
                            @if let Some(w) = s.wake_at { " · wakes/times out " (time(w)) }
                        }
                        @if let Some(e) = &s.error { div class="error-text" { (e) } }
                        @if let (false, Some(u)) = (s.reconciled(), &s.usage) {
                            div class="meta" { "usage " (u) }
                        }
                        @if let (true, Some(out)) = (revealed, &s.output) {
                            (html::json_block(out))
                        } @else if s.output.is_some() {
                            div class="meta" { "output hidden" }
                        }
                    }
                }
            }
            @if o.more_steps {
                p class="muted" {
                    "The journal goes on after step #" (o.steps.last().map_or(0, |s| s.seq))
                    ": read all of it with " code { "agentq steps " (op_id) } " or "
                    code { "GET /v1/operations/" (op_id) "/steps" } " (pages, with "
                    code { "after" } ")."
                }
            }
        }
    }
}

fn audit_table(actions: &[ActionView]) -> Markup {
    html! {
        h2 { "Operator actions" }
        @if actions.is_empty() {
            p class="muted" { "None." }
        } @else {
            table {
                thead { tr {
                    th { "at" } th { "actor" } th { "action" } th { "before → after" }
                    th { "reason" }
                } }
                tbody {
                    @for a in actions {
                        tr {
                            td { (time(a.created_at)) }
                            td { (a.actor) }
                            td { (a.action) }
                            td {
                                (a.status_before.as_deref().unwrap_or("")) " → "
                                (a.status_after.as_deref().unwrap_or(""))
                            }
                            td { (a.reason.as_deref().unwrap_or("")) }
                        }
                    }
                }
            }
        }
    }
}

/// The signal and cancel forms of an unfinished operation (`agentq signal` / `cancel`).
fn control_forms(session: &Session, op: Uuid, next: &str) -> Markup {
    let form = |action: &str, fields| html::operation_form(session, op, action, next, fields);
    html! {
        div class="actions" {
            (form("signal", html! {
                input name="name" placeholder="signal name" required;
                input name="payload" placeholder="payload (JSON, optional)";
                button type="submit" data-action="signal" { "Send signal" }
            }))
            (form("cancel", html! {
                (reason_field())
                button type="submit" class="danger" data-action="cancel" { "Cancel" }
            }))
        }
    }
}

/// `POST /ui/operations/{id}/signal`: `agentq signal`, through the application layer.
pub async fn signal(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let op = OperationId(parse_id(&id, "operation")?);
    let name = post.filled("name").unwrap_or_default();
    let outcome = match post
        .filled("payload")
        .map(serde_json::from_str::<serde_json::Value>)
    {
        Some(Err(e)) => Err(app::AppError::invalid(
            "payload",
            format!("the payload is not JSON: {e}"),
        )),
        payload => {
            let payload = payload.and_then(Result::ok).unwrap_or_default();
            let audit = app::operations::Audit {
                action: "signal",
                reason: None,
            };
            app::operations::signal(&state.api.app, post.caller(), op, name, &payload, audit)
                .await
                .map(|sent| format!("signal {name:?} {} for {op}", sent.as_str()))
        }
    };
    post.done(&state, outcome, "/ui/operations")
}

/// `POST /ui/operations/{id}/cancel`: `agentq cancel`, through the application layer.
pub async fn cancel(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let op = OperationId(parse_id(&id, "operation")?);
    let outcome = app::operations::cancel(&state.api.app, post.caller(), op, post.filled("reason"))
        .await
        .map(|done| match done {
            app::operations::Cancelled::Now => format!("cancelled {op}"),
            app::operations::Cancelled::Requested => {
                format!("cancel requested for {op}: its worker stops it at the next step")
            }
        });
    post.done(&state, outcome, "/ui/operations")
}
