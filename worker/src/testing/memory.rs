//! The in-memory store of one tester run: the operation's journal, its waits and joins as
//! PostgreSQL would hold them (it implements the context's `Store`), the signals and child
//! outcomes scripted for it, and the watch on every step and effect that finds what a crash
//! would break.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use agentq_core::db::{self, steps::JournalEntry, steps::StepWrite};
use agentq_core::state::{Status, StepKind, StepStatus};
use chrono::Utc;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::crash::Event;
use super::report::{Check, Violation};
use super::run::World;
use super::{ChildEnd, ChildFn};
use crate::context::ChildOutcome;
use crate::context::store::Store;
use crate::context::{OperationInfo, Services};
use crate::error::{Engine, JobError};
use crate::tool::{Reconciled, Replay};
use agentq_core::db::settle::RunWrite;
use agentq_core::db::steps::StepBatch;
use agentq_core::group_commit::Written;
use agentq_core::operation::Requires;
use async_trait::async_trait;

/// Where a run starts from: the journal and the effects a crash left.
#[derive(Default)]
pub(super) struct Scenario {
    pub(super) journal: Vec<StepWrite>,
    pub(super) happened: HashMap<String, Value>,
    /// Keys of step bodies that began: an effect that began and did not return may or may not
    /// have happened, so no reconcile's answer about it is wrong.
    pub(super) began: HashSet<String>,
}

/// The in-memory stand-in for an operation's rows in PostgreSQL during one run of the tester
/// (the journal, its waits and joins), which also watches every step and effect.
pub(super) struct Memory {
    /// Every child spawned in any run, by id: its kind and input.
    children: Arc<Mutex<BTreeMap<uuid::Uuid, (String, Value)>>>,
    state: Mutex<MemoryState>,
}

pub(super) struct MemoryState {
    journal: BTreeMap<i32, StepWrite>,
    /// The first run records its timeline; replays check theirs against the scenario.
    recording: bool,
    timeline: Vec<Event>,
    /// Effects that happened before the crash (a replay), or so far (the first run).
    pub(super) happened: HashMap<String, Value>,
    /// Keys of the step bodies that began (see [`Scenario::began`]).
    began: HashSet<String>,
    violations: Vec<Violation>,
    /// The kind of each step asked for at a position this run.
    seen: BTreeMap<i32, StepKind>,
    /// The model step running now.
    model_at: Option<i32>,
    /// The tool step running now.
    tool_step: String,
    /// The signals still to deliver, per name.
    signals: HashMap<String, VecDeque<Value>>,
    /// Waits (by seq) decided since they parked: their journaled output.
    waits: HashMap<i32, Value>,
    /// Joins (by seq) decided since they parked: the outcomes of their children.
    joins: HashMap<i32, Value>,
    /// [`replay_journal`]: stop where the code asks for a step past the journal's end.
    pub(super) stop_at_end: bool,
    /// A run up to a crash point: it crashes once its timeline holds this many events.
    crash_after: Option<usize>,
    /// It crashed: nothing more is written or done.
    crashed: bool,
    stopped: bool,
}

impl Memory {
    pub(super) fn new(
        world: &World,
        scenario: Scenario,
        signals: &[(String, Value)],
        recording: bool,
    ) -> Self {
        let journal: BTreeMap<i32, StepWrite> =
            scenario.journal.into_iter().map(|r| (r.seq, r)).collect();
        // Signals consumed by waits the journal already completed are gone.
        let mut consumed: HashMap<&str, usize> = HashMap::new();
        for r in journal.values() {
            let payload = r.output.as_ref().and_then(|o| o.get("payload"));
            if r.kind == StepKind::Signal && r.status == StepStatus::Completed && payload.is_some()
            {
                let name = r.name.strip_prefix("signal:").unwrap_or(&r.name);
                *consumed.entry(name).or_default() += 1;
            }
        }
        let mut queues: HashMap<String, VecDeque<Value>> = HashMap::new();
        for (name, payload) in signals {
            let skip = consumed.get(name.as_str()).copied().unwrap_or(0);
            let queue = queues.entry(name.clone()).or_default();
            queue.push_back(payload.clone());
            if queue.len() <= skip {
                queue.pop_front();
                *consumed.get_mut(name.as_str()).expect("counted") -= 1;
            }
        }
        Self {
            children: world.children.clone(),
            state: Mutex::new(MemoryState {
                journal,
                recording,
                timeline: Vec::new(),
                happened: scenario.happened,
                began: scenario.began,
                violations: Vec::new(),
                seen: BTreeMap::new(),
                model_at: None,
                tool_step: String::new(),
                signals: queues,
                waits: HashMap::new(),
                joins: HashMap::new(),
                stop_at_end: false,
                crash_after: None,
                crashed: false,
                stopped: false,
            }),
        }
    }

