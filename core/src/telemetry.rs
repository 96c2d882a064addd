//! Logging set-up. Logs carry ids, kinds, classes and counts; never job inputs, prompts, model
//! outputs, tokens or secrets.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber: human-readable by default, JSON with `AGENTQ_LOG_FORMAT=json`.
/// `RUST_LOG` filters (default `info`). Logs go to stderr so `--json` output on stdout stays clean.
pub fn init() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,lapin=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let json = std::env::var("AGENTQ_LOG_FORMAT").is_ok_and(|v| v == "json");
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
