//! Fair shares of this worker's slots: a tenant runs at most `AGENTQ_TENANT_SHARE` of a lane's
//! slots here while another tenant has work waiting in that lane that a worker could start;
//! alone, it may use them all (work-conserving).
//!
//! The claim path asks [`Shares::hold`] which of a batch's deliveries to hold instead of
//! claiming: those of a tenant already at its share here, when another tenant has claimable
//! work waiting (`db::claim::others_claimable`: due, its pointer out, and through every gate of
//! the claim that does not depend on the worker: no pause, no stopped batch, first of its
//! ordering key, its concurrency key under its limit; counted per tenant over a bounded sample,
//! cached a second per tenant). Held operations stay `queued` (`share_held`, their pointers
//! acked, so the worker reaches the deliveries behind them), and [`Shares::pullable`] picks,
//! every second, the held ones this worker may start now: oldest first, of tenants under their
//! share here, or of any tenant when nobody else waits.
//!
//! A tenant running past its share here gives back only as many slots as other tenants have
//! claimable work waiting, less the lane's free slots ([`Shares::debts`]). Its debt is paid at
//! step boundaries first: the first of its operations here to reach one stops there and is
//! handed back with its journal, whichever it is, so nothing is cut and the ones that give
//! way rotate. Only when the debt has stood for the grace (`AGENTQ_TENANT_SHARE_GRACE_SECS`)
//! are operations stopped mid-step, those whose step in flight began last (the least work
//! lost), never during an unsafe call. Every worker applies its own share, so a tenant holds
//! at most that share of every worker.
//!
//! Invariant kept here: holding never loses an operation: it is a flag on a queued row, and the
//! claim statement (the one gate) clears it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use agentq_core::db;
use agentq_core::operation::Lane;
use sqlx::PgPool;
use uuid::Uuid;

/// A running operation asked to give its slot back. For fair shares, it stops at its next step
/// boundary when its tenant owes a slot there ([`Yield::at_boundary`]), or, once the debt has
/// stood for the grace, at once unless an unsafe step's call is in flight (that call is never
/// cut: its effect may be under way), in which case at its next step boundary; an unsafe step
/// never begins once this is asked. The two flags are read and written in opposite orders
/// (sequentially consistent), so either the job sees the request before it begins an unsafe
/// step, or the request sees the step and waits for its end.
///
/// An operator's pause asks the same, except that it never cuts a call: the operation stops at
/// its next step boundary, whatever the step (`pause`).
pub(crate) struct Yield {
    requested: AtomicBool,
    unsafe_running: AtomicBool,
    /// Asked by an operator's pause (not by fair shares).
    paused: AtomicBool,
    /// The slots its tenant owes other tenants in its lane on this worker now, shared by all its
    /// tenant's operations there: a step boundary that finds a debt takes one and stops.
    owed: Arc<AtomicUsize>,
    /// When its step in flight began ([`clock_ms`]); 0 when none is.
    step_began: AtomicU64,
}

impl Default for Yield {
    fn default() -> Self {
        Self::new(Arc::default())
    }
}

/// Milliseconds since this process first asked, never 0 (0 means "no step in flight").
fn clock_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

impl Yield {
    /// One that pays its tenant's debt `owed` at its step boundaries.
    pub(crate) fn new(owed: Arc<AtomicUsize>) -> Self {
        Self {
            requested: AtomicBool::new(false),
            unsafe_running: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            owed,
            step_began: AtomicU64::new(0),
        }
    }

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

    /// At a step boundary: whether to stop here, because it was asked to or because its tenant
    /// owes a slot here and this operation takes that debt on (it is then asked, as if by
    /// [`Yield::request`]).
    pub(crate) fn at_boundary(&self) -> bool {
        if self.requested() {
            return true;
        }
        let took = self
            .owed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if took.is_ok() {
            self.requested.store(true, Ordering::SeqCst);
            return true;
        }
        false
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

    /// A step's work begins.
    pub(crate) fn step_began(&self) {
        self.step_began.store(clock_ms(), Ordering::SeqCst);
    }

    /// The step's work ended.
    pub(crate) fn step_ended(&self) {
        self.step_began.store(0, Ordering::SeqCst);
    }

    /// How long its step in flight has run: what stopping it now loses (zero between steps).
    pub(crate) fn work_in_flight(&self) -> Duration {
        match self.step_began.load(Ordering::SeqCst) {
            0 => Duration::ZERO,
            began => Duration::from_millis(clock_ms().saturating_sub(began)),
        }
    }
}

/// How long a count of other tenants' claimable work waiting in a lane is trusted.
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
    /// How long a tenant's debt of slots may stand before operations are stopped mid-step.
    grace: Duration,
    /// (lane, tenant) → how many operations of other tenants wait in that lane that a worker
    /// could start (counted up to the lane's slots), and when read.
    waiting: Mutex<HashMap<(Lane, String), (Instant, usize)>>,
}

