//! What a failure leads to: the pure decisions behind every failing transition.
//!
//! [`after_failure`] decides a failed attempt (the worker's `settle` gathers the facts, calls
//! it and writes the answer in one fenced statement); [`after_lease_expiry`] decides an expired
//! lease, and the reaper's one statement (`db::settle::reap_expired_leases`) mirrors it in SQL for many
//! rows at once: a test there checks the statement names what this function answers. Neither
//! touches a clock, a database or a random number: the retry time is computed by the caller
//! from [`To::Retry`] / [`To::Park`] with `core::retry`.

use chrono::{DateTime, Utc};

use super::{ErrorClass, Status};

/// How an attempt failed, as far as the decision cares: the kind of error, never its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Transient; the failing call may have had its effect. Not before `not_before`.
    Retryable { not_before: Option<DateTime<Utc>> },
    /// Transient, and the failing call certainly had no effect.
    NoEffect,
    /// The job function panicked (a failure of this attempt).
    Panicked,
    /// A provider is overloaded. Not before `not_before`.
    Overloaded { not_before: Option<DateTime<Utc>> },
    /// Can never succeed as is.
    NonRetryable,
    /// The job asked for other steps than its journal recorded.
    Nondeterminism,
    /// An unsafe step's outcome is unknown and could not be reconciled.
    UnknownSideEffect,
    /// The operation's deadline passed.
    DeadlineExceeded,
    /// The operation's token budget refused a model call and was not raised in time.
    BudgetExceeded,
    /// Stopped on request (the job, or an operator through the heartbeat).
    Cancelled,
}

impl Failure {
    /// The failure's own class: what it is stored as when nothing overrides it (a retry, or
    /// death on the spot), and the outcome on spans.
    pub const fn class(self) -> ErrorClass {
        match self {
            Failure::Retryable { .. } | Failure::NoEffect | Failure::Panicked => {
                ErrorClass::Retryable
            }
            Failure::Overloaded { .. } => ErrorClass::Overloaded,
            Failure::NonRetryable => ErrorClass::NonRetryable,
            Failure::Nondeterminism => ErrorClass::Nondeterminism,
            Failure::UnknownSideEffect => ErrorClass::UnknownSideEffect,
            Failure::DeadlineExceeded => ErrorClass::DeadlineExceeded,
            Failure::BudgetExceeded => ErrorClass::BudgetExceeded,
            Failure::Cancelled => ErrorClass::Cancelled,
        }
    }
}

/// Where a failed attempt sends its running operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum To {
    /// `queued` after the ordinary backoff for this attempt (never before `not_before`); the
    /// attempt counts.
    Retry { not_before: Option<DateTime<Utc>> },
    /// `queued` after the longer overload backoff (never before `not_before`); the attempt is
    /// given back: an overloaded provider is not the operation's fault.
    Park { not_before: Option<DateTime<Utc>> },
    /// `dead`, with an open dead letter. `unknown_step`: the letter names the unsafe step whose
    /// outcome is unknown (and its idempotency key), not the error the attempt ended with.
    Dead { unknown_step: bool },
    /// `cancelled`.
    Cancelled,
}

impl To {
    /// The operation's status after the transition.
    pub const fn status(self) -> Status {
        match self {
            To::Retry { .. } | To::Park { .. } => Status::Queued,
            To::Dead { .. } => Status::Dead,
            To::Cancelled => Status::Cancelled,
        }
    }
}

/// The decision for a failed attempt: its class and where the operation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Next {
    pub class: ErrorClass,
    pub to: To,
}

/// Decides what the failed attempt number `attempt` (1-based, of at most `max_attempts`) leads
/// to. `unknown_step`: the attempt left an unsafe step `unknown` in the journal (its call failed
/// in a way that may have had its effect).
///
/// - transient failures retry while attempts are left, else the operation is dead as
///   `retries_exhausted`; when the last attempt ends on a transient failure that may have had
///   an effect and left a step unknown, no attempt is left to reconcile it: dead as
///   `unknown_side_effect`, naming the step;
/// - an overloaded provider parks the operation without using the attempt, however many are
///   left;
/// - a cancel cancels; anything else is dead on the spot with its own class.
pub const fn after_failure(
    failure: Failure,
    attempt: i32,
    max_attempts: i32,
    unknown_step: bool,
) -> Next {
    let attempts_left = attempt < max_attempts;
    let (class, to) = match failure {
        Failure::Retryable { not_before } if attempts_left => {
            (ErrorClass::Retryable, To::Retry { not_before })
        }
        Failure::NoEffect | Failure::Panicked if attempts_left => {
            (ErrorClass::Retryable, To::Retry { not_before: None })
        }
        Failure::Retryable { .. } if unknown_step => (
            ErrorClass::UnknownSideEffect,
            To::Dead { unknown_step: true },
        ),
        Failure::Retryable { .. } | Failure::NoEffect | Failure::Panicked => (
            ErrorClass::RetriesExhausted,
            To::Dead {
                unknown_step: false,
            },
        ),
        Failure::Overloaded { not_before } => (ErrorClass::Overloaded, To::Park { not_before }),
        Failure::Cancelled => (ErrorClass::Cancelled, To::Cancelled),
        Failure::NonRetryable
        | Failure::Nondeterminism
        | Failure::UnknownSideEffect
        | Failure::DeadlineExceeded
        | Failure::BudgetExceeded => (
            failure.class(),
            To::Dead {
                unknown_step: false,
            },
        ),
    };
    Next { class, to }
}

