//! What a deployment runs, as every role sees it: the [`Catalog`] of its kinds (names,
//! versions, input schemas, whether only webhook deliveries may create them) and of the tools
//! its `agent` kind may name, with the one check of an input against its kind.
//!
//! The deployment's registry (`agentq_sdk::Registry`) and the registered services' kinds are
//! the catalog (`agentq_worker::ServedKinds`): a deployment builds one registry and hands it to
//! every role of its binary, so the producer, the API, the scheduler and the console check
//! exactly what the workers run. Nothing here reads a global.
//!
//! Invariant kept here: an input refused by [`Catalog::requires`] names where it is wrong
//! ([`InputError::pointer`], a JSON Pointer into the input), so a front end can say which field
//! to change.

use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;

use crate::operation::Requires;
use crate::state::Replay;

/// One kind of a deployment, as `agentq kinds` and `GET /v1/kinds` show it.
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct KindInfo {
    /// The name operations are enqueued with.
    pub name: String,
    /// Every version this binary registers, oldest first (natural order); new operations run
    /// on the newest one a live worker runs.
    pub versions: Vec<String>,
    /// Created only by a verified webhook delivery of a source of this kind (its input holds
    /// the source's configuration); an enqueue or a spawn of it is refused.
    pub webhook_only: bool,
    /// Registered for tests, demos and benchmarks, not for production tenants' work (the
    /// built-in `script`). An admin keeps it from a tenant with `agentq tenants kinds`.
    pub for_tests: bool,
    /// What the kind does, as its author registered it (may be empty).
    pub description: String,
    /// The JSON Schema (draft 2020-12) of the newest version's input, derived from its Rust type.
    /// An enqueue is checked against the type itself, which may say more than the schema can
    /// (a `tool_choice` must name one of `tools`, a sleep is at most 100 years).
    pub input_schema: Value,
    /// The service that runs the kind's newest version, for a remote kind (`agentq services`,
    /// docs/protocol.md); absent for a kind of the binary itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
}

/// One tool a deployment registered, which an `agent` operation may name in its `tools` and
/// `approval` lists.
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct ToolInfo {
    /// The name the model calls it by, and its steps' name in the journal.
    pub name: String,
    /// What it does, as the model reads it.
    pub description: String,
    /// The JSON Schema of its arguments, as the model receives it.
    pub parameters: Value,
    /// `safe`: repeating a call with the same idempotency key is harmless. `unsafe`: a call
    /// whose outcome a crash lost is reconciled, or the operation stops as
    /// `unknown_side_effect`.
    pub replay: Replay,
    /// Every call waits for a human's approval (signal `approval`), whatever the operation's
    /// `approval` list says.
    pub requires_approval: bool,
}

/// Why an input does not fit its kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputError {
    /// Where in the input: a JSON Pointer (`/steps/0/work_ms`), empty for the input as a whole.
    pub pointer: String,
    /// What is wrong there and what to do, for a person.
    pub message: String,
}

impl InputError {
    /// An error about the whole input.
    pub fn whole(message: impl Into<String>) -> Self {
        Self {
            pointer: String::new(),
            message: message.into(),
        }
    }

    /// An error at `pointer` (a JSON Pointer into the input).
    pub fn at(pointer: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            pointer: pointer.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for InputError {
    /// `steps[1].fail: needs "times"`: the place as a person reads it (see [`path`]), then
    /// what is wrong there.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pointer.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", path(&self.pointer), self.message)
        }
    }
}

/// A decoder's (serde's) message about an input, in the words of the input's author: `missing
/// field `times`` is `needs "times"`, `unknown field `x`, expected one of `a`, `b`` names the
/// fields there are, a Rust integer type is a range, and an untagged enum that nothing fit
/// points at the kind's schema instead of naming a Rust type.
pub fn readable(message: &str) -> String {
    let quoted = |list: &str| -> Vec<String> {
        list.split('`')
            .skip(1)
            .step_by(2)
            .map(|f| format!("\"{f}\""))
            .collect()
    };
    if let Some(name) = message
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        return format!("needs \"{name}\"");
    }
    for (head, what) in [("unknown field `", "field"), ("unknown variant `", "value")] {
        if let Some((name, rest)) = message.strip_prefix(head).and_then(|r| r.split_once('`')) {
            let known = quoted(rest);
            return match (what, known.is_empty()) {
                ("field", true) => format!("unknown field \"{name}\": this object takes no fields"),
                ("field", false) => format!(
                    "unknown field \"{name}\"; the fields here are {}",
                    known.join(", ")
                ),
                (_, true) => format!("unknown value \"{name}\""),
                _ => format!("unknown value \"{name}\"; use one of {}", known.join(", ")),
            };
        }
    }
    if message.starts_with("data did not match any variant of untagged enum") {
        return "fits none of the forms this field takes (`agentq kinds KIND` shows the kind's \
                input schema)"
            .into();
    }
    let Some((head, rust)) = message.rsplit_once(", expected ") else {
        return message.to_string();
    };
    let range = |min: i128, max: i128| format!("a whole number from {min} to {max}");
    let expected = match rust {
        "u8" => range(0, u8::MAX.into()),
        "u16" => range(0, u16::MAX.into()),
        "u32" => range(0, u32::MAX.into()),
        "u64" | "usize" => range(0, u64::MAX.into()),
        "i8" => range(i8::MIN.into(), i8::MAX.into()),
        "i16" => range(i16::MIN.into(), i16::MAX.into()),
        "i32" => range(i32::MIN.into(), i32::MAX.into()),
        "i64" | "isize" => range(i64::MIN.into(), i64::MAX.into()),
        "f32" | "f64" => "a number".into(),
        _ => return message.to_string(),
    };
    format!("{head}, expected {expected}")
}

