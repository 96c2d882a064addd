//! The console's Kinds page: what this deployment runs, through `agentq_app::kinds::list` (the
//! flow of `agentq kinds` and `GET /v1/kinds`): each kind with its versions, the versions live
//! workers run, whether only webhook deliveries create it and its input schema; and the tools
//! an agent may name.

use std::sync::Arc;

use agentq_app as app;
use axum::extract::State;
use maud::html;

use super::html::{self, badge};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/kinds`.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let kinds = app::kinds::list(&state.api.app, &session.caller).await?;
    let schema = |v: &serde_json::Value| {
        html! {
            details {
                summary { "schema" }
                pre { (serde_json::to_string_pretty(v).unwrap_or_default()) }
            }
        }
    };
    let body = html! {
        h1 { "Kinds" }
        p class="muted" {
            "What this deployment runs: its binary's kinds, and the kinds of the services an admin registered ("
            code { "agentq services" } "). Enqueue one with " code { "agentq enqueue --kind K" }
            " or " code { "POST /v1/operations" } "; its input must fit the schema."
        }
        table {
            thead { tr {
                th { "kind" } th { "versions" } th { "live workers run" } th { "what it does" }
                th { "input" }
            } }
            tbody {
                @for k in &kinds.kinds {
                    tr data-kind=(k.kind.name) {
                        td class="mono" {
                            (k.kind.name)
                            @if k.kind.webhook_only {
                                " " (badge("webhook only"))
                            } @else if k.kind.for_tests {
                                " " (badge("for tests"))
                            }
                            @if let Some(service) = &k.kind.service {
                                " " (badge(&format!("service {service}")))
                            }
                            @if k.service_drift {
                                " " (badge("service drifted: agentq services list"))
                            }
                        }
                        td class="mono" { (k.kind.versions.join(", ")) }
                        td class="mono" {
                            @if k.live_versions.is_empty() {
                                (badge("no live worker"))
                            } @else {
                                (k.live_versions.join(", "))
                            }
                        }
                        td { (k.kind.description) }
                        td { (schema(&k.kind.input_schema)) }
                    }
                }
            }
        }
        h2 { "Tools" }
        p class="muted" {
            "An " code { "agent" } " operation names them in " code { "tools" } ", and in "
            code { "approval" } " for a human's approval before each call."
        }
        table {
            thead { tr {
                th { "tool" } th { "replay" } th { "what it does" } th { "arguments" }
            } }
            tbody {
                @for t in &kinds.tools {
                    tr data-tool=(t.name) {
                        td class="mono" { (t.name) }
                        td {
                            (t.replay.as_str())
                            @if t.requires_approval { " " (badge("always approved first")) }
                        }
                        td { (t.description) }
                        td { (schema(&t.parameters)) }
                    }
                }
            }
        }
    };
    Ok(html::page(&session, "Kinds", "/ui/kinds", body))
}
