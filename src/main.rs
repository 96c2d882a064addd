//! The `agentq` binary: the command line over agentq's built-in kinds and tools. A deployment
//! with kinds of its own writes the same three lines with its own registry (see the library's
//! docs, and docs/your-first-kind.md).

fn main() -> std::process::ExitCode {
    agentq::main(agentq::builtin::registry())
}