/// Decides what the reaper does with an operation whose lease expired after `restarts` earlier
/// recoveries: restart it (`queued`, `lease_expired`, the attempt given back) while `restarts + 1`
/// is within `restart_limit`, else `dead` as `crash_loop`. `db::settle::reap_expired_leases` is this
/// function in SQL.
pub const fn after_lease_expiry(restarts: i32, restart_limit: i32) -> (Status, ErrorClass) {
    if restarts + 1 > restart_limit {
        (Status::Dead, ErrorClass::CrashLoop)
    } else {
        (Status::Queued, ErrorClass::LeaseExpired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::can_transition;

    #[test]
    fn failed_attempts() {
        use ErrorClass as C;
        use Failure as F;
        let nb = Some(DateTime::from_timestamp(1_900_000_000, 0).unwrap());
        let dead = To::Dead {
            unknown_step: false,
        };
        let blamed = To::Dead { unknown_step: true };
        #[rustfmt::skip]
        let table = [
            // failure,                              attempt, max, unknown step, class,                 to
            (F::Retryable { not_before: None },       1, 3, false, C::Retryable,        To::Retry { not_before: None }),
            (F::Retryable { not_before: nb },         2, 3, false, C::Retryable,        To::Retry { not_before: nb }),
            // An unknown step with attempts left is reconciled by the next attempt.
            (F::Retryable { not_before: None },       2, 3, true,  C::Retryable,        To::Retry { not_before: None }),
            (F::Retryable { not_before: nb },         3, 3, false, C::RetriesExhausted, dead),
            (F::Retryable { not_before: None },       3, 3, true,  C::UnknownSideEffect, blamed),
            (F::Retryable { not_before: None },       4, 3, false, C::RetriesExhausted, dead),
            (F::Retryable { not_before: None },       1, 1, false, C::RetriesExhausted, dead),
            (F::NoEffect,                             2, 3, false, C::Retryable,        To::Retry { not_before: None }),
            (F::NoEffect,                             3, 3, false, C::RetriesExhausted, dead),
            // NoEffect certainly had no effect: an unknown step is not what it died of.
            (F::NoEffect,                             3, 3, true,  C::RetriesExhausted, dead),
            (F::Panicked,                             1, 5, false, C::Retryable,        To::Retry { not_before: None }),
            (F::Panicked,                             5, 5, true,  C::RetriesExhausted, dead),
            (F::Overloaded { not_before: None },      1, 3, false, C::Overloaded,       To::Park { not_before: None }),
            (F::Overloaded { not_before: nb },        3, 3, true,  C::Overloaded,       To::Park { not_before: nb }),
            (F::NonRetryable,                         1, 3, false, C::NonRetryable,     dead),
            (F::NonRetryable,                         3, 3, true,  C::NonRetryable,     dead),
            (F::Nondeterminism,                       1, 3, false, C::Nondeterminism,   dead),
            (F::UnknownSideEffect,                    1, 3, true,  C::UnknownSideEffect, dead),
            (F::DeadlineExceeded,                     1, 3, false, C::DeadlineExceeded, dead),
            (F::BudgetExceeded,                       1, 3, false, C::BudgetExceeded,   dead),
            (F::Cancelled,                            1, 3, false, C::Cancelled,        To::Cancelled),
            (F::Cancelled,                            3, 3, true,  C::Cancelled,        To::Cancelled),
        ];
        for (i, (failure, attempt, max, unknown, class, to)) in table.into_iter().enumerate() {
            let next = after_failure(failure, attempt, max, unknown);
            assert_eq!(
                next,
                Next { class, to },
                "row {i}: {failure:?} at attempt {attempt} of {max}, unknown step: {unknown}"
            );
            assert!(can_transition(Status::Running, next.to.status()), "row {i}");
            // A class names the status it leads to: only these three classes go back to queued.
            let requeues = matches!(class, C::Retryable | C::Overloaded | C::LeaseExpired);
            assert_eq!(next.to.status() == Status::Queued, requeues, "row {i}");
        }
    }

    #[test]
    fn every_failure_has_its_own_class_when_it_ends_the_operation_at_once() {
        for failure in [
            Failure::NonRetryable,
            Failure::Nondeterminism,
            Failure::UnknownSideEffect,
            Failure::DeadlineExceeded,
            Failure::BudgetExceeded,
            Failure::Cancelled,
        ] {
            assert_eq!(after_failure(failure, 1, 5, false).class, failure.class());
        }
    }

    #[test]
    fn expired_leases() {
        #[rustfmt::skip]
        let table = [
            // restarts so far, limit, status,          class
            (0, 3, Status::Queued, ErrorClass::LeaseExpired),
            (2, 3, Status::Queued, ErrorClass::LeaseExpired),
            (3, 3, Status::Dead,   ErrorClass::CrashLoop),
            (7, 3, Status::Dead,   ErrorClass::CrashLoop),
            (0, 0, Status::Dead,   ErrorClass::CrashLoop),
        ];
        for (restarts, limit, status, class) in table {
            assert_eq!(
                after_lease_expiry(restarts, limit),
                (status, class),
                "restarts {restarts}, limit {limit}"
            );
            assert!(can_transition(Status::Running, status));
        }
    }
}
