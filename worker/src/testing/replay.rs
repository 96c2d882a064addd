//! Replaying a journal exported from production against the code at hand
//! ([`replay_journal`], `agentq replay`): whether a deploy would replay the operations that
//! wait today.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use agentq_core::db::{steps::JournalEntry, steps::StepWrite};
use agentq_core::operation::{OperationId, StepView, step_idempotency_key};
use chrono::Utc;
use serde_json::Value;

use super::Tester;
use super::memory::{Memory, Scenario};
use super::report::End;
use super::run::{World, drive};
use crate::served::{ServedKinds, Serves};

/// Reads the journal `agentq steps OP --json` printed (JSON Lines of steps), for
/// [`replay_journal`].
pub fn journal_from_steps(jsonl: &str) -> Result<Vec<JournalEntry>, String> {
    let mut steps = Vec::new();
    for (n, line) in jsonl.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        steps
            .push(serde_json::from_str::<StepView>(line).map_err(|e| {
                format!("line {}: not a step of `agentq steps --json`: {e}", n + 1)
            })?);
    }
    Ok(journal_from_views(steps))
}

/// An operation's journal as its steps are shown (`GET /v1/operations/{id}/steps`), as a claim
/// loads it.
pub fn journal_from_views(steps: Vec<StepView>) -> Vec<JournalEntry> {
    let mut entries: Vec<JournalEntry> = steps
        .into_iter()
        .map(|step| JournalEntry {
            seq: step.seq,
            name: step.name,
            kind: step.kind,
            replay: step.replay,
            status: step.status,
            output: step.output,
            error: step.error,
            wake_at: step.wake_at,
        })
        .collect();
    entries.sort_by_key(|e| e.seq);
    entries
}

/// What [`replay_journal`] found.
#[derive(Clone, Debug)]
pub struct JournalReplay {
    /// Journal rows the code read back.
    pub steps: usize,
    /// How the replay ended: [`End::ReachedEnd`] when the code agreed with the journal up to
    /// its end (or finished), a failure naming the first step it asks for differently.
    pub outcome: End,
}

impl JournalReplay {
    /// Whether the code replays the journal without diverging.
    pub fn agrees(&self) -> bool {
        matches!(self.outcome, End::ReachedEnd | End::Succeeded(_))
    }
}

/// Replays an operation's journal (`journal`, e.g. from [`journal_from_steps`]) against
/// `version` of `kind` in `registry` with `input`, as a worker running this code would after
/// a deploy, stopping where the code asks for a step the journal does not hold yet: nothing is
/// called, nothing written. A step asked for differently than recorded is `nondeterminism`:
/// bump the kind's version, or use `ctx.patched`.
pub async fn replay_journal(
    registry: &impl Serves,
    kind: &str,
    version: &str,
    input: Value,
    journal: Vec<JournalEntry>,
) -> JournalReplay {
    replay_operation(
        registry,
        uuid::Uuid::new_v4(),
        kind,
        version,
        input,
        journal,
    )
    .await
}

/// [`replay_journal`] for the operation `op_id` (its id as [`JobContext::info`](crate::JobContext::info) shows it to the
/// kind, and in its steps' idempotency keys).
pub async fn replay_operation(
    registry: &impl Serves,
    op_id: uuid::Uuid,
    kind: &str,
    version: &str,
    input: Value,
    journal: Vec<JournalEntry>,
) -> JournalReplay {
    let kinds: ServedKinds = registry.served();
    let steps = journal.len();
    let world = World {
        op_id: OperationId(op_id),
        children: Arc::new(Mutex::new(BTreeMap::new())),
    };
    let rows = journal
        .into_iter()
        .map(|e| StepWrite {
            seq: e.seq,
            idempotency_key: step_idempotency_key(world.op_id, e.seq, &e.name),
            name: e.name,
            kind: e.kind,
            replay: e.replay,
            status: e.status,
            output: e.output,
            error: e.error,
            started_at: Utc::now(),
            completed_at: None,
            usage: None,
            wake_at: e.wake_at,
        })
        .collect();
    let memory = Arc::new(Memory::new(
        &world,
        Scenario {
            journal: rows,
            happened: HashMap::new(),
            began: Default::default(),
        },
        &[],
        false,
    ));
    memory.state().stop_at_end = true;
    let tester = Tester::new(&kinds, kind, input.clone());
    let services = tester.services(&memory);
    let outcome = drive(
        &kinds,
        &world,
        (kind, version, "replay"),
        &input,
        &memory,
        &services,
        &tester.children,
    )
    .await;
    JournalReplay { steps, outcome }
}
