//! The input of `doc_migration`: its shape, its defaults and the checks made at enqueue (a
//! document identity that stays under a store's root, stores named, never places), and what it
//! requires of its tenant (the stores it names, readable and writable).

use std::path::{Component, Path};
use std::time::Duration;

use agentq_core::db::stores::{self, Access, Need};
use agentq_core::operation::Requires;
use serde::{Deserialize, Serialize};
use serde_json::Value;

const DEFAULT_CHUNK_CHARS: usize = 8000;
const CHUNK_CHARS_RANGE: std::ops::RangeInclusive<usize> = 64..=1_000_000;
const DEFAULT_REVIEW_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// Input of `doc_migration`, checked in full at enqueue (a bad one is refused, exit code 2),
/// the stores it names included: the tenant must have them (see [`requires`]).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "RawInput")]
pub struct DocMigrationInput {
    /// The document's identity: a path relative to the source store's directory, or the row
    /// key of a table store. Never absolute, never with a `..` segment.
    pub doc_id: String,
    /// The store read from (registered by an admin for the tenant, with read access).
    pub source: String,
    /// The store written to (registered with write access).
    pub target: String,
    pub instructions: String,
    /// Largest chunk sent to the model, in characters (Unicode scalar values).
    pub chunk_chars: usize,
    pub validate: Validate,
    /// How long a low-confidence document waits for its `review` signal.
    pub review_timeout: Duration,
}

/// What an input needs beyond its shape: its source store readable and its target store
/// writable by its tenant (the producer checks both before writing anything).
pub fn requires(input: &DocMigrationInput) -> Requires {
    Requires {
        stores: vec![
            Need {
                field: "source.store",
                store: input.source.clone(),
                access: Access::Read,
            },
            Need {
                field: "target.store",
                store: input.target.clone(),
                access: Access::Write,
            },
        ],
        ..Requires::default()
    }
}

/// Checks of the migrated text.
#[derive(Clone, Debug, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Validate {
    /// Strings the output must contain; a missing one fails the document (non-retryable).
    #[serde(default)]
    pub required: Vec<String>,
    /// An output/input length ratio (in characters) below this flags low confidence.
    #[serde(default)]
    pub min_ratio: Option<f64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawInput {
    doc_id: String,
    source: RawStore,
    target: RawStore,
    instructions: String,
    #[serde(default)]
    chunk_chars: Option<usize>,
    #[serde(default)]
    validate: Validate,
    #[serde(default)]
    review: RawReview,
}

/// `{"store": NAME}`. The fields of the inputs before stores (`dir`, `table`, `id_column`,
/// `body_column`) are recognised only to say what to do instead.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawStore {
    /// The name of a store an admin registered for the tenant (`agentq stores add`).
    store: Option<String>,
    #[schemars(skip)]
    dir: Option<Value>,
    #[schemars(skip)]
    table: Option<Value>,
    #[schemars(skip)]
    id_column: Option<Value>,
    #[schemars(skip)]
    body_column: Option<Value>,
}

impl RawStore {
    fn name(self, field: &str, access: &str) -> Result<String, String> {
        let named_a_place = self.dir.is_some()
            || self.table.is_some()
            || self.id_column.is_some()
            || self.body_column.is_some();
        match self.store {
            Some(name) if !named_a_place => {
                stores::check_name(&name).map_err(|e| format!("{field}.store: {e}"))?;
                Ok(name)
            }
            _ if named_a_place => Err(format!(
                "{field}: an input names a store, never a directory or a table (a doc_migration \
                 reads and writes only what an admin registered for its tenant); register it \
                 with `agentq stores add --tenant T --name NAME --dir PATH|--table NAME --access \
                 {access}` and give {{\"store\": \"NAME\"}}"
            )),
            _ => Err(format!(
                "{field}: give {{\"store\": \"NAME\"}}, a store registered with `agentq stores add`"
            )),
        }
    }
}

#[derive(Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawReview {
    timeout_ms: Option<u64>,
}

impl TryFrom<RawInput> for DocMigrationInput {
    type Error = String;

