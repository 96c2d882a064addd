//! Consuming a lane and claiming operations.
//!
//! For each batch of deliveries already buffered by the broker (at most one per free
//! concurrency slot): decode the pointers, claim every due, queued operation among them in one
//! committed `UPDATE`, start the claimed ones, and only then ack. A delivery that claims nothing
//! (a duplicate, a finished operation, one running elsewhere, one not yet due) is acked and
//! changes nothing; an undecodable one is rejected to the dead-letter exchange. A pointer to an
//! operation of a version this worker does not run parks it for one that does
//! ([`pull_parked`], `crate::versions`).

use std::sync::Arc;
use std::time::Duration;

use agentq_core::broker::{self, Consumer, Delivery};
use agentq_core::db;
use agentq_core::operation::{Lane, Pointer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::executor::Shared;
use crate::slot::LaneSlot;
use crate::versions::PULL_EVERY;

/// Most deliveries claimed by one statement.
const MAX_BATCH: usize = 128;

/// Why a lane's consume loop ended.
pub(crate) enum Ended {
    /// Shutdown was requested.
    Shutdown,
    /// The channel or connection failed; reconnect.
    Broken(String),
}

/// Consumes `lane` until shutdown or a broker failure.
pub(crate) async fn consume_lane(
    shared: Arc<Shared>,
    mut consumer: Consumer,
    lane: Lane,
    slots: Arc<Semaphore>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
) -> Ended {
    loop {
        // A delivery first, then a slot for it: a slot waiting for a delivery would sit idle
        // while an operation back from a model call waits for one (`crate::slot`). The broker
        // sends this consumer no more unacked deliveries than it has slots, so one waiting for
        // a slot here holds nothing another worker could take sooner.
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            d = consumer.next() => d,
        };
        let first = match first {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Ended::Broken(e.to_string()),
            None => return Ended::Broken(format!("consumer of lane {lane} was cancelled")),
        };
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            p = slots.clone().acquire_owned() => p.expect("slots semaphore is never closed"),
        };
        let mut batch = vec![(first, permit)];
        while batch.len() < MAX_BATCH {
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                break;
            };
            match consumer.try_next() {
                Some(Ok(d)) => batch.push((d, permit)),
                Some(Err(e)) => return Ended::Broken(e.to_string()),
                None => break,
            }
        }
        if let Err(e) = claim_batch(&shared, lane, &slots, batch, &tasks).await {
            return Ended::Broken(e.to_string());
        }
    }
    let _ = consumer.close().await;
    Ended::Shutdown
}

