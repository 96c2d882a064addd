//! agentq-sdk: what a kind written in Rust sees of agentq, and nothing of the engine.
//!
//! - [`JobContext`]: the handle a kind's function receives: durable steps ([`JobContext::step`],
//!   [`JobContext::unsafe_step`] with a reconcile, [`JobContext::deferred_step`]), model and
//!   tool calls ([`JobContext::model`], [`JobContext::call`]), sleeps, signals, children, the
//!   agent loop ([`JobContext::agent`]) and the deployment's own state
//!   ([`JobContext::state`]);
//! - [`TypedTool`] and [`Tool`]: side effects with a replay policy and a reconcile;
//! - [`JobError`]: the three classes a kind raises (retryable, no effect, non-retryable), and
//!   the engine's stops, which a kind propagates with `?`;
//! - [`Registry`]: a deployment's kinds (by name and version), tools and own state, handed to
//!   every role by `agentq::main`;
//! - the model types ([`ModelRequest`], [`ModelResponse`], [`ModelClient`] for a provider of
//!   your own).
//!
//! The handle is a thin value over one interface, [`context::Backend`]: the worker
//! (`agentq-worker`) implements it over PostgreSQL, and its replay tester
//! (`agentq::testing`) runs the same runner over a journal in memory. This crate names no
//! database or broker client; `tests/invariants.rs` keeps it so. `agentq` re-exports all of it.

pub mod agent;
pub mod context;
pub mod error;
mod info;
pub mod model;
#[doc(hidden)]
pub mod provided;
pub mod registry;
pub mod tool;

/// For tools: `#[async_trait]` on an `impl TypedTool` or `impl Tool`.
pub use async_trait::async_trait;
pub use context::{ChildOutcome, JobContext, SignalOutcome};
pub use error::JobError;
pub use info::OperationInfo;
#[doc(hidden)]
pub use info::decode;
pub use model::{LocalModel, ModelClient, ModelRequest, ModelResponse};
pub use registry::{KindOptions, Registry};
pub use tool::{Reconciled, Replay, Tool, ToolContext, TypedTool};
