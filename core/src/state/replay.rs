//! What replay does with a journal entry: the pure decision behind every step of a restarted
//! job function ([`resume`], called by `worker::context` before it runs a step).
//!
//! Invariant kept here: an unsafe step left `started` by a crash, or `unknown` by a call that
//! may have had its effect, is never re-run blindly: it is reconciled with its tool, or the
//! operation fails closed (`unknown_side_effect`). Only `failed` entries, and safe steps whose
//! outcome was lost, run again.

use super::{ErrorClass, Replay, StepStatus};

/// The journal's entry at the position of the step the job asks for now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recorded {
    /// The entry's status.
    pub status: StepStatus,
    /// The replay policy it was recorded with.
    pub replay: Replay,
    /// Whether it is the step the job asks for (same name and kind).
    pub same_step: bool,
}

/// What to do with a step, given what the journal recorded at its position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Run it: nothing recorded, a failed entry, or a safe step whose outcome was lost.
    Run,
    /// Return the recorded output without running it.
    UseRecorded,
    /// Ask the tool whether the call with this step's idempotency key happened, then use its
    /// answer, run the step (it did not happen), or fail closed (the tool cannot tell).
    Reconcile,
    /// Mark the step `unknown` and stop the operation: `unknown_side_effect`.
    FailClosed,
    /// The job asks for another step than the journal recorded: `nondeterminism`.
    Diverged,
}

impl Resume {
    /// The class the operation fails with, for the two answers that stop it.
    pub const fn class(self) -> Option<ErrorClass> {
        match self {
            Resume::FailClosed => Some(ErrorClass::UnknownSideEffect),
            Resume::Diverged => Some(ErrorClass::Nondeterminism),
            Resume::Run | Resume::UseRecorded | Resume::Reconcile => None,
        }
    }
}

/// Decides a step from its journal entry (`None`: nothing recorded at its position).
/// `can_reconcile`: the step has a tool to ask (a `ctx.step` has none).
///
/// A failed entry has no outcome to keep: whatever the code asks for at that position now (an
/// operator may have patched the input) runs fresh, so only other entries are checked for
/// divergence.
pub const fn resume(recorded: Option<Recorded>, can_reconcile: bool) -> Resume {
    let Some(r) = recorded else {
        return Resume::Run;
    };
    match (r.status, r.replay) {
        (StepStatus::Failed, _) => Resume::Run,
        _ if !r.same_step => Resume::Diverged,
        (StepStatus::Completed, _) => Resume::UseRecorded,
        (StepStatus::Started | StepStatus::Unknown, Replay::Safe) => Resume::Run,
        (StepStatus::Started | StepStatus::Unknown, Replay::Unsafe) if can_reconcile => {
            Resume::Reconcile
        }
        (StepStatus::Started | StepStatus::Unknown, Replay::Unsafe) => Resume::FailClosed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Replay::{Safe, Unsafe};
    use Resume::*;
    use StepStatus::{Completed, Failed, Started, Unknown};

    #[test]
    fn every_policy_and_status() {
        #[rustfmt::skip]
        let table = [
            // replay, status,    can reconcile, decision
            (Safe,   Started,   false, Run),
            (Safe,   Started,   true,  Run),
            (Safe,   Completed, false, UseRecorded),
            (Safe,   Completed, true,  UseRecorded),
            (Safe,   Failed,    false, Run),
            (Safe,   Failed,    true,  Run),
            (Safe,   Unknown,   false, Run),
            (Safe,   Unknown,   true,  Run),
            (Unsafe, Started,   false, FailClosed),
            (Unsafe, Started,   true,  Reconcile),
            (Unsafe, Completed, false, UseRecorded),
            (Unsafe, Completed, true,  UseRecorded),
            (Unsafe, Failed,    false, Run),
            (Unsafe, Failed,    true,  Run),
            (Unsafe, Unknown,   false, FailClosed),
            (Unsafe, Unknown,   true,  Reconcile),
        ];
        // Every (policy, status) pair is in the table, with and without a tool to ask.
        assert_eq!(table.len(), Replay::ALL.len() * StepStatus::ALL.len() * 2);
        for (replay, status, can_reconcile, decision) in table {
            let recorded = Recorded {
                status,
                replay,
                same_step: true,
            };
            assert_eq!(
                resume(Some(recorded), can_reconcile),
                decision,
                "{replay} step recorded {status}, can reconcile: {can_reconcile}"
            );
        }
    }

    #[test]
    fn another_step_at_a_recorded_position_diverges_unless_it_had_failed() {
        for &replay in Replay::ALL {
            for &status in StepStatus::ALL {
                let recorded = Recorded {
                    status,
                    replay,
                    same_step: false,
                };
                let expected = if status == Failed { Run } else { Diverged };
                for can_reconcile in [false, true] {
                    assert_eq!(
                        resume(Some(recorded), can_reconcile),
                        expected,
                        "{replay} {status}"
                    );
                }
            }
        }
        assert_eq!(Diverged.class(), Some(ErrorClass::Nondeterminism));
        assert_eq!(FailClosed.class(), Some(ErrorClass::UnknownSideEffect));
    }

    #[test]
    fn nothing_recorded_runs() {
        assert_eq!(resume(None, false), Run);
        assert_eq!(resume(None, true), Run);
    }
}
