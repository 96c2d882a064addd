//! The console's Kinds page: what this deployment runs, through `agentq_app::kinds::list` (the
//! flow of `agentq kinds` and `GET /v1/kinds`): each kind with its versions, the versions live
//! workers run, whether only webhook deliveries create it and its input schema; and the tools
//! an agent may name.

use std::sync::Arc;

use agentq_app as app;
use axum::extract::State;

use super::html::{self, badge, esc};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/kinds`.
pub async fn list(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let kinds = app::kinds::list(&state.api.app, &session.caller.app()).await?;
    let mut body = String::from(
        "<h1>Kinds</h1><p class=\"muted\">What this deployment's binary runs. Enqueue one with \
         <code>agentq enqueue --kind K</code> or <code>POST /v1/operations</code>; its input \
         must fit the schema.</p><table><thead><tr><th>kind</th><th>versions</th>\
         <th>live workers run</th><th>what it does</th><th>input</th></tr></thead><tbody>",
    );
    for k in &kinds.kinds {
        let live = if k.live_versions.is_empty() {
            badge("no live worker")
        } else {
            esc(&k.live_versions.join(", "))
        };
        let webhook = match (k.kind.webhook_only, k.kind.for_tests) {
            (true, _) => format!(" {}", badge("webhook only")),
            (false, true) => format!(" {}", badge("for tests")),
            (false, false) => String::new(),
        };
        body.push_str(&format!(
            "<tr data-kind=\"{name}\"><td class=\"mono\">{name}{webhook}</td><td class=\"mono\">{}</td>\
             <td class=\"mono\">{live}</td><td>{}</td><td><details><summary>schema</summary>\
             <pre>{}</pre></details></td></tr>",
            esc(&k.kind.versions.join(", ")),
            esc(&k.kind.description),
            esc(&serde_json::to_string_pretty(&k.kind.input_schema).unwrap_or_default()),
            name = esc(&k.kind.name),
        ));
    }
    body.push_str("</tbody></table>");
    body.push_str(
        "<h2>Tools</h2><p class=\"muted\">An <code>agent</code> operation names them in \
         <code>tools</code>, and in <code>approval</code> for a human's approval before each \
         call.</p><table><thead><tr><th>tool</th><th>replay</th><th>what it does</th>\
         <th>arguments</th></tr></thead><tbody>",
    );
    for t in &kinds.tools {
        let approval = if t.requires_approval {
            format!(" {}", badge("always approved first"))
        } else {
            String::new()
        };
        body.push_str(&format!(
            "<tr data-tool=\"{name}\"><td class=\"mono\">{name}</td><td>{}{approval}</td><td>{}</td>\
             <td><details><summary>schema</summary><pre>{}</pre></details></td></tr>",
            esc(t.replay.as_str()),
            esc(&t.description),
            esc(&serde_json::to_string_pretty(&t.parameters).unwrap_or_default()),
            name = esc(&t.name),
        ));
    }
    body.push_str("</tbody></table>");
    Ok(html::page(&session, "Kinds", "/ui/kinds", &body))
}
