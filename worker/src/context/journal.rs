//! The journal cursor and the journal's writes: which step a position holds (as loaded at
//! claim time), the next position a step takes, the room left in the journal, and the rows
//! held until the next durable write, written in one fenced statement through the worker's
//! group commit.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agentq_core::db::{self, steps::JournalEntry, steps::StepWrite};
use agentq_core::metrics;
use agentq_core::state::replay::Recorded;
use agentq_core::state::{StepKind, StepStatus};
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::JobRun;
use crate::error::{Engine, JobError};
use crate::tool::Replay;

/// Deferred steps' rows older than this are written at the next step boundary even when no
/// durable write is due, so a long run of deferred steps does not lose much work to a crash.
pub const DEFERRED_FLUSH_AFTER: Duration = Duration::from_secs(5);
/// Deferred steps' rows held at most; past this many they are written at the next boundary.
pub const DEFERRED_MAX_ROWS: usize = 64;

/// What a step is, for the journal and its span.
#[derive(Clone, Copy)]
pub(super) struct StepSpec<'a> {
    pub(super) name: &'a str,
    pub(super) kind: StepKind,
    pub(super) replay: Replay,
    /// Written with the next durable write instead of before the next step starts.
    pub(super) deferred: bool,
}

impl<'a> StepSpec<'a> {
    pub(super) fn new(name: &'a str, kind: StepKind, replay: Replay) -> Self {
        Self {
            name,
            kind,
            replay,
            deferred: false,
        }
    }

    /// The journal row of this step at `seq` with `status`, nothing recorded yet.
    pub(super) fn row(
        &self,
        seq: i32,
        key: &str,
        status: StepStatus,
        started_at: DateTime<Utc>,
    ) -> StepWrite {
        StepWrite {
            seq,
            name: self.name.to_string(),
            kind: self.kind,
            replay: self.replay,
            idempotency_key: key.to_string(),
            status,
            output: None,
            error: None,
            started_at,
            completed_at: None,
            usage: None,
            wake_at: None,
        }
    }
}

/// The journal's entry at `seq`: the journal is in seq order (as loaded, and as a rebase
/// leaves it), so a lookup is a binary search, and a replay of n steps costs O(n log n), not
/// O(n²).
pub(super) fn entry_at(journal: &[JournalEntry], seq: i32) -> Option<&JournalEntry> {
    journal
        .binary_search_by_key(&seq, |e| e.seq)
        .ok()
        .map(|i| &journal[i])
}

/// The bytes a journal row's output and error take as JSON, counted without building the text.
pub(crate) fn row_bytes(output: Option<&Value>, error: Option<&str>) -> u64 {
    struct Count(u64);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len() as u64;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    if let Some(v) = output {
        // Writing a `Value` to a sink that never fails cannot fail.
        let _ = serde_json::to_writer(&mut count, v);
    }
    count.0 + error.map_or(0, |e| e.len() as u64)
}

/// A journal entry as the replay decision sees it, for the step `name` of `kind` asked now.
pub(super) fn recorded_as(entry: &JournalEntry, name: &str, kind: StepKind) -> Recorded {
    Recorded {
        status: entry.status,
        replay: entry.replay,
        same_step: entry.name == name && entry.kind == kind,
    }
}

/// The error of a job asking for another step than its journal recorded at `seq`.
pub(super) fn diverged(
    seq: i32,
    entry: Option<&JournalEntry>,
    name: &str,
    kind: StepKind,
) -> JobError {
    let (was, was_kind) = entry.map_or(("?", "?"), |e| (e.name.as_str(), e.kind.as_str()));
    JobError::from(Engine::Nondeterminism(format!(
        "step {seq} was recorded as {was:?} ({was_kind}) but the job now asks for {name:?} ({kind})"
    )))
}

impl JobRun {
    /// The SDK handle's `peek_recorded`: the journal's next step, if recorded and not failed.
    pub fn peek_recorded(&self) -> Option<(String, StepStatus)> {
        let seq = self.run_state().next_seq;
        self.recorded(seq)
            .filter(|e| e.status != StepStatus::Failed)
            .map(|e| (e.name, e.status))
    }

    /// The SDK handle's `skip_recorded`: passes over the journal's next step if recorded.
    pub fn skip_recorded(&self) -> bool {
        let mut st = self.run_state();
        let seq = st.next_seq;
        let recorded = entry_at(&st.journal, seq).is_some_and(|e| e.status != StepStatus::Failed);
        if recorded {
            st.next_seq += 1;
        }
        recorded
    }

    /// `f` of the journal as this run's claim loaded it (a remote kind sends it to its service),
    /// read in place.
    pub(crate) fn with_loaded_journal<R>(&self, f: impl FnOnce(&[JournalEntry]) -> R) -> R {
        f(&self.run_state().journal)
    }

    /// The position the next step takes.
    pub(crate) fn cursor(&self) -> i32 {
        self.run_state().next_seq
    }

    /// Takes the next journal position for a step, passing over patch markers there: a
    /// `patched` call that was removed from the code (its old path deleted once
    /// no operation needed it) leaves its marker behind, and nothing asks for it.
    pub(super) fn next_position(&self) -> i32 {
        let mut st = self.run_state();
        loop {
            let seq = st.next_seq;
            st.next_seq += 1;
            let marker = entry_at(&st.journal, seq)
                .is_some_and(|e| e.kind == StepKind::Patch && e.status == StepStatus::Completed);
            if !marker {
                return seq;
            }
        }
    }

