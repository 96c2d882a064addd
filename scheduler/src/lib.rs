//! agentq-scheduler: fires what is due.
//!
//! - schedules: each due tick of a schedule becomes an ordinary operation (dedupe key
//!   `schedule:<id>:<tick>`), the schedule's next tick moved on in the same transaction as the
//!   inserts, the rows locked `FOR UPDATE SKIP LOCKED`: any number of schedulers fire a tick
//!   exactly once (`db::schedules::fire_due`); their pointers are published after the commit;
//! - timers: sleeping operations whose wake time came and waiting ones whose timeout passed (or
//!   whose signal arrived) go back to `queued` and are dispatched at once;
//! - deadlines: queued, sleeping or waiting operations past their deadline become dead
//!   (`deadline_exceeded`); running ones are flagged for their worker to stop;
//! - retention: finished operations older than the retention period are deleted in batches;
//! - the reaper: `running` operations whose lease expired (the worker died or hung) go back to
//!   `queued` with `restarts + 1` and are dispatched at once, or to `dead` as `crash_loop` once
//!   restarts exceed the limit;
//!
//! - committed but never confirmed pointers (`queued`, `dispatched_at IS NULL`, older than a
//!   grace period): the producer died between its commit and its publish, or a retry came due;
//! - lost pointers: queued operations confirmed long ago while their lane's queue is empty (the
//!   broker lost them). Checking the queue first means a large legitimate backlog never causes
//!   mass re-publication.
//!
//! - batch auto-pause: a batch whose newest outcomes failed too often (its configured window
//!   and ratio) is paused, so a provider outage or a bad prompt does not burn the whole batch;
//! - batch completion: a running batch whose every document was enqueued and has an outcome
//!   becomes `completed` (`db::batches::complete`, one index probe per running batch);
//!
//! - the broker dead-letter recorder: every message that reaches `<ns>.dlq` becomes a
//!   `poison_message` dead letter (see `broker_dlq`).
//!
//! Every sweep locks its rows with `FOR UPDATE SKIP LOCKED`, publishes their pointers and marks
//! the confirmed ones in the same transaction (`Dispatcher::publish_locked`), so several
//! schedulers can run at once without publishing a row twice per sweep, and no failure leaves a
//! row marked without a pointer. Wakes and the reaper change rows as they make them due and
//! then publish and mark them as a producer does.

mod broker_dlq;

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentq_core::broker::{self, Names};
use agentq_core::db;
use agentq_core::dispatch::{Dispatcher, Target, send_all};
use agentq_core::health::Progress;
use agentq_core::metrics;
use agentq_core::operation::Lane;
use agentq_core::state::{ErrorClass, Status};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Wake-up batches published concurrently (each up to `wake_batch` confirms in flight).
pub const PUBLISHES_IN_FLIGHT: usize = 4;

/// How long the loop may go without finishing a pass (or a retention batch) before its
/// `GET /healthz` answers 503. A pass whose every statement fails (PostgreSQL down) still
/// finishes, after each statement's 10 s pool timeout; one that hangs does not.
pub const STALLED_AFTER: Duration = Duration::from_secs(120);

/// Scheduler settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pause between sweeps when there was nothing to do.
    pub tick: Duration,
    /// How old an unconfirmed row must be before the sweeper publishes it (the producer's own
    /// publish normally lands within milliseconds).
    pub dispatch_grace: Duration,
    /// How old a confirmed pointer of a queued row must be to count as lost when its queue is empty.
    pub lost_after: Duration,
    /// How often to check for lost pointers.
    pub lost_check_every: Duration,
    /// Rows per sweep statement.
    pub batch: i64,
    /// Operations woken per timer statement (a burst of due timers is published in batches of
    /// this size, several at once).
    pub wake_batch: i64,
    /// Crash recoveries allowed per operation before `crash_loop`.
    pub restart_limit: i32,
    /// Days finished operations are kept.
    pub retention_days: u32,
    /// How often retention runs.
    pub retention_every: Duration,
    /// Schedules handled per firing pass.
    pub schedule_batch: i64,
    /// Ticks one schedule fires per pass at most (a catch-up continues on the next pass).
    pub fire_per_schedule: usize,
    /// Unfinished operations a tenant may have: a schedule whose tenant has them fires nothing
    /// (`AGENTQ_TENANT_MAX_UNFINISHED`).
    pub tenant_max_unfinished: i64,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            tick: Duration::from_millis(200),
            dispatch_grace: Duration::from_secs(5),
            lost_after: Duration::from_secs(60),
            lost_check_every: Duration::from_secs(30),
            batch: 500,
            wake_batch: 2000,
            restart_limit: 3,
            retention_days: 30,
            retention_every: Duration::from_secs(60),
            schedule_batch: 100,
            fire_per_schedule: 50,
            tenant_max_unfinished: 100_000,
        }
    }
}

