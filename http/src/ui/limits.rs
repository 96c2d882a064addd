//! The console's Limits page: the rate limits the session's caller may see, each with what its
//! current window holds, through `agentq_app::rate_limits::list` (the flow of `agentq limits
//! list` and `GET /v1/rate-limits`), and its tenant's token budget per period through
//! `agentq_app::budgets::of_tenant`. Read only: limits are set with `agentq limits set` or the
//! API, where each change is audited with its reason.

use std::sync::Arc;

use agentq_app as app;
use axum::extract::State;
use maud::html;

use super::html::{self, time};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/limits`.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let app = &state.api.app;
    let limits = app::rate_limits::list(app, &session.caller, None).await?;
    // A tenant's own budget per period (an admin's session has no one tenant).
    let budget = if session.caller.role == app::Role::Admin {
        None
    } else {
        app::budgets::of_tenant(app, &session.caller, None)
            .await
            .ok()
    };
    let cap = |n: Option<i64>| n.map_or_else(|| "–".to_string(), |n| n.to_string());
    let body = html! {
        h1 { "Limits" }
        p class="muted" {
            "Rate limits cap the tokens and model calls in any window, shared by every worker; a "
            "call with no room waits, or its operation parks until the window reopens. Set them "
            "with " code { "agentq limits set" } " or " code { "POST /v1/rate-limits" } "."
        }
        @if limits.is_empty() {
            p { "No rate limit." }
        } @else {
            table {
                thead { tr {
                    th { "scope" } th { "limit" } th { "window" } th { "tokens in window" }
                    th { "calls in window" } th { "learned ratio" } th { "set" }
                } }
                tbody {
                    @for l in &limits {
                        tr data-limit=(l.name) {
                            td { (l.scope) }
                            td class="mono" {
                                @if l.tenant.is_empty() { (l.name) }
                                @else { (l.tenant) ":" (l.name) }
                            }
                            td { (l.window_secs) " s" }
                            td { (l.window_tokens) " of " (cap(l.max_tokens)) }
                            td { (l.window_requests) " of " (cap(l.max_requests)) }
                            td { (format!("{:.2}", l.usage_ratio)) }
                            td { (time(l.updated_at)) }
                        }
                    }
                }
            }
        }
        @if let Some(b) = &budget {
            h2 { "Token budget per period" }
            p {
                (b.spent_tokens) " of " (b.limit_tokens) " " (b.measure) " tokens spent, "
                (b.held_tokens) " held"
                @if let Some(end) = b.period_ends { "; this period ends " (time(end)) }
            }
        }
    };
    Ok(html::page(&session, "Limits", "/ui/limits", body))
}
