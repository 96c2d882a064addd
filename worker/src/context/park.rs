//! Sleeps and waits for a signal: the steps that park an operation (its row `sleeping` or
//! `waiting`, holding no worker) until the scheduler or a signal wakes it, and the longest
//! park allowed (the SDK's `MAX_PARK`).

use std::sync::atomic::Ordering;

use agentq_core::approval;
use agentq_core::db::{self, steps::StepWrite};
use agentq_core::operation::step_idempotency_key;
use agentq_core::state::replay::{Resume, resume};
use agentq_core::state::{StepKind, StepStatus};
use chrono::{DateTime, Utc};
use serde_json::Value;

use super::journal::{StepSpec, recorded_as};
use super::{JobRun, SignalOutcome};
use agentq_sdk::context::wake_after;
use agentq_sdk::error::{Engine, JobError};
use agentq_sdk::tool::Replay;

impl JobRun {
    /// The SDK handle's `sleep_until`: parks until `until`, journaled at first execution.
    pub(crate) async fn sleep_until(&self, until: DateTime<Utc>) -> Result<(), JobError> {
        let (seq, key) = self.begin_park("sleep", StepKind::Sleep).await?;
        let wake_at = match self.recorded(seq) {
            Some(e) if e.status == StepStatus::Completed => return Ok(()),
            Some(e) => e.wake_at.unwrap_or(until),
            None => until,
        };
        let mut row = self.park_row(seq, "sleep", StepKind::Sleep, key, wake_at);
        if Utc::now() >= wake_at {
            row.status = StepStatus::Completed;
            row.completed_at = Some(Utc::now());
            self.push(row, true);
            return Ok(());
        }
        self.push(row, true);
        self.run_state().suspend = Some((wake_at, None));
        Err(JobError::from(Engine::Suspended))
    }

    /// A wait for the signal `name` for at most `timeout`, `about` journaled with it (the
    /// SDK handle's `wait_for_signal_about` says what it means).
    pub(crate) async fn wait_for_signal_about(
        &self,
        name: &str,
        timeout: std::time::Duration,
        about: Value,
    ) -> Result<SignalOutcome, JobError> {
        let step = format!("signal:{name}");
        let (seq, key) = self.begin_park(&step, StepKind::Signal).await?;
        let deadline = match self.recorded(seq) {
            Some(e) if e.status == StepStatus::Completed => {
                return Ok(SignalOutcome::from_journal(
                    &e.output.unwrap_or(Value::Null),
                ));
            }
            Some(e) => e.wake_at.unwrap_or_else(Utc::now),
            None => {
                let deadline = wake_after(&format!("wait for {name:?}"), timeout)?;
                // The wait step must exist before it can be resolved; it carries `about`
                // until the wait is decided (its output then is the decision).
                let mut row = self.park_row(seq, &step, StepKind::Signal, key.clone(), deadline);
                row.output = approval::about_output(about);
                self.push(row, true);
                self.flush().await?;
                deadline
            }
        };
        let info = &self.inner.info;
        let services = &self.inner.services;
        let resolved = services
            .store
            .resolve_wait(services, info, seq, name, deadline)
            .await
            .map_err(|e| JobError::retryable(format!("resolving a wait: {e}")))?;
        match resolved {
            db::timers::Wait::Resolved(output) => Ok(SignalOutcome::from_journal(&output)),
            db::timers::Wait::LeaseLost => {
                self.inner.lost.store(true, Ordering::Release);
                Err(JobError::from(Engine::LeaseLost))
            }
            db::timers::Wait::Pending => {
                self.run_state().suspend = Some((deadline, Some(name.to_string())));
                Err(JobError::from(Engine::Suspended))
            }
        }
    }

    /// Takes the next seq for a sleep or wait, checking the journal agrees on what it is.
    pub(super) async fn begin_park(
        &self,
        name: &str,
        kind: StepKind,
    ) -> Result<(i32, String), JobError> {
        self.check_running()?;
        let seq = self.next_position();
        let entry = self.recorded(seq);
        // A park has no tool to reconcile with; only divergence matters here, the rest is the
        // park's own (a recorded wake time, a resolved wait).
        if resume(entry.as_ref().map(|e| recorded_as(e, name, kind)), false) == Resume::Diverged {
            self.rebase_or_diverge(seq, entry.as_ref(), name, kind)
                .await?;
        }
        if entry.is_none() {
            self.check_journal_room(seq, name)?;
        }
        if entry.is_none() {
            self.inner.services.store.step_runs(seq, kind)?;
        }
        Ok((seq, step_idempotency_key(self.inner.info.op_id, seq, name)))
    }

    pub(super) fn park_row(
        &self,
        seq: i32,
        name: &str,
        kind: StepKind,
        key: String,
        wake_at: DateTime<Utc>,
    ) -> StepWrite {
        let mut row =
            StepSpec::new(name, kind, Replay::Safe).row(seq, &key, StepStatus::Started, Utc::now());
        row.wake_at = Some(wake_at);
        row
    }
}