    /// Refuses a step at `seq` that is not in the journal yet once the journal is full
    /// (`AGENTQ_JOURNAL_MAX_STEPS` rows, or more than `AGENTQ_JOURNAL_MAX_BYTES` of outputs):
    /// the operation fails as non-retryable, with nothing of the step run.
    pub(super) fn check_journal_room(&self, seq: i32, name: &str) -> Result<(), JobError> {
        let limits = &self.inner.services.limits;
        if i64::from(seq) >= limits.journal_max_steps {
            return Err(JobError::NonRetryable(format!(
                "journal limit: step {seq} ({name:?}) was not run: one operation records at most \
                 {} steps (AGENTQ_JOURNAL_MAX_STEPS); split the work into child operations \
                 (ctx.spawn), or raise the cap",
                limits.journal_max_steps
            )));
        }
        let bytes = self.run_state().journal_bytes;
        if bytes > limits.journal_max_bytes as u64 {
            return Err(JobError::NonRetryable(format!(
                "journal limit: step {seq} ({name:?}) was not run: the journal's outputs take \
                 {bytes} bytes, more than the {} one operation may hold \
                 (AGENTQ_JOURNAL_MAX_BYTES); return smaller step outputs (keep large data in a \
                 store and journal its key), or raise the cap",
                limits.journal_max_bytes
            )));
        }
        Ok(())
    }

    pub(super) fn recorded(&self, seq: i32) -> Option<JournalEntry> {
        let st = self.run_state();
        entry_at(&st.journal, seq).cloned()
    }

    /// Holds `row` for the next write; `durable`: it must commit before the next step starts.
    pub(super) fn push(&self, row: StepWrite, durable: bool) {
        let mut st = self.run_state();
        st.journal_bytes += row_bytes(row.output.as_ref(), row.error.as_deref());
        // A later row for the same seq replaces the earlier one (started → completed).
        st.pending.retain(|r| r.seq != row.seq);
        st.pending.push(row);
        st.pending_since.get_or_insert_with(Instant::now);
        st.pending_durable |= durable;
    }

    /// Whether the pending rows must be written before the next step starts: any row but a
    /// deferred step's, or deferred rows that waited too long or grew too many.
    pub(super) fn flush_due(&self) -> bool {
        let st = self.run_state();
        st.pending_durable
            || st.pending.len() >= DEFERRED_MAX_ROWS
            || st
                .pending_since
                .is_some_and(|t| t.elapsed() >= DEFERRED_FLUSH_AFTER)
    }

    /// Makes the steps finished so far durable, if any waits (what a step's start does): a
    /// remote kind calls it before each call to its service, so the service runs its next step
    /// only after the previous one committed.
    pub(crate) async fn make_durable(&self) -> Result<(), JobError> {
        self.check_running()?;
        if self.flush_due() {
            self.flush().await?;
        }
        Ok(())
    }

    /// Writes the pending rows in one fenced statement.
    pub(super) async fn flush(&self) -> Result<(), JobError> {
        // Taken, not copied: rows pushed meanwhile (by a clone of this context) stay pending.
        let (rows, durable) = {
            let mut st = self.run_state();
            if st.pending.is_empty() {
                return Ok(());
            }
            st.pending_since = None;
            let durable = std::mem::replace(&mut st.pending_durable, false);
            (std::mem::take(&mut st.pending), durable)
        };
        let info = &self.inner.info;
        let services = &self.inner.services;
        let write = db::steps::StepBatch {
            id: info.op_id.0,
            epoch: info.epoch,
            steps: rows,
        };
        let asked = Instant::now();
        match services.store.write(services, write).await {
            Ok(true) => {
                metrics::JOURNAL_COMMIT_DURATION.observe(&[], asked.elapsed().as_secs_f64());
                Ok(())
            }
            Ok(false) => {
                self.inner.lost.store(true, Ordering::Release);
                Err(JobError::from(Engine::LeaseLost))
            }
            Err(unwritten) => {
                // Not written: the rows go back, before any pushed meanwhile (a newer row for
                // the same seq wins), so the failure's statement writes them.
                let mut st = self.run_state();
                let newer: Vec<StepWrite> = std::mem::take(&mut st.pending);
                let mut rows = unwritten.write.into_steps();
                rows.retain(|r| !newer.iter().any(|n| n.seq == r.seq));
                rows.extend(newer);
                st.pending = rows;
                st.pending_since.get_or_insert_with(Instant::now);
                st.pending_durable |= durable;
                Err(JobError::retryable(format!(
                    "writing the journal: {}",
                    unwritten.error
                )))
            }
        }
    }

    /// The rows to write with the final transition, and the step that failed (if any). A run
    /// stopped during an unsafe step's call adds that step as `unknown`: the next run of the
    /// operation (an operator's retry) reconciles it, as after a crash, never runs it blindly.
    pub(crate) fn take_pending(&self) -> (Vec<StepWrite>, Option<i32>) {
        let mut st = self.run_state();
        st.pending_since = None;
        st.pending_durable = false;
        if let Some(unknown) = st.in_flight.take() {
            st.failed_step = Some(unknown.seq);
            st.pending.retain(|r| r.seq != unknown.seq);
            st.pending.push(unknown);
        }
        (std::mem::take(&mut st.pending), st.failed_step)
    }
}
