//! Group commit: writes of many operations share one fenced statement (one commit).
//!
//! Two writers use it: the journal writer (a running operation's finished steps, and an unsafe
//! step's `started` row) and the completer (a successful attempt's result with its last rows).
//! Each execution hands its write to [`GroupCommit::write`] and waits for the answer, so a step
//! is reported durable, and an outcome acked, released or reported, only after its own row has
//! committed, exactly as with one statement per operation. A writer takes everything queued at
//! that moment (up to [`MAX_BATCH`], one write per operation) into one statement, each row
//! checked against its own operation's epoch and status and the rows locked in id order; up to
//! [`Grouped::IN_FLIGHT`] statements are in flight at once, and while they are, the next batch grows. A
//! failed batch (a deadlock with a heartbeat, say) is retried one operation at a time, so one
//! fenced-out or broken operation never fails the others.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use agentq_core::db::{self, settle::Completion, steps::StepBatch};
use futures_util::future::BoxFuture;
use sqlx::PgPool;
use tokio::sync::{Semaphore, mpsc, oneshot};
use uuid::Uuid;

/// Most operations written by one statement.
const MAX_BATCH: usize = 256;
/// Writes waiting for a statement; beyond this, executions wait (backpressure).
const QUEUE: usize = 4096;

/// A write of one operation that is made many per statement.
pub(crate) trait Grouped: Send + Sync + 'static {
    /// What the metric and the logs call this writer.
    const WHAT: &'static str;
    /// Statements of this writer in flight at once. Fewer statements carry more operations
    /// each: on the 2-core machine the journal's throughput is bounded by CPU per statement,
    /// so it runs 2 (1: 11.1k durable steps/s, 2: 10.7k, 4: 8.9k, 8: 5.8k at concurrency 64);
    /// more than one keeps a statement that waits on a row lock from stalling every step.
    const IN_FLIGHT: usize;
    /// The operation written.
    fn op_id(&self) -> Uuid;
    /// Writes `batch` (distinct operations) in one statement; returns the ids written (an id
    /// missing from it lost its lease: nothing was written for it).
    fn write_many<'a>(pool: &'a PgPool, batch: &'a [Self]) -> BoxFuture<'a, db::Result<Vec<Uuid>>>
    where
        Self: Sized;
}

impl Grouped for Completion {
    const WHAT: &'static str = "completion";
    const IN_FLIGHT: usize = 4;
    fn op_id(&self) -> Uuid {
        self.id
    }
    fn write_many<'a>(pool: &'a PgPool, batch: &'a [Self]) -> BoxFuture<'a, db::Result<Vec<Uuid>>> {
        Box::pin(db::within(db::settle::complete_operations(pool, batch)))
    }
}

impl Grouped for StepBatch {
    const WHAT: &'static str = "journal";
    const IN_FLIGHT: usize = 2;
    fn op_id(&self) -> Uuid {
        self.id
    }
    fn write_many<'a>(pool: &'a PgPool, batch: &'a [Self]) -> BoxFuture<'a, db::Result<Vec<Uuid>>> {
        Box::pin(db::within(db::steps::record_steps_many(pool, batch)))
    }
}

/// Writes one operation alone.
async fn write_one<T: Grouped>(pool: &PgPool, write: T) -> Written<T> {
    match T::write_many(pool, std::slice::from_ref(&write)).await {
        Ok(done) => Ok(done.contains(&write.op_id())),
        Err(error) => Err(Unwritten { error, write }),
    }
}

/// A write that failed (a database error), handed back so its caller keeps its rows.
pub(crate) struct Unwritten<T> {
    pub(crate) error: db::Error,
    pub(crate) write: T,
}

/// What became of a write: true once committed, false when the lease was lost and nothing was
/// written (or the writer was stopped): write nothing more for that operation.
pub(crate) type Written<T> = Result<bool, Unwritten<T>>;

struct Request<T> {
    write: T,
    reply: oneshot::Sender<Written<T>>,
}

/// The handle executions write through.
pub(crate) struct GroupCommit<T: Grouped> {
    tx: mpsc::Sender<Request<T>>,
    /// Taken by [`GroupCommit::run`].
    rx: Mutex<Option<mpsc::Receiver<Request<T>>>>,
}

impl<T: Grouped> GroupCommit<T> {
    pub(crate) fn new() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
        }
    }

    /// Writes `write`, grouped with others, and waits for its own commit.
    pub(crate) async fn write(&self, pool: &PgPool, write: T) -> Written<T> {
        let (reply, answer) = oneshot::channel();
        match self.tx.send(Request { write, reply }).await {
            // The writer was stopped (worker shutdown) with this write taken, so whether it
            // committed is unknown: act as on a lost lease and write nothing more for the
            // operation. Its journal decides what the next claim replays.
            Ok(()) => answer.await.unwrap_or(Ok(false)),
            // No writer running: write this one alone.
            Err(unsent) => write_one(pool, unsent.0.write).await,
        }
    }

    /// Takes batches off the queue and writes them; runs until aborted. Call once.
    pub(crate) async fn run(&self, pool: PgPool) {
        let Some(mut rx) = self.rx.lock().expect("group commit lock").take() else {
            return;
        };
        let writers = Arc::new(Semaphore::new(T::IN_FLIGHT));
        // A write of an operation already in the batch being built waits for the next one (a
        // statement may touch an operation's rows once).
        let mut held: Option<Request<T>> = None;
        loop {
            let first = match held.take() {
                Some(r) => r,
                None => match rx.recv().await {
                    Some(r) => r,
                    None => return,
                },
            };
            let permit = writers
                .clone()
                .acquire_owned()
                .await
                .expect("writers semaphore is never closed");
            let mut ids = HashSet::from([first.write.op_id()]);
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(r) if ids.insert(r.write.op_id()) => batch.push(r),
                    Ok(r) => {
                        held = Some(r);
                        break;
                    }
                    Err(_) => break,
                }
            }
            let pool = pool.clone();
            tokio::spawn(async move {
                write_batch(&pool, batch).await;
                drop(permit);
            });
        }
    }
}

async fn write_batch<T: Grouped>(pool: &PgPool, batch: Vec<Request<T>>) {
    let (writes, replies): (Vec<T>, Vec<_>) = batch.into_iter().map(|r| (r.write, r.reply)).unzip();
    agentq_core::metrics::GROUP_COMMIT_SIZE.observe(&[T::WHAT], writes.len() as f64);
    match T::write_many(pool, &writes).await {
        Ok(done) => {
            let done: HashSet<Uuid> = done.into_iter().collect();
            for (w, reply) in writes.iter().zip(replies) {
                let _ = reply.send(Ok(done.contains(&w.op_id())));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, writer = T::WHAT, operations = writes.len(), "grouped write failed; writing one by one");
            for (w, reply) in writes.into_iter().zip(replies) {
                let _ = reply.send(write_one(pool, w).await);
            }
        }
    }
}