/// Claims and starts what a batch of deliveries points at, then acks the deliveries.
async fn claim_batch(
    shared: &Arc<Shared>,
    lane: Lane,
    slots: &Arc<Semaphore>,
    batch: Vec<(Delivery, OwnedSemaphorePermit)>,
    tasks: &TaskTracker,
) -> broker::Result<()> {
    let mut pointed: Vec<(Uuid, Delivery, OwnedSemaphorePermit)> = Vec::with_capacity(batch.len());
    let mut tenants: Vec<(Uuid, String)> = Vec::with_capacity(batch.len());
    for (delivery, permit) in batch {
        match Pointer::decode(delivery.body()) {
            Ok(p) => {
                tenants.push((p.op_id.0, p.tenant));
                pointed.push((p.op_id.0, delivery, permit));
            }
            Err(reason) => {
                tracing::warn!(%reason, "rejecting an undecodable message to the dead-letter queue");
                delivery.reject().await?;
            }
        }
    }
    if pointed.is_empty() {
        return Ok(());
    }
    // A tenant at its share of this lane's slots here, while another tenant waits, is held.
    let held = shared
        .shares
        .hold(
            shared.pool(),
            lane,
            shared.leases.running_by_tenant(lane),
            &tenants,
        )
        .await;
    let held = if held.is_empty() {
        held
    } else {
        // Not held (a failure), an operation is claimed below as usual: a share is a
        // preference, never a reason to lose or stall work.
        match db::within(db::claim::hold_for_share(shared.pool(), &held)).await {
            Ok(n) => {
                tracing::debug!(n, %lane, "held operations of tenants at their share");
                held
            }
            Err(e) => {
                tracing::warn!(error = %e, "holding operations for fair shares failed");
                Vec::new()
            }
        }
    };
    let ids: Vec<Uuid> = pointed
        .iter()
        .map(|(id, _, _)| *id)
        .filter(|id| !held.contains(id))
        .collect();
    let runnable = shared.versions.runnable();
    let mut delay = Duration::from_millis(100);
    let mut claimed = loop {
        match db::within(db::claim::claim_operations(
            shared.pool(),
            &ids,
            &runnable,
            shared.leases.owner(),
            shared.leases.ttl(),
        ))
        .await
        {
            Ok(c) => break c,
            Err(e) => {
                // Postgres is unavailable: hold the deliveries (unclaimed, unacked) and retry;
                // if it stays down the broker redelivers them after we disconnect.
                tracing::warn!(error = %e, "claiming failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    };
    // Pointers that claimed nothing are duplicates, unless this worker may not run their
    // operation's version (parked for a worker that does, the pointer acked) or their
    // operation does not exist at all: those are poison and go to the dead-letter exchange.
    let unknown: Vec<Uuid> = if claimed.len() < ids.len() {
        let unclaimed: Vec<Uuid> = ids
            .iter()
            .filter(|id| !claimed.iter().any(|c| c.id == **id))
            .copied()
            .collect();
        let refused = db::within(db::versions::park_refused(
            shared.pool(),
            &unclaimed,
            &runnable,
        ))
        .await
        .unwrap_or_default();
        let parked = refused.iter().filter(|(_, parked)| *parked).count();
        if parked > 0 {
            tracing::info!(
                parked,
                "left operations of versions this worker does not run for a worker that does"
            );
        }
        refused
            .into_iter()
            .filter(|(_, parked)| !parked)
            .map(|(id, _)| id)
            .collect()
    } else {
        Vec::new()
    };
    // Every delivery of the batch is settled by one `multiple` ack of the last acked one
    // (deliveries arrive in tag order; rejects are sent before it).
    let mut last_acked = None;
    for (id, delivery, permit) in pointed {
        if unknown.contains(&id) {
            tracing::warn!(op_id = %id, "rejecting a pointer to an unknown operation to the dead-letter queue");
            delivery.reject().await?;
            continue;
        }
        // The same pointer twice in one batch claims once; the second permit is just dropped.
        if let Some(i) = claimed.iter().position(|c| c.id == id) {
            start(shared, lane, claimed.swap_remove(i), (slots, permit), tasks);
        }
        last_acked = Some(delivery);
    }
    // Ack after the claim committed (or once it is known to change nothing).
    if let Some(delivery) = last_acked {
        delivery.ack_through().await?;
    }
    Ok(())
}

/// Runs a claimed operation on the worker's tasks, with its slot of `slots` (`permit`), held
/// until it settles but during its model calls (`crate::slot`).
fn start(
    shared: &Arc<Shared>,
    lane: Lane,
    op: db::claim::Claimed,
    (slots, permit): (&Arc<Semaphore>, OwnedSemaphorePermit),
    tasks: &TaskTracker,
) {
    let (stop, cancel, yielding) = shared.leases.hold(op.id, op.epoch, &op.tenant_id, lane);
    let shared = shared.clone();
    let slot = LaneSlot::new(slots.clone(), permit);
    tasks.spawn(async move {
        crate::executor::execute(shared, op, slot.clone(), stop, cancel, yielding).await;
        // Given back here even if a clone of the job's context outlives the run.
        slot.release();
    });
}

/// What a pull of one lane ([`pull_parked`], [`pull_held`]) works with: the worker, the lane
/// and its slots, where it starts operations, and when it stops.
#[derive(Clone)]
pub(crate) struct Pull {
    pub(crate) shared: Arc<Shared>,
    pub(crate) lane: Lane,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) tasks: TaskTracker,
    pub(crate) shutdown: CancellationToken,
}

/// Until `shutdown`, every [`PULL_EVERY`]: claims the parked operations of `lane` this worker
/// may run (refused by a worker that does not run their version), as many as it has free
/// slots, with the claim statement every pointer goes through, and starts them.
pub(crate) async fn pull_parked(pull: Pull) {
    let (shared, lane) = (&pull.shared, pull.lane);
    while pull.next().await {
        let free = pull.free();
        if free == 0 {
            continue;
        }
        let runnable = shared.versions.runnable();
        let pool = shared.pool();
        let ids =
            match db::within(db::versions::parked_for(pool, lane, &runnable, free as i64)).await {
                Ok(ids) if !ids.is_empty() => ids,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "looking for parked operations failed");
                    continue;
                }
            };
        let n = pull.claim_and_start(&ids, &runnable, "parked").await;
        if n > 0 {
            tracing::info!(n, %lane, "claimed parked operations of a version this worker runs");
        }
    }
}

/// Until `shutdown`, every [`PULL_EVERY`]: sets the slots each tenant running more than its
/// share of `lane` here owes other tenants with claimable work waiting (`Shares::debts`,
/// `Leases::owe`: paid at its operations' step boundaries, or by stopping some mid-step once
/// the debt has stood for the grace; each stopped one is held); then claims the operations of
/// `lane` held for fair shares that this worker may start now (`Shares::pullable`: oldest
/// first, tenants under their share here, or any when nobody else waits), as many as it has
/// free slots, and starts them.
pub(crate) async fn pull_held(pull: Pull) {
    let (shared, lane) = (&pull.shared, pull.lane);
    while pull.next().await {
        let running = shared.leases.running_by_tenant(lane);
        let debts = shared
            .shares
            .debts(
                shared.pool(),
                lane,
                &running,
                pull.slots.available_permits(),
            )
            .await;
        let stopped = shared.leases.owe(lane, &debts, shared.shares.grace());
        if stopped > 0 {
            tracing::info!(
                stopped,
                %lane,
                "a tenant over its share stopped operations mid-step for others waiting past the grace"
            );
        }
        let free = pull.free();
        if free == 0 {
            continue;
        }
        let pool = shared.pool();
        // More candidates than slots: some may belong to tenants at their share here.
        let held = match db::within(db::claim::share_held_in(pool, lane, (free * 4) as i64)).await {
            Ok(held) if !held.is_empty() => held,
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "looking for held operations failed");
                continue;
            }
        };
        let running = shared.leases.running_by_tenant(lane);
        let ids = shared
            .shares
            .pullable(pool, lane, running, held, free)
            .await;
        let runnable = shared.versions.runnable();
        pull.claim_and_start(&ids, &runnable, "held").await;
    }
}

