//! Leases: the table of operations this worker runs, and the heartbeat that renews all of them
//! in one statement every `lease_ttl / 3`.
//!
//! An operation missing from the renewal's answer was lost (reaped, or claimed by another
//! worker at a newer epoch): its stop token fires and it writes nothing more. If renewals keep
//! failing until the lease would have expired, the worker stops everything itself
//! (self-fencing), because another worker may already own those operations.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentq_core::db;
use agentq_core::health::Progress;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct Held {
    epoch: i64,
    /// Whose, and in which lane: what fair shares count.
    tenant: String,
    lane: agentq_core::operation::Lane,
    /// Fair shares asking it to give its slot back.
    yielding: Arc<crate::share::Yield>,
    stop: CancellationToken,
    cancel: CancellationToken,
    /// Its final write is under way: the heartbeat leaves it alone (that write is fenced
    /// itself, and would otherwise race the renewal into a false "lease lost").
    settling: bool,
}

/// A tenant's debt of slots in a lane here (fair shares), paid by its operations.
struct Debt {
    /// Slots still owed, taken by its operations at their step boundaries.
    owed: Arc<AtomicUsize>,
    /// Since when something has been owed without a break.
    since: Option<Instant>,
}

/// The operations this worker holds.
pub(crate) struct Leases {
    owner: String,
    ttl: Duration,
    active: Mutex<HashMap<Uuid, Held>>,
    /// (tenant, lane) → the slots it owes other tenants now.
    debts: Mutex<HashMap<(String, agentq_core::operation::Lane), Debt>>,
    /// Marked by every heartbeat round whose renewal succeeded (or had nothing to renew); stale
    /// after a whole lease period, when the worker fences itself.
    progress: Arc<Progress>,
}

impl Leases {
    pub(crate) fn new(owner: String, ttl: Duration) -> Self {
        Self {
            owner,
            ttl,
            active: Mutex::new(HashMap::new()),
            debts: Mutex::new(HashMap::new()),
            progress: Progress::new("lease_renewal", ttl),
        }
    }

    pub(crate) fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    pub(crate) fn owner(&self) -> &str {
        &self.owner
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Held>> {
        self.active.lock().expect("leases lock")
    }

    /// Starts tracking a claimed operation. `stop` fires when the lease is lost; `cancel` when
    /// a heartbeat learns that the operation must stop: an operator (or its parent, or its
    /// batch) cancelled it, or the scheduler found its deadline past.
    pub(crate) fn hold(
        &self,
        id: Uuid,
        epoch: i64,
        tenant: &str,
        lane: agentq_core::operation::Lane,
    ) -> (
        CancellationToken,
        CancellationToken,
        Arc<crate::share::Yield>,
    ) {
        let stop = CancellationToken::new();
        let cancel = CancellationToken::new();
        let owed = self
            .debts
            .lock()
            .expect("debts lock")
            .entry((tenant.to_string(), lane))
            .or_insert_with(|| Debt {
                owed: Arc::default(),
                since: None,
            })
            .owed
            .clone();
        let yielding = Arc::new(crate::share::Yield::new(owed));
        self.map().insert(
            id,
            Held {
                epoch,
                tenant: tenant.to_string(),
                lane,
                yielding: yielding.clone(),
                stop: stop.clone(),
                cancel: cancel.clone(),
                settling: false,
            },
        );
        (stop, cancel, yielding)
    }

    /// Sets what each tenant running in `lane` here owes other tenants now (`owed`, from
    /// `Shares::debts`; a tenant missing from it owes nothing). Its operations pay at their
    /// step boundaries; a debt that has stood for `grace` is paid at once instead by stopping
    /// the tenant's operations whose step in flight began last (the least work lost), each
    /// at once or, during an unsafe call, at its next step boundary. Returns how many it
    /// stopped at once.
    pub(crate) fn owe(
        &self,
        lane: agentq_core::operation::Lane,
        owed: &HashMap<String, usize>,
        grace: Duration,
    ) -> usize {
        let mut overdue: Vec<(String, usize)> = Vec::new();
        {
            let mut debts = self.debts.lock().expect("debts lock");
            // A debt no operation can pay any more is forgotten.
            debts.retain(|_, d| Arc::strong_count(&d.owed) > 1);
            for ((tenant, l), d) in debts.iter_mut() {
                if *l != lane {
                    continue;
                }
                let n = owed.get(tenant).copied().unwrap_or(0);
                d.owed.store(n, Ordering::SeqCst);
                if n == 0 {
                    d.since = None;
                    continue;
                }
                let since = *d.since.get_or_insert_with(Instant::now);
                if since.elapsed() >= grace {
                    d.owed.store(0, Ordering::SeqCst);
                    d.since = Some(Instant::now());
                    overdue.push((tenant.clone(), n));
                }
            }
        }
        let map = self.map();
        let mut stopped = 0;
        for (tenant, n) in overdue {
            let mut theirs: Vec<&Held> = map
                .values()
                .filter(|h| h.tenant == tenant && h.lane == lane && !h.settling)
                .filter(|h| !h.yielding.requested())
                .collect();
            theirs.sort_by_key(|h| h.yielding.work_in_flight());
            for h in theirs.iter().take(n) {
                if h.yielding.request() {
                    h.stop.cancel();
                }
                stopped += 1;
            }
        }
        stopped
    }

    /// Whether this worker asked `id` (at `epoch`) to give its slot back.
    pub(crate) fn yielded(&self, id: Uuid, epoch: i64) -> bool {
        self.map()
            .get(&id)
            .is_some_and(|h| h.epoch == epoch && h.yielding.requested())
    }

    /// Whether `id` (at `epoch`) was asked to stop for an operator's pause.
    pub(crate) fn paused(&self, id: Uuid, epoch: i64) -> bool {
        self.map()
            .get(&id)
            .is_some_and(|h| h.epoch == epoch && h.yielding.paused())
    }

    /// The operation is about to write its outcome; stop renewing it.
    pub(crate) fn settling(&self, id: Uuid, epoch: i64) {
        if let Some(h) = self.map().get_mut(&id).filter(|h| h.epoch == epoch) {
            h.settling = true;
        }
    }

    /// Stops tracking an operation (finished, or abandoned) at `epoch`; a newer claim of the
    /// same operation by this worker stays tracked.
    pub(crate) fn release(&self, id: Uuid, epoch: i64) {
        let mut map = self.map();
        if map.get(&id).is_some_and(|h| h.epoch == epoch) {
            map.remove(&id);
        }
    }

    /// On shutdown, after the grace period: stops every operation still running here and hands
    /// it back to the queue (no restart counted), so nobody waits for the lease to lapse.
    pub(crate) async fn release_all(&self, pool: &PgPool) {
        let held: Vec<(Uuid, i64)> = {
            let mut map = self.map();
            let held = map.iter().map(|(id, h)| (*id, h.epoch)).collect();
            for h in map.values() {
                h.stop.cancel();
            }
            map.clear();
            held
        };
        if held.is_empty() {
            return;
        }
        match db::within(db::settle::release_leases(pool, &self.owner, &held)).await {
            Ok(n) => tracing::info!(n, "released unfinished operations back to the queue"),
            Err(e) => {
                tracing::warn!(error = %e, "releasing leases failed; they will lapse and be reaped")
            }
        }
    }

    /// How many operations each tenant runs here in `lane`, leaving out those asked to give
    /// their slot back (they are leaving).
    pub(crate) fn running_by_tenant(
        &self,
        lane: agentq_core::operation::Lane,
    ) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for h in self
            .map()
            .values()
            .filter(|h| h.lane == lane && !h.yielding.requested())
        {
            *counts.entry(h.tenant.clone()).or_default() += 1;
        }
        counts
    }

