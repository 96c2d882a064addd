//! Fair shares of this worker's slots: a tenant runs at most `AGENTQ_TENANT_SHARE` of a lane's
//! slots here while another tenant has work queued in that lane; alone, it may use them all
//! (work-conserving).
//!
//! The claim path asks [`Shares::hold`] which of a batch's deliveries to hold instead of
//! claiming: those of a tenant already at its share here, when another tenant has work queued
//! (`db::claim::others_queued`, two index probes, cached a second per tenant). Held operations stay
//! `queued` (`share_held`, their pointers acked, so the worker reaches the deliveries behind
//! them), and [`Shares::pullable`] picks, every second, the held ones this worker may start now:
//! oldest first, of tenants under their share here, or of any tenant when nobody else waits.
//! Every worker applies its own share, so a tenant holds at most that share of every worker.
//!
//! Invariant kept here: holding never loses an operation: it is a flag on a queued row, and the
//! claim statement (the one gate) clears it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agentq_core::db;
use agentq_core::operation::Lane;
use sqlx::PgPool;
use uuid::Uuid;

/// A running operation asked to give its slot back for fair shares. It stops at once unless an
/// unsafe step's call is in flight (that call is never cut: its effect may be under way), in
/// which case it stops at its next step boundary; an unsafe step never begins once this is
/// asked. The two flags are read and written in opposite orders (sequentially consistent), so
/// either the job sees the request before it begins an unsafe step, or the request sees the
/// step and waits for its end.
///
/// An operator's pause asks the same, except that it never cuts a call: the operation stops at
/// its next step boundary, whatever the step (`pause`).
#[derive(Default)]
pub(crate) struct Yield {
    requested: AtomicBool,
    unsafe_running: AtomicBool,
    /// Asked by an operator's pause (not by fair shares).
    paused: AtomicBool,
}

impl Yield {
    /// Asks the operation to stop at its next step boundary for an operator's pause.
    pub(crate) fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        self.requested.store(true, Ordering::SeqCst);
    }

    /// Whether an operator's pause asked it to stop.
    pub(crate) fn paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Asks the operation to yield; true when it may be stopped at once.
    pub(crate) fn request(&self) -> bool {
        self.requested.store(true, Ordering::SeqCst);
        !self.unsafe_running.load(Ordering::SeqCst)
    }

    /// Whether it was asked to yield.
    pub(crate) fn requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// An unsafe step is about to begin (before its `started` row is written): false when the
    /// operation must yield instead.
    pub(crate) fn begin_unsafe(&self) -> bool {
        self.unsafe_running.store(true, Ordering::SeqCst);
        if self.requested.load(Ordering::SeqCst) {
            self.unsafe_running.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The unsafe step's call ended.
    pub(crate) fn end_unsafe(&self) {
        self.unsafe_running.store(false, Ordering::SeqCst);
    }
}

/// How long "another tenant has work queued in this lane" is trusted.
const WAITING_TTL: Duration = Duration::from_secs(1);

/// A lane's slots and the most of them one tenant may hold while others wait.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LaneShare {
    pub(crate) slots: usize,
    pub(crate) per_tenant: usize,
}

/// This worker's shares, per lane.
pub(crate) struct Shares {
    interactive: LaneShare,
    batch: LaneShare,
    /// (lane, tenant) → whether another tenant had work queued in that lane, and when read.
    waiting: Mutex<HashMap<(Lane, String), (Instant, bool)>>,
}

impl Shares {
    /// `share` (0 < share ≤ 1) of each lane's `slots`, at least one.
    pub(crate) fn new(share: f64, interactive: usize, batch: usize) -> Self {
        let lane = |slots: usize| LaneShare {
            slots,
            per_tenant: ((slots as f64 * share).ceil() as usize).clamp(1, slots.max(1)),
        };
        Self {
            interactive: lane(interactive),
            batch: lane(batch),
            waiting: Mutex::new(HashMap::new()),
        }
    }

