//! The console's Operations list (`GET /ui/operations`): filters and keyset pages, newest
//! first, through the same application flow as `GET /v1/operations` and `agentq list`
//! (`agentq_app::operations::list`).

use std::sync::Arc;

use agentq_app as app;
use agentq_app::console::Summary;
use axum::extract::{Query, State};
use chrono::{DateTime, NaiveDateTime, Utc};
use maud::{Markup, html};
use serde::Deserialize;

use super::html::{self, badge, short, time, url};
use super::overview::STATUSES;
use super::session::Session;
use super::{UiError, UiResult, UiState};

/// Operations per page of the list.
const PAGE: i64 = 50;

/// The list's filters, as the filter form sends them.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    status: Option<String>,
    kind: Option<String>,
    tenant: Option<String>,
    batch: Option<String>,
    schedule: Option<String>,
    parent: Option<String>,
    since: Option<String>,
    until: Option<String>,
    after: Option<String>,
}

fn non_empty(s: &Option<String>) -> Option<String> {
    s.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

/// A time filter: RFC 3339, a `datetime-local` value (UTC), or an age such as `2h`.
fn parse_time(s: &str, field: &str) -> UiResult<DateTime<Utc>> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    for f in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, f) {
            return Ok(t.and_utc());
        }
    }
    app::time::parse_since(s, field).map_err(|_| {
        UiError::bad_request(format!(
            "{field} is not a time: give 2026-01-31T12:00 (UTC), RFC 3339, or an age such as 2h"
        ))
    })
}

/// The console's own time forms (`datetime-local`, in UTC) as the RFC 3339 the flow reads. A
/// time outside what the flow takes is refused here, naming the console's own field.
fn time_filter(v: &Option<String>, field: &str) -> UiResult<Option<String>> {
    non_empty(v)
        .map(|s| {
            let t = parse_time(&s, field)?;
            if !(1970..=9999).contains(&chrono::Datelike::year(&t)) {
                return Err(UiError::bad_request(format!(
                    "{field} is out of range: give a time in the years 1970 to 9999"
                )));
            }
            Ok(t.to_rfc3339())
        })
        .transpose()
}

/// `GET /ui/operations`: filters and keyset pages, newest first, through the same
/// application flow as `GET /v1/operations` and `agentq list`.
pub async fn list(
    State(state): State<Arc<UiState>>,
    session: Session,
    Query(q): Query<ListQuery>,
) -> UiResult {
    // Only an admin is shown the tenant field. The tenant named goes to the flow as given: its one tenant rule decides (a non-admin
    // naming another tenant is refused, not silently shown its own).
    let admin = session.caller.sees_every_tenant();
    let query = app::operations::ListQuery {
        tenant: non_empty(&q.tenant),
        status: non_empty(&q.status).into_iter().collect(),
        kind: non_empty(&q.kind),
        batch: non_empty(&q.batch),
        schedule: non_empty(&q.schedule),
        parent: non_empty(&q.parent),
        created_after: time_filter(&q.since, "since")?,
        created_before: time_filter(&q.until, "until")?,
        ..Default::default()
    };
    let page = app::operations::list(
        &state.api.app,
        &session.caller,
        &query,
        PAGE,
        non_empty(&q.after).as_deref(),
    )
    .await?;

    let status = non_empty(&q.status).unwrap_or_default();
    let field = |name: &str, v: &Option<String>, hint: &str| {
        html! {
            label { (name) input name=(name) value=(v.as_deref().unwrap_or("")) placeholder=(hint); }
        }
    };
    let body = html! {
        h1 { "Operations" }
        form method="get" class="filters" {
            label {
                "status"
                select name="status" {
                    @for s in STATUSES.iter().rev() {
                        option value=(s) selected[status == *s] {
                            (if s.is_empty() { "any" } else { s })
                        }
                    }
                }
            }
            (field("kind", &q.kind, "any"))
            @if admin { (field("tenant", &q.tenant, "all")) }
            (field("batch", &q.batch, "batch id"))
            (field("schedule", &q.schedule, "schedule id"))
            (field("parent", &q.parent, "operation id"))
            (field("since", &q.since, "2h or 2026-01-31T12:00"))
            (field("until", &q.until, "UTC"))
            button type="submit" { "Filter" }
        }
        (table(&page.items))
        @if let Some(cursor) = &page.next_cursor {
            p class="pager" { a href=(next_page(&q, cursor)) { "Older →" } }
        }
    };
    Ok(html::page(&session, "Operations", "/ui/operations", body))
}

/// The link to the page after `cursor` with the same filters.
fn next_page(q: &ListQuery, cursor: &str) -> String {
    let mut next = String::from("/ui/operations?");
    for (k, v) in [
        ("status", &q.status),
        ("kind", &q.kind),
        ("tenant", &q.tenant),
        ("batch", &q.batch),
        ("schedule", &q.schedule),
        ("parent", &q.parent),
        ("since", &q.since),
        ("until", &q.until),
    ] {
        if let Some(v) = non_empty(v) {
            next.push_str(&format!("{k}={}&", url(&v)));
        }
    }
    next.push_str(&format!("after={}", url(cursor)));
    next
}

fn table(rows: &[Summary]) -> Markup {
    if rows.is_empty() {
        return html! { p class="muted" { "No operations match." } };
    }
    html! {
        table {
            thead { tr {
                th { "operation" } th { "tenant" } th { "kind" } th { "status" }
                th class="num" { "attempt" } th { "created" } th { "updated" }
                th { "error class" } th { "batch" }
            } }
            tbody {
                @for r in rows {
                    tr {
                        td { a class="mono" href={ "/ui/operations/" (r.op_id) } { (r.op_id) } }
                        td { (r.tenant) }
                        td { (r.kind) }
                        td {
                            (badge(r.status.as_str()))
                            @if let Some(w) = &r.waiting_for {
                                " " span class="muted" { "for " (w) }
                            }
                        }
                        td class="num" { (r.attempt) "/" (r.max_attempts) }
                        td { (time(r.created_at)) }
                        td { (time(r.updated_at)) }
                        td { (r.error_class.as_deref().unwrap_or("")) }
                        td {
                            @if let Some(b) = r.batch_id {
                                a class="mono" href={ "/ui/operations?batch=" (b) } { (short(b)) }
                            }
                        }
                    }
                }
            }
        }
    }
}
