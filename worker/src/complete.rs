//! Batched completion: successful attempts are written many per statement, so finishing an
//! operation does not cost a commit of its own.
//!
//! Each execution hands its result and pending journal rows to [`Completer::complete`] and
//! waits for the answer, so nothing is acked, released or reported before its row has
//! committed, exactly as with one statement per operation. A writer takes everything queued at
//! that moment (up to [`MAX_BATCH`]) into one fenced statement ([`db::complete_operations`]);
//! up to [`WRITERS`] statements are in flight at once, and while they are, the next batch
//! grows. A failed batch (a deadlock with a heartbeat, say) is retried one operation at a time.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use agentq_core::db::{self, Completion};
use sqlx::PgPool;
use tokio::sync::{Semaphore, mpsc, oneshot};
use uuid::Uuid;

/// Most operations completed by one statement.
const MAX_BATCH: usize = 256;
/// Completion statements in flight at once.
const WRITERS: usize = 4;
/// Completions waiting for a writer; beyond this, executions wait (backpressure).
const QUEUE: usize = 4096;

struct Request {
    completion: Completion,
    reply: oneshot::Sender<db::Result<bool>>,
}

/// The handle executions complete through.
pub(crate) struct Completer {
    tx: mpsc::Sender<Request>,
    /// Taken by [`Completer::run`].
    rx: Mutex<Option<mpsc::Receiver<Request>>>,
}

impl Completer {
    pub(crate) fn new() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
        }
    }

    /// Writes `completion` (batched with others); true once committed, false when the lease
    /// was lost and nothing was written.
    pub(crate) async fn complete(&self, pool: &PgPool, completion: Completion) -> db::Result<bool> {
        let (reply, answer) = oneshot::channel();
        let request = Request {
            completion: completion.clone(),
            reply,
        };
        if self.tx.send(request).await.is_ok()
            && let Ok(written) = answer.await
        {
            return written;
        }
        // No writer (not running, or stopped): write this one alone.
        complete_one(pool, &completion).await
    }

    /// Takes batches off the queue and writes them; runs until aborted. Call once.
    pub(crate) async fn run(&self, pool: PgPool) {
        let Some(mut rx) = self.rx.lock().expect("completer lock").take() else {
            return;
        };
        let writers = Arc::new(Semaphore::new(WRITERS));
        while let Some(first) = rx.recv().await {
            let permit = writers
                .clone()
                .acquire_owned()
                .await
                .expect("writers semaphore is never closed");
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            let pool = pool.clone();
            tokio::spawn(async move {
                write(&pool, batch).await;
                drop(permit);
            });
        }
    }
}

async fn complete_one(pool: &PgPool, c: &Completion) -> db::Result<bool> {
    db::complete_operation(pool, c.id, c.epoch, &c.result, &c.steps).await
}

async fn write(pool: &PgPool, batch: Vec<Request>) {
    let completions: Vec<Completion> = batch.iter().map(|r| r.completion.clone()).collect();
    match db::complete_operations(pool, &completions).await {
        Ok(done) => {
            let done: HashSet<Uuid> = done.into_iter().collect();
            for r in batch {
                let _ = r.reply.send(Ok(done.contains(&r.completion.id)));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, operations = batch.len(), "batched completion failed; writing one by one");
            for r in batch {
                let written = complete_one(pool, &r.completion).await;
                let _ = r.reply.send(written);
            }
        }
    }
}
