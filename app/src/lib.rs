//! agentq-app: the application layer. Every flow a person or a service starts — enqueue,
//! signal, approve or reject, cancel, the DLQ actions, batch controls — is one function here
//! that takes the [`Caller`], decides what it may do, does it through `agentq-core` and
//! returns a typed outcome or an [`AppError`]. The CLI, the HTTP API and the console only
//! parse, call and render, so they cannot disagree.
//!
//! - [`access`]: tokens, webhook sources, stores (an admin's, audited), and the caller a
//!   token stands for;
//! - [`capacity`]: the caps of a tenant every way an operation is born goes through;
//! - [`console`]: the operator console's read views (overview, one operation, approvals,
//!   batches, the dead-letter inbox);
//! - [`decision`]: what a person decides on (a waiting operation's pending decision: the
//!   signal, its timeout, what the job needs, the agent's tool call), and an operation shown
//!   with it and, for an operator, with its input (audited);
//! - [`kinds`]: the deployment's kinds and tools, with the versions live workers run;
//! - [`names`]: names of batches and schedules, and the one resolver of an id or a name;
//! - [`operations`]: enqueue, find, list and search, signal, approve / reject, cancel;
//! - [`dlq`]: list, retry, resolve, discard one dead letter;
//! - [`page`]: keyset pages and their cursors;
//! - [`pauses`]: pause and resume live work (an operation, a kind, a tenant, a lane, a
//!   schedule, or the whole deployment);
//! - [`batches`]: start, list, pause, resume, cancel a batch, and its progress;
//! - [`schedules`]: add, list, pause, resume, delete schedules (cron or interval firings);
//! - [`tenants`]: the kinds each tenant may use (an admin's lists), and their check;
//! - [`time`]: times and durations as people type them;
//! - [`usage`]: model calls and tokens per tenant and kind;
//! - [`database`]: opening the database (pool, migrations, call deadline);
//! - [`debounce`]: debounce on a key (the CLI, the API and webhook sources), with its conflict
//!   policy for a key whose operation has started;
//! - [`versions`]: the versions report, and upgrading an operation to another version;
//! - [`webhooks`]: verifying a signed webhook delivery and enqueueing it;
//! - [`events`]: operations' event logs as the event streams read them;
//! - [`health`]: whether the database answers;
//! - [`why`]: what an operation is doing, or the one gate that holds it, with its evidence.

pub mod access;
pub mod batches;
pub mod budgets;
pub mod caller;
pub mod capacity;
pub mod console;
pub mod create;
pub mod database;
pub mod debounce;
pub mod decision;
pub mod dlq;
pub mod error;
pub mod events;
pub mod health;
pub mod kinds;
pub mod names;
pub mod operations;
pub mod page;
pub mod pauses;
pub mod rate_limits;
pub mod redact;
pub mod schedules;
pub mod services;
pub mod tenants;
pub mod time;
pub mod usage;
pub mod versions;
pub mod webhooks;
pub mod why;

use std::sync::Arc;

use agentq_core::dispatch::Dispatcher;
use agentq_producer::Producer;
use sqlx::PgPool;

pub use caller::{Caller, Role};
pub use error::{AppError, Result};

/// What the flows need: the database, the producer (enqueue, input checks) and a dispatcher
/// for what a flow re-queues. Cheap to clone.
#[derive(Clone)]
pub struct App {
    pub pool: PgPool,
    pub producer: Producer,
    pub dispatcher: Arc<Dispatcher>,
    pub settings: Settings,
    /// Tenants' counts of unfinished operations, cached for [`capacity::admit`].
    pub counts: Arc<capacity::Counts>,
    /// Tenants' lists of kinds, cached for [`tenants::check_kind`].
    pub policies: Arc<tenants::Policies>,
    /// API tokens as looked up, cached for [`access::authenticate`].
    pub tokens: Arc<access::Tokens>,
}

impl App {
    /// Publishes what `lock` locks (queued operations, a chunk at a time, each chunk marked
    /// once the broker confirms it) until it locks nothing more. Stops early when the broker
    /// refuses a chunk: the dispatch sweeper publishes the rest once it is back. Returns how
    /// many pointers were published.
    pub(crate) async fn publish_all<F, Fut>(&self, mut lock: F) -> Result<usize>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<agentq_core::db::dispatch::Locked>>,
    {
        let mut total = 0;
        loop {
            let locked = lock().await?;
            if locked.rows.is_empty() {
                break;
            }
            let published = self.dispatcher.publish_locked(locked).await?;
            total += published.sent;
            if published.failed > 0 {
                break;
            }
        }
        Ok(total)
    }
}

/// The deployment's choices the flows apply.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// A producer token may send the approval signals (`AGENTQ_PRODUCER_MAY_APPROVE`).
    pub producer_may_approve: bool,
    /// The caps of a tenant.
    pub limits: capacity::Limits,
    /// JSON keys shown as `[redacted]` wherever a payload, a step output or a pending
    /// decision's context is shown (`AGENTQ_CONSOLE_REDACT`; [`redact::redact`]).
    pub redact: Vec<String>,
    /// The share of a worker's lane slots a tenant keeps while another waits
    /// (`AGENTQ_TENANT_SHARE` as this process reads it), for [`why`]'s answers; `None`: unknown.
    pub tenant_share: Option<f64>,
}

impl App {
    pub fn new(
        pool: PgPool,
        producer: Producer,
        dispatcher: Arc<Dispatcher>,
        settings: Settings,
    ) -> Self {
        Self {
            pool,
            producer,
            dispatcher,
            settings,
            counts: Arc::default(),
            policies: Arc::default(),
            tokens: Arc::default(),
        }
    }
}