    /// Makes this (recording) run crash once its timeline holds `events` events: every
    /// write after it is lost, and the run stops at its next step.
    pub(super) fn crash_after(&self, events: usize) {
        let mut st = self.state();
        st.crash_after = Some(events);
        st.crashed = events == 0;
    }

    /// Whether the run reached its crash point.
    pub(super) fn crashed(&self) -> bool {
        self.state().crashed
    }

    /// What a crash left: the journal and the effects that had happened.
    pub(super) fn left(&self) -> Scenario {
        let st = self.state();
        Scenario {
            journal: st.journal.values().cloned().collect(),
            happened: st.happened.clone(),
            began: st.began.clone(),
        }
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.state.lock().expect("replay tester state")
    }

    /// The journal as a claim loads it.
    pub(super) fn entries(&self) -> Vec<JournalEntry> {
        self.state()
            .journal
            .values()
            .map(|r| JournalEntry {
                seq: r.seq,
                name: r.name.clone(),
                kind: r.kind,
                replay: r.replay,
                status: r.status,
                output: r.output.clone(),
                error: r.error.clone(),
                wake_at: r.wake_at,
            })
            .collect()
    }

    /// The scheduler's wake-up of a sleep: its wake time has come.
    pub(super) fn wake_sleeps(&self) {
        let mut st = self.state();
        let past = Utc::now() - chrono::Duration::seconds(1);
        for r in st.journal.values_mut() {
            if r.kind == StepKind::Sleep && r.status == StepStatus::Started {
                r.wake_at = Some(past);
            }
        }
    }

    /// A parked wait on `signal` gets the next scripted payload, or times out.
    pub(super) fn decide_wait(&self, signal: &str) {
        let mut st = self.state();
        let step = format!("signal:{signal}");
        let parked: Vec<i32> = st
            .journal
            .values()
            .filter(|r| {
                r.kind == StepKind::Signal && r.status == StepStatus::Started && r.name == step
            })
            .map(|r| r.seq)
            .collect();
        for seq in parked {
            let output = match st.signals.get_mut(signal).and_then(VecDeque::pop_front) {
                Some(payload) => json!({ "payload": payload, "sent_by": "replay-tester" }),
                None => json!({ "timed_out": true }),
            };
            st.waits.insert(seq, output);
        }
    }

    /// A parked join: every child it names ends as `outcome` says.
    pub(super) fn decide_joins(
        &self,
        children: &Mutex<BTreeMap<uuid::Uuid, (String, Value)>>,
        outcome: &ChildFn,
    ) {
        let mut st = self.state();
        let parked: Vec<i32> = st
            .journal
            .values()
            .filter(|r| r.kind == StepKind::Join && r.status == StepStatus::Started)
            .map(|r| r.seq)
            .collect();
        // The children of this operation, in spawn order.
        let spawned: Vec<(uuid::Uuid, String)> = st
            .journal
            .values()
            .filter(|r| r.kind == StepKind::Spawn && r.status == StepStatus::Completed)
            .filter_map(|r| {
                let id = r.output.as_ref()?.as_str()?.parse().ok()?;
                Some((id, r.name.trim_start_matches("spawn:").to_string()))
            })
            .collect();
        let known = children.lock().expect("children");
        for seq in parked {
            let outcomes: Vec<ChildOutcome> = spawned
                .iter()
                .map(|(id, kind)| {
                    let input = known.get(id).map(|(_, i)| i.clone()).unwrap_or(Value::Null);
                    let (status, result, error_class, error_message) = match outcome(kind, &input) {
                        ChildEnd::Succeeded(v) => (Status::Succeeded, Some(v), None, None),
                        ChildEnd::Dead { class, message } => {
                            (Status::Dead, None, Some(class), Some(message))
                        }
                    };
                    ChildOutcome {
                        op_id: *id,
                        kind: kind.clone(),
                        status,
                        result,
                        error_class,
                        error_message,
                    }
                })
                .collect();
            st.joins
                .insert(seq, serde_json::to_value(outcomes).unwrap_or(Value::Null));
        }
    }

