//! The `agentq` binary: parses the command line, installs logging and tracing, and hands the
//! command to [`commands::run`]. Exit codes: 0 success, 2 the input was refused (the message on stderr
//! says what and why), 1 anything else.

mod access;
mod batch;
mod bench;
mod bench_common;
mod bench_durable;
mod bench_http;
mod bench_jobs;
mod bench_model;
mod bench_scenarios;
mod cli;
mod commands;
mod dlq;
mod wiring;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
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
