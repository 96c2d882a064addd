//! The console's pages other than the DLQ: overview, operations (list and one operation, with
//! the audited payload reveal), pending approvals, and batches with pause / resume (the
//! Schedules page is `schedules.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use agentq_app as app;
use agentq_app::operations::STEPS_PAGE_BYTES;
use agentq_core::OperationId;
use agentq_core::db::{self, console, listing};
use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{DateTime, NaiveDateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

use super::html::{self, badge, csrf, esc, secs, time, url};
use super::session::{Fields, Session, filled};
use super::{UiError, UiResult, UiState};

const STATUSES: [&str; 9] = [
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

/// Operations per page of the list.
const PAGE: i64 = 50;

pub(super) fn parse_uuid(s: &str, what: &str) -> UiResult<Uuid> {
    Uuid::parse_str(s.trim()).map_err(|_| UiError::not_found(format!("no {what} {s}")))
}

/// Where to go after an action: a console path from the form, else `default`.
pub(super) fn back(fields: &Fields, default: &str) -> Response {
    let next = fields
        .get("next")
        .filter(|n| n.starts_with("/ui") && !n.contains("//") && !n.contains('\\'))
        .map(String::as_str)
        .unwrap_or(default);
    Redirect::to(next).into_response()
}

// ---------------------------------------------------------------- overview

/// `GET /ui`: counts, open dead letters, queue age, and the last hour per minute.
pub async fn overview(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let pool = &state.api.app.pool;
    let scope = session.caller.scope();
    let counts = console::status_counts(pool, scope).await?;
    let dead = console::open_dead_letters_by_class(pool, scope).await?;
    let oldest = console::oldest_queued(pool, scope).await?;
    let minutes = console::minutes(pool, scope, 60).await?;

    let mut body = String::from("<h1>Overview</h1><div class=\"cards\">");
    let by: BTreeMap<&str, i64> = counts.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    for s in STATUSES.iter().filter(|s| !s.is_empty()) {
        body.push_str(&format!(
            "<a class=\"card\" href=\"/ui/operations?status={s}\"><div class=\"n\">{}</div>{}</a>",
            by.get(s).copied().unwrap_or(0),
            badge(s)
        ));
    }
    body.push_str("</div><div class=\"cards\">");
    let open: i64 = dead.iter().map(|(_, n)| n).sum();
    body.push_str(&format!(
        "<a class=\"card\" href=\"/ui/dlq\"><div class=\"n\">{open}</div>open dead letters</a>"
    ));
    for (class, n) in &dead {
        body.push_str(&format!(
            "<a class=\"card\" href=\"/ui/dlq?class={}\"><div class=\"n\">{n}</div>{}</a>",
            url(class),
            esc(class)
        ));
    }
    if oldest.is_empty() {
        body.push_str("<div class=\"card\"><div class=\"n\">–</div>oldest queued</div>");
    }
    for (lane, age) in &oldest {
        body.push_str(&format!(
            "<div class=\"card\"><div class=\"n\">{}</div>oldest queued ({})</div>",
            esc(&secs(*age)),
            esc(lane)
        ));
    }
    body.push_str("</div><h2>Last hour, per minute</h2><div class=\"charts\">");
    let series = |f: fn(&console::Minute) -> f64| -> Vec<(DateTime<Utc>, f64)> {
        minutes.iter().map(|m| (m.minute, f(m))).collect()
    };
    body.push_str(&html::bar_chart(
        "Throughput: operations succeeded",
        &series(|m| m.succeeded as f64),
        |v| format!("{v:.0}"),
    ));
    body.push_str(&html::bar_chart(
        "Failures: attempts failed (retried or dead)",
        &series(|m| (m.dead + m.retried) as f64),
        |v| format!("{v:.0}"),
    ));
    body.push_str(&html::bar_chart(
        "Queue age: longest wait before a claim",
        &series(|m| m.max_wait_secs),
        secs,
    ));
    body.push_str("</div>");
    Ok(html::page(&session, "Overview", "/ui", &body))
}

// ---------------------------------------------------------------- operations list

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

/// `GET /ui/operations`: filters and keyset pages, newest first, through the same
/// application flow as `GET /v1/operations` and `agentq list`.
pub async fn operations(
    State(state): State<Arc<UiState>>,
    session: Session,
    Query(q): Query<ListQuery>,
) -> UiResult {
    let scope = session.caller.scope();
    // The console's own time forms (`datetime-local`, in UTC) as the RFC 3339 the flow reads.
    // A time outside what the flow takes is refused here, naming the console's own field.
    let time = |v: &Option<String>, field: &str| {
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
    };
    let query = app::operations::ListQuery {
        tenant: if scope.is_none() {
            non_empty(&q.tenant)
        } else {
            None
        },
        status: non_empty(&q.status).into_iter().collect(),
        kind: non_empty(&q.kind),
        batch: non_empty(&q.batch),
        schedule: non_empty(&q.schedule),
        parent: non_empty(&q.parent),
        created_after: time(&q.since, "since")?,
        created_before: time(&q.until, "until")?,
        ..Default::default()
    };
    let page = app::operations::list(
        &state.api.app,
        &session.caller.app(),
        &query,
        PAGE,
        non_empty(&q.after).as_deref(),
    )
    .await?;
    let rows = page.items;

    let mut body = String::from("<h1>Operations</h1><form method=\"get\" class=\"filters\">");
    body.push_str("<label>status<select name=\"status\">");
    for s in STATUSES.iter().rev() {
        let sel = if non_empty(&q.status).as_deref().unwrap_or("") == *s {
            " selected"
        } else {
            ""
        };
        let label = if s.is_empty() { "any" } else { s };
        body.push_str(&format!("<option value=\"{s}\"{sel}>{label}</option>"));
    }
    body.push_str("</select></label>");
    let field = |name: &str, v: &Option<String>, hint: &str| {
        format!(
            "<label>{name}<input name=\"{name}\" value=\"{}\" placeholder=\"{hint}\"></label>",
            esc(v.as_deref().unwrap_or(""))
        )
    };
    body.push_str(&field("kind", &q.kind, "any"));
    if scope.is_none() {
        body.push_str(&field("tenant", &q.tenant, "all"));
    }
    body.push_str(&field("batch", &q.batch, "batch id"));
    body.push_str(&field("schedule", &q.schedule, "schedule id"));
    body.push_str(&field("parent", &q.parent, "operation id"));
    body.push_str(&field("since", &q.since, "2h or 2026-01-31T12:00"));
    body.push_str(&field("until", &q.until, "UTC"));
    body.push_str("<button type=\"submit\">Filter</button></form>");
    body.push_str(&operations_table(&rows));
    if let Some(cursor) = page.next_cursor {
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
        next.push_str(&format!("after={}", url(&cursor)));
        body.push_str(&format!(
            "<p class=\"pager\"><a href=\"{}\">Older →</a></p>",
            esc(&next)
        ));
    }
    Ok(html::page(&session, "Operations", "/ui/operations", &body))
}

fn operations_table(rows: &[listing::Summary]) -> String {
    if rows.is_empty() {
        return "<p class=\"muted\">No operations match.</p>".into();
    }
    let mut t = String::from(
        "<table><thead><tr><th>operation</th><th>tenant</th><th>kind</th><th>status</th>\
         <th class=\"num\">attempt</th><th>created</th><th>updated</th><th>error class</th>\
         <th>batch</th></tr></thead><tbody>",
    );
    for r in rows {
        t.push_str(&format!(
            "<tr><td><a class=\"mono\" href=\"/ui/operations/{id}\">{id}</a></td><td>{}</td>\
             <td>{}</td><td>{}{}</td><td class=\"num\">{}/{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td></tr>",
            esc(&r.tenant),
            esc(&r.kind),
            badge(r.status.as_str()),
            r.waiting_for
                .as_deref()
                .map(|w| format!(" <span class=\"muted\">for {}</span>", esc(w)))
                .unwrap_or_default(),
            r.attempt,
            r.max_attempts,
            time(r.created_at),
            time(r.updated_at),
            esc(r.error_class.as_deref().unwrap_or("")),
            r.batch_id
                .map(|b| format!(
                    "<a class=\"mono\" href=\"/ui/operations?batch={b}\">{}</a>",
                    &b.to_string()[..8]
                ))
                .unwrap_or_default(),
            id = r.op_id,
        ));
    }
    t.push_str("</tbody></table>");
    t
}

// ---------------------------------------------------------------- one operation

/// `GET /ui/operations/{id}`: the operation, its journal as a timeline, its events and audit
/// trail; payloads hidden.
pub async fn operation(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
) -> UiResult {
    operation_page(&state, &session, &id, false).await
}

/// `POST /ui/operations/{id}/reveal`: the same page with the input, result and step outputs
/// shown; audited as `reveal_payloads`.
pub async fn reveal(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    session.check(form)?;
    operation_page(&state, &session, &id, true).await
}

async fn operation_page(state: &UiState, session: &Session, id: &str, revealed: bool) -> UiResult {
    let pool = &state.api.app.pool;
    let scope = session.caller.scope();
    let op_id = parse_uuid(id, "operation")?;
    let op = db::find_operation(pool, OperationId(op_id), scope)
        .await?
        .ok_or_else(|| UiError::not_found(format!("no operation {op_id}")))?;
    // The first page of the journal: a long one is read in full by `agentq steps` or the API.
    let (mut steps, more_steps) =
        db::steps_page(pool, op_id, scope, None, 500, 4 * STEPS_PAGE_BYTES).await?;
    for s in &mut steps {
        if let Some(o) = &mut s.output {
            html::redact(o, &state.api.redact_keys);
        }
    }
    let events = db::events::events_after(pool, op_id, 0, 500).await?;
    let payloads = if revealed {
        console::audit_reveal(pool, op_id, &session.actor(), op.status.as_str()).await?;
        console::payloads(pool, op_id, scope).await?.map(|mut p| {
            html::redact(&mut p.input, &state.api.redact_keys);
            if let Some(r) = &mut p.result {
                html::redact(r, &state.api.redact_keys);
            }
            p
        })
    } else {
        None
    };
    let actions = console::operation_actions(pool, op_id).await?;

    let mut body = format!(
        "<h1>Operation <span class=\"mono\">{op_id}</span> {}</h1><dl class=\"kv\">\
         <dt>tenant</dt><dd>{}</dd><dt>kind</dt><dd>{}</dd><dt>version</dt><dd>{}</dd>\
         <dt>lane</dt><dd>{}</dd><dt>attempt</dt><dd>{} of {} (restarts {})</dd><dt>created</dt><dd>{}</dd>\
         <dt>updated</dt><dd>{}</dd><dt>finished</dt><dd>{}</dd>",
        badge(op.status.as_str()),
        esc(&op.tenant),
        esc(&op.kind),
        match (&op.kind_version, op.version_parked) {
            (None, _) => "not run yet (its first claim pins the newest live version)".to_string(),
            (Some(v), false) => esc(v),
            (Some(v), true) => format!(
                "{} <span class=\"muted\">(waiting for a worker that runs it: \
                 <a href=\"/ui/versions\">versions</a>)</span>",
                esc(v)
            ),
        },
        esc(op.lane.as_str()),
        op.attempt,
        op.max_attempts,
        op.restarts,
        time(op.created_at),
        time(op.updated_at),
        op.finished_at.map(time).unwrap_or_else(|| "–".into()),
    );
    if let Some(w) = &op.waiting_for {
        body.push_str(&format!("<dt>waiting for</dt><dd>signal {}</dd>", esc(w)));
    }
    if let Some(p) = op.parent_id {
        body.push_str(&format!(
            "<dt>parent</dt><dd><a class=\"mono\" href=\"/ui/operations/{p}\">{p}</a></dd>"
        ));
    }
    if let Some(k) = &op.ordering_key {
        body.push_str(&format!(
            "<dt>ordering key</dt><dd class=\"mono\">{}</dd>",
            esc(k)
        ));
    }
    if let (Some(k), Some(n)) = (&op.concurrency_key, op.concurrency_limit) {
        body.push_str(&format!(
            "<dt>concurrency key</dt><dd><span class=\"mono\">{}</span> (at most {n} at once)</dd>",
            esc(k)
        ));
    }
    if let Some(b) = op.batch_id {
        body.push_str(&format!(
            "<dt>batch</dt><dd><a class=\"mono\" href=\"/ui/operations?batch={b}\">{b}</a></dd>"
        ));
    }
    if let Some(c) = &op.error_class {
        body.push_str(&format!(
            "<dt>error</dt><dd>{} <span class=\"error-text\">{}</span></dd>",
            badge(c),
            esc(op.error_message.as_deref().unwrap_or(""))
        ));
    }
    body.push_str("</dl>");

    let path = format!("/ui/operations/{op_id}");
    if op.waiting_for.as_deref() == Some("approval") && op.status.as_str() == "waiting" {
        body.push_str(&approval_forms(session, op_id, &path));
    }
    if !op.status.is_terminal() {
        body.push_str(&control_forms(session, op_id, &path));
    }
    if op.status.as_str() == "dead" {
        body.push_str(
            "<p><a href=\"/ui/dlq\">This operation is dead: act on it in the dead-letter inbox</a></p>",
        );
    }

    // Its children, grandchildren…: depth first, in the order they were spawned.
    let (tree, more) = db::children::descendants(pool, op_id, 200).await?;
    if !tree.is_empty() {
        body.push_str(&format!(
            "<h2>Children</h2><p><a href=\"/ui/operations?parent={op_id}\">List its children</a></p>\
             <ul class=\"tree\">"
        ));
        for n in &tree {
            body.push_str(&format!(
                "<li style=\"margin-left:{}em\"><a class=\"mono\" href=\"/ui/operations/{id}\">{short}</a> \
                 {} {}{}</li>",
                (n.depth - 1) * 2,
                esc(&n.kind),
                badge(n.status.as_str()),
                n.error_class
                    .as_deref()
                    .map(|c| format!(" {}", badge(c)))
                    .unwrap_or_default(),
                id = n.id,
                short = &n.id.to_string()[..8],
            ));
        }
        body.push_str("</ul>");
        if more {
            body.push_str("<p class=\"muted\">The first 200 are shown.</p>");
        }
    }

    body.push_str("<h2>Payloads</h2>");
    match &payloads {
        Some(p) => {
            body.push_str(
                "<p class=\"muted\">Revealed for you; this reveal is recorded in the audit trail.</p>\
                 <h3>input</h3>",
            );
            body.push_str(&html::json_block(&p.input));
            if let Some(r) = &p.result {
                body.push_str("<h3>result</h3>");
                body.push_str(&html::json_block(r));
            }
        }
        None => body.push_str(&format!(
            "<form method=\"post\" action=\"{path}/reveal\" class=\"inline\">{}\
             <button type=\"submit\" class=\"secondary\" id=\"reveal\">Reveal input, result and \
             step outputs</button></form> <span class=\"muted\">(recorded in the audit \
             trail)</span>",
            csrf(session)
        )),
    }

    body.push_str("<h2>Journal</h2>");
    if steps.is_empty() {
        body.push_str("<p class=\"muted\">No steps yet.</p>");
    } else {
        body.push_str("<ol class=\"timeline\">");
        for s in &steps {
            let took = s
                .completed_at
                .map(|c| secs((c - s.started_at).num_milliseconds() as f64 / 1000.0))
                .unwrap_or_else(|| "–".into());
            body.push_str(&format!(
                "<li class=\"{}\"><strong>#{} {}</strong> <span class=\"muted\">{} · {}</span> {}\
                 <div class=\"meta\">started {} · took {} · epoch {}{}</div>",
                esc(s.status.as_str()),
                s.seq,
                esc(&s.name),
                esc(s.kind.as_str()),
                esc(s.replay.as_str()),
                badge(s.status.as_str()),
                time(s.started_at),
                esc(&took),
                s.epoch,
                s.wake_at
                    .map(|w| format!(" · wakes/times out {}", time(w)))
                    .unwrap_or_default(),
            ));
            if let Some(e) = &s.error {
                body.push_str(&format!("<div class=\"error-text\">{}</div>", esc(e)));
            }
            if let Some(u) = &s.usage {
                body.push_str(&format!(
                    "<div class=\"meta\">usage {}</div>",
                    esc(&u.to_string())
                ));
            }
            if payloads.is_some()
                && let Some(o) = &s.output
            {
                body.push_str(&html::json_block(o));
            } else if s.output.is_some() {
                body.push_str("<div class=\"meta\">output hidden</div>");
            }
            body.push_str("</li>");
        }
        body.push_str("</ol>");
        if more_steps {
            body.push_str(&format!(
                "<p class=\"muted\">The journal goes on after step #{}: read all of it with \
                 <code>agentq steps {op_id}</code> or <code>GET /v1/operations/{op_id}/steps</code> \
                 (pages, with <code>after</code>).</p>",
                steps.last().map_or(0, |s| s.seq)
            ));
        }
    }

    body.push_str(
        "<h2>Events</h2><table><thead><tr><th class=\"num\">#</th><th>at</th><th>type</th>\
         <th>what</th></tr></thead><tbody>",
    );
    for e in &events {
        body.push_str(&format!(
            "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"mono\">{}</td></tr>",
            e.seq,
            esc(&e.at.format("%H:%M:%S%.3f").to_string()),
            esc(&e.kind),
            esc(&e.data.to_string())
        ));
    }
    body.push_str("</tbody></table>");

    body.push_str(&audit_table(&actions));
    Ok(html::page(session, "Operation", "/ui/operations", &body))
}

fn audit_table(actions: &[db::dead_letters::ActionView]) -> String {
    if actions.is_empty() {
        return "<h2>Operator actions</h2><p class=\"muted\">None.</p>".into();
    }
    let mut t = String::from(
        "<h2>Operator actions</h2><table><thead><tr><th>at</th><th>actor</th><th>action</th>\
         <th>before → after</th><th>reason</th></tr></thead><tbody>",
    );
    for a in actions {
        t.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} → {}</td><td>{}</td></tr>",
            time(a.created_at),
            esc(&a.actor),
            esc(&a.action),
            esc(a.status_before.as_deref().unwrap_or("")),
            esc(a.status_after.as_deref().unwrap_or("")),
            esc(a.reason.as_deref().unwrap_or(""))
        ));
    }
    t.push_str("</tbody></table>");
    t
}