    /// The model step running now: its number among the operation's model steps.
    pub(super) fn model_step(&self) -> usize {
        let st = self.state();
        let Some(at) = st.model_at else { return 0 };
        let recorded = st
            .journal
            .values()
            .filter(|r| r.seq < at && r.kind == StepKind::Model)
            .map(|r| r.seq);
        let seen = st
            .seen
            .iter()
            .filter(|(s, k)| **s < at && **k == StepKind::Model)
            .map(|(s, _)| *s);
        recorded.chain(seen).collect::<HashSet<i32>>().len()
    }

    pub(super) fn stopped(&self) -> bool {
        self.state().stopped
    }

    pub(super) fn take_violations(&self) -> Vec<Violation> {
        std::mem::take(&mut self.state().violations)
    }

    /// The timeline (first run) and the journal at the end.
    pub(super) fn finish(&self) -> (Vec<Event>, Vec<StepWrite>) {
        let mut st = self.state();
        let timeline = std::mem::take(&mut st.timeline);
        (timeline, st.journal.values().cloned().collect())
    }
}

impl Memory {
    /// A durable write of the journal (a flush, a suspend, the outcome's rows); lost after the
    /// run's crash point.
    pub(super) fn keep(&self, rows: Vec<StepWrite>) {
        if rows.is_empty() {
            return;
        }
        let mut st = self.state();
        if st.crashed {
            return;
        }
        for r in rows {
            st.journal.insert(r.seq, r);
        }
        if st.recording {
            let snapshot = st.journal.values().cloned().collect();
            st.timeline.push(Event::Durable(snapshot));
            st.crash_if_due();
        }
    }
}

#[async_trait]
impl Store for Memory {
    async fn write(&self, _services: &Services, batch: StepBatch) -> Written<RunWrite> {
        self.keep(batch.steps);
        Ok(true)
    }

    /// A step about to run its body (or a park about to be recorded) at `seq`.
    fn step_runs(&self, seq: i32, kind: StepKind) -> Result<(), JobError> {
        let mut st = self.state();
        if st.stop_at_end || st.crashed {
            st.stopped = true;
            return Err(JobError::from(Engine::Suspended));
        }
        st.seen.insert(seq, kind);
        st.model_at = (kind == StepKind::Model).then_some(seq);
        // An unsafe step's body (a closure's, a tool's) is watched as it runs, after its
        // `started` row is durable: `effect_begins`, `effect_happened`.
        Ok(())
    }

    /// A recovery about to ask a tool whether an unsafe call happened.
    fn before_reconcile(&self) -> Result<(), JobError> {
        let mut st = self.state();
        if st.stop_at_end || st.crashed {
            // Asking would reach the outside system: the journal replay stops here.
            st.stopped = true;
            return Err(JobError::from(Engine::Suspended));
        }
        Ok(())
    }

    /// A step's body (a tool call, an unsafe closure) about to run with the step's key.
    fn effect_begins(&self, key: &str, name: &str, replay: Replay) -> Result<(), JobError> {
        let mut st = self.state();
        if st.crashed {
            st.stopped = true;
            return Err(JobError::from(Engine::Suspended));
        }
        if replay == Replay::Unsafe {
            let seq = st.seen.keys().next_back().copied();
            st.check_not_again(seq, name, key);
        }
        st.began.insert(key.to_string());
        st.tool_step = name.to_string();
        Ok(())
    }

    /// A step's body returned `output`: its effect happened.
    fn effect_happened(&self, key: &str, output: &Value) {
        let mut st = self.state();
        let name = std::mem::take(&mut st.tool_step);
        st.effect(&name, key, output.clone());
        st.crash_if_due();
    }

    /// A reconcile's answer for the step `name` with `key`: checked against what happened in
    /// this timeline before its crash.
    fn reconciled(&self, seq: i32, name: &str, key: &str, answer: &Reconciled) {
        let mut st = self.state();
        if st.recording {
            return;
        }
        let wrong = match (answer, st.happened.get(key)) {
            // A body that began and failed may have made its effect: either answer is right.
            (Reconciled::Happened(_), None) if st.began.contains(key) => None,
            (Reconciled::Happened(_), None) => Some(
                "its reconcile answered that the effect happened, but in this timeline the crash \
                 came before it: the step would be recorded as done and the effect never made (a \
                 reconcile must look the effect up by the idempotency key)"
                    .to_string(),
            ),
            (Reconciled::Happened(said), Some(made)) if said != made => Some(format!(
                "its reconcile answered with another output than the effect's: {said} where the \
                 effect returned {made}"
            )),
            _ => None,
        };
        if let Some(message) = wrong {
            st.violations.push(Violation {
                check: Check::WrongReconcile,
                seq: Some(seq),
                step: name.to_string(),
                at: String::new(),
                message,
            });
        }
    }

