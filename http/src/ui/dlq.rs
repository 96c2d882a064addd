//! The dead-letter inbox (`GET /ui/dlq`, through `agentq_app::console::inbox`): open dead
//! letters grouped by class, kind and error fingerprint, each with retry, patch-and-retry,
//! retry on a version, resolve and discard: the same `agentq_app::dlq::act` as `agentq dlq`
//! and `POST /v1/dlq/{id}/…`, so the same audit rows.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::console::DeadLetterView;
use axum::extract::{Path, Query, State};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::Value;

use super::form::{FormPost, parse_id};
use super::html::{self, badge, short, time, url};
use super::session::Session;
use super::{UiResult, UiState};

/// Most dead letters listed under the groups.
const ITEMS: i64 = 200;

/// The inbox's filters (a group's link sets both).
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
    let inbox = app::console::inbox(&state.api.app, &session.caller, query, ITEMS).await?;
    let filter = &inbox.filter;
    let body = html! {
        h1 { "Dead letters" }
        @if filter.class.is_some() || filter.kind.is_some() {
            p {
                "Showing " (filter.class.as_deref().unwrap_or("any class")) " "
                (filter.kind.as_deref().unwrap_or("")) " · " a href="/ui/dlq" { "show all" }
            }
        }
        @if inbox.groups.is_empty() {
            p class="muted" { "The inbox is empty: no open dead letters." }
        }
        @if inbox.items.len() as i64 == ITEMS {
            p class="muted" {
                "Showing the newest " (ITEMS) " dead letters; filter by class or use "
                code { "agentq dlq" } " for bulk actions."
            }
        }
        @for g in &inbox.groups {
            section class="group" {
                h2 {
                    (badge(&g.class)) " "
                    a href={
                        "/ui/dlq?class=" (url(&g.class)) "&kind=" (url(g.kind.as_deref().unwrap_or("")))
                    } { (g.kind.as_deref().unwrap_or("(no kind)")) }
                    " " span class="muted" { "× " (g.count) }
                }
                p class="mono" { (g.fingerprint) }
                p class="muted" { "oldest " (time(g.oldest)) " · newest " (time(g.newest)) }
                table {
                    thead { tr {
                        th { "dead letter" } th { "operation" } th { "tenant" }
                        th class="num" { "attempts" } th class="num" { "step" } th { "died" }
                        th { "reason" } th { "act" }
                    } }
                    tbody {
                        @for it in inbox.items.iter().filter(|i| {
                            i.fingerprint == g.fingerprint
                                && i.dead_letter.class == g.class
                                && i.dead_letter.kind == g.kind
                        }) {
                            (item_row(&session, &it.dead_letter))
                        }
                    }
                }
            }
        }
    };
    Ok(html::page(&session, "Dead letters", "/ui/dlq", body))
}