    /// Number of operations held.
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }

    fn lose(&self, ids: impl IntoIterator<Item = Uuid>) {
        let mut map = self.map();
        for id in ids {
            if map.get(&id).is_some_and(|h| h.settling) {
                continue;
            }
            if let Some(h) = map.remove(&id) {
                tracing::warn!(op_id = %id, epoch = h.epoch, "lease lost; stopping the operation");
                h.stop.cancel();
            }
        }
    }

    /// Renews every held lease once; returns false if the database could not be reached.
    pub(crate) async fn renew(&self, pool: &PgPool) -> bool {
        let held: Vec<(Uuid, i64)> = self
            .map()
            .iter()
            .filter(|(_, h)| !h.settling)
            .map(|(id, h)| (*id, h.epoch))
            .collect();
        if held.is_empty() {
            return true;
        }
        match db::within(db::claim::renew_leases(pool, &self.owner, &held, self.ttl)).await {
            Ok(kept) => {
                {
                    let map = self.map();
                    for r in &kept {
                        let Some(h) = map.get(&r.id) else { continue };
                        if r.cancel_requested {
                            h.cancel.cancel();
                        } else if r.paused && !h.yielding.paused() {
                            tracing::info!(op_id = %r.id, "paused by an operator; stopping at the next step boundary");
                            h.yielding.pause();
                        }
                    }
                }
                let lost = held
                    .iter()
                    .map(|(id, _)| *id)
                    .filter(|id| !kept.iter().any(|k| k.id == *id));
                self.lose(lost);
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "renewing leases failed");
                false
            }
        }
    }

    /// Heartbeats until `shutdown`, self-fencing when renewals fail for a whole lease period.
    pub(crate) async fn run_heartbeat(&self, pool: PgPool, shutdown: CancellationToken) {
        let every = self.ttl / 3;
        let mut last_ok = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            if self.renew(&pool).await {
                last_ok = Instant::now();
                self.progress.mark();
            } else if last_ok.elapsed() + every >= self.ttl {
                let all: Vec<Uuid> = self.map().keys().copied().collect();
                tracing::error!(
                    n = all.len(),
                    "leases could not be renewed in time; stopping all operations"
                );
                self.lose(all);
            }
        }
    }
}
