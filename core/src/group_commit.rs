//! Group commit: writes of many operations share one statement (one commit).
//!
//! Two writers use it: a worker's journal writer (a running operation's finished steps, an
//! unsafe step's `started` row, and a successful attempt's result with its last rows, in the
//! same statements), fenced by each operation's epoch, and a producer's enqueues (new
//! operations, each with its budget). Each caller hands its write to [`GroupCommit::write`]
//! and waits for the answer, so a step is reported durable, an outcome acked, released or
//! reported, and an enqueue answered and published only after its own row has committed,
//! exactly as with one statement per operation. A writer takes everything queued at that moment
//! (up to [`Grouped::MAX_BATCH`], one write per operation) into one statement (the worker's
//! writer checks each row against its own operation's epoch and status and locks the rows in id
//! order); up to [`Grouped::IN_FLIGHT`] statements are in flight at once (the journal's: one,
//! and a second only beside one that is slow, [`Grouped::STALL`]), and while they are, the next
//! batch grows. A failed batch (a deadlock with a heartbeat, say) is retried one operation at a
//! time, so one fenced-out or broken operation never fails the others.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::db::{self, operations::NewOperation, settle::RunWrite};
use futures_util::future::BoxFuture;
use sqlx::PgPool;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use uuid::Uuid;

/// Writes waiting for a statement; beyond this, executions wait (backpressure).
const QUEUE: usize = 4096;

/// A write of one operation that is made many per statement.
pub trait Grouped: Send + Sync + 'static {
    /// What the metric and the logs call this writer.
    const WHAT: &'static str;
    /// Statements of this writer in flight at once. Fewer statements carry more operations
    /// each: on the 2-core machine the journal's throughput is bounded by CPU per statement
    /// (1: 11.1k durable steps/s, 2: 10.7k, 4: 8.9k, 8: 5.8k at concurrency 64); more than one
    /// keeps a statement that waits on a row lock from stalling every write.
    const IN_FLIGHT: usize;
    /// With a value, a statement starts beside others only once the newest in flight has run
    /// this long: one at a time while statements are quick (each carries more), and another
    /// (up to [`Grouped::IN_FLIGHT`]) as soon as one is slow, as when it waits on a row lock.
    const STALL: Option<Duration> = None;
    /// Most operations written by one statement.
    const MAX_BATCH: usize = 256;
    /// The operation written.
    fn op_id(&self) -> Uuid;
    /// Writes `batch` (distinct operations) in one statement; returns the ids written (nothing
    /// was written for an id missing from it: a worker's write lost its lease, an enqueue's
    /// dedupe key already names an operation).
    fn write_many<'a>(pool: &'a PgPool, batch: &'a [Self]) -> BoxFuture<'a, db::Result<Vec<Uuid>>>
    where
        Self: Sized;
}

impl Grouped for RunWrite {
    const WHAT: &'static str = "journal";
    const IN_FLIGHT: usize = 2;
    /// One statement at a time unless it is slow: a quarter fewer commits per job on workload
    /// B than two at a time, with as many durable steps/s or a few per cent more
    /// (docs/benchmarks.md, "One journal statement at a time"); under that load a statement
    /// commits in a few milliseconds, so 20 ms is slow.
    const STALL: Option<Duration> = Some(Duration::from_millis(20));
    fn op_id(&self) -> Uuid {
        self.id()
    }
    fn write_many<'a>(pool: &'a PgPool, batch: &'a [Self]) -> BoxFuture<'a, db::Result<Vec<Uuid>>> {
        Box::pin(db::within(db::settle::write_runs(pool, batch)))
    }
}

impl Grouped for NewOperation {
    const WHAT: &'static str = "enqueue";
    /// As the journal's: fewer statements carry more rows each.
    const IN_FLIGHT: usize = 2;
    /// An input may be 1 MiB: at most 64 MiB of inputs in one statement.
    const MAX_BATCH: usize = 64;
    fn op_id(&self) -> Uuid {
        self.id.0
    }
    fn write_many<'a>(pool: &'a PgPool, batch: &'a [Self]) -> BoxFuture<'a, db::Result<Vec<Uuid>>> {
        Box::pin(db::within(async move {
            let created = db::operations::insert_operations(pool, batch).await?;
            Ok(created.into_iter().map(|c| c.id).collect())
        }))
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
pub struct Unwritten<T> {
    pub error: db::Error,
    pub write: T,
}

/// What became of a write: true once committed; false when nothing was written for it (see
/// [`Grouped::write_many`]) or the writer was stopped with it: a worker writes nothing more for
/// that operation, a producer looks the operation up.
pub type Written<T> = Result<bool, Unwritten<T>>;

struct Request<T> {
    write: T,
    reply: oneshot::Sender<Written<T>>,
}

/// The handle executions write through.
pub struct GroupCommit<T: Grouped> {
    tx: mpsc::Sender<Request<T>>,
    /// Taken by [`GroupCommit::run`].
    rx: Mutex<Option<mpsc::Receiver<Request<T>>>>,
}

impl<T: Grouped> GroupCommit<T> {
    pub fn new() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
        }
    }