    fn of(&self, lane: Lane) -> LaneShare {
        match lane {
            Lane::Interactive => self.interactive,
            Lane::Batch => self.batch,
        }
    }

    /// Whether a tenant other than `tenant` has work queued in `lane` (at most a second old; a
    /// failed read says no, so a database hiccup never holds work back).
    async fn others_wait(&self, pool: &PgPool, lane: Lane, tenant: &str) -> bool {
        let key = (lane, tenant.to_string());
        if let Some((at, waiting)) = self.waiting.lock().expect("shares lock").get(&key)
            && at.elapsed() < WAITING_TTL
        {
            return *waiting;
        }
        let waiting = db::within(db::claim::others_queued(pool, lane, tenant))
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "reading whether other tenants wait failed");
                false
            });
        self.waiting
            .lock()
            .expect("shares lock")
            .insert(key, (Instant::now(), waiting));
        waiting
    }

    /// Of `pointed` (operation id and tenant, in delivery order), the ones to hold rather than
    /// claim: each tenant may start operations until it runs its share of the lane here
    /// (`running`: what each tenant runs in this lane now), past which its operations are held
    /// while another tenant has work queued.
    pub(crate) async fn hold(
        &self,
        pool: &PgPool,
        lane: Lane,
        mut running: HashMap<String, usize>,
        pointed: &[(Uuid, String)],
    ) -> Vec<Uuid> {
        let share = self.of(lane);
        if share.per_tenant >= share.slots {
            return Vec::new();
        }
        let mut held = Vec::new();
        for (id, tenant) in pointed {
            let n = running.entry(tenant.clone()).or_default();
            if *n >= share.per_tenant && self.others_wait(pool, lane, tenant).await {
                held.push(*id);
            } else {
                *n += 1;
            }
        }
        held
    }

    /// The most of `lane`'s slots here one tenant runs while others wait.
    pub(crate) fn per_tenant(&self, lane: Lane) -> usize {
        self.of(lane).per_tenant
    }

    /// The tenants running more than their share of `lane` here (`running`) while another
    /// tenant has work queued: they give slots back.
    pub(crate) async fn over_share(
        &self,
        pool: &PgPool,
        lane: Lane,
        running: &HashMap<String, usize>,
    ) -> Vec<String> {
        let share = self.of(lane);
        if share.per_tenant >= share.slots {
            return Vec::new();
        }
        let mut over = Vec::new();
        for (tenant, n) in running {
            if *n > share.per_tenant && self.others_wait(pool, lane, tenant).await {
                over.push(tenant.clone());
            }
        }
        over
    }

    /// Of `held` (operations held for shares, oldest first: id and tenant), up to `free` this
    /// worker may start now: a tenant under its share here, or any when nobody else waits.
    pub(crate) async fn pullable(
        &self,
        pool: &PgPool,
        lane: Lane,
        mut running: HashMap<String, usize>,
        held: Vec<(Uuid, String)>,
        free: usize,
    ) -> Vec<Uuid> {
        let share = self.of(lane);
        let mut chosen = Vec::new();
        for (id, tenant) in held {
            if chosen.len() >= free {
                break;
            }
            let n = running.entry(tenant.clone()).or_default();
            if *n < share.per_tenant || !self.others_wait(pool, lane, &tenant).await {
                *n += 1;
                chosen.push(id);
            }
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_a_whole_number_of_slots_at_least_one() {
        let s = Shares::new(0.5, 64, 16);
        assert_eq!(s.of(Lane::Interactive).per_tenant, 32);
        assert_eq!(s.of(Lane::Batch).per_tenant, 8);
        let tiny = Shares::new(0.01, 3, 0);
        assert_eq!(tiny.of(Lane::Interactive).per_tenant, 1);
        let all = Shares::new(1.0, 64, 16);
        assert_eq!(all.of(Lane::Interactive).per_tenant, 64);
    }
}