// ---------------------------------------------------------------- approvals

fn approval_forms(session: &Session, op: Uuid, next: &str) -> String {
    let c = csrf(session);
    let next = esc(next);
    format!(
        "<div class=\"actions\">\
         <form method=\"post\" action=\"/ui/operations/{op}/approve\" class=\"inline\">{c}\
         <input type=\"hidden\" name=\"next\" value=\"{next}\">\
         <input name=\"reason\" placeholder=\"reason (optional)\">\
         <button type=\"submit\" data-action=\"approve\">Approve</button></form>\
         <form method=\"post\" action=\"/ui/operations/{op}/reject\" class=\"inline\">{c}\
         <input type=\"hidden\" name=\"next\" value=\"{next}\">\
         <input name=\"reason\" placeholder=\"reason (optional)\">\
         <button type=\"submit\" class=\"danger\" data-action=\"reject\">Reject</button></form>\
         </div>"
    )
}

/// The signal and cancel forms of an unfinished operation (`agentq signal` / `cancel`).
fn control_forms(session: &Session, op: Uuid, next: &str) -> String {
    let c = csrf(session);
    let next = esc(next);
    format!(
        "<div class=\"actions\">\
         <form method=\"post\" action=\"/ui/operations/{op}/signal\" class=\"inline\">{c}\
         <input type=\"hidden\" name=\"next\" value=\"{next}\">\
         <input name=\"name\" placeholder=\"signal name\" required>\
         <input name=\"payload\" placeholder=\"payload (JSON, optional)\">\
         <button type=\"submit\" data-action=\"signal\">Send signal</button></form>\
         <form method=\"post\" action=\"/ui/operations/{op}/cancel\" class=\"inline\">{c}\
         <input type=\"hidden\" name=\"next\" value=\"{next}\">\
         <input name=\"reason\" placeholder=\"reason (optional)\">\
         <button type=\"submit\" class=\"danger\" data-action=\"cancel\">Cancel</button></form>\
         </div>"
    )
}

