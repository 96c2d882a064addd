//! Domain types of an operation: ids, lanes, the public operation and step views, and the
//! pointer message that travels through RabbitMQ. Its states are [`crate::state`]'s
//! ([`Status`] is re-exported here).
//!
//! Invariant kept here: a [`Pointer`] carries only `{v, op_id, tenant, kind}`, never the input.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use crate::state::Status;
use crate::state::{Replay, StepKind, StepStatus};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// An operation's id: a random UUIDv4 minted at ingress (unguessable, carries no content).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(transparent)]
pub struct OperationId(pub Uuid);

impl OperationId {
    /// Mints a new random id.
    pub fn new() -> Self {
        Self(Uuid::new_v4())
    }

    /// Parses a user-supplied id, with an error that says what was expected.
    pub fn parse(s: &str) -> Result<Self, String> {
        Uuid::parse_str(s.trim())
            .map(Self)
            .map_err(|_| format!("{s:?} is not an operation id (expected a UUID like 3f0c…-…)"))
    }
}

impl Default for OperationId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A tenant: non-empty, at most 128 characters of `[A-Za-z0-9_.:-]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantId(String);

impl TenantId {
    /// Validates a tenant name.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("tenant must not be empty (pass --tenant NAME)".into());
        }
        if s.len() > 128 {
            return Err(format!(
                "tenant is {} characters long; the limit is 128",
                s.len()
            ));
        }
        if let Some(c) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
        {
            return Err(format!(
                "tenant {s:?} contains {c:?}; use letters, digits, '_', '-', '.' or ':'"
            ));
        }
        Ok(Self(s.to_string()))
    }

    /// The tenant as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which queue an operation travels on: interactive work is never stuck behind a batch.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Lane {
    /// Latency-sensitive work (webhooks, API calls).
    #[default]
    Interactive,
    /// Bulk work (campaigns, migrations).
    Batch,
}

impl Lane {
    /// Both lanes, in the order workers consume them.
    pub const ALL: [Lane; 2] = [Lane::Interactive, Lane::Batch];

    /// The stored and routed name.
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Interactive => "interactive",
            Lane::Batch => "batch",
        }
    }
}

impl FromStr for Lane {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "interactive" => Ok(Lane::Interactive),
            "batch" => Ok(Lane::Batch),
            other => Err(format!("unknown lane {other:?}: use interactive or batch")),
        }
    }
}

impl TryFrom<String> for Lane {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The one operation object: the same in `agentq status --json` and the HTTP API.
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[schemars(rename = "Operation")]
pub struct OperationView {
    pub op_id: OperationId,
    pub tenant: String,
    /// The job kind that runs it.
    pub kind: String,
    /// The version of its kind it runs on: pinned by its first claim (`None` until then), or
    /// chosen by an operator's upgrade.
    #[serde(default)]
    pub kind_version: Option<String>,
    /// Queued for a version the worker that got its pointer does not run: a worker that runs
    /// it takes it (`agentq versions` shows whether one is live).
    #[serde(default)]
    pub version_parked: bool,
    pub lane: Lane,
    pub status: Status,
    pub attempt: i32,
    pub max_attempts: i32,
    /// Expired leases recovered by the reaper (its worker died or hung).
    pub restarts: i32,
    /// Not started before this instant.
    pub run_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// When it reached a terminal status.
    pub finished_at: Option<DateTime<Utc>>,
    /// What the job returned, once it succeeded.
    pub result: Option<serde_json::Value>,
    /// Why the last attempt or the operation failed (an error class).
    pub error_class: Option<String>,
    pub error_message: Option<String>,
    /// The signal a waiting operation waits for.
    pub waiting_for: Option<String>,
    pub batch_id: Option<Uuid>,
    /// Its Idempotency-Key, webhook-id or batch document key.
    pub dedupe_key: Option<String>,
    /// Operations sharing it run one at a time, in order.
    pub ordering_key: Option<String>,
    /// Operations of its tenant sharing it run at most `concurrency_limit` at once.
    #[serde(default)]
    pub concurrency_key: Option<String>,
    #[serde(default)]
    pub concurrency_limit: Option<i32>,
    /// The `x-request-id` of the HTTP request that created it, if any.
    #[serde(default)]
    pub request_id: Option<String>,
    /// The schedule that fired it, if any (kept after the schedule is deleted).
    #[serde(default)]
    pub schedule_id: Option<Uuid>,
    /// The operation that spawned it (`ctx.spawn`), if any.
    #[serde(default)]
    pub parent_id: Option<Uuid>,
}

/// One journal entry as shown by `agentq steps` (outputs are shown; they are the user's data).
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema)]
#[schemars(rename = "Step")]
pub struct StepView {
    /// Its place in the journal.
    pub seq: i32,
    pub name: String,
    pub kind: StepKind,
    /// Whether it may run again after a crash left its outcome unknown.
    pub replay: Replay,
    pub status: StepStatus,
    pub idempotency_key: String,
    /// The operation's epoch (one per claim) that wrote it.
    pub epoch: i64,
    pub started_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    /// When a durable sleep or a wait's timeout ends.
    pub wake_at: Option<DateTime<Utc>>,
    /// What the step returned (replayed instead of running it again).
    pub output: Option<serde_json::Value>,
    pub error: Option<String>,
    /// A model call's token usage; `{"reconciled": true}` for an unsafe step whose effect a
    /// reconcile found after a crash (such a step has no token usage of its own).
    pub usage: Option<serde_json::Value>,
}

/// The `usage` an unsafe step is journaled with when, after a crash lost its outcome, its
/// reconcile found that the effect had happened: `{"reconciled": true}`. `agentq steps`, the
/// API and the console mark the step so.
pub fn reconciled_usage() -> serde_json::Value {
    serde_json::json!({ "reconciled": true })
}

impl StepView {
    /// Whether the step's effect was found by its reconcile, not recorded by its own run.
    pub fn reconciled(&self) -> bool {
        self.usage
            .as_ref()
            .and_then(|u| u.get("reconciled"))
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false)
    }
}

/// The message published to RabbitMQ: a pointer to a row in Postgres, never the job input.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pointer {
    /// Message format version; workers reject versions they do not know.
    pub v: u32,
    pub op_id: OperationId,
    pub tenant: String,
    pub kind: String,
}

impl Pointer {
    /// The only format version this build writes and reads.
    pub const VERSION: u32 = 1;

    /// A pointer to `op_id`.
    pub fn new(op_id: OperationId, tenant: &str, kind: &str) -> Self {
        Self {
            v: Self::VERSION,
            op_id,
            tenant: tenant.to_string(),
            kind: kind.to_string(),
        }
    }

    /// Encodes the pointer as JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a pointer always serializes")
    }

    /// Decodes a delivery body; an error means the message is poison.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let p: Pointer =
            serde_json::from_slice(bytes).map_err(|e| format!("not a pointer: {e}"))?;
        if p.v != Self::VERSION {
            return Err(format!("unsupported pointer version {}", p.v));
        }
        Ok(p)
    }
}

/// The JSON pointer of the first string (or key) of `v` holding U+0000, which PostgreSQL's
/// `jsonb` and `text` cannot store (the root is `/`).
pub fn nul_at(v: &serde_json::Value) -> Option<String> {
    fn walk(v: &serde_json::Value, at: String) -> Option<String> {
        use serde_json::Value;
        match v {
            Value::String(s) if s.contains('\0') => {
                Some(if at.is_empty() { "/".into() } else { at })
            }
            Value::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, x)| walk(x, format!("{at}/{i}"))),
            Value::Object(map) => map.iter().find_map(|(k, x)| {
                let here = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                if k.contains('\0') {
                    Some(here)
                } else {
                    walk(x, here)
                }
            }),
            _ => None,
        }
    }
    walk(v, String::new())
}

/// Hex SHA-256 of the canonical JSON of an input: how an idempotent enqueue recognises "same input".
pub fn input_sha256(input: &serde_json::Value) -> String {
    // serde_json's Map is ordered by key (no `preserve_order` feature), so this is canonical.
    let bytes = serde_json::to_vec(input).expect("a JSON value always serializes");
    hex::encode(Sha256::digest(bytes))
}

/// Dedupe-key prefixes agentq derives itself: a webhook delivery's `webhook:{source}:{id}`,
/// a batch document's `batch:{batch}:{doc}`, a schedule firing's `schedule:{id}:{tick}` and a
/// child operation's `child:{the spawn step's idempotency key}`.
pub const DERIVED_KEY_PREFIXES: [&str; 4] = ["webhook:", "batch:", "schedule:", "child:"];

/// Largest accepted input, serialized (inputs are stored in Postgres, not sent to the broker):
/// an enqueue's and a spawned child's.
pub const MAX_INPUT_BYTES: usize = 1024 * 1024;

/// Refuses an input larger than [`MAX_INPUT_BYTES`] serialized: an enqueue's and a spawn's
/// check.
pub fn check_input_size(input: &serde_json::Value) -> Result<(), String> {
    let size = serde_json::to_vec(input).map_or(usize::MAX, |v| v.len());
    if size > MAX_INPUT_BYTES {
        return Err(format!(
            "input is {size} bytes; the limit is {MAX_INPUT_BYTES} (store large documents \
             elsewhere and pass a reference)"
        ));
    }
    Ok(())
}

/// What a parent parked on `ctx.join` waits for (`operations.waiting_for`): not a signal name
/// (those have no parentheses), so no signal can wake or resolve a join.
pub const JOIN_WAIT: &str = "(children)";

/// Refuses a dedupe key a producer chose (`--key`, `Idempotency-Key`) that falls in a namespace
/// agentq derives keys in, so a producer can never take the key of a genuine webhook delivery,
/// batch document or schedule firing before it arrives.
pub fn check_producer_key(key: &str) -> Result<(), String> {
    match DERIVED_KEY_PREFIXES.iter().find(|p| key.starts_with(*p)) {
        Some(p) => Err(format!(
            "keys starting with {p:?} are agentq's own (webhook deliveries, batch documents, \
             schedule firings and child operations); choose another key"
        )),
        None => Ok(()),
    }
}

/// What operations may do with a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::ReadWrite => "read_write",
        }
    }

    /// Parses `read`, `write`, `read_write` (or `read-write`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "read" => Ok(Access::Read),
            "write" => Ok(Access::Write),
            "read_write" | "read-write" => Ok(Access::ReadWrite),
            _ => Err(format!("access {s:?}: use read, write or read_write")),
        }
    }

    /// True when a store with this access grants `wanted`.
    pub fn grants(self, wanted: Access) -> bool {
        self == Access::ReadWrite || self == wanted
    }
}

