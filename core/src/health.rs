//! Liveness of a long-running role, answered by `GET /healthz` on its metrics endpoint
//! (`AGENTQ_METRICS_ADDR`): the role's main loop marks [`Progress`] each time it completes a
//! round, and the endpoint answers 503 once the last mark is older than the role's limit (a
//! loop that hangs, or a worker that cannot renew its leases). Checking costs two atomic reads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When a loop last completed a round, and how long it may go without one.
#[derive(Debug)]
pub struct Progress {
    /// What completes a round, as `/healthz` names it (`lease_renewal`, `scheduler_pass`).
    what: &'static str,
    stale_after: Duration,
    start: Instant,
    /// Milliseconds from `start` to the last mark.
    last_ms: AtomicU64,
}

impl Progress {
    /// A loop that has just started (counts as a fresh mark).
    pub fn new(what: &'static str, stale_after: Duration) -> Arc<Self> {
        Arc::new(Self {
            what,
            stale_after,
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        })
    }

    /// The loop completed a round.
    pub fn mark(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    pub fn what(&self) -> &'static str {
        self.what
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Time since the last mark.
    pub fn since(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }

    /// True when no round completed within `stale_after`.
    pub fn is_stale(&self) -> bool {
        self.since() > self.stale_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_goes_stale_without_marks_and_fresh_with_one() {
        let p = Progress::new("loop", Duration::from_millis(30));
        assert!(!p.is_stale(), "a new loop counts as fresh");
        std::thread::sleep(Duration::from_millis(50));
        assert!(p.is_stale());
        assert!(p.since() >= Duration::from_millis(50));
        p.mark();
        assert!(!p.is_stale());
        assert_eq!(p.what(), "loop");
    }
}