/// `POST /ui/operations/{id}/signal`: `agentq signal`, through the application layer.
pub async fn signal(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let op = OperationId(parse_uuid(&id, "operation")?);
    let name = filled(&fields, "name").unwrap_or_default();
    let outcome = match filled(&fields, "payload").map(serde_json::from_str::<serde_json::Value>) {
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
            app::operations::signal(
                &state.api.app,
                &session.caller.app(),
                op,
                name,
                &payload,
                audit,
            )
            .await
            .map(|sent| format!("signal {name:?} {} for {op}", sent.as_str()))
        }
    };
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/operations"))
}

/// `POST /ui/operations/{id}/cancel`: `agentq cancel`, through the application layer.
pub async fn cancel(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let op = OperationId(parse_uuid(&id, "operation")?);
    let reason = filled(&fields, "reason");
    let outcome = app::operations::cancel(&state.api.app, &session.caller.app(), op, reason)
        .await
        .map(|done| match done {
            app::operations::Cancelled::Now => format!("cancelled {op}"),
            app::operations::Cancelled::Requested => {
                format!("cancel requested for {op}: its worker stops it at the next step")
            }
        });
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/operations"))
}

/// `GET /ui/approvals`: operations waiting for an `approval` signal.
pub async fn approvals(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let filter = listing::Filter {
        tenant: session.caller.scope().map(String::from),
        waiting_for: Some("approval".into()),
        ..Default::default()
    };
    let rows = listing::list(&state.api.app.pool, &filter, 200, None).await?;
    let mut body = String::from("<h1>Pending approvals</h1>");
    if rows.is_empty() {
        body.push_str("<p class=\"muted\">Nothing waits for an approval.</p>");
    } else {
        body.push_str(
            "<table><thead><tr><th>operation</th><th>tenant</th><th>kind</th><th>waiting since</th>\
             <th>decide</th></tr></thead><tbody>",
        );
        for r in &rows {
            body.push_str(&format!(
                "<tr data-op=\"{id}\"><td><a class=\"mono\" href=\"/ui/operations/{id}\">{id}</a></td>\
                 <td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&r.tenant),
                esc(&r.kind),
                time(r.updated_at),
                approval_forms(&session, r.op_id, "/ui/approvals"),
                id = r.op_id
            ));
        }
        body.push_str("</tbody></table>");
    }
    Ok(html::page(&session, "Approvals", "/ui/approvals", &body))
}

