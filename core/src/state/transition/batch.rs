//! The named transitions of a batch (`batches.status`): every status change agentq writes to
//! a batch, each with the statuses it starts from and the one it leads to.
//!
//! Invariant kept here: every statement of `db` that writes `batches.status` names one of these
//! transitions (`batch::NAME`) and guards on its from-set ([`Transition::from_sql`]); the
//! edges of these transitions are exactly [`can_transition`]'s table (tests below check both).
//!
//! ```text
//! canary ──promote──▶ running ──complete──▶ completed ──reopen (a DLQ retry)──▶ running
//!   │                  │  ▲
//!   ├─pause/auto_pause─┴──┼──▶ paused ──resume──▶ running
//!   └─cancel (canary, running, paused) ──▶ cancelled
//! ```

use crate::state::BatchStatus::{self, *};

/// One named status change of a batch: from any of `from` to `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Its name (`complete`, `reopen`…), the const's in lower case; audited as `batch_<name>`.
    pub name: &'static str,
    /// The statuses it may start from: the SQL guard of its statement.
    pub from: &'static [BatchStatus],
    /// The status it writes.
    pub to: BatchStatus,
}

impl Transition {
    /// Whether the transition may start from `status`.
    pub fn starts_from(&self, status: BatchStatus) -> bool {
        self.from.contains(&status)
    }

    /// The from-set as an SQL list (`('running', 'canary')`), for the statement's guard.
    pub fn from_sql(&self) -> String {
        let names: Vec<String> = self.from.iter().map(|s| format!("'{s}'")).collect();
        format!("({})", names.join(", "))
    }

    /// The target as an SQL literal (`'completed'`).
    pub fn to_sql(&self) -> String {
        format!("'{}'", self.to)
    }
}

/// An operator runs the rest of a canary (`batch resume` of a canary batch).
pub const PROMOTE: Transition = Transition {
    name: "promote",
    from: &[Canary],
    to: Running,
};
/// An operator pauses a running or canary batch.
pub const PAUSE: Transition = Transition {
    name: "pause",
    from: &[Running, Canary],
    to: Paused,
};
/// The scheduler pauses a batch whose newest outcomes failed past its ratio
/// (`db::batches::auto_pause`).
pub const AUTO_PAUSE: Transition = Transition {
    name: "auto_pause",
    from: &[Running, Canary],
    to: Paused,
};
/// An operator resumes a paused batch.
pub const RESUME: Transition = Transition {
    name: "resume",
    from: &[Paused],
    to: Running,
};
/// An operator cancels a batch that has not finished.
pub const CANCEL: Transition = Transition {
    name: "cancel",
    from: &[Canary, Running, Paused],
    to: Cancelled,
};
/// The scheduler finds every document of a filled, running batch with an outcome
/// (`db::batches::complete`).
pub const COMPLETE: Transition = Transition {
    name: "complete",
    from: &[Running],
    to: Completed,
};
/// A completed batch gets unfinished work again: a DLQ retry of one of its operations, or a
/// `batch start` that finds documents it is missing (`db::batches::reopen`).
pub const REOPEN: Transition = Transition {
    name: "reopen",
    from: &[Completed],
    to: Running,
};

/// Every named transition of a batch.
pub const ALL: &[Transition] = &[PROMOTE, PAUSE, AUTO_PAUSE, RESUME, CANCEL, COMPLETE, REOPEN];

/// Whether a batch may go from `from` to `to`: the table the named transitions must match.
pub fn can_transition(from: BatchStatus, to: BatchStatus) -> bool {
    matches!(
        (from, to),
        (Canary, Running)
            | (Canary | Running, Paused)
            | (Paused, Running)
            | (Canary | Running | Paused, Cancelled)
            | (Running, Completed)
            | (Completed, Running)
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn the_named_transitions_are_the_table() {
        let mut names = Vec::new();
        for t in ALL {
            assert!(!names.contains(&t.name), "{} is named twice", t.name);
            names.push(t.name);
            for &from in t.from {
                assert!(can_transition(from, t.to), "{}: {from} → {}", t.name, t.to);
            }
        }
        for &from in BatchStatus::ALL {
            for &to in BatchStatus::ALL {
                let named = ALL.iter().any(|t| t.starts_from(from) && t.to == to);
                assert_eq!(can_transition(from, to), named, "{from} → {to}");
            }
        }
        // Cancelled is for good; completed only reopens.
        for &to in BatchStatus::ALL {
            assert!(!can_transition(Cancelled, to));
            assert_eq!(can_transition(Completed, to), to == Running);
        }
    }

    /// The Rust items (functions) of `src` that contain `needle`, each whole.
    fn items_with<'a>(src: &'a str, needle: &str) -> Vec<&'a str> {
        let starts: Vec<usize> = src
            .match_indices("\npub async fn ")
            .chain(src.match_indices("\nasync fn "))
            .chain(src.match_indices("\npub fn "))
            .map(|(i, _)| i)
            .collect();
        let mut bounds = starts.clone();
        bounds.sort();
        bounds.push(src.len());
        bounds
            .windows(2)
            .map(|w| &src[w[0]..w[1]])
            .filter(|item| item.contains(needle))
            .collect()
    }

    /// The text of the statements the scan below looks for.
    const WRITER: &str = "UPDATE batches";

    /// Every statement of `db` that writes `batches.status` is in a function that names a
    /// batch transition (`batch::NAME`) and builds its guard from it (`from_sql()`).
    #[test]
    fn every_batch_status_writer_names_its_transition() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/db");
        let mut writers = 0;
        for entry in std::fs::read_dir(&root).unwrap() {
            let path = entry.unwrap().path();
            let src = std::fs::read_to_string(&path).unwrap();
            let src = src.split("#[cfg(test)]").next().unwrap();
            for item in items_with(src, WRITER) {
                let at = item.find(WRITER).unwrap();
                let set = &item[at..];
                let set = &set[..set.find("WHERE").unwrap_or(set.len())];
                let writes_status = set.contains("SET status") || set.contains(" status =");
                if !writes_status {
                    continue;
                }
                writers += 1;
                let named = ALL
                    .iter()
                    .any(|t| item.contains(&format!("batch::{}", t.name.to_uppercase())));
                assert!(
                    named && item.contains("from_sql()"),
                    "{}: a write of batches.status that names no batch transition \
                     (`batch::NAME`) or does not guard with its `from_sql()`:\n{item}",
                    path.display()
                );
            }
        }
        assert!(writers >= 3, "the scan found {writers} writers");
    }
}
