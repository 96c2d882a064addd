//! Changing a kind's code under operations already running: `patched` (a
//! marker step that keeps old journals on the old path) and the rebase of an operation an
//! operator upgraded to another version (its journal from the first step the new code asks
//! for differently is moved aside, and the run goes on from there).

use std::sync::atomic::Ordering;

use agentq_core::db::{self, steps::JournalEntry};
use agentq_core::operation::step_idempotency_key;
use agentq_core::state::{StepKind, StepStatus};
use chrono::Utc;
use serde_json::Value;

use super::JobRun;
use super::journal::{StepSpec, diverged, entry_at};
use crate::error::{Engine, JobError};
use crate::tool::Replay;

impl JobRun {
    /// The code asks for another step at `seq` than the journal recorded. After an operator's
    /// upgrade that covers `seq`, the journal from `seq` on was recorded by the old version:
    /// it is moved out of the journal (kept in `operation_steps_superseded`) in one fenced
    /// statement and the step runs anew. Otherwise the run fails as `nondeterminism`.
    pub(super) async fn rebase_or_diverge(
        &self,
        seq: i32,
        entry: Option<&JournalEntry>,
        name: &str,
        kind: StepKind,
    ) -> Result<(), JobError> {
        let covered = self.run_state().upgrade_through.is_some_and(|t| seq <= t);
        if !covered {
            return Err(diverged(seq, entry, name, kind));
        }
        let info = &self.inner.info;
        let rebased = db::within(db::versions::rebase(
            &self.inner.services.pool,
            info.op_id.0,
            info.epoch,
            seq,
        ))
        .await
        .map_err(|e| JobError::retryable(format!("rebasing the journal: {e}")))?;
        if !rebased {
            self.inner.lost.store(true, Ordering::Release);
            return Err(JobError::from(Engine::LeaseLost));
        }
        tracing::info!(
            op_id = %info.op_id,
            seq,
            version = %info.version,
            "upgraded: the journal from this step on was recorded by another version; running it anew"
        );
        let mut st = self.run_state();
        st.journal.retain(|e| e.seq < seq);
        st.upgrade_through = None;
        Ok(())
    }

    /// The SDK handle's `patched`: whether this run takes the path of the change `change_id`.
    pub fn patched(&self, change_id: &str) -> Result<bool, JobError> {
        self.check_running()?;
        let first_execution_at = {
            let mut st = self.run_state();
            let mut seq = st.next_seq;
            loop {
                let entry = entry_at(&st.journal, seq).filter(|e| e.status != StepStatus::Failed);
                match entry {
                    // Recorded by code that had the patch.
                    Some(e) if e.kind == StepKind::Patch && e.name == change_id => {
                        st.next_seq = seq + 1;
                        return Ok(true);
                    }
                    // Another patch's marker, its call removed or moved: look past it.
                    Some(e) if e.kind == StepKind::Patch => seq += 1,
                    // Recorded before the patch: the old path, nothing taken.
                    Some(_) => return Ok(false),
                    None => {
                        st.next_seq = seq + 1;
                        break seq;
                    }
                }
            }
        };
        let seq = first_execution_at;
        let key = step_idempotency_key(self.inner.info.op_id, seq, change_id);
        let spec = StepSpec::new(change_id, StepKind::Patch, Replay::Safe);
        let mut row = spec.row(seq, &key, StepStatus::Completed, Utc::now());
        row.output = Some(Value::Bool(true));
        row.completed_at = Some(Utc::now());
        // It rides the next durable write: a crash before that finds no marker here and
        // returns true again, as nothing of the new path can have been recorded.
        self.push(row, false);
        Ok(true)
    }
}