/// `POST /ui/operations/{id}/approve`.
pub async fn approve(
    state: State<Arc<UiState>>,
    session: Session,
    id: Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    decide(state, session, id, form, true).await
}

/// `POST /ui/operations/{id}/reject`.
pub async fn reject(
    state: State<Arc<UiState>>,
    session: Session,
    id: Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    decide(state, session, id, form, false).await
}

/// The approval convention of `agentq approve` / `reject`, through the application layer.
async fn decide(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
    approved: bool,
) -> UiResult {
    let fields = session.check(form)?;
    let op = OperationId(parse_uuid(&id, "operation")?);
    let reason = filled(&fields, "reason");
    let verb = if approved { "approved" } else { "rejected" };
    let outcome =
        app::operations::decide(&state.api.app, &session.caller.app(), op, approved, reason)
            .await
            .map(|sent| match sent {
                app::operations::Signalled::Delivered => format!("{verb} {op}: it resumes now"),
                app::operations::Signalled::Kept { status, .. } => {
                    format!("{verb} {op}: it is {status}; the decision is kept for its wait")
                }
            });
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/approvals"))
}

// ---------------------------------------------------------------- versions

/// `GET /ui/versions`: `agentq versions` — per kind, the versions live workers run and the
/// unfinished operations on each; versions nobody runs stand out.
pub async fn versions(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let report = app::versions::report(&state.api.app, &session.caller.app(), None).await?;
    let mut body = String::from(
        "<h1>Versions</h1><p class=\"muted\">An operation runs on the version of its kind \
         it first ran on. Move operations with <code>agentq versions upgrade</code>.</p>",
    );
    if report.kinds.is_empty() {
        body.push_str("<p class=\"muted\">No live worker and no unfinished operation.</p>");
    }
    for k in &report.kinds {
        body.push_str(&format!(
            "<h2>{} <span class=\"muted\">new operations run on {}</span></h2>\
             <table data-kind=\"{}\"><thead><tr><th>version</th><th class=\"num\">workers</th>\
             <th class=\"num\">queued</th><th class=\"num\">running</th>\
             <th class=\"num\">sleeping</th><th class=\"num\">waiting</th>\
             <th class=\"num\">dead</th><th class=\"num\">parked</th>\
             <th>oldest waiting since</th><th></th></tr></thead><tbody>",
            esc(&k.kind),
            k.newest_live
                .as_deref()
                .map_or("– (no live worker)".into(), esc),
            esc(&k.kind),
        ));
        for l in &k.versions {
            let counts: String = l
                .counts()
                .iter()
                .map(|n| format!("<td class=\"num\">{n}</td>"))
                .collect();
            let note = if l.unserved {
                badge("no live worker")
            } else if l.retirable && l.version.is_some() {
                "<span class=\"muted\">nothing left on it</span>".into()
            } else {
                String::new()
            };
            body.push_str(&format!(
                "<tr data-version=\"{}\"><td class=\"mono\">{}</td><td class=\"num\">{}</td>\
                 {counts}<td class=\"num\">{}</td><td>{}</td><td>{note}</td></tr>",
                esc(l.version.as_deref().unwrap_or("")),
                esc(l.version.as_deref().unwrap_or("(not run yet)")),
                l.live_workers,
                l.parked,
                l.oldest_waiting_since
                    .map(time)
                    .unwrap_or_else(|| "–".into()),
            ));
        }
        body.push_str("</tbody></table>");
    }
    body.push_str(&format!(
        "<h2>Live workers ({})</h2><ul>",
        report.workers.len()
    ));
    for w in &report.workers {
        body.push_str(&format!(
            "<li><span class=\"mono\">{}</span> seen {}: {}</li>",
            esc(&w.owner),
            time(w.seen_at),
            esc(&w.runs().join(" "))
        ));
    }
    body.push_str("</ul>");
    Ok(html::page(&session, "Versions", "/ui/versions", &body))
}