/// A JSON Pointer as a person reads the place it names: `/steps/1/fail` is `steps[1].fail`, a
/// key that is not a plain name is quoted (`config["a b"]`).
pub fn path(pointer: &str) -> String {
    let mut out = String::new();
    for raw in pointer.split('/').skip(1) {
        let segment = raw.replace("~1", "/").replace("~0", "~");
        let plain = !segment.is_empty()
            && segment
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !segment.is_empty() && segment.chars().all(|c| c.is_ascii_digit()) {
            out.push_str(&format!("[{segment}]"));
        } else if plain {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&segment);
        } else {
            out.push_str(&format!("[{segment:?}]"));
        }
    }
    out
}

/// The kinds and tools a deployment runs, and the check of an input against its kind.
pub trait Catalog: Send + Sync {
    /// Every kind, by name.
    fn kinds(&self) -> Vec<KindInfo>;

    /// Whether `kind` is one of them (cheaper than [`Catalog::kinds`]).
    fn has_kind(&self, kind: &str) -> bool;

    /// Every registered tool, by name.
    fn tools(&self) -> Vec<ToolInfo>;

    /// Checks that `input` fits `kind` (which must be known) and returns what it requires
    /// beyond its shape (the stores it names, a webhook origin), for the caller to check
    /// before anything is written.
    fn requires(&self, kind: &str, input: &Value) -> Result<Requires, InputError>;
}

/// The names of `catalog`'s kinds, for a message listing them.
pub fn names(catalog: &dyn Catalog) -> String {
    let names: Vec<String> = catalog.kinds().into_iter().map(|k| k.name).collect();
    names.join(", ")
}

/// `segments` (map keys and array indexes, outermost first) as a JSON Pointer (RFC 6901).
pub fn pointer<'a>(segments: impl IntoIterator<Item = &'a str>) -> String {
    segments.into_iter().fold(String::new(), |mut p, s| {
        p.push('/');
        p.push_str(&s.replace('~', "~0").replace('/', "~1"));
        p
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_escape_tilde_and_slash() {
        assert_eq!(pointer(["steps", "0", "work_ms"]), "/steps/0/work_ms");
        assert_eq!(pointer(["a/b", "c~d"]), "/a~1b/c~0d");
        assert_eq!(pointer([]), "");
    }

    #[test]
    fn serde_messages_read_as_the_input_author_would_write_them() {
        assert_eq!(readable("missing field `times`"), "needs \"times\"");
        assert_eq!(
            readable("unknown field `txt`, expected `text`"),
            "unknown field \"txt\"; the fields here are \"text\""
        );
        assert_eq!(
            readable("unknown field `x`, expected one of `a`, `b`"),
            "unknown field \"x\"; the fields here are \"a\", \"b\""
        );
        assert_eq!(
            readable("unknown variant `fast`, expected one of `safe`, `unsafe`"),
            "unknown value \"fast\"; use one of \"safe\", \"unsafe\""
        );
        assert_eq!(
            readable("invalid value: integer `-1`, expected u32"),
            "invalid value: integer `-1`, expected a whole number from 0 to 4294967295"
        );
        assert_eq!(
            readable("invalid type: string \"x\", expected a boolean"),
            "invalid type: string \"x\", expected a boolean"
        );
        assert!(!readable("data did not match any variant of untagged enum Step").contains("enum"));
    }

    #[test]
    fn a_pointer_reads_as_a_path() {
        assert_eq!(path("/steps/0/work_ms"), "steps[0].work_ms");
        assert_eq!(path("/variants/v2/3/then/0"), "variants.v2[3].then[0]");
        assert_eq!(path("/a~1b/c d"), "[\"a/b\"][\"c d\"]");
        assert_eq!(path(""), "");
    }

    #[test]
    fn an_input_error_names_its_place() {
        assert_eq!(
            InputError::at("/steps/0", "bad").to_string(),
            "steps[0]: bad"
        );
        assert_eq!(
            InputError::at("/steps/1/fail", "needs \"times\"").to_string(),
            "steps[1].fail: needs \"times\""
        );
        assert_eq!(InputError::whole("bad").to_string(), "bad");
    }
}
