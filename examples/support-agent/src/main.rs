//! The support agent's binary: agentq's whole command line (`dev`, `worker`, `serve`,
//! `enqueue`, `dlq`, …) with agentq's built-in kinds and this crate's own.

use std::process::ExitCode;

fn main() -> ExitCode {
    let settings = match support_agent::Settings::from_env() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut registry = agentq::builtin::registry();
    support_agent::register(&mut registry, settings);
    agentq::main(registry)
}
