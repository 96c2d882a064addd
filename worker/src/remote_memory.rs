//! The worker's memory for remote journals (the sessions of `remote` kinds): one budget of
//! bytes (`AGENTQ_REMOTE_JOURNAL_MEMORY`)
//! that every remote run's session draws on for the journal it keeps for its service (its
//! entries as the JSON they are sent as) and the part of it its next request carries. A session
//! takes more room before each call to its service. When the budget is held by others, the
//! session holding the most waits for room (up to [`WAIT`]) and every other one gives way at
//! once: its operation goes back to the queue (`overloaded`, its attempt given back, its journal
//! kept), so sessions never all hold room while waiting for more. A session that alone needs
//! more than the whole budget takes the whole budget: it runs, alone.
//!
//! Not counted: answers (at most `MAX_ANSWER_BYTES` each, read while a call is in flight) and
//! the whole journal a `resend` sends again (bounded by the run's resend allowance).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long the session holding the most waits for room before its operation goes back to
/// the queue too.
pub(crate) const WAIT: Duration = Duration::from_secs(10);

/// The budget, in KiB, and what each session holds of it.
pub(crate) struct Memory {
    kib: Arc<Semaphore>,
    total_kib: usize,
    /// Session → KiB it holds.
    holders: Mutex<HashMap<u64, usize>>,
}

/// A session's room in the budget; given back when dropped.
pub(crate) struct Room {
    id: u64,
    permit: Option<OwnedSemaphorePermit>,
    memory: Arc<Memory>,
}

impl Drop for Room {
    fn drop(&mut self) {
        self.memory
            .holders
            .lock()
            .expect("memory lock")
            .remove(&self.id);
    }
}

impl Memory {
    /// A budget of `bytes` (at least 1 KiB).
    pub(crate) fn new(bytes: u64) -> Self {
        let total_kib = usize::try_from(bytes / 1024)
            .unwrap_or(usize::MAX)
            .clamp(1, Semaphore::MAX_PERMITS);
        Self {
            kib: Arc::new(Semaphore::new(total_kib)),
            total_kib,
            holders: Mutex::new(HashMap::new()),
        }
    }

    /// An empty room for a new session.
    pub(crate) fn room(self: &Arc<Self>) -> Room {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Room {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            permit: None,
            memory: self.clone(),
        }
    }

    /// KiB not held by any session now.
    #[cfg(test)]
    fn free_kib(&self) -> usize {
        self.kib.available_permits()
    }
}

impl Room {
    /// Grows the room to cover `bytes`: at once if the budget has it; else, if this session
    /// holds the most, waiting up to [`WAIT`]; false when it did not get it (unchanged).
    pub(crate) async fn grow(&mut self, bytes: usize) -> bool {
        let memory = self.memory.clone();
        let want = bytes.div_ceil(1024).min(memory.total_kib);
        let have = self
            .permit
            .as_ref()
            .map_or(0, OwnedSemaphorePermit::num_permits);
        let Some(more) = want.checked_sub(have).filter(|m| *m > 0) else {
            return true;
        };
        let more = u32::try_from(more).unwrap_or(u32::MAX);
        let taken = match memory.kib.clone().try_acquire_many_owned(more) {
            Ok(p) => Some(p),
            Err(_) if self.holds_most(have) => {
                tokio::time::timeout(WAIT, memory.kib.clone().acquire_many_owned(more))
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
            Err(_) => None,
        };
        let Some(permit) = taken else {
            return false;
        };
        match &mut self.permit {
            Some(p) => p.merge(permit),
            None => self.permit = Some(permit),
        }
        memory
            .holders
            .lock()
            .expect("memory lock")
            .insert(self.id, want);
        true
    }

    /// Whether no other session holds more than `have` KiB (ties: the oldest session).
    fn holds_most(&self, have: usize) -> bool {
        let holders = self.memory.holders.lock().expect("memory lock");
        !holders
            .iter()
            .any(|(id, h)| *id != self.id && (*h > have || (*h == have && *id < self.id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    #[tokio::test(start_paused = true)]
    async fn sessions_share_the_budget_the_largest_waits_and_a_lone_giant_takes_all() {
        let memory = Arc::new(Memory::new(100 * 1024));
        let (mut a, mut b) = (memory.room(), memory.room());
        assert!(a.grow(60 * KIB).await);
        assert!(a.grow(50 * KIB).await, "shrinking asks nothing");
        assert!(b.grow(30 * KIB).await);
        assert_eq!(memory.free_kib(), 10);
        // b wants 50 while a holds 60: b holds less, so it gives way at once, keeping its 30.
        assert!(!b.grow(50 * KIB).await);
        assert_eq!(memory.free_kib(), 10);
        // a holds the most: it waits, and gets its room once b has given way.
        let waited = tokio::spawn(async move {
            let got = a.grow(90 * KIB).await;
            (a, got)
        });
        tokio::task::yield_now().await;
        drop(b);
        let (a, got) = waited.await.unwrap();
        assert!(got);
        assert_eq!(memory.free_kib(), 10);
        drop(a);
        // Alone, a session asking for more than everything gets everything.
        let mut c = memory.room();
        assert!(c.grow(500 * KIB).await);
        assert_eq!(memory.free_kib(), 0);
        drop(c);
        assert_eq!(memory.free_kib(), 100);
    }
}
