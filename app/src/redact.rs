//! Redaction: the values of the JSON keys of `AGENTQ_CONSOLE_REDACT`
//! ([`crate::Settings::redact`]) shown as `"[redacted]"` wherever agentq shows a payload, a
//! journal step's output or a wait's context (the console, the API, the CLI, the event stream).

use serde_json::Value;

use crate::App;

/// The keys of `AGENTQ_CONSOLE_REDACT` (comma-separated, blanks ignored).
pub fn redact_keys(list: Option<&str>) -> Vec<String> {
    list.unwrap_or_default()
        .split(',')
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .collect()
}

/// Replaces the value of every object key in `keys`, at any depth, with `"[redacted]"`,
/// also inside strings that hold JSON (a model's tool call carries its arguments as JSON text).
pub fn redact(value: &mut Value, keys: &[String]) {
    if keys.is_empty() {
        return;
    }
    match value {
        Value::String(text) if text.trim_start().starts_with(['{', '[']) => {
            if let Ok(mut inner) = serde_json::from_str::<Value>(text) {
                let before = inner.clone();
                redact(&mut inner, keys);
                if inner != before {
                    *text = inner.to_string();
                }
            }
        }
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                if keys.iter().any(|r| r == k) {
                    *v = Value::String("[redacted]".into());
                } else {
                    redact(v, keys);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| redact(v, keys)),
        _ => {}
    }
}

/// Redacts the `about` a wait's step event carries (the event stream serves it).
pub fn redact_event(app: &App, data: &mut Value) {
    if let Some(about) = data.get_mut("about") {
        redact(about, &app.settings.redact);
    }
}

/// Redacts the `AGENTQ_CONSOLE_REDACT` keys in the outputs of journal `steps` (a model turn's
/// tool call carries its arguments): every reader of a journal (the API, the CLI, the console)
/// sees them as the approval views do.
pub fn redact_steps(app: &App, steps: &mut [agentq_core::operation::StepView]) {
    for s in steps {
        if let Some(out) = &mut s.output {
            redact(out, &app.settings.redact);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_replaces_named_keys_at_any_depth() {
        let mut v =
            serde_json::json!({ "email": "a@b", "doc": { "items": [{ "email": "c", "x": 1 }] } });
        redact(&mut v, &["email".to_string()]);
        assert_eq!(
            v,
            serde_json::json!({ "email": "[redacted]", "doc": { "items": [{ "email": "[redacted]", "x": 1 }] } })
        );
        let mut call = serde_json::json!({ "arguments": "{\"email\":\"a@b\",\"n\":1}" });
        redact(&mut call, &["email".to_string()]);
        assert_eq!(call["arguments"], "{\"email\":\"[redacted]\",\"n\":1}");
        assert_eq!(redact_keys(Some(" a, ,b ")), vec!["a", "b"]);
        assert!(redact_keys(None).is_empty());
    }
}
