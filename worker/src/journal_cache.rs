//! The journals of the operations this worker ran, kept in memory within a byte budget
//! (`AGENTQ_JOURNAL_CACHE_MEMORY`), so that an operation's next run here reads from the
//! database only the rows that can have changed, not its whole journal: a script of 3,000
//! sleeps reads a few rows per wake instead of every row before it.
//!
//! A kept journal is used only when it cannot be stale, which the claim's epoch proves: every
//! claim adds one to it and nothing ever lowers it, so a claim at the kept run's epoch plus one
//! means no other run (here or on another worker) and no requeue happened in between. What can
//! still have changed since the kept run loaded its journal:
//! - rows that run appended (a sequence above the kept last one): read again;
//! - rows not `completed` when loaded (a started sleep, wait or join that the scheduler
//!   decided, an `unknown` call an operator resolved, a failed step run again): read again;
//! - nothing else. A `completed` row is final: a run replays it without writing it, and the one
//!   statement that moves completed rows (an upgrade's rebase) runs only for a claim with
//!   `upgrade_through`, which always reads the whole journal.
//!
//! An operation that ends, or whose claim reads its journal whole, drops what was kept for it;
//! past the budget the least recently used journals go first, and a journal bigger than a
//! quarter of the budget is not kept.

use std::collections::HashMap;
use std::sync::Mutex;

use agentq_core::db::{self, claim::Claimed, steps::JournalEntry};
use agentq_core::metrics;
use agentq_core::state::StepStatus;
use sqlx::PgPool;
use uuid::Uuid;

use crate::context::row_bytes;

/// A journal as a run of this worker loaded it.
struct Kept {
    /// The epoch of the run that loaded it.
    epoch: i64,
    entries: Vec<JournalEntry>,
    /// Each entry's bytes ([`row_bytes`]), in the same order.
    sizes: Vec<u64>,
    bytes: u64,
    /// When it was last used, on [`Inner::clock`].
    used: u64,
}

#[derive(Default)]
struct Inner {
    kept: HashMap<Uuid, Kept>,
    bytes: u64,
    clock: u64,
}

/// The journals this worker keeps (see the module).
pub(crate) struct JournalCache {
    /// Bytes of outputs and errors kept, all journals together; 0 keeps none.
    budget: u64,
    inner: Mutex<Inner>,
}

impl JournalCache {
    pub(crate) fn new(budget: u64) -> Self {
        Self {
            budget,
            inner: Mutex::default(),
        }
    }

    /// The journal `op`'s run replays: what was kept from its previous run here, with the rows
    /// that can have changed since read again, else the whole journal.
    pub(crate) async fn load(&self, pool: &PgPool, op: &Claimed) -> db::Result<Vec<JournalEntry>> {
        let kept = self.take(op.id);
        if !op.has_journal {
            return Ok(Vec::new());
        }
        let kept = kept.filter(|k| k.epoch + 1 == op.epoch && op.upgrade_through.is_none());
        let (entries, sizes) = match kept {
            Some(k) => {
                let after = k.entries.last().map_or(-1, |e| e.seq);
                let open: Vec<i32> = k
                    .entries
                    .iter()
                    .filter(|e| e.status != StepStatus::Completed)
                    .map(|e| e.seq)
                    .collect();
                let fresh =
                    db::within(db::steps::load_journal_changes(pool, op.id, after, &open)).await?;
                metrics::JOURNAL_ROWS_READ.add(&["database"], fresh.len() as f64);
                metrics::JOURNAL_ROWS_READ.add(&["memory"], (k.entries.len() - open.len()) as f64);
                merge(k, fresh)
            }
            None => {
                let entries = db::within(db::steps::load_journal(pool, op.id)).await?;
                metrics::JOURNAL_ROWS_READ.add(&["database"], entries.len() as f64);
                let sizes = entries.iter().map(entry_bytes).collect();
                (entries, sizes)
            }
        };
        self.keep(op.id, op.epoch, &entries, sizes);
        Ok(entries)
    }

    /// Drops what was kept for `id` (it ended).
    pub(crate) fn forget(&self, id: Uuid) {
        drop(self.take(id));
    }

    fn take(&self, id: Uuid) -> Option<Kept> {
        let mut inner = self.inner.lock().expect("journal cache lock");
        let k = inner.kept.remove(&id)?;
        inner.bytes -= k.bytes;
        Some(k)
    }

