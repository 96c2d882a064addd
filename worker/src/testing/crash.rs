//! The crash points of a first run: its timeline (durable writes and effects, in order) and
//! every point of it where a crash leaves a different state to start again from.

use std::collections::HashMap;

use agentq_core::db::steps::StepWrite;
use agentq_core::state::{StepKind, StepStatus};
use serde_json::Value;

/// The completed steps of a journal, in order.
pub(super) fn completed(journal: &[StepWrite]) -> Vec<(i32, String, StepKind)> {
    journal
        .iter()
        .filter(|r| r.status == StepStatus::Completed)
        .map(|r| (r.seq, r.name.clone(), r.kind))
        .collect()
}

/// A point of the first run where a crash can hit: the journal as the last durable write left
/// it, and the effects that had happened by then.
#[derive(Clone, Debug)]
pub(super) struct CrashPoint {
    pub(super) journal: Vec<StepWrite>,
    pub(super) happened: HashMap<String, Value>,
    /// How many of the timeline's events came before it.
    pub(super) events: usize,
    /// The last thing that happened before it.
    after: String,
}

impl CrashPoint {
    pub(super) fn describe(&self, n: usize) -> String {
        format!("crash point {} ({})", n + 1, self.after)
    }
}

/// What the first run did, in order.
#[derive(Clone, Debug)]
pub(super) enum Event {
    /// A durable write: the journal after it.
    Durable(Vec<StepWrite>),
    /// An effect: its idempotency key, its step, and what it answered.
    Effect {
        key: String,
        step: String,
        output: Value,
    },
}

/// The waits of `timeline` that said what they need, as they were written when they parked:
/// seq, signal name, `about` (each once, in order).
pub(super) fn waits(timeline: &[Event]) -> Vec<(i32, String, Value)> {
    let mut seen = Vec::new();
    for e in timeline {
        let Event::Durable(journal) = e else { continue };
        for r in journal {
            if r.kind != StepKind::Signal || seen.iter().any(|(s, _, _)| *s == r.seq) {
                continue;
            }
            if let Some(about) = agentq_core::approval::about_of(r.output.as_ref()) {
                let name = r.name.strip_prefix("signal:").unwrap_or(&r.name);
                seen.push((r.seq, name.to_string(), about.clone()));
            }
        }
    }
    seen
}

/// Every point of `timeline` where a crash leaves a different state: before anything, after
/// each durable write, and after each effect.
pub(super) fn crash_points(timeline: &[Event]) -> Vec<CrashPoint> {
    let mut points = vec![CrashPoint {
        journal: Vec::new(),
        happened: HashMap::new(),
        events: 0,
        after: "before the first step".into(),
    }];
    let mut journal: Vec<StepWrite> = Vec::new();
    let mut happened: HashMap<String, Value> = HashMap::new();
    for (n, event) in timeline.iter().enumerate() {
        let after = match event {
            Event::Durable(j) => {
                journal = j.clone();
                match j.last() {
                    Some(r) => {
                        format!("after step {} ({}) was written {}", r.seq, r.name, r.status)
                    }
                    None => "after a write".into(),
                }
            }
            Event::Effect { key, step, output } => {
                happened.insert(key.clone(), output.clone());
                format!("after the effect of {step}, before its journal write")
            }
        };
        let point = CrashPoint {
            journal: journal.clone(),
            happened: happened.clone(),
            events: n + 1,
            after,
        };
        let same = points
            .last()
            .is_some_and(|p| same_rows(&p.journal, &point.journal) && p.happened == point.happened);
        if !same {
            points.push(point);
        }
    }
    points
}

/// Whether two journals hold the same rows (position, step, status, output).
fn same_rows(a: &[StepWrite], b: &[StepWrite]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (x.seq, &x.name, x.status, &x.output) == (y.seq, &y.name, y.status, &y.output)
        })
}
