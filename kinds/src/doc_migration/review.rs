//! The `validate` step (required strings, output/input ratio, the chunks' lowest confidence)
//! and the human review a low-confidence document waits for: the `review` signal's decision.

use std::time::Duration;

use agentq_worker::JobError;
use serde_json::Value;

use super::{LOW_CONFIDENCE, Validate, Verdict};

/// The `validate` step: a failure is non-retryable (the same output fails the same way);
/// low confidence is a verdict, not a failure.
pub(super) fn validate(
    rules: &Validate,
    input: &str,
    output: &str,
    confidence: f64,
) -> Result<Verdict, JobError> {
    if output.trim().is_empty() {
        return Err(JobError::NonRetryable(
            "validation failed: the output is empty".into(),
        ));
    }
    let missing: Vec<String> = rules
        .required
        .iter()
        .filter(|s| !output.contains(s.as_str()))
        .map(|s| format!("{s:?}"))
        .collect();
    if !missing.is_empty() {
        let what = if missing.len() == 1 {
            "string"
        } else {
            "strings"
        };
        return Err(JobError::NonRetryable(format!(
            "validation failed: the output lacks the required {what} {}",
            missing.join(", ")
        )));
    }
    let chars_in = input.chars().count();
    let chars_out = output.chars().count();
    let ratio = chars_out as f64 / chars_in.max(1) as f64;
    let low_confidence =
        confidence < LOW_CONFIDENCE || rules.min_ratio.is_some_and(|min| ratio < min);
    Ok(Verdict {
        confidence,
        ratio,
        low_confidence,
        chars_in,
        chars_out,
    })
}

/// A reviewer's answer, the payload of the `review` signal.
#[derive(Debug, PartialEq)]
pub(super) enum Decision {
    Approve,
    Edit(String),
    Reject(String),
}

/// Reads `{"decision": "approve"}`, `{"decision": "edit", "text": …}` or `{"decision":
/// "reject", "reason": …}`; the approval convention's `{"approved": bool, "reason"}` works too.
/// An unreadable payload is an error naming the expected shapes.
pub(super) fn review_decision(payload: &Value) -> Result<Decision, String> {
    let approval = agentq_core::approval::Decision::read(payload);
    let reason = || {
        approval
            .reason
            .clone()
            .unwrap_or_else(|| "no reason given".to_string())
    };
    match (
        payload.get("decision").and_then(Value::as_str),
        approval.approved,
    ) {
        (Some("approve"), _) | (None, Some(true)) => Ok(Decision::Approve),
        (Some("reject"), _) | (None, Some(false)) => Ok(Decision::Reject(reason())),
        (Some("edit"), _) => match payload.get("text").and_then(Value::as_str) {
            Some(text) if !text.trim().is_empty() => Ok(Decision::Edit(text.to_string())),
            _ => Err("review signal: an \"edit\" decision needs a non-empty \"text\"".into()),
        },
        _ => Err(
            "review signal payload is not a decision: expected {\"decision\": \"approve\"}, \
             {\"decision\": \"edit\", \"text\": …} or {\"decision\": \"reject\", \"reason\": …}"
                .into(),
        ),
    }
}

pub(super) fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(3_600_000) {
        format!("{} h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{} min", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn validation_names_missing_strings_and_flags_low_confidence() {
        let rules = Validate {
            required: vec!["Title:".into(), "Date:".into()],
            min_ratio: Some(0.5),
        };
        let ok = validate(&rules, "Title: a\nDate: b", "Title: A\nDate: B", 0.9).unwrap();
        assert!(!ok.low_confidence);
        assert_eq!(ok.ratio, 1.0);

        let e = validate(&rules, "x", "Date: b", 1.0).unwrap_err();
        assert_eq!(e.class(), "non_retryable");
        assert_eq!(
            e.to_string(),
            "validation failed: the output lacks the required string \"Title:\""
        );
        let e = validate(&rules, "x", "nothing", 1.0).unwrap_err();
        assert!(
            e.to_string().contains("strings \"Title:\", \"Date:\""),
            "{e}"
        );
        let e = validate(&Validate::default(), "x", " \n ", 1.0).unwrap_err();
        assert_eq!(e.to_string(), "validation failed: the output is empty");

        assert!(
            validate(&rules, "x", "Title: Date:", 0.4)
                .unwrap()
                .low_confidence
        );
        let short = validate(&rules, &"x".repeat(100), "Title: Date:", 1.0).unwrap();
        assert!(short.low_confidence, "ratio {}", short.ratio);
        assert!(
            !validate(&Validate::default(), &"x".repeat(100), "y", 1.0)
                .unwrap()
                .low_confidence,
            "no min_ratio, no ratio check"
        );
    }

    #[test]
    fn review_payloads_decide() {
        assert_eq!(
            review_decision(&json!({ "decision": "approve" })),
            Ok(Decision::Approve)
        );
        assert_eq!(
            review_decision(&json!({ "decision": "edit", "text": "new" })),
            Ok(Decision::Edit("new".into()))
        );
        assert_eq!(
            review_decision(&json!({ "decision": "reject", "reason": "wrong tone" })),
            Ok(Decision::Reject("wrong tone".into()))
        );
        assert_eq!(
            review_decision(&json!({ "approved": false })),
            Ok(Decision::Reject("no reason given".into()))
        );
        assert_eq!(
            review_decision(&json!({ "approved": true })),
            Ok(Decision::Approve)
        );
        assert!(review_decision(&json!({ "decision": "edit" })).is_err());
        assert!(review_decision(&json!({ "decision": "maybe" })).is_err());
        assert!(review_decision(&Value::Null).is_err());
        assert_eq!(human_duration(Duration::from_millis(86_400_000)), "24 h");
        assert_eq!(human_duration(Duration::from_millis(1500)), "1500 ms");
    }
}
