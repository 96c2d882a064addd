//! The console's Versions page (`GET /ui/versions`): `agentq versions` through
//! `agentq_app::versions::report` — per kind, the versions live workers run and the
//! unfinished operations on each; versions nobody runs stand out.

use std::sync::Arc;

use agentq_app as app;
use axum::extract::State;
use maud::html;

use super::html::{self, badge, time};
use super::session::Session;
use super::{UiResult, UiState};

/// `GET /ui/versions`.
pub async fn report(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let report = app::versions::report(&state.api.app, &session.caller, None).await?;
    let body = html! {
        h1 { "Versions" }
        p class="muted" {
            "An operation runs on the version of its kind it first ran on. Move operations with "
            code { "agentq versions upgrade" } "."
        }
        @if report.kinds.is_empty() {
            p class="muted" { "No live worker and no unfinished operation." }
        }
        @for k in &report.kinds {
            h2 {
                (k.kind) " "
                span class="muted" {
                    "new operations run on "
                    (k.newest_live.as_deref().unwrap_or("– (no live worker)"))
                }
            }
            table data-kind=(k.kind) {
                thead { tr {
                    th { "version" } th class="num" { "workers" } th class="num" { "queued" }
                    th class="num" { "running" } th class="num" { "sleeping" }
                    th class="num" { "waiting" } th class="num" { "dead" }
                    th class="num" { "parked" } th { "oldest waiting since" } th {}
                } }
                tbody {
                    @for l in &k.versions {
                        tr data-version=(l.version.as_deref().unwrap_or("")) {
                            td class="mono" { (l.version.as_deref().unwrap_or("(not run yet)")) }
                            td class="num" { (l.live_workers) }
                            @for n in l.counts() { td class="num" { (n) } }
                            td class="num" { (l.parked) }
                            td { (l.oldest_waiting_since.map(time).unwrap_or_else(|| "–".into())) }
                            td {
                                @if l.unserved {
                                    (badge("no live worker"))
                                } @else if l.retirable && l.version.is_some() {
                                    span class="muted" { "nothing left on it" }
                                }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Live workers (" (report.workers.len()) ")" }
        ul {
            @for w in &report.workers {
                li { span class="mono" { (w.owner) } " seen " (time(w.seen_at)) ": " (w.runs().join(" ")) }
            }
        }
    };
    Ok(html::page(&session, "Versions", "/ui/versions", body))
}
