//! The broker layer: the only place in agentq that imports `lapin`.
//!
//! RabbitMQ carries pointers, never state: losing a message costs latency (the scheduler
//! re-dispatches from Postgres), never an operation. Every exchange and queue name is built
//! from the namespace by [`Names`], so deployments and tests can share one broker.

mod consumer;
mod publisher;
mod topology;

/// A broker connection, for code outside this module that holds one (`dispatch`).
pub use lapin::Connection;

pub use consumer::{Consumer, Delivery};
pub use publisher::Publisher;
pub use topology::{Names, declare_topology, delete_topology, purge_lane, queue_depth};

use lapin::ConnectionProperties;

/// Deliveries a queue allows before the broker dead-letters a message (set explicitly: 3.10
/// has no default).
pub const DELIVERY_LIMIT: i32 = 20;

/// Errors of the broker layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The client library reported a connection, channel or protocol error.
    #[error("rabbitmq: {0}")]
    Amqp(#[from] lapin::Error),
    /// The broker did not confirm a publish (nack, or unroutable with `mandatory`).
    #[error("rabbitmq refused the message: {0}")]
    NotConfirmed(String),
    /// A broker call took longer than its deadline.
    #[error("rabbitmq did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The namespace is not a valid name prefix.
    #[error("{0}")]
    Namespace(String),
    /// The URL could not be parsed.
    #[error("invalid AMQP_URL: {0}")]
    Url(String),
    /// A recent connection attempt failed; the next one waits this long (backoff).
    #[error("rabbitmq is unreachable; the next connection attempt is in {0:?}")]
    Unreachable(std::time::Duration),
}

/// Result alias of the broker layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Heartbeat interval asked of the broker when the URL sets none (`?heartbeat=N` overrides):
/// a connection whose peer vanished without a reset (a partition, a dead load balancer) is
/// dropped after two silent intervals, 20 s, instead of the server default's 120 s, and the
/// process reconnects.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// The nodes `url` lists: one AMQP URL, or several separated by commas (the nodes of a
/// cluster).
pub fn nodes(url: &str) -> Vec<&str> {
    url.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// The node this process connects to first (an index into [`nodes`]): the one it last
/// connected to, so a process stays on a node while it lives; processes start at different
/// nodes (by process id) to spread over a cluster.
static PREFERRED_NODE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(usize::MAX);

/// The size new quorum queues are declared with (0: the broker's default). See
/// [`set_quorum_size`].
static QUORUM_SIZE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Sets the replica count of the lanes' quorum queues when this process declares them
/// (`AGENTQ_QUORUM_SIZE`; 3 by default when `AMQP_URL` lists several nodes, otherwise the
/// broker's default). Only a queue's first declaration uses it: an existing queue keeps its
/// members (grow or shrink them with `rabbitmq-queues grow` / `shrink`).
pub fn set_quorum_size(size: Option<u32>) {
    QUORUM_SIZE.store(size.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn quorum_size() -> Option<u32> {
    match QUORUM_SIZE.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Opens a connection to the first node of `url` that accepts one, starting from the node this
/// process last used ([`nodes`]): when a node dies, the next connection goes to another. Named
/// after the process role so it is recognisable in the management UI.
pub async fn connect(url: &str, role: &str) -> Result<Connection> {
    use std::sync::atomic::Ordering::Relaxed;
    let nodes = nodes(url);
    if nodes.is_empty() {
        return Err(Error::Url("AMQP_URL names no node".into()));
    }
    let n = nodes.len();
    let mut start = PREFERRED_NODE.load(Relaxed);
    if start == usize::MAX {
        start = std::process::id() as usize;
    }
    let mut last = None;
    for i in 0..n {
        let at = (start + i) % n;
        match connect_node(nodes[at], role).await {
            Ok(conn) => {
                PREFERRED_NODE.store(at, Relaxed);
                return Ok(conn);
            }
            Err(e) => {
                if n > 1 {
                    // The node's address only: what precedes `@` holds the credentials.
                    let node = nodes[at].rsplit('@').next().unwrap_or_default();
                    tracing::warn!(
                        node, error = %e,
                        "rabbitmq node unreachable; trying the next one"
                    );
                }
                last = Some(e);
            }
        }
    }
    // Next time, begin with the node after the one tried first.
    PREFERRED_NODE.store((start + 1) % n, Relaxed);
    Err(last.expect("at least one node was tried"))
}

async fn connect_node(url: &str, role: &str) -> Result<Connection> {
    let mut uri: lapin::uri::AMQPUri = url.parse().map_err(Error::Url)?;
    if uri.query.heartbeat.is_none() {
        uri.query.heartbeat = Some(DEFAULT_HEARTBEAT_SECS);
    }
    // Heartbeats only start once the connection is open: a handshake with a server that went
    // silent is given up after as long as heartbeats would take to give up an open connection.
    let heartbeat = uri.query.heartbeat.unwrap_or(DEFAULT_HEARTBEAT_SECS).max(1);
    let deadline = (std::time::Duration::from_secs(2 * u64::from(heartbeat)))
        .clamp(std::time::Duration::from_secs(5), CALL_TIMEOUT);
    let props =
        ConnectionProperties::default().with_connection_name(format!("agentq-{role}").into());
    let conn = tokio::time::timeout(deadline, Connection::connect_uri(uri, props))
        .await
        .map_err(|_| Error::Timeout(deadline))??;
    Ok(conn)
}

/// Deadline of one broker round trip (declare, publish confirm). lapin calls can hang when the
/// server goes away mid-call, so every hot-path await is bounded.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A namespace is 1–64 characters of `[a-z0-9_-]` and may contain dots between parts.
pub fn validate_namespace(ns: &str) -> Result<(), String> {
    let ok = !ns.is_empty()
        && ns.len() <= 64
        && !ns.starts_with('.')
        && !ns.ends_with('.')
        && ns
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "AGENTQ_NAMESPACE {ns:?} is invalid: use 1-64 characters of a-z, 0-9, '_', '-', '.'"
        ))
    }
}
