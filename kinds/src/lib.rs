//! agentq-kinds: agentq's built-in job kinds and their tools, written with the worker's public
//! SDK only ([`JobContext`](agentq_worker::JobContext), [`Tool`](agentq_worker::Tool),
//! [`Registry`]), as a user's own kind would be.
//!
//! - [`echo`]: input `{"text": …}`; one model step; output `{"text": …}`.
//! - [`script`]: a small JSON program for demos, smoke tests, benchmarks and crash tests.
//! - [`agent`]: the agent loop from JSON, with any registered tool: the built-in `kv_put`,
//!   `kv_get` (a key-value table per tenant), `ledger` (an unsafe side effect with reconcile)
//!   and `http_get` (`tools`, registered by [`register_builtin`] as a deployment registers its
//!   own), and a deployment's.
//! - `triage` (`triage.rs`): the webhook-triggered kind: summarize and classify an event, then
//!   post the result to the source's callback once.
//! - `doc_migration` (`doc_migration/`): one document of a migration, chunked through the
//!   model, validated, reviewed on low confidence, written idempotently.
//! - [`outbound`]: the one HTTP client of `http_get` and `triage`'s callback.
//! - [`tables`]: the built-in kinds' own tables (`agent_kv`, `ledger_effects`, `doc_migration`'s
//!   source and target tables): the crate's only SQL.
//!
//! Invariant kept here: a kind takes host resources (tables, directories, URLs) only from what
//! an operator registered or allowed, never from its input.

use agentq_worker::Registry;

pub mod agent;
mod doc_migration;
pub mod echo;
pub use agentq_core::outbound;
pub mod script;
pub mod tables;
mod tools;
mod triage;

/// Registers the built-in kinds (`echo`, `script`, `agent`, `triage`, `doc_migration`) and
/// tools (`kv_put`, `kv_get`, `ledger`, `http_get`) in `r`, next to a deployment's own.
pub fn register_builtin(r: &mut Registry) {
    r.register("echo", echo::echo)
        .describe("Sends its text to the model and returns the answer: a smoke test.");
    for version in script_versions() {
        r.register_version("script", &version, script::script)
            .describe(
                "A small JSON program of work, tool calls, model calls, sleeps, waits, spawns and \
             failures: for demos, tests and benchmarks.",
            )
            .for_tests();
    }
    register_agent(r);
    tools::register(r);
    // triage's configuration comes from its webhook source: a producer cannot supply one.
    r.register("triage", triage::triage)
        .webhook_only()
        .describe(
            "Summarizes and labels a webhook delivery, then posts the result to the source's \
             callback once.",
        );
    r.register("doc_migration", doc_migration::doc_migration)
        .requires(doc_migration::requires)
        .describe(
            "Migrates one document from a source store to a target store through the model, \
             validated, reviewed by a human on low confidence, written idempotently.",
        );
}

/// Registers the `agent` kind alone: the agent loop over the tools `r` registers (none of the
/// built-in ones unless [`register_builtin`] registers them too). For a deployment that offers
/// only its own tools to its agents.
pub fn register_agent(r: &mut Registry) {
    r.register("agent", agent::agent)
        .requires(agent::requires)
        .describe(
            "The agent loop: model turns and calls of the registered tools it names, any of \
             them behind a human's approval.",
        );
}

/// Test hook: the versions of `script` a worker registers, comma-separated (default `1`), so
/// that tests run workers of different versions of one kind; with
/// [`script::VARIANT_VAR`] and the input's `variants` a test chooses each
/// version's steps. A version that is not valid is left out with a warning.
pub const SCRIPT_VERSIONS_VAR: &str = "AGENTQ_SCRIPT_VERSIONS";

fn script_versions() -> Vec<String> {
    let listed = std::env::var(SCRIPT_VERSIONS_VAR).unwrap_or_default();
    let mut versions: Vec<String> = Vec::new();
    for v in listed.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        match agentq_core::version::check(v) {
            Ok(()) if !versions.iter().any(|seen| seen == v) => versions.push(v.to_string()),
            Ok(()) => {}
            Err(e) => tracing::warn!("{SCRIPT_VERSIONS_VAR}: {e}; left out"),
        }
    }
    if versions.is_empty() {
        versions.push(agentq_core::version::DEFAULT.to_string());
    }
    versions
}

