//! What a deployment runs, as every role sees it: the [`Catalog`] of its kinds (names,
//! versions, input schemas, whether only webhook deliveries may create them) and of the tools
//! its `agent` kind may name, with the one check of an input against its kind.
//!
//! The worker's registry (`agentq_worker::Registry`) is the catalog: a deployment builds one
//! registry and hands it to every role of its binary, so the producer, the API, the scheduler
//! and the console check exactly what the workers run. Nothing here reads a global.
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
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pointer.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "at {}: {}", self.pointer, self.message)
        }
    }
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
    fn an_input_error_names_its_place() {
        assert_eq!(
            InputError::at("/steps/0", "bad").to_string(),
            "at /steps/0: bad"
        );
        assert_eq!(InputError::whole("bad").to_string(), "bad");
    }
}
