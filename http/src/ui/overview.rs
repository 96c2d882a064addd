//! The console's Overview (`GET /ui`): operations by status, open dead letters by class, the
//! age of the oldest queued operation per lane, and the last hour per minute as SVG charts,
//! through `agentq_app::console::overview`.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentq_app as app;
use agentq_app::console::Minute;
use axum::extract::State;
use chrono::{DateTime, Utc};
use maud::html;

use super::html::{self, badge, secs, url};
use super::session::Session;
use super::{UiResult, UiState};

/// The statuses an operation can have, in the order the overview and the list's filter show
/// them (the empty one: any status).
pub(super) const STATUSES: [&str; 9] = [
    "queued",
    "running",
    "sleeping",
    "waiting",
    "succeeded",
    "dead",
    "cancelled",
    "discarded",
    "",
];

/// `GET /ui`: counts, open dead letters, queue age, and the last hour per minute.
pub async fn overview(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let o = app::console::overview(&state.api.app, &session.caller, 60).await?;
    let by: BTreeMap<&str, i64> = o.counts.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    let open: i64 = o.dead_by_class.iter().map(|(_, n)| n).sum();
    let series = |f: fn(&Minute) -> f64| -> Vec<(DateTime<Utc>, f64)> {
        o.minutes.iter().map(|m| (m.minute, f(m))).collect()
    };
    let count = |v: f64| format!("{v:.0}");
    let body = html! {
        h1 { "Overview" }
        div class="cards" {
            @for s in STATUSES.iter().filter(|s| !s.is_empty()) {
                a class="card" href={ "/ui/operations?status=" (s) } {
                    div class="n" { (by.get(s).copied().unwrap_or(0)) }
                    (badge(s))
                }
            }
        }
        div class="cards" {
            a class="card" href="/ui/dlq" { div class="n" { (open) } "open dead letters" }
            @for (class, n) in &o.dead_by_class {
                a class="card" href={ "/ui/dlq?class=" (url(class)) } {
                    div class="n" { (n) }
                    (class)
                }
            }
            @if o.oldest_queued.is_empty() {
                div class="card" { div class="n" { "–" } "oldest queued" }
            }
            @for (lane, age) in &o.oldest_queued {
                div class="card" { div class="n" { (secs(*age)) } "oldest queued (" (lane) ")" }
            }
        }
        h2 { "Last hour, per minute" }
        div class="charts" {
            (html::bar_chart(
                "Throughput: operations succeeded",
                &series(|m| m.succeeded as f64),
                count,
            ))
            (html::bar_chart(
                "Failures: attempts failed (retried or dead)",
                &series(|m| (m.dead + m.retried) as f64),
                count,
            ))
            (html::bar_chart(
                "Queue age: longest wait before a claim",
                &series(|m| m.max_wait_secs),
                secs,
            ))
        }
    };
    Ok(html::page(&session, "Overview", "/ui", body))
}
