//! What the tester reports: how a run ended ([`End`]), what it checks ([`Check`]), each thing a
//! crash would break ([`Violation`]), and the whole [`Report`].

use std::fmt;

use agentq_core::state::StepKind;
use serde_json::Value;

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Succeeded(Value),
    Failed {
        class: String,
        message: String,
    },
    /// [`replay_journal`](super::replay_journal): the code agreed with the journal up to its end.
    ReachedEnd,
}

impl End {
    pub(super) fn class(&self) -> &str {
        match self {
            End::Succeeded(_) => "succeeded",
            End::Failed { class, .. } => class,
            End::ReachedEnd => "reached_end",
        }
    }
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Succeeded(_) => f.write_str("succeeded"),
            End::Failed { class, message } => write!(f, "failed ({class}: {message})"),
            End::ReachedEnd => f.write_str("agreed with the journal to its end"),
        }
    }
}

/// What the tester checks; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Check {
    Nondeterminism,
    RanAgain,
    NoReconcile,
    /// A reconcile answered other than what happened in its timeline: "happened" for an
    /// effect that had not, or with another output than the effect's.
    WrongReconcile,
    Failed,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Check::Nondeterminism => "nondeterminism",
            Check::RanAgain => "ran again",
            Check::NoReconcile => "no reconcile",
            Check::WrongReconcile => "wrong reconcile",
            Check::Failed => "failed",
        })
    }
}

/// One thing a crash would break.
#[derive(Clone, Debug)]
pub struct Violation {
    pub check: Check,
    /// The step, where one is to blame.
    pub seq: Option<i32>,
    pub step: String,
    /// The crash point (or "the first run").
    pub at: String,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.seq {
            Some(seq) => write!(
                f,
                "[{}] step {seq} ({}) at {}: {}",
                self.check, self.step, self.at, self.message
            ),
            None => write!(f, "[{}] at {}: {}", self.check, self.at, self.message),
        }
    }
}

/// What [`Tester::run`](super::Tester::run) found.
#[derive(Clone, Debug)]
pub struct Report {
    /// How the first run ended.
    pub outcome: End,
    /// The first run's journal: seq, step name, step kind.
    pub steps: Vec<(i32, String, StepKind)>,
    /// The first run's waits for a signal that said what they need
    /// (`ctx.wait_for_signal_about`): seq, signal name, `about`, in the order they parked.
    pub waits: Vec<(i32, String, Value)>,
    /// Crash points the tester replayed from.
    pub crash_points: usize,
    /// What went wrong, one entry per check and step.
    pub violations: Vec<Violation>,
}

impl Report {
    pub(super) fn broken(why: String) -> Self {
        Report {
            outcome: End::Failed {
                class: "tester".into(),
                message: why.clone(),
            },
            steps: Vec::new(),
            waits: Vec::new(),
            crash_points: 0,
            violations: vec![Violation {
                check: Check::Failed,
                seq: None,
                step: String::new(),
                at: "the start".into(),
                message: why,
            }],
        }
    }

    /// Keeps the first violation of each check and step.
    pub(super) fn note(&mut self, v: Violation) {
        let seen = self
            .violations
            .iter()
            .any(|o| o.check == v.check && o.seq == v.seq && o.step == v.step);
        if !seen {
            self.violations.push(v);
        }
    }

    /// Whether nothing went wrong: no problem found, and the first run did not fail (a kind
    /// meant to fail is checked with [`Report::outcome`] and [`Report::found`]).
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty() && !matches!(self.outcome, End::Failed { .. })
    }

    /// The first run's output, if it succeeded.
    pub fn output(&self) -> Option<&Value> {
        match &self.outcome {
            End::Succeeded(v) => Some(v),
            _ => None,
        }
    }

    /// The violations of `check`.
    pub fn found(&self, check: Check) -> Vec<&Violation> {
        self.violations
            .iter()
            .filter(|v| v.check == check)
            .collect()
    }

    /// Panics with the report unless nothing went wrong ([`Report::is_ok`]: a failed run fails
    /// it too).
    #[track_caller]
    pub fn assert_ok(&self) {
        assert!(self.is_ok(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.violations.len();
        writeln!(
            f,
            "replay tester: {} steps, {}, {} crash points replayed, {n} {}",
            self.steps.len(),
            self.outcome,
            self.crash_points,
            if n == 1 { "problem" } else { "problems" }
        )?;
        for v in &self.violations {
            writeln!(f, "  {v}")?;
        }
        Ok(())
    }
}
