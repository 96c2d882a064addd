//! Dispatching: publishing the pointer of a committed operation and recording that it was sent.
//!
//! Two orders, one rule (an operation queued with `dispatched_at` NULL gets published by the
//! sweeper after a grace period):
//! - producers commit the row, publish, and then mark `dispatched_at` in batches (one UPDATE for
//!   many confirms, because a commit per publish would double the enqueue cost). A producer that
//!   dies between its commit and its publish leaves `dispatched_at` NULL: the sweeper publishes.
//! - the scheduler's sweeps and a batch's resume lock the rows to dispatch in a transaction,
//!   publish, and mark the confirmed ones in that transaction ([`Dispatcher::publish_locked`]):
//!   other sweepers skip locked rows, so a burst whose confirms lag behind the grace period is
//!   never published twice, and nothing is marked that was not published (a commit that never
//!   happened leaves the rows due). Timer wakes and the reaper publish and mark like a producer.
//!
//! A duplicate pointer is harmless (the claim is conditional); a missing one is recovered by
//! the sweeper or, for a pointer the broker lost, by the lost-pointer check.

use std::sync::Mutex;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::broker::{self, Names, Publisher};
use crate::db;
use crate::operation::{Lane, OperationId, Pointer};

/// How long a pointer's publish may take before it counts as failed. A confirm takes
/// milliseconds; a publish still pending after this is stuck behind a broker connection that
/// went silent (its own call timeout is far longer than a lease), and the operation must not
/// wait for it: the row is left for the sweeper. Publishing twice is harmless: the second
/// pointer claims nothing.
pub const PUBLISH_TIMEOUT: Duration = Duration::from_secs(5);

/// How many confirmed dispatches may wait to be marked before publishers slow down.
const MARK_BACKLOG: usize = 8192;
/// At most this many marks per UPDATE.
const MARK_BATCH: usize = 1000;

/// Errors of dispatching.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The broker was unreachable or refused the pointer; the sweeper will retry it.
    #[error(transparent)]
    Broker(#[from] broker::Error),
}

/// What to publish for one operation.
#[derive(Clone, Debug)]
pub struct Target {
    pub op_id: OperationId,
    pub tenant: String,
    pub kind: String,
    pub lane: Lane,
    /// The epoch the operation had when it was committed as queued; the mark applies only if
    /// nothing claimed it since.
    pub epoch: i64,
    /// The W3C trace context stored with the operation, sent as the pointer's `traceparent`
    /// header (the worker reads the stored one; the header is for anything else on the path).
    pub traceparent: Option<String>,
}

impl From<db::dispatch::Dispatch> for Target {
    fn from(d: db::dispatch::Dispatch) -> Self {
        Target {
            op_id: OperationId(d.id),
            tenant: d.tenant_id,
            kind: d.kind,
            lane: d.lane.parse().unwrap_or_default(),
            epoch: d.epoch,
            traceparent: d.traceparent,
        }
    }
}

struct Link {
    /// Shared so a broker call on it (a queue depth) runs without holding the link's lock:
    /// publishes never wait behind such a call.
    conn: std::sync::Arc<broker::Connection>,
    publisher: Publisher,
    /// Which link this is (each (re)connection opens a new one).
    generation: u64,
}

/// How long closing a dispatcher waits for its outstanding marks to be written.
const CLOSE_MARKS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long closing a dispatcher waits for the broker to acknowledge the close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Publishes pointers over a lazily (re)opened connection and marks them dispatched in batches.
pub struct Dispatcher {
    amqp_url: String,
    names: Names,
    role: String,
    link: tokio::sync::Mutex<Option<Link>>,
    /// After a failed connection attempt: no new attempt before this instant (so an outage
    /// costs a connection attempt every few seconds, not one per publish).
    retry: Mutex<Retry>,
    marks: Mutex<Option<mpsc::Sender<(Uuid, i64)>>>,
    marker: Mutex<Option<JoinHandle<()>>>,
}

/// The reconnect backoff of a [`Dispatcher`].
struct Retry {
    not_before: Option<std::time::Instant>,
    delay: Duration,
}

/// First and longest wait between connection attempts while the broker is unreachable.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(2);

