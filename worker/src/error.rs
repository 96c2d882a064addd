//! How a job, or one of its steps, fails: [`JobError`] and its stable classes.
//!
//! The class of an error decides what happens next (retry later, back off harder, dead letter,
//! park), in one place: `executor::settle`. This module imports nothing from the rest of the
//! crate, so the context, the model clients and gate, and tools can all return a `JobError`
//! without depending on each other.

use agentq_core::state::failure::Failure;
use chrono::{DateTime, Utc};

/// How a job (or one of its steps) failed. The class decides what happens next.
///
/// Class a failure by what the next attempt can change, and, for a side effect, by whether it
/// may have happened:
///
/// ```
/// use agentq_worker::JobError;
///
/// /// How a payments API's answer fails a refund.
/// fn refund_failed(status: u16) -> JobError {
///     match status {
///         // Refused before acting: nothing happened, send it again later.
///         429 | 503 => JobError::no_effect(format!("payments answered {status}")),
///         // Will not change on retry: to the dead-letter queue, for a human.
///         400..=499 => JobError::NonRetryable(format!("payments refused the refund ({status})")),
///         // May have been applied: the step is journaled `unknown` and reconciled next time.
///         _ => JobError::retryable(format!("payments answered {status}")),
///     }
/// }
///
/// assert!(matches!(refund_failed(503), JobError::NoEffect(_)));
/// assert_eq!(refund_failed(502).class(), "retryable");
/// ```
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Transient: retry the operation later (job-level retries are data, not loops).
    #[error("{message}")]
    Retryable {
        message: String,
        not_before: Option<DateTime<Utc>>,
    },
    /// A provider is overloaded: back off harder.
    #[error("{message}")]
    Overloaded {
        message: String,
        not_before: Option<DateTime<Utc>>,
    },
    /// Transient, and the call certainly had no effect: it was never sent, or the outside
    /// system refused it before acting (429, 503, a database error for the statement).
    /// Retried like `Retryable`; an unsafe step runs again on the next attempt. A plain
    /// `Retryable` from an unsafe step leaves its outcome unknown instead (see
    /// [`Tool::call`](crate::Tool::call)).
    #[error("{0}")]
    NoEffect(String),
    /// Can never succeed as is: straight to the DLQ.
    #[error("{0}")]
    NonRetryable(String),
    /// Stopped on request.
    #[error("cancelled")]
    Cancelled,
    /// This worker no longer holds the operation: write nothing more for it.
    #[error("lease lost")]
    LeaseLost,
    /// The function asked for different steps than the journal recorded.
    #[error("{0}")]
    Nondeterminism(String),
    /// An unsafe step was left `started` by a crash and cannot be reconciled.
    #[error("step {seq} ({name}) may or may not have happened; idempotency key {key}")]
    UnknownSideEffect { seq: i32, name: String, key: String },
    /// The job function panicked (treated as a retryable failure of this attempt).
    #[error("job panicked: {0}")]
    Panicked(String),
    /// The operation's deadline passed before it finished.
    #[error("deadline {0} passed before the operation finished")]
    DeadlineExceeded(DateTime<Utc>),
    /// The operation's token budget refused a model call and was not raised within its
    /// timeout: dead (`budget_exceeded`).
    #[error("{0}")]
    BudgetExceeded(String),
    /// The operation parked itself (a durable sleep, or a wait for a signal): the worker lets go
    /// of it and the scheduler wakes it. Job code just propagates it with `?`.
    #[error("suspended until a wake-up")]
    Suspended,
}

impl JobError {
    /// A retryable error with a message.
    pub fn retryable(message: impl Into<String>) -> Self {
        JobError::Retryable {
            message: message.into(),
            not_before: None,
        }
    }

    /// A transient error that certainly had no effect (see [`JobError::NoEffect`]).
    pub fn no_effect(message: impl Into<String>) -> Self {
        JobError::NoEffect(message.into())
    }

    /// Whether a step that failed with this error may have had its effect anyway: a
    /// transient failure not known to be [`JobError::NoEffect`] (a dropped connection or a
    /// timeout after the request was sent). An unsafe step ending so is journaled `unknown`.
    pub(crate) fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            JobError::Retryable { .. } | JobError::Overloaded { .. }
        )
    }

    /// What the failure decision ([`agentq_core::state::failure::after_failure`]) needs to know
    /// of this error; `None` when the attempt did not fail: the lease was lost (nothing may be
    /// written) or the job parked itself.
    pub fn failure(&self) -> Option<Failure> {
        Some(match self {
            JobError::Retryable { not_before, .. } => Failure::Retryable {
                not_before: *not_before,
            },
            JobError::NoEffect(_) => Failure::NoEffect,
            JobError::Panicked(_) => Failure::Panicked,
            JobError::Overloaded { not_before, .. } => Failure::Overloaded {
                not_before: *not_before,
            },
            JobError::NonRetryable(_) => Failure::NonRetryable,
            JobError::Nondeterminism(_) => Failure::Nondeterminism,
            JobError::UnknownSideEffect { .. } => Failure::UnknownSideEffect,
            JobError::DeadlineExceeded(_) => Failure::DeadlineExceeded,
            JobError::BudgetExceeded(_) => Failure::BudgetExceeded,
            JobError::Cancelled => Failure::Cancelled,
            JobError::LeaseLost | JobError::Suspended => return None,
        })
    }

    /// The stable snake_case class of the error itself, as spans report it: its failure's
    /// class, or `lease_lost` / `suspended`. (What is stored as `error_class` is decided by
    /// the failure decision, which may say `retries_exhausted` instead.)
    pub fn class(&self) -> &'static str {
        match (self.failure(), self) {
            (Some(f), _) => f.class().as_str(),
            (None, JobError::LeaseLost) => "lease_lost",
            (None, _) => "suspended",
        }
    }
}