impl Shares {
    /// `share` (0 < share ≤ 1) of each lane's `slots`, at least one; a debt stands `grace`
    /// before operations are stopped mid-step.
    pub(crate) fn new(share: f64, interactive: usize, batch: usize, grace: Duration) -> Self {
        let lane = |slots: usize| LaneShare {
            slots,
            per_tenant: ((slots as f64 * share).ceil() as usize).clamp(1, slots.max(1)),
        };
        Self {
            interactive: lane(interactive),
            batch: lane(batch),
            grace,
            waiting: Mutex::new(HashMap::new()),
        }
    }

    fn of(&self, lane: Lane) -> LaneShare {
        match lane {
            Lane::Interactive => self.interactive,
            Lane::Batch => self.batch,
        }
    }

    /// How long a debt of slots stands before operations are stopped mid-step.
    pub(crate) fn grace(&self) -> Duration {
        self.grace
    }

    /// How many operations of tenants other than `tenant` wait in `lane` that a worker could
    /// start, up to the lane's slots (read now when `fresh`, else at most a second old; a
    /// failed read says none, so a database hiccup never holds work back).
    async fn others_waiting(&self, pool: &PgPool, lane: Lane, tenant: &str, fresh: bool) -> usize {
        let key = (lane, tenant.to_string());
        if let Some((at, waiting)) = self.waiting.lock().expect("shares lock").get(&key)
            && at.elapsed() < WAITING_TTL
            && !fresh
        {
            return *waiting;
        }
        let most = self.of(lane).slots as i64;
        let waiting = db::within(db::claim::others_claimable(pool, lane, tenant, most))
            .await
            .map(|n| n as usize)
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "reading whether other tenants wait failed");
                0
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
    /// while another tenant has claimable work waiting.
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
            if *n >= share.per_tenant && self.others_waiting(pool, lane, tenant, false).await > 0 {
                held.push(*id);
            } else {
                *n += 1;
            }
        }
        held
    }

    /// The slots each tenant running here (`running`, in `lane`) owes others now: of its
    /// operations past its share, as many as other tenants have claimable work waiting, less
    /// the lane's `free` slots (work that waits for a free slot needs no one to give way).
    /// Every tenant of `running` is in the answer, owing nothing when it is within its share.
    pub(crate) async fn debts(
        &self,
        pool: &PgPool,
        lane: Lane,
        running: &HashMap<String, usize>,
        free: usize,
    ) -> HashMap<String, usize> {
        let share = self.of(lane);
        let mut debts = HashMap::with_capacity(running.len());
        for (tenant, n) in running {
            let excess = n.saturating_sub(share.per_tenant);
            let owed = if excess == 0 || share.per_tenant >= share.slots {
                0
            } else {
                // Read now: a count a second old may still show work a slot given back a
                // moment ago has started, and another operation would give way for nothing.
                let waiting = self.others_waiting(pool, lane, tenant, true).await;
                excess.min(waiting).saturating_sub(free)
            };
            debts.insert(tenant.clone(), owed);
        }
        debts
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
            if *n < share.per_tenant || self.others_waiting(pool, lane, &tenant, false).await == 0 {
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
        let s = Shares::new(0.5, 64, 16, Duration::from_secs(5));
        assert_eq!(s.of(Lane::Interactive).per_tenant, 32);
        assert_eq!(s.of(Lane::Batch).per_tenant, 8);
        let tiny = Shares::new(0.01, 3, 0, Duration::ZERO);
        assert_eq!(tiny.of(Lane::Interactive).per_tenant, 1);
        let all = Shares::new(1.0, 64, 16, Duration::ZERO);
        assert_eq!(all.of(Lane::Interactive).per_tenant, 64);
    }
}