/// One dead letter with the forms of the actions it allows.
fn item_row(session: &Session, d: &DeadLetterView) -> Markup {
    let id = d.id;
    let action = |what: &str| format!("/ui/dlq/{id}/{what}");
    let reason: String = d.reason.chars().take(300).collect();
    let actions = html! {
        div class="actions" {
            @if d.class == "unknown_side_effect" {
                details {
                    summary { "Resolve" }
                    (html::form(session, &action("resolve"), None, html! {
                        label {
                            input type="radio" name="happened" value="true" required;
                            " it happened; its output (JSON):"
                        }
                        textarea name="output" placeholder="null" {}
                        label {
                            input type="radio" name="happened" value="false";
                            " it did not happen (run it again)"
                        }
                        br;
                        (html::reason_field())
                        button type="submit" data-action="resolve" { "Resolve" }
                    }))
                }
            } @else if d.op_id.is_some() {
                (html::form(session, &action("retry"), Some("inline"), html! {
                    button type="submit" data-action="retry" { "Retry" }
                }))
                details {
                    summary { "Patch & retry" }
                    (html::form(session, &action("retry"), None, html! {
                        label {
                            "JSON merge patch (RFC 7386) of the input"
                            textarea name="patch_input" required
                                placeholder="{\"field\": \"new value\"}" {}
                        }
                        (html::reason_field())
                        button type="submit" data-action="patch-retry" { "Patch and retry" }
                    }))
                }
                details {
                    summary { "Retry on a version" }
                    (html::form(session, &action("retry"), None, html! {
                        label {
                            "version of the kind (a live worker must run it; the journal is \
                             rebased where it diverges)"
                            input name="to_version" required placeholder="2";
                        }
                        (html::reason_field())
                        button type="submit" data-action="version-retry" { "Retry on it" }
                    }))
                }
            }
            details {
                summary { "Discard" }
                (html::form(session, &action("discard"), None, html! {
                    input name="reason" required placeholder="why (required, audited)";
                    button type="submit" class="danger" data-action="discard" { "Discard" }
                }))
            }
        }
    };
    html! {
        tr data-op=(d.op_id.map(|o| o.to_string()).unwrap_or_default()) {
            td class="mono" { (short(id)) }
            td {
                @match d.op_id {
                    Some(o) => {
                        a class="mono" href={ "/ui/operations/" (o) } { (o) }
                        @if let Some(p) = d.parent_id {
                            br;
                            span class="muted" {
                                "child of "
                                a class="mono" href={ "/ui/operations/" (p) } { (short(p)) }
                            }
                        }
                    }
                    None => "broker message",
                }
            }
            td { (d.tenant.as_deref().unwrap_or("")) }
            td class="num" { (d.attempts) }
            td class="num" { (d.failed_step.map(|s| s.to_string()).unwrap_or_default()) }
            td { (time(d.created_at)) }
            td class="error-text" { (reason) }
            td { (actions) }
        }
    }
}

/// Parses a JSON field (`what`: what it holds), refusing one that is not JSON.
fn json_field(post: &FormPost, name: &str, what: &str) -> app::Result<Option<Value>> {
    post.filled(name)
        .map(|raw| {
            serde_json::from_str(raw)
                .map_err(|e| app::AppError::invalid(name, format!("the {what} is not JSON: {e}")))
        })
        .transpose()
}

/// Runs `request` through the application layer (as the CLI and the API do) and leaves its
/// outcome, or why the form was refused, for the inbox.
async fn act(
    state: &UiState,
    id: &str,
    post: &FormPost,
    request: app::Result<app::dlq::Request>,
) -> UiResult {
    let outcome = match request {
        Err(refused) => Err(refused),
        Ok(request) => {
            let id = parse_id(id, "dead letter")?;
            let reason = post.filled("reason").map(str::to_string);
            app::dlq::act(&state.api.app, post.caller(), id, request, reason)
                .await
                .map(|a| match a.op_id {
                    Some(op) => format!(
                        "{} dead letter {}: operation {op} is queued again",
                        a.done, a.id
                    ),
                    None => format!("{} dead letter {}", a.done, a.id),
                })
        }
    };
    post.done(state, outcome, "/ui/dlq")
}

/// `POST /ui/dlq/{id}/retry`, with an optional `patch_input` (an RFC 7386 merge patch) and an
/// optional `to_version`.
pub async fn retry(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let request = json_field(&post, "patch_input", "patch").map(|patch| {
        let to_version = post.filled("to_version").map(str::to_string);
        app::dlq::Request::Retry { patch, to_version }
    });
    act(&state, &id, &post, request).await
}

/// `POST /ui/dlq/{id}/resolve`: `happened` (`true`/`false`) and, if it happened, the output.
pub async fn resolve(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let request = json_field(&post, "output", "output").and_then(|output| {
        let happened = match post.fields.get("happened").map(String::as_str) {
            Some("true") => true,
            Some("false") => false,
            _ => {
                return Err(app::AppError::invalid(
                    "happened",
                    "say whether the step happened",
                ));
            }
        };
        Ok(app::dlq::Request::Resolve { happened, output })
    });
    act(&state, &id, &post, request).await
}

/// `POST /ui/dlq/{id}/discard`: the reason is required and kept in the audit trail.
pub async fn discard(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    act(&state, &id, &post, Ok(app::dlq::Request::Discard)).await
}
