//! What a worker process knows about the limits its model calls may be under, so that a call
//! under none asks PostgreSQL nothing: the rate limits (a small table, read whole) and when the
//! newest budget set apart from its operation's enqueue was born (a claim says whether a budget
//! was over its operation; a later one is found by comparing that birth with the claim).
//!
//! Read again by the first model call that finds it more than [`FRESH`] old; the calls meanwhile
//! use what was read (a limit or a budget set now applies to calls from at most that long
//! after). A snapshot older than [`STALE`] is never used: its reader waits for the new one.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentq_core::db::{self, rate_limits::Target};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// How old a snapshot may be before a call reads it again.
pub(crate) const FRESH: Duration = Duration::from_secs(1);
/// How old a snapshot may be and still serve calls while one of them reads the next.
const STALE: Duration = Duration::from_secs(5);

/// What was read, and when.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    loaded: Option<Instant>,
    /// Every rate limit.
    pub(crate) targets: Vec<Target>,
    /// When the newest budget born apart from its operation was.
    pub(crate) newest_budget: Option<DateTime<Utc>>,
}

/// The process-wide cache.
pub(crate) struct CallLimits {
    pool: PgPool,
    /// Whether it reads them at all (not for the replay tester's runs, which have none).
    reads: bool,
    /// The process's open rate limit grants.
    pub(crate) grants: crate::grants::Grants,
    snapshot: Mutex<Arc<Snapshot>>,
    reading: tokio::sync::Mutex<()>,
}

impl CallLimits {
    pub(crate) fn new(pool: PgPool) -> Self {
        Self {
            grants: crate::grants::Grants::new(pool.clone()),
            pool,
            reads: true,
            snapshot: Mutex::new(Arc::new(Snapshot::default())),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    fn held(&self) -> Arc<Snapshot> {
        self.snapshot.lock().expect("limits lock").clone()
    }

    /// The limits as of at most [`FRESH`] ago (or [`STALE`], while another call reads them).
    /// No limits and no budgets, ever: the replay tester's (its runs hold no calls).
    pub(crate) fn none(pool: PgPool) -> Self {
        Self {
            reads: false,
            ..Self::new(pool)
        }
    }

    pub(crate) async fn current(&self) -> db::Result<Arc<Snapshot>> {
        let age = |s: &Snapshot| s.loaded.map(|t| t.elapsed());
        let held = self.held();
        if !self.reads || age(&held).is_some_and(|a| a < FRESH) {
            return Ok(held);
        }
        let _reading = if age(&held).is_some_and(|a| a < STALE) {
            match self.reading.try_lock() {
                Ok(guard) => guard,
                Err(_) => return Ok(held), // another call is reading them
            }
        } else {
            self.reading.lock().await
        };
        let held = self.held();
        if age(&held).is_some_and(|a| a < FRESH) {
            return Ok(held); // read while this call waited
        }
        let targets = db::within(db::rate_limits::targets(&self.pool)).await?;
        let (newest_budget, _) = db::within(db::budgets::newest_born_apart(&self.pool)).await?;
        let read = Arc::new(Snapshot {
            loaded: Some(Instant::now()),
            targets,
            newest_budget,
        });
        *self.snapshot.lock().expect("limits lock") = read.clone();
        Ok(read)
    }
}

/// How long before the claim a budget's birth may be and still be missed by it: a transaction
/// that set a budget may have begun (its `created_at`) before the claim and committed after.
pub(crate) const BIRTH_SLACK: chrono::Duration = chrono::Duration::seconds(10);

/// Whether a run claimed at `claimed_at`, whose claim found no budget over it, must look again
/// before a model call, given when the newest budget born apart was.
pub(crate) fn budget_may_be_new(newest: Option<DateTime<Utc>>, claimed_at: DateTime<Utc>) -> bool {
    newest.is_some_and(|n| n > claimed_at - BIRTH_SLACK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_budget_born_near_or_after_the_claim_asks_for_a_look() {
        let claim = Utc::now();
        assert!(!budget_may_be_new(None, claim));
        assert!(!budget_may_be_new(
            Some(claim - chrono::Duration::minutes(1)),
            claim
        ));
        assert!(budget_may_be_new(
            Some(claim - chrono::Duration::seconds(2)),
            claim
        ));
        assert!(budget_may_be_new(
            Some(claim + chrono::Duration::seconds(2)),
            claim
        ));
    }
}