impl Dispatcher {
    /// A dispatcher for `names`; it connects on first use and declares the topology each time
    /// it (re)connects.
    pub fn new(pool: PgPool, amqp_url: &str, names: Names, role: &str) -> Self {
        let (tx, rx) = mpsc::channel(MARK_BACKLOG);
        let marker = tokio::spawn(run_marker(pool, rx));
        Self {
            amqp_url: amqp_url.to_string(),
            names,
            role: role.to_string(),
            link: tokio::sync::Mutex::new(None),
            retry: Mutex::new(Retry {
                not_before: None,
                delay: RETRY_FIRST,
            }),
            marks: Mutex::new(Some(tx)),
            marker: Mutex::new(Some(marker)),
        }
    }

    /// The publisher of the current link and the link's generation, connecting (and declaring
    /// the topology) if needed.
    async fn publisher(&self) -> Result<(Publisher, u64), Error> {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_ref()
            && l.publisher.is_usable()
        {
            return Ok((l.publisher.clone(), l.generation));
        }
        if let Some(at) = self.retry.lock().expect("retry lock").not_before {
            let now = std::time::Instant::now();
            if now < at {
                return Err(broker::Error::Unreachable(at - now).into());
            }
        }
        let opened = async {
            let conn = broker::connect(&self.amqp_url, &self.role).await?;
            broker::declare_topology(&conn, &self.names).await?;
            let publisher = Publisher::open(&conn, self.names.clone()).await?;
            Ok::<_, broker::Error>((conn, publisher))
        };
        let (conn, publisher) = match opened.await {
            Ok(opened) => {
                let mut retry = self.retry.lock().expect("retry lock");
                (retry.not_before, retry.delay) = (None, RETRY_FIRST);
                opened
            }
            Err(e) => {
                let mut retry = self.retry.lock().expect("retry lock");
                retry.not_before = Some(std::time::Instant::now() + retry.delay);
                retry.delay = (retry.delay * 2).min(RETRY_MAX);
                return Err(e.into());
            }
        };
        let generation = link.as_ref().map_or(0, |l| l.generation) + 1;
        *link = Some(Link {
            conn: std::sync::Arc::new(conn),
            publisher: publisher.clone(),
            generation,
        });
        Ok((publisher, generation))
    }

    /// Publishes the pointer of `target` and, once confirmed, queues its dispatch mark.
    pub async fn dispatch(&self, target: &Target) -> Result<(), Error> {
        self.publish(target).await?;
        let tx = self.marks.lock().expect("marks lock").clone();
        if let Some(tx) = tx {
            // A closed marker only means we are shutting down: the sweeper re-dispatches.
            let _ = tx.send((target.op_id.0, target.epoch)).await;
        }
        Ok(())
    }

    /// Publishes the pointer of `target` without marking it (the caller marks it, as
    /// [`Dispatcher::publish_locked`] does).
    /// A publish not confirmed within [`PUBLISH_TIMEOUT`] fails, and the connection it went
    /// out on is closed (the next publish opens a new one): a connection that went silent is
    /// never used again, rather than waited on until heartbeats give it up.
    pub async fn publish(&self, target: &Target) -> Result<(), Error> {
        let (publisher, generation) = self.publisher().await?;
        let pointer = Pointer::new(target.op_id, &target.tenant, &target.kind);
        let sent = publisher.publish_traced(&pointer, target.lane, target.traceparent.as_deref());
        match tokio::time::timeout(PUBLISH_TIMEOUT, sent).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.drop_link(generation, false).await;
                Err(e.into())
            }
            Err(_) => {
                self.drop_link(generation, true).await;
                Err(broker::Error::Timeout(PUBLISH_TIMEOUT).into())
            }
        }
    }

    /// Drops link `generation` when it broke, or always when `silent` (it missed a deadline);
    /// a link opened since by another publish is kept.
    async fn drop_link(&self, generation: u64, silent: bool) {
        let mut link = self.link.lock().await;
        let Some(l) = link.as_ref() else { return };
        if l.generation != generation || (!silent && l.publisher.is_usable()) {
            return;
        }
        if let Some(l) = link.take() {
            if silent {
                tracing::warn!("a publish got no confirm in time; closing that broker connection");
            }
            // Closing a silent connection must not hold the lock: nobody answers the close.
            let conn = l.conn;
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), conn.close(320, "silent".into()))
                        .await;
            });
        }
    }

    /// The connection this dispatcher publishes on, opening it if needed (the scheduler reads
    /// queue depths through it).
    pub async fn with_connection<T>(
        &self,
        f: impl AsyncFnOnce(&broker::Connection) -> broker::Result<T>,
    ) -> Result<T, Error> {
        self.publisher().await?;
        let conn = self.link.lock().await.as_ref().map(|l| l.conn.clone());
        // Dropped by a failed publish since: the next call reconnects.
        let conn = conn.ok_or(broker::Error::Unreachable(Duration::ZERO))?;
        let called = tokio::time::timeout(broker::CALL_TIMEOUT, f(&conn))
            .await
            .map_err(|_| broker::Error::Timeout(broker::CALL_TIMEOUT))?;
        Ok(called?)
    }

    /// Writes the outstanding dispatch marks and closes the connection, each within a bound:
    /// a broker that went silent never answers the close (a command line `agentq signal` once
    /// waited on it for good), and marks not written are the sweeper's to re-dispatch.
    pub async fn close(&self) {
        drop(self.marks.lock().expect("marks lock").take());
        let marker = self.marker.lock().expect("marker lock").take();
        if let Some(marker) = marker
            && tokio::time::timeout(CLOSE_MARKS_TIMEOUT, marker)
                .await
                .is_err()
        {
            tracing::warn!("dispatch marks not written on close; the sweeper re-dispatches them");
        }
        let link = tokio::time::timeout(CLOSE_TIMEOUT, self.link.lock()).await;
        if let Ok(mut link) = link
            && let Some(l) = link.take()
        {
            let _ =
                tokio::time::timeout(CLOSE_TIMEOUT, l.conn.close(200, "dispatcher closed".into()))
                    .await;
        }
    }
}