    fn try_from(raw: RawInput) -> Result<Self, String> {
        check_doc_id(&raw.doc_id)?;
        let source = raw.source.name("source", "read")?;
        let target = raw.target.name("target", "write")?;
        let chunk_chars = raw.chunk_chars.unwrap_or(DEFAULT_CHUNK_CHARS);
        if !CHUNK_CHARS_RANGE.contains(&chunk_chars) {
            return Err(format!(
                "chunk_chars: {chunk_chars} is not between {} and {}",
                CHUNK_CHARS_RANGE.start(),
                CHUNK_CHARS_RANGE.end()
            ));
        }
        if raw.validate.required.iter().any(String::is_empty) {
            return Err("validate.required: the strings must not be empty".into());
        }
        if let Some(r) = raw.validate.min_ratio
            && !(r.is_finite() && r >= 0.0)
        {
            return Err("validate.min_ratio: must be a number ≥ 0".into());
        }
        let timeout_ms = raw.review.timeout_ms.unwrap_or(DEFAULT_REVIEW_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err("review.timeout_ms: must be more than 0".into());
        }
        agentq_worker::context::check_park("review.timeout_ms", Duration::from_millis(timeout_ms))?;
        Ok(Self {
            doc_id: raw.doc_id,
            source,
            target,
            instructions: raw.instructions,
            chunk_chars,
            validate: raw.validate,
            review_timeout: Duration::from_millis(timeout_ms),
        })
    }
}

/// A document identity may name a file under a root, so it must stay under it.
fn check_doc_id(doc_id: &str) -> Result<(), String> {
    if doc_id.is_empty() {
        return Err("doc_id must not be empty".into());
    }
    if doc_id.len() > 1024 || doc_id.contains('\0') {
        return Err("doc_id must be at most 1024 bytes, without NUL".into());
    }
    if doc_id.starts_with('/') || Path::new(doc_id).is_absolute() {
        return Err(format!("doc_id {doc_id:?} must be relative, not absolute"));
    }
    if doc_id.split('/').any(|s| s == "..") {
        return Err(format!(
            "doc_id {doc_id:?} must not contain a \"..\" segment"
        ));
    }
    if !Path::new(doc_id)
        .components()
        .any(|c| matches!(c, Component::Normal(_)))
    {
        return Err(format!("doc_id {doc_id:?} names no file"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::registry;

    fn input(v: Value) -> Result<(), String> {
        registry().check_input("doc_migration", &v)
    }

    #[test]
    fn inputs_are_checked_at_enqueue() {
        let good = json!({
            "doc_id": "reports/2024/q1.md",
            "source": { "store": "legacy" },
            "target": { "store": "migrated" },
            "instructions": "Convert to Markdown.",
        });
        input(good.clone()).unwrap();
        let needs =
            agentq_core::kinds::Catalog::requires(&registry(), "doc_migration", &good).unwrap();
        assert_eq!(
            needs.stores,
            vec![
                Need {
                    field: "source.store",
                    store: "legacy".into(),
                    access: Access::Read
                },
                Need {
                    field: "target.store",
                    store: "migrated".into(),
                    access: Access::Write
                },
            ]
        );
        assert!(!needs.webhook_only);
        let with = |patch: Value| {
            let mut v = good.clone();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            input(v)
        };
        with(json!({
            "chunk_chars": 4000,
            "validate": { "required": ["Title:"], "min_ratio": 0.2 },
            "review": { "timeout_ms": 60000 },
        }))
        .unwrap();

        for (patch, says) in [
            (json!({ "doc_id": "" }), "doc_id must not be empty"),
            (json!({ "doc_id": "../etc/passwd" }), "\"..\""),
            (json!({ "doc_id": "a/../../b" }), "\"..\""),
            (json!({ "doc_id": "/etc/passwd" }), "relative"),
            (json!({ "doc_id": "." }), "names no file"),
            // A place instead of a store is refused, saying what to register.
            (json!({ "source": { "dir": "/" } }), "agentq stores add"),
            (
                json!({ "source": { "table": "webhook_secrets" } }),
                "never a directory or a table",
            ),
            (
                json!({ "target": { "store": "out", "dir": "/tmp" } }),
                "never a directory or a table",
            ),
            (json!({ "source": {} }), "{\"store\": \"NAME\"}"),
            (json!({ "target": { "store": "a/b" } }), "target.store"),
            (json!({ "target": { "store": "" } }), "target.store"),
            (json!({ "chunk_chars": 0 }), "chunk_chars"),
            (json!({ "validate": { "required": [""] } }), "required"),
            (json!({ "validate": { "min_ratio": -1 } }), "min_ratio"),
            (json!({ "review": { "timeout_ms": 0 } }), "timeout_ms"),
            (json!({ "review": { "timeout": 5 } }), "unknown field"),
            (
                json!({ "source": { "store": "a", "path": "/" } }),
                "unknown field",
            ),
            (json!({ "extra": true }), "unknown field"),
        ] {
            let e = with(patch.clone()).expect_err(&patch.to_string());
            assert!(e.contains(says), "{patch}: {e}");
        }
        let mut missing = good.clone();
        missing.as_object_mut().unwrap().remove("instructions");
        assert!(input(missing).is_err());
    }
}
