//! The `agentq` binary: parses the command line, installs logging and tracing, and hands the
//! command to [`commands::run`]. Exit codes: 0 success, 2 the input was refused (the message on stderr
//! says what and why), 1 anything else; 141 when the reader of its output went away
//! (`agentq steps OP | head`), as for a program ended by SIGPIPE.

mod access;
mod batch;
mod bench;
mod bench_common;
mod bench_durable;
mod bench_http;
mod bench_jobs;
mod bench_model;
mod bench_scenarios;
mod bulk;
mod cli;
mod commands;
mod dlq;
mod probe;
mod schedules;
mod versions;
mod wiring;

use std::process::ExitCode;

use clap::Parser;

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

fn main() -> ExitCode {
    quiet_on_broken_pipe();
    let cli = cli::Cli::parse();
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
    let outcome = runtime.block_on(commands::run(cli));
    drop(runtime);
    // Every command (serve, worker, scheduler, dev) ends here: export the last spans.
    telemetry.shutdown();
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(refusal) = e.downcast_ref::<wiring::Refused>() {
                eprintln!("error: {refusal}");
                ExitCode::from(2)
            } else {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    }
}