    /// A child spawned with the step's key: its id, the same in every run.
    async fn spawn(
        &self,
        _services: &Services,
        _info: &OperationInfo,
        key: &str,
        kind: &str,
        input: &Value,
        _requires: &Requires,
    ) -> Result<uuid::Uuid, JobError> {
        let id = child_id(key);
        self.children
            .lock()
            .expect("children")
            .insert(id, (kind.to_string(), input.clone()));
        Ok(id)
    }

    /// Decides a wait as `db::timers::resolve_wait` does: a decision made since it parked
    /// completes its step (durably, with the decision as output).
    async fn resolve_wait(
        &self,
        _services: &Services,
        _info: &OperationInfo,
        seq: i32,
        _name: &str,
        _deadline: chrono::DateTime<Utc>,
    ) -> db::Result<db::timers::Wait> {
        Ok(match self.state().take_decision(seq, |st| &mut st.waits) {
            Some(output) => db::timers::Wait::Resolved(output),
            None => db::timers::Wait::Pending,
        })
    }

    /// Decides a join as `db::children::resolve_join` does.
    async fn resolve_join(
        &self,
        _services: &Services,
        _info: &OperationInfo,
        seq: i32,
        _ids: &[uuid::Uuid],
    ) -> db::Result<db::children::Join> {
        Ok(match self.state().take_decision(seq, |st| &mut st.joins) {
            Some(output) => db::children::Join::Resolved(output),
            None => db::children::Join::Pending,
        })
    }
}

impl MemoryState {
    /// Notes a violation if the unsafe effect `key` had happened before the crash this run
    /// started from.
    fn check_not_again(&mut self, seq: Option<i32>, name: &str, key: &str) {
        if self.recording || !self.happened.contains_key(key) {
            return;
        }
        self.violations.push(Violation {
            check: Check::RanAgain,
            seq,
            step: name.to_string(),
            at: String::new(),
            message: format!(
                "its unsafe effect (idempotency key {key}) had happened before the crash and \
                 happened again: the effect would happen twice (a reconcile must find it by the \
                 key, and nothing unsafe may run outside a step)"
            ),
        });
    }

    /// Crashes a run up to a crash point once its timeline has reached it.
    fn crash_if_due(&mut self) {
        if self.crash_after.is_some_and(|n| self.timeline.len() >= n) {
            self.crashed = true;
        }
    }

    fn effect(&mut self, name: &str, key: &str, output: Value) {
        if self.recording {
            self.timeline.push(Event::Effect {
                key: key.to_string(),
                step: if name.is_empty() {
                    "a tool call".into()
                } else {
                    name.to_string()
                },
                output: output.clone(),
            });
        }
        self.happened.insert(key.to_string(), output);
    }

    /// The decision made for the parked step `seq` since it parked (taken from `decided`, the
    /// waits or the joins), completing its step; `None` while it is pending, and always once a
    /// journal replay has reached its end (that stops the replay).
    fn take_decision(
        &mut self,
        seq: i32,
        decided: impl FnOnce(&mut Self) -> &mut HashMap<i32, Value>,
    ) -> Option<Value> {
        if self.stop_at_end {
            self.stopped = true;
            return None;
        }
        let output = decided(self).remove(&seq)?;
        self.complete(seq, output.clone());
        Some(output)
    }

    /// Completes the parked step `seq` with `output`, durably.
    fn complete(&mut self, seq: i32, output: Value) {
        if let Some(r) = self.journal.get_mut(&seq) {
            r.status = StepStatus::Completed;
            r.output = Some(output);
            r.completed_at = Some(Utc::now());
        }
        if self.recording {
            let snapshot = self.journal.values().cloned().collect();
            self.timeline.push(Event::Durable(snapshot));
        }
    }
}

/// A spawned child's id: derived from the spawn step's key, so every run spawns the same one.
fn child_id(key: &str) -> uuid::Uuid {
    let digest = Sha256::digest(key.as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_random_bytes(bytes).into_uuid()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ids_follow_the_spawn_key() {
        assert_eq!(child_id("k"), child_id("k"));
        assert_ne!(child_id("k"), child_id("l"));
    }
}
