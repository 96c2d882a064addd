//! The approval convention, encoded and decoded here only: a human's decision is the signal
//! [`SIGNAL`] (`approval`) with the payload `{"approved": bool, "by": name, "reason": text}`,
//! sent by `agentq approve` / `reject`, `POST /v1/operations/{id}/approve|reject` and the
//! console's buttons (all through `agentq_app::operations::decide`), and read by the agent's
//! approval-gated tools, `script`'s signal waits and `doc_migration`'s review.
//! [`APPROVAL_SIGNALS`] are the signals whose sending is an operator's act.

use serde_json::{Value, json};

/// The signal an approval-gated step waits for.
pub const SIGNAL: &str = "approval";

/// Signals that approve or reject: `approval` (the agent's approval-gated tools, `agentq
/// approve` / `reject`) and `review` (`doc_migration`'s low-confidence review). Sending one is
/// an operator's act (see `AGENTQ_PRODUCER_MAY_APPROVE`).
pub const APPROVAL_SIGNALS: [&str; 2] = [SIGNAL, "review"];

/// Whether `name` approves or rejects (one of [`APPROVAL_SIGNALS`]).
pub fn is_approval_signal(name: &str) -> bool {
    APPROVAL_SIGNALS.contains(&name)
}

/// The output a wait step carries while it waits: `{"about": about}`, what the job said it
/// needs from whoever sends the signal (`ctx.wait_for_signal_about`); `None` for a wait that
/// says nothing (`about` is null). The decided wait's output replaces it.
pub fn about_output(about: Value) -> Option<Value> {
    (!about.is_null()).then(|| json!({ "about": about }))
}

/// What a waiting step's output says the job needs (see [`about_output`]).
pub fn about_of(output: Option<&Value>) -> Option<&Value> {
    output?.get("about").filter(|v| !v.is_null())
}

/// What the built-in agent says about a pending approval-gated tool call: the tool, its
/// arguments and the text of the model turn that asked for it.
pub fn tool_call_about(tool: &str, arguments: &Value, text: &str) -> Value {
    json!({ "tool": tool, "arguments": arguments, "text": text })
}

/// A decision as a signal's payload carries it. Read leniently: a payload that is not an
/// object, or lacks `approved`, is neither an approval nor a rejection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// `Some(true)` approves, `Some(false)` rejects, `None` says neither.
    pub approved: Option<bool>,
    /// Who decided, as the sender named them.
    pub by: Option<String>,
    /// Why (an empty reason counts as none).
    pub reason: Option<String>,
}

impl Decision {
    /// A decision made by `by`.
    pub fn new(approved: bool, by: &str, reason: Option<&str>) -> Self {
        Self {
            approved: Some(approved),
            by: Some(by.to_string()),
            reason: reason.map(str::to_string),
        }
    }

    /// The signal's payload.
    pub fn payload(&self) -> Value {
        json!({ "approved": self.approved, "by": self.by, "reason": self.reason })
    }

    /// Reads a signal's payload.
    pub fn read(payload: &Value) -> Self {
        let text = |k: &str| {
            payload
                .get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        Self {
            approved: payload.get("approved").and_then(Value::as_bool),
            by: text("by"),
            reason: text("reason"),
        }
    }

    /// True only for an explicit approval.
    pub fn is_approved(&self) -> bool {
        self.approved == Some(true)
    }

    /// True only for an explicit rejection.
    pub fn is_rejected(&self) -> bool {
        self.approved == Some(false)
    }

    /// "rejected by {by}: {reason}", naming the payload's `by`, else `sent_by` (who sent the
    /// signal), else "a reviewer"; the reason, else "no reason given".
    pub fn refusal(&self, sent_by: Option<&str>) -> String {
        format!(
            "rejected by {}: {}",
            self.by.as_deref().or(sent_by).unwrap_or("a reviewer"),
            self.reason.as_deref().unwrap_or("no reason given")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_reads_back_what_it_wrote() {
        let d = Decision::new(false, "ana", Some("wrong account"));
        assert_eq!(Decision::read(&d.payload()), d);
        assert!(d.is_rejected() && !d.is_approved());
        assert_eq!(d.refusal(Some("token:x")), "rejected by ana: wrong account");
    }

    #[test]
    fn a_waits_about_reads_back_and_null_says_nothing() {
        let about = tool_call_about("kv_put", &json!({ "key": "k" }), "saving it");
        let out = about_output(about.clone());
        assert_eq!(about_of(out.as_ref()), Some(&about));
        assert_eq!(about_output(Value::Null), None);
        assert_eq!(about_of(Some(&json!({ "payload": 1 }))), None);
        assert_eq!(about_of(None), None);
    }

    #[test]
    fn a_payload_without_a_decision_is_neither() {
        for p in [
            json!({}),
            json!("yes"),
            json!({ "approved": "true" }),
            json!(null),
        ] {
            let d = Decision::read(&p);
            assert!(!d.is_approved() && !d.is_rejected(), "{p}");
        }
        let d = Decision::read(&json!({ "approved": false, "reason": "" }));
        assert_eq!(
            d.refusal(Some("token:x")),
            "rejected by token:x: no reason given"
        );
        assert_eq!(d.refusal(None), "rejected by a reviewer: no reason given");
    }
}