    fn keep(&self, id: Uuid, epoch: i64, entries: &[JournalEntry], sizes: Vec<u64>) {
        let bytes: u64 = sizes.iter().sum::<u64>() + entries.len() as u64 * ENTRY_OVERHEAD;
        if self.budget == 0 || bytes > self.budget / 4 {
            return;
        }
        let mut inner = self.inner.lock().expect("journal cache lock");
        while inner.bytes + bytes > self.budget {
            let Some(oldest) = inner
                .kept
                .iter()
                .min_by_key(|(_, k)| k.used)
                .map(|(id, _)| *id)
            else {
                break;
            };
            let k = inner.kept.remove(&oldest).expect("just found");
            inner.bytes -= k.bytes;
        }
        inner.clock += 1;
        let used = inner.clock;
        inner.bytes += bytes;
        inner.kept.insert(
            id,
            Kept {
                epoch,
                entries: entries.to_vec(),
                sizes,
                bytes,
                used,
            },
        );
    }
}

/// What an entry costs besides its output and error: its name, fields and the vector's slot.
const ENTRY_OVERHEAD: u64 = 160;

fn entry_bytes(e: &JournalEntry) -> u64 {
    row_bytes(e.output.as_ref(), e.error.as_deref()) + e.name.len() as u64
}

/// The kept journal with the rows read again put in place (by sequence) and the new ones after.
fn merge(k: Kept, fresh: Vec<JournalEntry>) -> (Vec<JournalEntry>, Vec<u64>) {
    let (mut entries, mut sizes) = (k.entries, k.sizes);
    for e in fresh {
        let size = entry_bytes(&e);
        match entries.binary_search_by_key(&e.seq, |x| x.seq) {
            Ok(i) => {
                entries[i] = e;
                sizes[i] = size;
            }
            Err(i) => {
                entries.insert(i, e);
                sizes.insert(i, size);
            }
        }
    }
    (entries, sizes)
}

#[cfg(test)]
mod tests {
    use agentq_core::state::{Replay, StepKind};
    use serde_json::json;

    use super::*;

    fn entry(seq: i32, status: StepStatus, out: &str) -> JournalEntry {
        JournalEntry {
            seq,
            name: format!("s{seq}"),
            kind: StepKind::Sleep,
            replay: Replay::Safe,
            status,
            output: Some(json!(out)),
            error: None,
            wake_at: None,
        }
    }

    fn kept(entries: Vec<JournalEntry>) -> Kept {
        let sizes: Vec<u64> = entries.iter().map(entry_bytes).collect();
        Kept {
            epoch: 1,
            bytes: sizes.iter().sum(),
            entries,
            sizes,
            used: 0,
        }
    }

    #[test]
    fn rows_read_again_replace_theirs_and_new_ones_follow_in_order() {
        let k = kept(vec![
            entry(0, StepStatus::Completed, "a"),
            entry(1, StepStatus::Started, ""),
        ]);
        let (entries, sizes) = merge(
            k,
            vec![
                entry(1, StepStatus::Completed, "woken"),
                entry(2, StepStatus::Completed, "c"),
            ],
        );
        let seen: Vec<(i32, StepStatus)> = entries.iter().map(|e| (e.seq, e.status)).collect();
        assert_eq!(
            seen,
            [
                (0, StepStatus::Completed),
                (1, StepStatus::Completed),
                (2, StepStatus::Completed)
            ]
        );
        assert_eq!(entries[1].output, Some(json!("woken")));
        assert_eq!(sizes, entries.iter().map(entry_bytes).collect::<Vec<_>>());
    }

    #[test]
    fn the_budget_drops_the_least_recently_used_and_refuses_a_journal_over_a_quarter() {
        let one = vec![entry(0, StepStatus::Completed, &"x".repeat(1000))];
        let size = entry_bytes(&one[0]) + ENTRY_OVERHEAD;
        let cache = JournalCache::new(size * 4);
        let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
        for id in &ids {
            cache.keep(*id, 1, &one, vec![entry_bytes(&one[0])]);
        }
        let inner = cache.inner.lock().unwrap();
        assert_eq!(inner.kept.len(), 4);
        assert!(!inner.kept.contains_key(&ids[0]), "the oldest went first");
        assert_eq!(inner.bytes, size * 4);
        drop(inner);
        let big = vec![entry(0, StepStatus::Completed, &"x".repeat(1100))];
        cache.keep(Uuid::new_v4(), 1, &big, vec![entry_bytes(&big[0])]);
        assert_eq!(
            cache.inner.lock().unwrap().kept.len(),
            4,
            "over a quarter: not kept"
        );
        cache.forget(ids[1]);
        assert_eq!(cache.inner.lock().unwrap().bytes, size * 3);
    }
}