// ---------------------------------------------------------------- batches

/// `GET /ui/batches`: the newest batches with progress and pause / resume.
pub async fn batches(State(state): State<Arc<UiState>>, session: Session) -> UiResult {
    let rows = console::list_batches(&state.api.app.pool, session.caller.scope(), 100).await?;
    let mut body = String::from("<h1>Batches</h1>");
    if rows.is_empty() {
        body.push_str(
            "<p class=\"muted\">No batches. Start one with <code>agentq batch start</code>.</p>",
        );
    } else {
        body.push_str(
            "<table><thead><tr><th>batch</th><th>tenant</th><th>kind</th><th>status</th>\
             <th>progress</th><th class=\"num\">succeeded</th><th class=\"num\">failed</th>\
             <th class=\"num\">unfinished</th><th>created</th><th>control</th></tr></thead><tbody>",
        );
        let c = csrf(&session);
        for b in &rows {
            let total = i64::from(b.documents).max(b.enqueued).max(1);
            let done = b.succeeded + b.failed;
            let pause = format!(
                "<form method=\"post\" action=\"/ui/batches/{}/pause\" class=\"inline\">{c}\
                 <input name=\"reason\" placeholder=\"reason (optional)\">\
                 <button type=\"submit\" class=\"danger\" data-action=\"pause\">Pause</button></form>",
                b.id
            );
            let resume = format!(
                "<form method=\"post\" action=\"/ui/batches/{}/resume\" class=\"inline\">{c}\
                 <button type=\"submit\" data-action=\"resume\">Resume</button></form>",
                b.id
            );
            let cancel = format!(
                "<form method=\"post\" action=\"/ui/batches/{}/cancel\" class=\"inline\">{c}\
                 <input name=\"reason\" placeholder=\"reason (optional)\">\
                 <button type=\"submit\" class=\"danger\" data-action=\"cancel\">Cancel</button></form>",
                b.id
            );
            // The controls `agentq batch pause` / `resume` / `cancel` allow in each state.
            let control = match b.status.as_str() {
                "running" => format!("{pause}{cancel}"),
                "canary" => format!("{pause}{resume}{cancel}"),
                "paused" => format!("{resume}{cancel}"),
                _ => String::new(),
            };
            body.push_str(&format!(
                "<tr data-batch=\"{id}\"><td><a class=\"mono\" href=\"/ui/operations?batch={id}\">{}</a></td>\
                 <td>{}</td><td>{}</td><td>{}{}</td>\
                 <td><progress value=\"{done}\" max=\"{total}\"></progress> {done}/{total}</td>\
                 <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                 <td>{}</td><td>{control}</td></tr>",
                &b.id.to_string()[..8],
                esc(&b.tenant_id),
                esc(&b.kind),
                badge(b.status.as_str()),
                b.paused_reason
                    .as_deref()
                    .map(|r| format!("<div class=\"muted\">{}</div>", esc(r)))
                    .unwrap_or_default(),
                b.succeeded,
                b.failed,
                b.unfinished,
                time(b.created_at),
                id = b.id,
            ));
        }
        body.push_str("</tbody></table>");
    }
    Ok(html::page(&session, "Batches", "/ui/batches", &body))
}

