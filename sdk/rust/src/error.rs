//! How a job, or one of its steps, fails: [`JobError`] and its stable classes.
//!
//! The class of an error decides what happens next (retry later, back off harder, dead letter,
//! park), in one place: the worker's `executor::settle`. This module imports nothing from the rest of the
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
/// use agentq_sdk::JobError;
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
///
/// The engine's own stops (the lease was lost, the operation parked or was cancelled, the
/// journal disagrees with the code, …) are [`JobError::Stopped`], opaque: a kind propagates
/// them with `?` and never makes or matches one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// Transient: retry the operation later (job-level retries are data, not loops), not
    /// before `not_before` if given. From an unsafe step it leaves the outcome unknown: the
    /// step is reconciled on the next attempt. Build it with [`JobError::retryable`] or
    /// [`JobError::retryable_after`].
    #[error("{message}")]
    Retryable {
        message: String,
        not_before: Option<DateTime<Utc>>,
    },
    /// Transient, and the call certainly had no effect: it was never sent, or the outside
    /// system refused it before acting (429, 503, a database error for the statement).
    /// Retried like `Retryable`; an unsafe step runs again on the next attempt.
    #[error("{0}")]
    NoEffect(String),
    /// Can never succeed as is: straight to the DLQ.
    #[error("{0}")]
    NonRetryable(String),
    /// The engine stopped the run: propagate it with `?`.
    #[error("{0}")]
    Stopped(Stop),
}

/// Why the engine stopped a run (opaque to kinds; its class is [`JobError::class`]).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct Stop(#[doc(hidden)] pub Engine);

/// The engine's stops, made and matched only by a backend (the worker, the replay tester).
#[doc(hidden)]
#[derive(Debug, thiserror::Error)]
pub enum Engine {
    /// A provider is overloaded: back off harder.
    #[error("{message}")]
    Overloaded {
        message: String,
        not_before: Option<DateTime<Utc>>,
    },
    /// What the run called could not be reached and nothing was sent (a registered service
    /// that is down): parked like `Overloaded`, its attempt given back; a step it ends failed
    /// with no effect, so the next run runs it again instead of reconciling it.
    #[error("{message}")]
    Unreached {
        message: String,
        not_before: Option<DateTime<Utc>>,
    },
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
    /// of it and the scheduler wakes it.
    #[error("suspended until a wake-up")]
    Suspended,
}

/// An I/O error is transient, and may have had its effect (a write cut short): retryable; in
/// an unsafe step the step is reconciled. Map it yourself where it is known to be otherwise.
impl From<std::io::Error> for JobError {
    fn from(e: std::io::Error) -> Self {
        JobError::retryable(e.to_string())
    }
}

impl From<Engine> for JobError {
    fn from(stop: Engine) -> Self {
        JobError::Stopped(Stop(stop))
    }
}

impl JobError {
    /// A retryable error with a message.
    pub fn retryable(message: impl Into<String>) -> Self {
        JobError::Retryable {
            message: message.into(),
            not_before: None,
        }
    }

    /// A retryable error not to be retried before `not_before` (a `Retry-After`).
    pub fn retryable_after(message: impl Into<String>, not_before: DateTime<Utc>) -> Self {
        JobError::Retryable {
            message: message.into(),
            not_before: Some(not_before),
        }
    }

    /// A transient error that certainly had no effect (see [`JobError::NoEffect`]).
    pub fn no_effect(message: impl Into<String>) -> Self {
        JobError::NoEffect(message.into())
    }

    /// An error that no retry can change (see [`JobError::NonRetryable`]).
    pub fn non_retryable(message: impl Into<String>) -> Self {
        JobError::NonRetryable(message.into())
    }

    /// A provider (a model server, an API) says it is overloaded: retried like `Retryable`,
    /// but the operation backs off harder, not before `not_before` if given. For a
    /// [`ModelClient`](crate::ModelClient) of your own.
    pub fn overloaded(message: impl Into<String>, not_before: Option<DateTime<Utc>>) -> Self {
        Engine::Overloaded {
            message: message.into(),
            not_before,
        }
        .into()
    }

    /// The engine's stop this is, if it is one.
    #[doc(hidden)]
    pub fn engine(&self) -> Option<&Engine> {
        match self {
            JobError::Stopped(Stop(e)) => Some(e),
            _ => None,
        }
    }

    /// Whether a step that failed with this error may have had its effect anyway: a
    /// transient failure not known to be [`JobError::NoEffect`] (a dropped connection or a
    /// timeout after the request was sent). An unsafe step ending so is journaled `unknown`.
    #[doc(hidden)]
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            JobError::Retryable { .. } | JobError::Stopped(Stop(Engine::Overloaded { .. }))
        )
    }

    /// Whether the engine stopped the run because the worker lost the operation's lease.
    #[doc(hidden)]
    pub fn is_lease_lost(&self) -> bool {
        matches!(self.engine(), Some(Engine::LeaseLost))
    }

    /// Whether the operation parked itself (a sleep, a wait, a budget or rate pause).
    #[doc(hidden)]
    pub fn is_suspended(&self) -> bool {
        matches!(self.engine(), Some(Engine::Suspended))
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
            JobError::NonRetryable(_) => Failure::NonRetryable,
            JobError::Stopped(Stop(stop)) => match stop {
                Engine::Panicked(_) => Failure::Panicked,
                Engine::Overloaded { not_before, .. } | Engine::Unreached { not_before, .. } => {
                    Failure::Overloaded {
                        not_before: *not_before,
                    }
                }
                Engine::Nondeterminism(_) => Failure::Nondeterminism,
                Engine::UnknownSideEffect { .. } => Failure::UnknownSideEffect,
                Engine::DeadlineExceeded(_) => Failure::DeadlineExceeded,
                Engine::BudgetExceeded(_) => Failure::BudgetExceeded,
                Engine::Cancelled => Failure::Cancelled,
                Engine::LeaseLost | Engine::Suspended => return None,
            },
        })
    }

    /// The stable snake_case class of the error itself, as spans report it: its failure's
    /// class, or `lease_lost` / `suspended`. (What is stored as `error_class` is decided by
    /// the failure decision, which may say `retries_exhausted` instead.)
    pub fn class(&self) -> &'static str {
        match (self.failure(), self.is_lease_lost()) {
            (Some(f), _) => f.class().as_str(),
            (None, true) => "lease_lost",
            (None, false) => "suspended",
        }
    }
}