/// What an input asks of a store: the producer checks it at enqueue.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Need {
    /// The input field that names the store (`source.store`), for the error message.
    pub field: &'static str,
    pub store: String,
    pub access: Access,
}

/// Where an enqueue comes from, as far as a kind cares: some kinds (`triage`) take their
/// configuration from a webhook source and run only for that source's deliveries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Origin {
    /// A producer: `agentq enqueue`, `POST /v1/operations`, a batch.
    #[default]
    Producer,
    /// A verified delivery of a webhook source (its input built by agentq from the source).
    Webhook,
}

/// What an input requires beyond its shape, decided by its kind and checked by the producer
/// before anything is written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requires {
    /// The stores it names, with the access it needs (the tenant must have them).
    pub stores: Vec<Need>,
    /// The kind runs only for webhook deliveries ([`Origin::Webhook`]).
    pub webhook_only: bool,
    /// The tools it names (an `agent`'s `tools` and `approval`): each must be registered.
    pub tools: Vec<ToolRef>,
}

/// A tool an input names, and where (a JSON Pointer into the input, for the error message).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ToolRef {
    pub pointer: String,
    pub name: String,
}

/// The idempotency key of a step: hex SHA-256 of `op_id ‖ seq ‖ name`, stable across retries.
pub fn step_idempotency_key(op_id: OperationId, seq: i32, name: &str) -> String {
    let mut h = Sha256::new();
    h.update(op_id.0.as_bytes());
    h.update(seq.to_be_bytes());
    h.update(name.as_bytes());
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {

    #[test]
    fn producer_keys_stay_out_of_the_derived_namespaces() {
        assert!(check_producer_key("webhook:tracker:evt_2").is_err());
        assert!(check_producer_key("batch:b:doc").is_err());
        assert!(check_producer_key("schedule:s:2026-01-01T00:00:00Z").is_err());
        assert!(check_producer_key("order-42").is_ok());
        assert!(check_producer_key("my-webhook:1").is_ok());
    }

    use super::*;

    #[test]
    fn pointer_round_trips_and_rejects_garbage() {
        let p = Pointer::new(OperationId::new(), "acme", "echo");
        assert_eq!(Pointer::decode(&p.encode()).unwrap(), p);
        assert!(Pointer::decode(b"{not json").is_err());
        assert!(Pointer::decode(br#"{"v":2,"op_id":"00000000-0000-0000-0000-000000000000","tenant":"a","kind":"k"}"#).is_err());
    }

    #[test]
    fn input_hash_ignores_key_order() {
        let a: serde_json::Value = serde_json::from_str(r#"{"a":1,"b":2}"#).unwrap();
        let b: serde_json::Value = serde_json::from_str(r#"{"b":2,"a":1}"#).unwrap();
        assert_eq!(input_sha256(&a), input_sha256(&b));
    }

    #[test]
    fn tenant_rules() {
        assert!(TenantId::parse("").is_err());
        assert!(TenantId::parse("a b").is_err());
        assert!(TenantId::parse("acme-prod.eu:1").is_ok());
    }

    #[test]
    fn step_keys_differ_by_seq_and_name() {
        let op = OperationId::new();
        let k = step_idempotency_key(op, 0, "send");
        assert_eq!(k.len(), 64);
        assert_ne!(k, step_idempotency_key(op, 1, "send"));
        assert_ne!(k, step_idempotency_key(op, 0, "send2"));
        assert_eq!(k, step_idempotency_key(op, 0, "send"));
    }
}