/// A registry holding the built-in kinds only: what `agentq worker` runs and what producers
/// check inputs against.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    register_builtin(&mut r);
    r
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_agent_tool_choice_must_name_one_of_its_tools() {
        let r = registry();
        let agent = |extra: serde_json::Value| {
            let mut input = json!({ "user": "hi", "tools": ["kv_put"] });
            input
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            r.check_input("agent", &input)
        };
        assert!(agent(json!({ "tool_choice": "kv_put" })).is_ok());
        assert!(agent(json!({ "tool_choice": "required" })).is_ok());
        assert!(agent(json!({})).is_ok());
        let refused = agent(json!({ "tool_choice": "ledger" })).unwrap_err();
        assert!(refused.contains("not one of tools"), "{refused}");
        assert!(agent(json!({ "tool_choice": "sometimes" })).is_err());
        assert!(
            agent(json!({ "bogus": 1 })).is_err(),
            "unknown fields stay refused"
        );
    }

    #[test]
    fn script_inputs_are_checked_before_anything_runs() {
        let r = registry();
        assert!(
            r.check_input("script", &json!({ "steps": [{ "work_ms": 5 }] }))
                .is_ok()
        );
        assert!(
            r.check_input(
                "script",
                &json!({ "steps": [{ "work_ms": 5, "bogus": 1 }] })
            )
            .is_err()
        );
        assert!(
            r.check_input(
                "script",
                &json!({ "steps": [{ "tool": "ledger", "replay": "maybe", "label": "x" }] })
            )
            .is_err()
        );
        assert!(
            r.check_input("script", &json!({ "steps": [{ "sleep": 5 }] }))
                .is_err()
        );
        // A step holds a worker slot for at most an hour.
        let long = r
            .check_input(
                "script",
                &json!({ "steps": [{ "work_ms": 1 }, { "work_ms": 1_000_000_000_000_000u64 }] }),
            )
            .unwrap_err();
        assert!(
            long.contains("steps[1].work_ms") && long.contains("1 hour"),
            "{long}"
        );
        let slow = r
            .check_input(
                "script",
                &json!({ "steps": [{ "tool": "ledger", "replay": "safe", "label": "x",
                                     "after_ms": 3_600_001 }] }),
            )
            .unwrap_err();
        assert!(slow.contains("steps[0].after_ms"), "{slow}");
        assert!(
            r.check_input("script", &json!({ "steps": [{ "work_ms": 3_600_000 }] }))
                .is_ok()
        );
        assert!(
            r.check_input("agent", &json!({ "user": "hi", "tools": ["kv_put"] }))
                .is_ok()
        );
        assert!(
            r.check_input("agent", &json!({ "tools": ["kv_put"] }))
                .is_err(),
            "user is required"
        );
        assert!(
            r.check_input("agent", &json!({ "user": "hi", "tools": ["rm_rf"] }))
                .is_err()
        );
    }

    /// Every built-in kind refuses a bad input at the place of the field at fault, in words:
    /// never a serde internal ("untagged enum", a Rust type name).
    #[test]
    fn every_built_in_kind_names_the_field_at_fault() {
        let r = registry();
        let doc = |extra: serde_json::Value| {
            let mut input = json!({ "doc_id": "a.md", "source": { "store": "in" },
                                    "target": { "store": "out" }, "instructions": "x" });
            input
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            input
        };
        let triage = |config: serde_json::Value| json!({ "event": {}, "source": "s", "webhook_id": "w", "config": config });
        let cases = [
            ("echo", json!({}), "needs \"text\""),
            (
                "echo",
                json!({ "text": 7 }),
                "text: invalid type: integer `7`, expected a string",
            ),
            (
                "script",
                json!({ "steps": [{ "work_ms": 1 }, { "fail": "retryable" }] }),
                "steps[1]: a \"fail\" step needs \"times\"",
            ),
            (
                "script",
                json!({ "steps": [{ "wait_signal": "go" }] }),
                "steps[0]: a \"wait_signal\" step needs \"timeout_ms\"",
            ),
            (
                "script",
                json!({ "steps": [{ "fail": "sometimes", "times": 1 }] }),
                "steps[0].fail: unknown value \"sometimes\"; use one of \"retryable\", \
                 \"non_retryable\", \"overloaded\"",
            ),
            (
                "script",
                json!({ "steps": [{ "work_ms": "x" }] }),
                "steps[0].work_ms: invalid type: string \"x\", expected a whole number from 0 to \
                 18446744073709551615",
            ),
            (
                "script",
                json!({ "steps": [{ "work_ms": 1, "times": 2 }] }),
                "steps[0]: \"times\" is not a field of a \"work_ms\" step, which takes: work_ms, \
                 deferred",
            ),
            (
                "script",
                json!({ "steps": [{ "work_ms": 1, "sleep_ms": 2 }] }),
                "steps[0]: a step is one instruction, and \"work_ms\" and \"sleep_ms\" are two: \
                 make them two steps",
            ),
            (
                "script",
                json!({ "steps": [{ "patched": "c", "then": [{ "tool": "ledger", "label": "x" }] }] }),
                "steps[0].then[0]: a \"tool\" step needs \"replay\"",
            ),
            (
                "script",
                json!({ "steps": [], "variants": { "v2": [{ "sleep_ms": u64::MAX }] } }),
                "variants.v2[0].sleep_ms: 18446744073709551 s is longer than the longest sleep \
                 or wait, 100 years (3153600000 s)",
            ),
            (
                "agent",
                json!({ "user": "x", "tool_choice": 3 }),
                "tool_choice: invalid type: integer `3`, expected \"auto\", \"required\", \"none\" \
                 or the name of one of tools",
            ),
            (
                "agent",
                json!({ "user": "x", "max_turns": -1 }),
                "max_turns: invalid value: integer `-1`, expected a whole number from 0 to \
                 4294967295",
            ),
            (
                "doc_migration",
                doc(json!({ "chunk_chars": "big" })),
                "chunk_chars: invalid type: string \"big\", expected a whole number from 0 to \
                 18446744073709551615",
            ),
            (
                "doc_migration",
                doc(json!({ "review": { "timeout": 5 } })),
                "review.timeout: unknown field \"timeout\"; the fields here are \"timeout_ms\"",
            ),
            (
                "triage",
                triage(json!({ "callback_url": "ftp://x" })),
                "config.callback_url: \"ftp://x\" must be an http:// or https:// URL with a host",
            ),
            (
                "triage",
                triage(json!({ "labels": ["bug"] })),
                "config: needs \"callback_url\"",
            ),
        ];
        for (kind, input, expected) in cases {
            let refused = r.check_input(kind, &input).unwrap_err();
            assert_eq!(refused, expected, "{kind} {input}");
        }
    }
}
