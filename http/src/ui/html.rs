//! HTML building blocks of the console, on maud's compile-checked `html!` templates: the page
//! frame, the CSRF field every form carries, badges, inline SVG charts and JSON blocks
//! (payloads come redacted from `agentq_app`). No JavaScript. Every value spliced into markup
//! as `(value)` is escaped by maud; nothing here or in the pages uses `PreEscaped` (only maud's `DOCTYPE`).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, html};

use super::session::Session;

const CSS: &str = include_str!("console.css");

/// `GET /ui/console.css`.
pub async fn stylesheet() -> Response {
    let mut res = CSS.into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/css; charset=utf-8"),
    );
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=300"),
    );
    res
}

/// Percent-encodes a query-string value.
pub fn url(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A timestamp as `YYYY-MM-DD HH:MM:SS` UTC.
pub fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// A duration in seconds, short (`350 ms`, `4.2 s`, `3 min`, `2.5 h`).
pub fn secs(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

/// The first 8 characters of an id, as links to it show it.
pub fn short(id: impl ToString) -> String {
    id.to_string().chars().take(8).collect()
}

/// The hidden CSRF field of a form of `session`.
pub fn csrf(session: &Session) -> Markup {
    html! { input type="hidden" name="csrf" value=(session.csrf); }
}

/// A form posting to `action` on behalf of `session` (its CSRF field first), with `class`.
pub fn form(session: &Session, action: &str, class: Option<&str>, fields: Markup) -> Markup {
    html! {
        form method="post" action=(action) class=[class] { (csrf(session)) (fields) }
    }
}

/// An inline form acting on operation `op` (`/ui/operations/{op}/{action}`), which sends the
/// browser to `next` when done: every operation page's and list's action forms.
pub fn operation_form(
    session: &Session,
    op: uuid::Uuid,
    action: &str,
    next: &str,
    fields: Markup,
) -> Markup {
    form(
        session,
        &format!("/ui/operations/{op}/{action}"),
        Some("inline"),
        html! { input type="hidden" name="next" value=(next); (fields) },
    )
}

/// The optional `reason` field of an action's form.
pub fn reason_field() -> Markup {
    html! { input name="reason" placeholder="reason (optional)"; }
}

/// A status as a coloured badge.
pub fn badge(status: &str) -> Markup {
    let class = match status {
        "succeeded" | "resolved" | "retried" => "ok",
        "dead" | "open" | "crash_loop" => "bad",
        "running" | "queued" | "canary" | "active" => "busy",
        "waiting" | "sleeping" | "paused" => "wait",
        _ => "muted",
    };
    html! { span class={ "badge " (class) } { (status) } }
}

const NAV: [(&str, &str); 10] = [
    ("/ui", "Overview"),
    ("/ui/operations", "Operations"),
    ("/ui/dlq", "Dead letters"),
    ("/ui/approvals", "Approvals"),
    ("/ui/batches", "Batches"),
    ("/ui/versions", "Versions"),
    ("/ui/schedules", "Schedules"),
    ("/ui/pauses", "Pauses"),
    ("/ui/kinds", "Kinds"),
    ("/ui/limits", "Limits"),
];

/// The `<head>` of every console page.
fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · agentq" }
            link rel="stylesheet" href="/ui/console.css";
        }
    }
}

/// A full console page for `session`, with `active` highlighted in the navigation, and the
/// session's pending message (the outcome of its last action) above `body`.
pub fn page(session: &Session, title: &str, active: &str, body: Markup) -> Response {
    let flash_class = |f: &str| {
        if f.starts_with("refused") || f.starts_with("failed") {
            "flash error"
        } else {
            "flash"
        }
    };
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                header {
                    span class="brand" { "agentq" }
                    nav {
                        @for (href, label) in NAV {
                            a href=(href) class=[(href == active).then_some("active")] { (label) }
                        }
                    }
                    span class="who" {
                        (session.prefix) " · "
                        @match session.caller.scope() {
                            Some(t) => { "tenant " (t) }
                            None => "admin: all tenants",
                        }
                    }
                    (form(session, "/ui/logout", Some("inline"), html! {
                        button type="submit" class="link" { "Sign out" }
                    }))
                }
                main {
                    @if let Some(f) = &session.flash {
                        p class=(flash_class(f)) id="flash" { (f) }
                    }
                    (body)
                }
            }
        }
    };
    markup.into_response()
}

/// A page without navigation (sign-in, errors).
pub fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body { main { (body) } }
        }
    }
}

/// An error answer as a page.
pub fn error_page(status: StatusCode, message: &str) -> Response {
    let body = html! {
        section class="login" {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
            p class="flash error" { (message) }
            p { a href="/ui" { "Back to the console" } }
        }
    };
    (status, bare("Error", body)).into_response()
}

/// A bar chart of one value per minute as inline SVG; `fmt` labels the largest value.
pub fn bar_chart(
    title: &str,
    points: &[(DateTime<Utc>, f64)],
    fmt: impl Fn(f64) -> String,
) -> Markup {
    const W: f64 = 600.0;
    const H: f64 = 120.0;
    const PAD: f64 = 18.0;
    let max = points.iter().map(|p| p.1).fold(0.0, f64::max);
    let scale = if max > 0.0 {
        (H - PAD * 2.0) / max
    } else {
        0.0
    };
    let n = points.len().max(1) as f64;
    let bw = (W - 40.0) / n;
    let y0 = H - PAD;
    html! {
        figure class="chart" {
            figcaption { (title) }
            svg viewBox={ "0 0 " (W) " " (H) } width="100%" role="img" aria-label=(title) {
                line x1="40" y1=(y0) x2=(W) y2=(y0) stroke="#999" {}
                text x="36" y=(PAD + 4.0) text-anchor="end" font-size="10" { (fmt(max)) }
                text x="36" y=(y0) text-anchor="end" font-size="10" { "0" }
                @for (i, (at, v)) in points.iter().enumerate() {
                    @let h = v * scale;
                    rect x=(format!("{:.1}", 40.0 + i as f64 * bw))
                        y=(format!("{:.1}", H - PAD - h))
                        width=(format!("{:.1}", (bw - 1.0).max(1.0)))
                        height=(format!("{h:.1}")) fill="#3b6fb6" {
                        title { (at.format("%H:%M")) " " (fmt(*v)) }
                    }
                }
                @if let (Some(first), Some(last)) = (points.first(), points.last()) {
                    text x="40" y=(H) font-size="10" { (first.0.format("%H:%M")) }
                    text x=(W) y=(H) font-size="10" text-anchor="end" { (last.0.format("%H:%M")) }
                }
            }
        }
    }
}

/// A JSON value, pretty-printed, in a `<pre>`.
pub fn json_block(v: &serde_json::Value) -> Markup {
    html! { pre class="json" { (serde_json::to_string_pretty(v).unwrap_or_default()) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spliced_values_are_escaped_in_text_and_attributes() {
        let evil = "<script>alert(\"x\")</script>&";
        let markup = html! { p title=(evil) { (evil) } (badge(evil)) }.into_string();
        assert!(!markup.contains("<script>"), "{markup}");
        assert!(!markup.contains("\"x\""), "{markup}");
        assert!(markup.contains("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;"));
        let chart = bar_chart(evil, &[(Utc::now(), 1.0)], |_| evil.to_string()).into_string();
        assert!(!chart.contains("<script>"), "{chart}");
        let json = json_block(&serde_json::json!({ "k": evil })).into_string();
        assert!(!json.contains("<script>"), "{json}");
    }
}
