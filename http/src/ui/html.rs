//! HTML building blocks of the console: escaping, the page frame, forms with the CSRF token,
//! and inline SVG charts. No template engine and no JavaScript: pages are strings built here,
//! and every value from the database or the request passes through [`esc`].

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, Utc};

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

/// Escapes text for HTML element content and quoted attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
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

/// The hidden CSRF field of a form of `session`.
pub fn csrf(session: &Session) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        esc(&session.csrf)
    )
}

/// A status as a coloured badge.
pub fn badge(status: &str) -> String {
    let class = match status {
        "succeeded" | "resolved" | "retried" => "ok",
        "dead" | "open" | "crash_loop" => "bad",
        "running" | "queued" | "canary" | "active" => "busy",
        "waiting" | "sleeping" | "paused" => "wait",
        _ => "muted",
    };
    format!("<span class=\"badge {class}\">{}</span>", esc(status))
}

const NAV: [(&str, &str); 8] = [
    ("/ui", "Overview"),
    ("/ui/operations", "Operations"),
    ("/ui/dlq", "Dead letters"),
    ("/ui/approvals", "Approvals"),
    ("/ui/batches", "Batches"),
    ("/ui/versions", "Versions"),
    ("/ui/schedules", "Schedules"),
    ("/ui/kinds", "Kinds"),
];

/// A full console page for `session`, with `active` highlighted in the navigation.
pub fn page(session: &Session, title: &str, active: &str, body: &str) -> Response {
    let mut nav = String::new();
    for (href, label) in NAV {
        let class = if href == active {
            " class=\"active\""
        } else {
            ""
        };
        nav.push_str(&format!("<a href=\"{href}\"{class}>{label}</a>"));
    }
    let who = format!(
        "{} · {}",
        esc(&session.caller.prefix),
        match session.caller.scope() {
            Some(t) => format!("tenant {}", esc(t)),
            None => "admin: all tenants".into(),
        }
    );
    let flash = session
        .flash
        .as_deref()
        .map(|f| {
            let class = if f.starts_with("refused") || f.starts_with("failed") {
                "flash error"
            } else {
                "flash"
            };
            format!("<p class=\"{class}\" id=\"flash\">{}</p>", esc(f))
        })
        .unwrap_or_default();
    let html = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · agentq</title><link rel=\"stylesheet\" href=\"/ui/console.css\"></head>\
         <body><header><span class=\"brand\">agentq</span><nav>{nav}</nav>\
         <span class=\"who\">{who}</span>\
         <form method=\"post\" action=\"/ui/logout\" class=\"inline\">{}\
         <button type=\"submit\" class=\"link\">Sign out</button></form></header>\
         <main>{flash}{body}</main></body></html>",
        esc(title),
        csrf(session),
    );
    Html(html).into_response()
}

/// A page without navigation (sign-in, errors).
pub fn bare(title: &str, body: &str) -> Html<String> {
    Html(format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · agentq</title><link rel=\"stylesheet\" href=\"/ui/console.css\"></head>\
         <body><main>{body}</main></body></html>",
        esc(title)
    ))
}

/// An error answer as a page.
pub fn error_page(status: StatusCode, message: &str) -> Response {
    let body = format!(
        "<section class=\"login\"><h1>{} {}</h1><p class=\"flash error\">{}</p>\
         <p><a href=\"/ui\">Back to the console</a></p></section>",
        status.as_u16(),
        esc(status.canonical_reason().unwrap_or("")),
        esc(message)
    );
    (status, bare("Error", &body)).into_response()
}

/// A bar chart of one value per minute as inline SVG; `fmt` labels the largest value.
pub fn bar_chart(
    title: &str,
    points: &[(DateTime<Utc>, f64)],
    fmt: impl Fn(f64) -> String,
) -> String {
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
    let mut svg = format!(
        "<figure class=\"chart\"><figcaption>{}</figcaption>\
         <svg viewBox=\"0 0 {W} {H}\" width=\"100%\" role=\"img\" aria-label=\"{}\">\
         <line x1=\"40\" y1=\"{y0}\" x2=\"{W}\" y2=\"{y0}\" stroke=\"#999\"/>\
         <text x=\"36\" y=\"{top}\" text-anchor=\"end\" font-size=\"10\">{}</text>\
         <text x=\"36\" y=\"{y0}\" text-anchor=\"end\" font-size=\"10\">0</text>",
        esc(title),
        esc(title),
        esc(&fmt(max)),
        y0 = H - PAD,
        top = PAD + 4.0,
    );
    for (i, (at, v)) in points.iter().enumerate() {
        let h = v * scale;
        let x = 40.0 + i as f64 * bw;
        svg.push_str(&format!(
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"#3b6fb6\">\
             <title>{} {}</title></rect>",
            H - PAD - h,
            (bw - 1.0).max(1.0),
            esc(&at.format("%H:%M").to_string()),
            esc(&fmt(*v)),
        ));
    }
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        svg.push_str(&format!(
            "<text x=\"40\" y=\"{H}\" font-size=\"10\">{}</text>\
             <text x=\"{W}\" y=\"{H}\" font-size=\"10\" text-anchor=\"end\">{}</text>",
            first.0.format("%H:%M"),
            last.0.format("%H:%M")
        ));
    }
    svg.push_str("</svg></figure>");
    svg
}

/// A JSON value, pretty-printed and escaped, in a `<pre>`.
pub fn json_block(v: &serde_json::Value) -> String {
    format!(
        "<pre class=\"json\">{}</pre>",
        esc(&serde_json::to_string_pretty(v).unwrap_or_default())
    )
}

/// Replaces the value of every object key in `keys`, at any depth, with `"[redacted]"`.
pub fn redact(value: &mut serde_json::Value, keys: &[String]) {
    if keys.is_empty() {
        return;
    }
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                if keys.iter().any(|r| r == k) {
                    *v = serde_json::Value::String("[redacted]".into());
                } else {
                    redact(v, keys);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(|v| redact(v, keys)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_replaces_named_keys_at_any_depth() {
        let mut v =
            serde_json::json!({ "email": "a@b", "doc": { "items": [{ "email": "c@d", "x": 1 }] } });
        redact(&mut v, &["email".to_string()]);
        assert_eq!(
            v,
            serde_json::json!({ "email": "[redacted]", "doc": { "items": [{ "email": "[redacted]", "x": 1 }] } })
        );
    }
}