impl Pull {
    /// Waits for the next pull, [`PULL_EVERY`] from now; false once `shutdown` fires first.
    async fn next(&self) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => false,
            _ = tokio::time::sleep(PULL_EVERY) => true,
        }
    }

    /// The lane's free slots, at most a claim's batch.
    fn free(&self) -> usize {
        self.slots.available_permits().min(MAX_BATCH)
    }

    /// Takes a free slot for each of `ids` while there are any, claims those operations with
    /// the claim statement every pointer goes through (only what `runnable` allows), and
    /// starts the ones claimed; returns how many it started. A failed claim is logged, naming
    /// the `what` operations (`parked`, `held`), and starts nothing.
    async fn claim_and_start(
        &self,
        ids: &[Uuid],
        runnable: &db::versions::Runnable,
        what: &str,
    ) -> usize {
        let permits: Vec<OwnedSemaphorePermit> = ids
            .iter()
            .map_while(|_| self.slots.clone().try_acquire_owned().ok())
            .collect();
        let ids = &ids[..permits.len()];
        if ids.is_empty() {
            return 0;
        }
        let shared = &self.shared;
        let claimed = db::within(db::claim::claim_operations(
            shared.pool(),
            ids,
            runnable,
            shared.leases.owner(),
            shared.leases.ttl(),
        ))
        .await;
        match claimed {
            Ok(claimed) => {
                let n = claimed.len();
                for (op, permit) in claimed.into_iter().zip(permits) {
                    start(shared, self.lane, op, (&self.slots, permit), &self.tasks);
                }
                n
            }
            Err(e) => {
                tracing::warn!(error = %e, "claiming {what} operations failed");
                0
            }
        }
    }
}