/// Sends every target through `send` concurrently (so confirms pipeline), each given
/// [`PUBLISH_TIMEOUT`]; returns the `(id, epoch)` of those that failed, with why.
pub async fn send_all<F, Fut>(targets: Vec<Target>, send: F) -> Vec<((Uuid, i64), String)>
where
    F: Fn(Target) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let sends = targets.into_iter().map(|target| {
        let key = (target.op_id.0, target.epoch);
        let sent = send(target);
        async move {
            match tokio::time::timeout(PUBLISH_TIMEOUT, sent).await {
                Ok(published) => published.map_err(|e| (key, e.to_string())),
                Err(_) => Err((
                    key,
                    format!("no confirm within {} s", PUBLISH_TIMEOUT.as_secs()),
                )),
            }
        }
    });
    futures_util::future::join_all(sends)
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect()
}

/// What [`Dispatcher::publish_locked`] did.
#[derive(Debug, Default)]
pub struct Published {
    /// Pointers confirmed and marked.
    pub sent: usize,
    /// Pointers that failed (left unmarked, for the sweeper).
    pub failed: usize,
    /// Why the first one failed.
    pub error: Option<String>,
}

impl Dispatcher {
    /// Publishes the pointers of rows locked for dispatch and commits the marks of those the
    /// broker confirmed together with the release of the locks (see [`db::dispatch::Locked`]).
    pub async fn publish_locked(
        &self,
        locked: db::dispatch::Locked,
    ) -> Result<Published, db::Error> {
        let targets: Vec<Target> = locked.rows.iter().cloned().map(Target::from).collect();
        let total = targets.len();
        let failed = if total == 0 {
            Vec::new()
        } else {
            send_all(targets, |t| async move { self.publish(&t).await }).await
        };
        let sent: Vec<(Uuid, i64)> = locked
            .rows
            .iter()
            .map(|r| (r.id, r.epoch))
            .filter(|k| !failed.iter().any(|(f, _)| f == k))
            .collect();
        db::within(locked.mark(&sent)).await?;
        Ok(Published {
            sent: sent.len(),
            failed: failed.len(),
            error: failed.into_iter().next().map(|(_, e)| e),
        })
    }
}

/// Drains confirmed dispatches and marks them in batches until every sender is gone.
async fn run_marker(pool: PgPool, mut rx: mpsc::Receiver<(Uuid, i64)>) {
    let mut batch = Vec::with_capacity(MARK_BATCH);
    while rx.recv_many(&mut batch, MARK_BATCH).await > 0 {
        let mut delay = Duration::from_millis(50);
        loop {
            match db::within(db::dispatch::mark_dispatched(&pool, &batch)).await {
                Ok(_) => break,
                Err(e) => {
                    // Unmarked rows are re-published by the sweeper: harmless, so give up
                    // after a few tries rather than hold the batch forever.
                    tracing::warn!(error = %e, n = batch.len(), "marking dispatches failed");
                    if delay > Duration::from_secs(2) {
                        break;
                    }
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
            }
        }
        batch.clear();
    }
}
