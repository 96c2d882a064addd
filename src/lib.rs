//! agentq as a library: the whole `agentq` command line over a registry of your own. A
//! deployment's binary builds its [`Registry`] (agentq's built-in kinds and tools, its own, or
//! only its own) and hands it to [`main`]; every subcommand (`dev`, `worker`, `scheduler`,
//! `serve`, `enqueue`, `dlq`, `batch`, `schedules`, `versions`, `kinds`, `replay`, `bench`, …)
//! then knows those kinds: the worker runs them, and enqueues, webhook sources, schedules, the
//! API and the console check inputs against them. agentq's own binary is this entry point with
//! the built-in registry:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     agentq::main(agentq::builtin::registry())
//! }
//! ```
//!
//! A kind of your own, next to the built-in ones:
//!
//! ```no_run
//! use agentq::{JobContext, JobError};
//!
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Input {
//!     name: String,
//! }
//!
//! async fn greet(ctx: JobContext, input: Input) -> Result<String, JobError> {
//!     ctx.step("greet", || async move { Ok(format!("hello, {}", input.name)) })
//!         .await
//! }
//!
//! fn main() -> std::process::ExitCode {
//!     let mut registry = agentq::builtin::registry();
//!     registry.register("greet", greet);
//!     agentq::main(registry)
//! }
//! ```
//!
//! Tested at every crash point without a database or a broker, by the replay tester (the
//! worker's own step runner over a journal in memory):
//!
//! ```
//! use agentq::testing::{ModelScript, Tester};
//! use agentq::{JobContext, JobError, ModelResponse, Registry};
//!
//! async fn summarize(ctx: JobContext, doc: String) -> Result<usize, JobError> {
//!     let summary = ctx.model("summarize", doc).await?;
//!     let words = || async move { Ok(summary.content.split_whitespace().count()) };
//!     ctx.step("count", words).await
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let mut registry = Registry::new();
//! registry.register("summarize", summarize);
//! let report = Tester::new(&registry, "summarize", serde_json::json!("a long text"))
//!     .model(ModelScript::replies([ModelResponse::text("short text")]))
//!     .run()
//!     .await;
//! report.assert_ok();
//! assert_eq!(report.output(), Some(&serde_json::json!(2)));
//! # });
//! ```
//!
//! The SDK a kind is written with is re-exported here ([`JobContext`], [`Tool`],
//! [`TypedTool`], [`Registry`], [`JobError`], [`testing`]), so a deployment's crate depends on
//! `agentq` alone. `docs/your-first-kind.md` walks through it.
//!
//! Exit codes of [`main`]: 0 success, 2 the input was refused (the message on stderr says what
//! and why), 1 anything else; 141 when the reader of its output went away
//! (`agentq steps OP | head`), as for a program ended by SIGPIPE.

mod access;
mod batch;
#[cfg(feature = "bench")]
mod bench;
mod budgets;
mod bulk;
mod cli;
mod commands;
mod debounce;
mod dlq;
mod interrupt;
mod kinds;
mod limits;
mod pauses;
mod probe;
mod replay;
mod schedules;
mod services;
mod tenants;
mod versions;
mod why;
mod wiring;

use std::process::ExitCode;

pub use agentq_kinds as builtin;
pub use agentq_worker::agent::{AgentOutcome, AgentSpec};
pub use agentq_worker::context::check_park;
pub use agentq_worker::{
    ChildOutcome, JobContext, JobError, KindOptions, LocalModel, ModelClient, ModelRequest,
    ModelResponse, OperationInfo, Reconciled, Registry, Replay, SignalOutcome, Tool, ToolContext,
    TypedTool, agent, model, testing, tool,
};
/// For tools: `#[agentq::async_trait]` on an `impl TypedTool` or `impl Tool`.
pub use async_trait::async_trait;
/// The sqlx agentq is built with: a pool of your own on it (given to your kinds with
/// [`Registry::provide`]) needs no second version of sqlx to keep in step.
pub use sqlx;

/// Output piped into a reader that stopped (`agentq dlq list | head`) ends the process quietly
/// with 141, as SIGPIPE would, instead of a panic and a backtrace (Rust ignores SIGPIPE, so
/// `println!` panics on a closed pipe). Every other panic goes to the default hook.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to std") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// Runs the `agentq` command line (the arguments of this process) with `registry`'s kinds
/// and tools known to every subcommand, and returns the exit code. Call it from your binary's
/// `main`.
pub fn main(registry: Registry) -> ExitCode {
    quiet_on_broken_pipe();
    let cli = cli::parse();
    // A container's health check, run every few seconds: no logging, tracing or runtime.
    if let cli::Command::Probe { url, timeout_secs } = &cli.command {
        return match probe::run(url, std::time::Duration::from_secs(*timeout_secs)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let telemetry = agentq_core::telemetry::init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(commands::run(cli, registry));
    drop(runtime);
    // Every command (serve, worker, scheduler, dev) ends here: export the last spans.
    telemetry.shutdown();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(refusal) = e.downcast_ref::<wiring::Refused>() {
                eprintln!("error: {refusal}");
                ExitCode::from(2)
            } else if let Some(stopped) = e.downcast_ref::<interrupt::Interrupted>() {
                eprintln!("stopped: {stopped}");
                ExitCode::from(interrupt::EXIT_CODE)
            } else {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    }
}