/// The scheduler engine.
pub struct Scheduler {
    settings: Settings,
    /// Wake-up batches being published right now.
    in_flight: Arc<tokio::sync::Semaphore>,
    pool: PgPool,
    dispatcher: Arc<Dispatcher>,
    names: Names,
    /// Marked after every pass of the loop and every retention batch.
    progress: Arc<Progress>,
}

impl Scheduler {
    /// A scheduler publishing through `dispatcher`.
    pub fn new(
        settings: Settings,
        pool: PgPool,
        dispatcher: Arc<Dispatcher>,
        namespace: &str,
    ) -> Self {
        Self {
            settings,
            in_flight: Arc::new(tokio::sync::Semaphore::new(PUBLISHES_IN_FLIGHT)),
            pool,
            dispatcher,
            names: Names::new(namespace),
            progress: Progress::new("scheduler_pass", STALLED_AFTER),
        }
    }

    /// Marked after every pass of the loop; stale after [`STALLED_AFTER`] without one. Its
    /// metrics endpoint's `GET /healthz` answers from it.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Runs the loops until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        tracing::info!("scheduler started");
        let recorder = {
            let (pool, dispatcher, names, stop) = (
                self.pool.clone(),
                self.dispatcher.clone(),
                self.names.clone(),
                shutdown.clone(),
            );
            tokio::spawn(async move { broker_dlq::run(pool, &dispatcher, names, stop).await })
        };
        let mut last_lost_check = Instant::now();
        let mut last_retention = Instant::now() - self.settings.retention_every;
        loop {
            let mut busy = false;
            match self.fire_schedules().await {
                Ok(n) => busy |= n as i64 >= self.settings.schedule_batch,
                Err(e) => tracing::warn!(error = %e, "firing schedules failed"),
            }
            match self.wake().await {
                Ok(n) => busy |= n as i64 >= self.settings.wake_batch,
                Err(e) => tracing::warn!(error = %e, "waking due timers failed"),
            }
            if let Err(e) = self.expire_deadlines().await {
                tracing::warn!(error = %e, "expiring deadlines failed");
            }
            if let Err(e) = self.auto_pause().await {
                tracing::warn!(error = %e, "checking batches for auto-pause failed");
            }
            if let Err(e) = self.complete_batches().await {
                tracing::warn!(error = %e, "checking batches for completion failed");
            }
            if last_retention.elapsed() >= self.settings.retention_every {
                last_retention = Instant::now();
                if let Err(e) = self.retain().await {
                    tracing::warn!(error = %e, "retention failed");
                }
            }
            match self.reap().await {
                Ok(n) => busy |= n as i64 >= self.settings.batch,
                Err(e) => tracing::warn!(error = %e, "reaping expired leases failed"),
            }
            match self.sweep_undispatched().await {
                Ok(n) => busy |= n as i64 >= self.settings.batch,
                Err(e) => tracing::warn!(error = %e, "dispatch sweep failed"),
            }
            if last_lost_check.elapsed() >= self.settings.lost_check_every {
                last_lost_check = Instant::now();
                if let Err(e) = self.sweep_lost().await {
                    tracing::warn!(error = %e, "lost-dispatch sweep failed");
                }
            }
            self.progress.mark();
            if busy {
                continue;
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(self.settings.tick) => {}
            }
        }
        let _ = recorder.await;
        // Let the wake-up batches still publishing finish before the connection closes.
        let _ = self
            .in_flight
            .acquire_many(PUBLISHES_IN_FLIGHT as u32)
            .await;
        self.dispatcher.close().await;
        Ok(())
    }

    /// One pass of the timer loop: wakes what is due (committed), then hands the woken rows to
    /// a background publish that locks them, publishes their pointers and marks the confirmed
    /// ones in that transaction (`Dispatcher::publish_locked`, as the sweeps do): the sweeper
    /// skips them meanwhile, so a burst whose confirms lag past its grace period is published
    /// once, and one this scheduler never confirms is the sweeper's after the grace period. The
    /// next batch is woken while this one's confirms are still coming back; at most
    /// [`PUBLISHES_IN_FLIGHT`] batches publish at once. Returns how many it woke.
    pub async fn wake(&self) -> anyhow::Result<usize> {
        let permit = self.in_flight.clone().acquire_owned().await?;
        let woken = db::within(db::timers::wake_due(&self.pool, self.settings.wake_batch)).await?;
        let n = woken.len();
        for w in &woken {
            let lag = (w.woken_at - w.due_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
            metrics::TIMER_LAG.observe(&[], lag.max(0.0));
        }
        if n > 0 {
            let ids: Vec<uuid::Uuid> = woken.iter().map(|w| w.id).collect();
            let (dispatcher, pool) = (self.dispatcher.clone(), self.pool.clone());
            tokio::spawn(async move {
                // Locked, published, marked, released: a failure anywhere leaves the rows
                // unmarked for the sweeper, nothing to undo.
                let published = match db::within(db::dispatch::lock_woken(&pool, &ids)).await {
                    Ok(locked) => dispatcher.publish_locked(locked).await,
                    Err(e) => Err(e),
                };
                match published {
                    Ok(p) if p.failed > 0 => tracing::warn!(
                        error = ?p.error, n = p.failed,
                        "dispatching woken operations failed; the sweeper will publish them"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(
                        error = %e,
                        "dispatching woken operations failed; the sweeper will publish them"
                    ),
                }
                drop(permit);
            });
        }
        Ok(n)
    }

    /// One firing pass of the schedules: fires their due ticks as operations (committed with
    /// the schedules' next ticks), then publishes the new operations' pointers as a producer
    /// does (a failed publish is the sweeper's). Returns how many schedules it handled.
    pub async fn fire_schedules(&self) -> anyhow::Result<usize> {
        let fired = db::within(db::schedules::fire_due(
            &self.pool,
            self.settings.schedule_batch,
            self.settings.fire_per_schedule,
            self.settings.tenant_max_unfinished,
        ))
        .await?;
        let mut targets = Vec::new();
        for f in &fired {
            if f.missed > 0 {
                tracing::warn!(
                    schedule_id = %f.schedule_id, missed = f.missed,
                    "ticks older than the schedule's catch-up window were skipped"
                );
            }
            if f.skipped_capacity > 0 {
                tracing::warn!(
                    schedule_id = %f.schedule_id, skipped = f.skipped_capacity,
                    "ticks not fired: the schedule's tenant has its cap of unfinished operations"
                );
            }
            for (outcome, n) in [
                ("fired", f.created.len() as i64),
                ("skipped_overlap", f.skipped_overlap),
                ("missed", f.missed),
                ("skipped_capacity", f.skipped_capacity),
            ] {
                if n > 0 {
                    metrics::SCHEDULE_TICKS.add(&[&f.kind, outcome], n as f64);
                }
            }
            for d in &f.created {
                metrics::OPERATIONS_ENQUEUED.inc(&[&d.kind]);
                targets.push(Target::from(d.clone()));
            }
        }
        let dispatcher = &self.dispatcher;
        let failed = send_all(targets, |t| async move { dispatcher.dispatch(&t).await }).await;
        if let Some((_, e)) = failed.first() {
            tracing::warn!(error = %e, n = failed.len(), "publishing fired operations failed; the sweeper will publish them");
        }
        Ok(fired.len())
    }

    /// One pass of the deadline loop; returns how many operations it stopped.
    pub async fn expire_deadlines(&self) -> anyhow::Result<usize> {
        let expired = db::within(db::timers::expire_deadlines(
            &self.pool,
            self.settings.batch,
        ))
        .await?;
        for (id, kind) in &expired {
            tracing::info!(op_id = %id, "operation is dead: deadline_exceeded");
            count_death(kind, ErrorClass::DeadlineExceeded);
        }
        // Running ones are stopped by their worker (which writes the outcome).
        let flagged = db::within(db::timers::stop_running_past_deadline(
            &self.pool,
            self.settings.batch,
        ))
        .await?;
        if flagged > 0 {
            tracing::info!(
                n = flagged,
                "asked workers to stop running operations past their deadline"
            );
        }
        Ok(expired.len())
    }

    /// Pauses batches whose recent failure rate crossed their threshold; returns how many.
    pub async fn auto_pause(&self) -> anyhow::Result<usize> {
        let paused = db::within(db::batches::auto_pause(&self.pool)).await?;
        for b in &paused {
            tracing::warn!(
                batch_id = %b.id, tenant = %b.tenant_id, failed = b.failed, window = b.pause_window,
                "batch auto-paused: too many of its newest operations failed; \
                 fix the cause, then `agentq batch resume`"
            );
        }
        Ok(paused.len())
    }

    /// Completes the filled, running batches whose every operation has an outcome; returns
    /// how many.
    pub async fn complete_batches(&self) -> anyhow::Result<usize> {
        let done = db::within(db::batches::complete(&self.pool)).await?;
        for b in &done {
            tracing::info!(batch_id = %b.id, tenant = %b.tenant_id, "batch completed");
        }
        Ok(done.len())
    }

    /// One retention pass: deletes finished operations past the retention period, in small
    /// batches so it never holds many locks; returns how many it deleted.
    pub async fn retain(&self) -> anyhow::Result<u64> {
        let mut total = 0;
        loop {
            let n = db::within(db::retention::delete_expired(
                &self.pool,
                self.settings.retention_days,
                500,
            ))
            .await?;
            total += n;
            self.progress.mark();
            if n < 500 {
                break;
            }
        }
        if total > 0 {
            tracing::info!(deleted = total, "retention deleted finished operations");
        }
        Ok(total)
    }

    /// One pass of the reaper; returns how many expired leases it recovered.
    pub async fn reap(&self) -> anyhow::Result<usize> {
        let reaped = db::within(db::settle::reap_expired_leases(
            &self.pool,
            self.settings.restart_limit,
            self.settings.batch,
        ))
        .await?;
        let n = reaped.len();
        let mut requeued = Vec::new();
        for r in reaped {
            metrics::LEASES_EXPIRED.inc(&[&r.kind]);
            if r.status == Status::Dead {
                metrics::CRASH_LOOPS.inc(&[&r.kind]);
                count_death(&r.kind, ErrorClass::CrashLoop);
                tracing::warn!(op_id = %r.id, restarts = r.restarts, "operation is dead: crash_loop");
            } else {
                tracing::info!(op_id = %r.id, restarts = r.restarts, in_flight = ?r.in_flight, "recovered an expired lease");
                metrics::LEASES_RESCUED.inc(&[&r.kind]);
                requeued.push(Target::from(db::dispatch::Dispatch {
                    id: r.id,
                    tenant_id: r.tenant_id,
                    kind: r.kind,
                    lane: r.lane,
                    epoch: r.epoch,
                    traceparent: None,
                }));
            }
        }
        // Published and then marked, as a producer does: a failed publish (or a scheduler that
        // dies first) leaves the rows unmarked, for the sweeper after its grace period.
        let dispatcher = &self.dispatcher;
        let failed = send_all(requeued, |t| async move { dispatcher.dispatch(&t).await }).await;
        if let Some((_, e)) = failed.first() {
            tracing::warn!(error = %e, n = failed.len(), "dispatching recovered operations failed; the sweeper will retry");
        }
        Ok(n)
    }

    /// One pass of the dispatch sweeper; returns how many pointers it published.
    pub async fn sweep_undispatched(&self) -> anyhow::Result<usize> {
        let locked = db::within(db::dispatch::lock_undispatched(
            &self.pool,
            self.settings.dispatch_grace,
            self.settings.batch,
        ))
        .await?;
        self.publish(locked).await
    }

    /// One pass of the lost-pointer check; returns how many pointers it published.
    pub async fn sweep_lost(&self) -> anyhow::Result<usize> {
        let mut n = 0;
        for lane in Lane::ALL {
            let names = self.names.clone();
            let depth = self
                .dispatcher
                .with_connection(async |conn| broker::queue_depth(conn, &names, lane).await)
                .await?;
            if depth > 0 {
                continue;
            }
            let lost = db::within(db::dispatch::lock_lost_dispatches(
                &self.pool,
                lane,
                self.settings.lost_after,
                self.settings.batch,
            ))
            .await?;
            if !lost.rows.is_empty() {
                tracing::warn!(lane = %lane, n = lost.rows.len(), "republishing pointers the broker lost");
            }
            n += self.publish(lost).await?;
        }
        Ok(n)
    }

    /// Publishes rows this scheduler locked for dispatch and marks the confirmed ones as it
    /// releases them; the others stay due for the next sweep.
    async fn publish(&self, locked: db::dispatch::Locked) -> anyhow::Result<usize> {
        let published = self.dispatcher.publish_locked(locked).await?;
        if let Some(e) = &published.error {
            tracing::warn!(error = %e, n = published.failed, "publishing failed; the sweeper will retry");
            anyhow::bail!(
                "{} of {} publishes failed",
                published.failed,
                published.failed + published.sent
            );
        }
        Ok(published.sent)
    }
}

/// Starts the reaper's counters at 0 for `kinds` (the kinds the deployment runs), so the
/// first expired lease or crash loop of a kind shows as an increase (deploy/alerts.yml).
pub fn start_counters_at_zero(kinds: &[String]) {
    for kind in kinds {
        for m in [
            &metrics::LEASES_EXPIRED,
            &metrics::LEASES_RESCUED,
            &metrics::CRASH_LOOPS,
        ] {
            m.start_at_zero(&[kind]);
        }
    }
}

/// Counts an operation the scheduler ended as dead with `class`, as a worker counts the
/// deaths it writes.
fn count_death(kind: &str, class: ErrorClass) {
    metrics::OPERATIONS_FINISHED.inc(&[kind, Status::Dead.as_str()]);
    metrics::OPERATION_FAILURES.inc(&[kind, class.as_str()]);
}