/// `POST /ui/batches/{id}/pause`: `agentq batch pause`, through the application layer.
pub async fn pause(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let id = parse_uuid(&id, "batch")?;
    let reason = filled(&fields, "reason");
    let outcome = app::batches::pause(&state.api.app, &session.caller.app(), id, reason)
        .await
        .map(|()| {
            format!(
                "paused batch {id}: nothing new starts; running operations finish their current run"
            )
        });
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/batches"))
}

/// `POST /ui/batches/{id}/resume`: `agentq batch resume` (a paused batch, or the rest of a
/// canary), through the application layer.
pub async fn resume(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let id = parse_uuid(&id, "batch")?;
    let outcome = app::batches::resume(
        &state.api.app,
        &session.caller.app(),
        id,
        &app::batches::Quiet,
    )
    .await
    .map(|r| {
        format!(
            "resumed batch {id} (was {}): {} enqueued, {} queued operations re-dispatched",
            r.was, r.enqueued, r.redispatched
        )
    });
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/batches"))
}

/// `POST /ui/batches/{id}/cancel`: `agentq batch cancel`, through the application layer.
pub async fn cancel_batch(
    State(state): State<Arc<UiState>>,
    session: Session,
    Path(id): Path<String>,
    form: Result<Form<Fields>, FormRejection>,
) -> UiResult {
    let fields = session.check(form)?;
    let id = parse_uuid(&id, "batch")?;
    let reason = filled(&fields, "reason");
    let outcome = app::batches::cancel(&state.api.app, &session.caller.app(), id, reason)
        .await
        .map(|c| {
            format!(
                "cancelled batch {id}: {} operations cancelled, {} running ones stop at their next step",
                c.now, c.requested
            )
        });
    super::flash(&state, &session, outcome)?;
    Ok(back(&fields, "/ui/batches"))
}
