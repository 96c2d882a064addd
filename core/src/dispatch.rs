//! Dispatching: publishing the pointer of a committed operation and recording that it was sent.
//!
//! Two orders, one rule (an operation queued with `dispatched_at` NULL gets published by the
//! sweeper after a grace period):
//! - producers commit the row, publish, and then mark `dispatched_at` in batches (one UPDATE for
//!   many confirms, because a commit per publish would double the enqueue cost). A producer that
//!   dies between its commit and its publish leaves `dispatched_at` NULL: the sweeper publishes.
//! - the scheduler takes rows for dispatch (`dispatched_at` set in the very statement that makes
//!   them due), publishes, and clears `dispatched_at` for any publish that failed. Taking first
//!   means a burst whose confirms lag behind the grace period is never published twice.
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

impl From<db::Dispatch> for Target {
    fn from(d: db::Dispatch) -> Self {
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
}

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

    /// The publisher of the current link, connecting (and declaring the topology) if needed.
    async fn publisher(&self) -> Result<Publisher, Error> {
        let mut link = self.link.lock().await;
        if let Some(l) = link.as_ref()
            && l.publisher.is_usable()
        {
            return Ok(l.publisher.clone());
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
        *link = Some(Link {
            conn: std::sync::Arc::new(conn),
            publisher: publisher.clone(),
        });
        Ok(publisher)
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

    /// Publishes the pointer of an operation the caller already took for dispatch (its
    /// `dispatched_at` is set), so no mark is needed.
    pub async fn publish(&self, target: &Target) -> Result<(), Error> {
        let publisher = self.publisher().await?;
        let pointer = Pointer::new(target.op_id, &target.tenant, &target.kind);
        if let Err(e) = publisher
            .publish_traced(&pointer, target.lane, target.traceparent.as_deref())
            .await
        {
            self.drop_link_if_broken().await;
            return Err(e.into());
        }
        Ok(())
    }

    async fn drop_link_if_broken(&self) {
        let mut link = self.link.lock().await;
        if link.as_ref().is_some_and(|l| !l.publisher.is_usable()) {
            *link = None;
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

    /// Writes the outstanding dispatch marks and closes the connection.
    pub async fn close(&self) {
        drop(self.marks.lock().expect("marks lock").take());
        let marker = self.marker.lock().expect("marker lock").take();
        if let Some(marker) = marker {
            let _ = marker.await;
        }
        if let Some(l) = self.link.lock().await.take() {
            let _ = l.conn.close(200, "dispatcher closed".into()).await;
        }
    }
}

/// Drains confirmed dispatches and marks them in batches until every sender is gone.
async fn run_marker(pool: PgPool, mut rx: mpsc::Receiver<(Uuid, i64)>) {
    let mut batch = Vec::with_capacity(MARK_BATCH);
    while rx.recv_many(&mut batch, MARK_BATCH).await > 0 {
        let mut delay = Duration::from_millis(50);
        loop {
            match db::mark_dispatched(&pool, &batch).await {
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
