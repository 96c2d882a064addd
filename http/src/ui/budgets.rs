//! The token budgets on an operation's console page: the budgets over it (its own, its
//! batch's, its tenant's) with what is spent and held, and the forms to raise its own budget or
//! let one refused call through. Through `agentq_app::budgets`, the flows of `agentq budget`
//! and `/v1/operations/{id}/budget`, each form with the session's CSRF token.

use std::sync::Arc;

use agentq_app as app;
use agentq_app::budgets::{BudgetRequest, BudgetView};
use agentq_core::operation::OperationId;
use axum::extract::{Path, State};
use maud::{Markup, html};
use uuid::Uuid;

use super::form::{FormPost, parse_id};
use super::html::{self, time};
use super::session::Session;
use super::{UiResult, UiState};

/// The budgets over operation `op`, and (unless it finished) the forms to raise its own or
/// let one refused call through.
pub fn section(
    session: &Session,
    op: Uuid,
    budgets: &[BudgetView],
    finished: bool,
    next: &str,
) -> Markup {
    let form = |action: &str, fields| html::operation_form(session, op, action, next, fields);
    let own = budgets.iter().any(|b| b.scope == "operation");
    html! {
        @if !budgets.is_empty() {
            section id="budgets" {
                h2 { "Token budgets" }
                table {
                    tr { th { "scope" } th { "spent" } th { "held" } th { "limit" } th { "refused a call since" } }
                    @for b in budgets {
                        tr data-budget=(b.scope) {
                            td { (b.scope) }
                            td { (b.spent_tokens) }
                            td { (b.held_tokens) }
                            td { (b.limit_tokens) " " (b.measure) }
                            td { (b.exceeded_at.map(time).unwrap_or_else(|| "–".into())) }
                        }
                    }
                }
                @if own && !finished {
                    div class="actions" {
                        (form("budget", html! {
                            input name="tokens" type="number" min="1" placeholder="tokens" required;
                            (html::reason_field())
                            button type="submit" data-action="raise-budget" { "Set budget" }
                        }))
                        (form("budget/allow-once", html! {
                            (html::reason_field())
                            button type="submit" data-action="allow-once" { "Allow one call" }
                        }))
                    }
                }
            }
        }
    }
}

/// `POST /ui/operations/{id}/budget`: `agentq budget set OP --budget-tokens N`.
pub async fn raise(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let op = OperationId(parse_id(&id, "operation")?);
    let outcome = match post.filled("tokens").map(str::parse::<i64>) {
        Some(Ok(tokens)) => {
            let request = BudgetRequest {
                tokens,
                measure: None,
                timeout_secs: None,
            };
            app::budgets::set_for_operation(
                &state.api.app,
                post.caller(),
                op,
                &request,
                post.filled("reason"),
            )
            .await
            .map(|set| set.summary())
        }
        _ => Err(app::AppError::invalid(
            "tokens",
            "tokens: say how many, as a whole number",
        )),
    };
    post.done(&state, outcome, &format!("/ui/operations/{op}"))
}

/// `POST /ui/operations/{id}/budget/allow-once`: `agentq budget allow-once OP`.
pub async fn allow_once(
    State(state): State<Arc<UiState>>,
    Path(id): Path<String>,
    post: FormPost,
) -> UiResult {
    let op = OperationId(parse_id(&id, "operation")?);
    let outcome =
        app::budgets::allow_once(&state.api.app, post.caller(), op, post.filled("reason"))
            .await
            .map(|resumed| {
                format!(
                    "the next call its budget refuses will be let through{}",
                    if resumed {
                        "; the operation is queued again"
                    } else {
                        ""
                    }
                )
            });
    post.done(&state, outcome, &format!("/ui/operations/{op}"))
}
