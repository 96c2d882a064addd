//! agentq-core: the pieces every agentq process shares.
//!
//! - [`operation`]: domain types (ids, lanes, the operation view, the broker pointer);
//! - [`state`]: every stored state as an enum, the legal transitions, and the pure decisions
//!   of what a failure and a replayed journal entry lead to;
//! - [`config`]: environment variables and flags, with working local defaults;
//! - [`db`]: the only module that contains SQL;
//! - [`broker`]: the only module that imports `lapin`;
//! - [`schedule`]: schedules' ticks (cron in a time zone, or an interval) and what a
//!   scheduler does with the due ones, pure;
//! - [`dispatch`]: publishing pointers for committed operations and recording that they were sent;
//! - [`metrics`]: the Prometheus registry; every metric name declared once;
//! - [`health`]: the progress marks behind a worker's and a scheduler's `GET /healthz`;
//! - [`kinds`]: the catalog of a deployment's kinds and tools, and the check of an input;
//! - [`telemetry`]: logging and tracing set-up, OTLP export, W3C `traceparent` propagation
//!   (never logs or traces inputs, prompts, outputs or secrets);
//! - [`version`]: kind versions, checked and in natural order.
//!
//! Without its default feature `engine` it is only the shared types a kind's SDK needs
//! (`approval`, `kinds`, `operation`, `origins`, `services`, `state`, `version`): no database,
//! broker or HTTP client, no telemetry (`agentq-sdk` depends on it so).

pub mod approval;
#[cfg(feature = "engine")]
pub mod broker;
#[cfg(feature = "engine")]
pub mod config;
#[cfg(feature = "engine")]
pub mod db;
#[cfg(feature = "engine")]
pub mod dispatch;
#[cfg(feature = "engine")]
pub mod group_commit;
#[cfg(feature = "engine")]
pub mod health;
pub mod kinds;
#[cfg(feature = "engine")]
pub mod metrics;
pub mod operation;
pub mod origins;
#[cfg(feature = "engine")]
pub mod outbound;
#[cfg(feature = "engine")]
pub mod retry;
#[cfg(feature = "engine")]
pub mod schedule;
pub mod services;
pub mod state;
#[cfg(feature = "engine")]
pub mod telemetry;
pub mod version;
#[cfg(feature = "engine")]
pub mod webhook;

#[cfg(feature = "engine")]
pub use config::Config;
pub use operation::{Lane, OperationId, Status, TenantId};

/// The migrations of `migrations/`, embedded so every binary and test applies the same schema.
#[cfg(feature = "engine")]
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
