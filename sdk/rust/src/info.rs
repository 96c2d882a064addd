//! What a job and its tools may read about the operation they run for ([`OperationInfo`]),
//! and the one decoding of JSON into a kind's or a tool's Rust type, naming where a misfit is.
//! Imports nothing of the crate, so the context, the registry and tools can all use it.

use agentq_core::kinds::InputError;
use agentq_core::operation::OperationId;
use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Facts about the claimed operation that a job may read.
#[derive(Clone, Debug)]
pub struct OperationInfo {
    /// The operation's id, the same on every run: a key for a kind's own idempotent writes.
    pub op_id: OperationId,
    /// The tenant the operation belongs to: a kind reads and writes only this tenant's data.
    pub tenant: String,
    /// The kind it was enqueued as.
    pub kind: String,
    /// The version of the kind it runs on: the one its first claim pinned (or an operator's
    /// upgrade chose). Every run of the operation runs this version's function.
    pub version: String,
    /// The attempt counted against its retries (1 on the first); a sleep's or wait's wake-up,
    /// an overload back-off, a crash restart and a shutdown give the attempt back.
    pub attempt: i32,
    /// The claim's fencing number, one more on every claim (so it also counts runs): every
    /// write the context makes for this run carries it.
    pub epoch: i64,
    /// Stop (dead, `deadline_exceeded`) at the first step boundary after this.
    pub deadline: Option<DateTime<Utc>>,
}

/// Decodes `value` into `T`; a misfit names where (a JSON Pointer into `value`) and why, in
/// the input author's words ([`agentq_core::kinds::readable`]).
#[doc(hidden)]
pub fn decode<T: DeserializeOwned>(value: &Value) -> Result<T, InputError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let mut segments = Vec::new();
        for segment in e.path().iter() {
            match segment {
                serde_path_to_error::Segment::Seq { index } => segments.push(index.to_string()),
                serde_path_to_error::Segment::Map { key } => segments.push(key.clone()),
                serde_path_to_error::Segment::Enum { .. } => {}
                serde_path_to_error::Segment::Unknown => break,
            }
        }
        let pointer = agentq_core::kinds::pointer(segments.iter().map(String::as_str));
        InputError::at(
            pointer,
            agentq_core::kinds::readable(&e.into_inner().to_string()),
        )
    })
}