    /// Writes `write`, grouped with others, and waits for its own commit.
    pub async fn write(&self, pool: &PgPool, write: T) -> Written<T> {
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

    /// Writes handed in and not yet taken into a statement.
    pub fn waiting(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// A group commit whose writer runs on a task of its own until every handle to it is
    /// dropped. Outside a Tokio runtime there is no writer, and each write is made alone.
    pub fn spawn(pool: PgPool) -> Self {
        let gc = Self::new();
        let rx = gc.rx.lock().expect("group commit lock").take();
        if let (Ok(runtime), Some(rx)) = (tokio::runtime::Handle::try_current(), rx) {
            runtime.spawn(drain(rx, pool));
        }
        gc
    }

    /// Takes batches off the queue and writes them; runs until aborted. Call once.
    pub async fn run(&self, pool: PgPool) {
        let rx = self.rx.lock().expect("group commit lock").take();
        if let Some(rx) = rx {
            drain(rx, pool).await;
        }
    }
}

impl<T: Grouped> Default for GroupCommit<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Takes batches off `rx` and writes them, until every sender is gone.
async fn drain<T: Grouped>(mut rx: mpsc::Receiver<Request<T>>, pool: PgPool) {
    let writers = Arc::new(Semaphore::new(T::IN_FLIGHT));
    // Notified as each statement ends, for [`Grouped::STALL`].
    let ended = Arc::new(Notify::new());
    let mut newest = Instant::now();
    // A write of an operation already in the batch being built waits for the next one (a
    // statement may touch an operation's rows once).
    let mut held: Option<Request<T>> = None;
    loop {
        // A statement's turn first, then its writes: while it waits, the writes stay queued
        // ([`GroupCommit::waiting`]) and the next batch grows.
        let permit = turn::<T>(&writers, &ended, newest).await;
        let first = match held.take() {
            Some(r) => r,
            None => match rx.recv().await {
                Some(r) => r,
                None => return,
            },
        };
        let mut ids = HashSet::from([first.write.op_id()]);
        let mut batch = vec![first];
        while batch.len() < T::MAX_BATCH {
            match rx.try_recv() {
                Ok(r) if ids.insert(r.write.op_id()) => batch.push(r),
                Ok(r) => {
                    held = Some(r);
                    break;
                }
                Err(_) => break,
            }
        }
        newest = Instant::now();
        let (pool, ended) = (pool.clone(), ended.clone());
        tokio::spawn(async move {
            write_batch(&pool, batch).await;
            drop(permit);
            ended.notify_one();
        });
    }
}

/// Waits for a statement's turn: one of [`Grouped::IN_FLIGHT`]; with a [`Grouped::STALL`], only
/// when none is in flight or the newest (started at `newest`) has run that long.
async fn turn<T: Grouped>(
    writers: &Arc<Semaphore>,
    ended: &Notify,
    newest: Instant,
) -> OwnedSemaphorePermit {
    if let Some(stall) = T::STALL {
        let slow = tokio::time::sleep_until((newest + stall).into());
        tokio::pin!(slow);
        // A statement that ends between the check and the wait leaves its notification stored.
        while writers.available_permits() < T::IN_FLIGHT {
            tokio::select! {
                () = ended.notified() => {}
                () = &mut slow => break,
            }
        }
    }
    writers
        .clone()
        .acquire_owned()
        .await
        .expect("writers semaphore is never closed")
}

async fn write_batch<T: Grouped>(pool: &PgPool, batch: Vec<Request<T>>) {
    let (writes, replies): (Vec<T>, Vec<_>) = batch.into_iter().map(|r| (r.write, r.reply)).unzip();
    crate::metrics::GROUP_COMMIT_SIZE.observe(&[T::WHAT], writes.len() as f64);
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
