//! The command line: every subcommand, its flags and their defaults (`agentq <cmd> --help`).

use agentq_core::Config;
use agentq_core::operation::Lane;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// agentq: durable, crash-safe execution of long-running AI-agent jobs on PostgreSQL + RabbitMQ.
#[derive(Parser)]
#[command(name = "agentq", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub config: Config,

    #[command(subcommand)]
    pub command: Command,
}

/// What a subcommand's help says of the global options it hides.
const GLOBALS_POINTER: &str = "Global options (database, broker, namespace, models, limits, …) \
                               apply here too: `agentq --help` lists them.";

/// The command line, with each subcommand's help showing its own options and a pointer to
/// `agentq --help` for the global ones (the settings of every process), which a subcommand
/// still accepts.
pub fn command() -> clap::Command {
    let root = Cli::command();
    let globals: Vec<clap::Arg> = root
        .get_arguments()
        .filter(|a| a.is_global_set())
        .cloned()
        .collect();
    hide_globals(root, &globals)
}

/// Gives every subcommand below `cmd` a hidden copy of each of `globals` (clap propagates a
/// global option only where the subcommand has none of that name: the copy, which parses the
/// same, is what the subcommand keeps).
fn hide_globals(cmd: clap::Command, globals: &[clap::Arg]) -> clap::Command {
    cmd.mut_subcommands(|mut sub| {
        for g in globals {
            if sub.get_arguments().all(|a| a.get_id() != g.get_id()) {
                sub = sub.arg(g.clone().hide(true));
            }
        }
        hide_globals(sub.after_help(GLOBALS_POINTER), globals)
    })
}

/// Parses this process's arguments with [`command`] (exits with clap's message and code 2 on
/// a bad one, 0 after `--help`).
pub fn parse() -> Cli {
    let matches = command().get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

#[derive(Subcommand)]
pub enum Command {
    /// Create the database if missing and apply migrations (safe to repeat, safe to race).
    Migrate,
    /// Consume both lanes and run operations.
    Worker {
        /// Operations run at once on each lane (overrides AGENTQ_CONCURRENCY_*).
        #[arg(long)]
        concurrency: Option<u16>,
    },
    /// Fire what is due: schedules, timers (sleeps, waits, timeouts), deadlines, expired leases, dispatch sweeps, retention, batch auto-pause.
    Scheduler,
    /// The quickstart: migrate, then run a worker, a scheduler and the HTTP API in this one process.
    Dev,
    /// Serve the HTTP API on --listen (AGENTQ_LISTEN).
    Serve,
    /// Enqueue an operation.
    Enqueue(EnqueueArgs),
    /// Show an operation, and what it waits for (an agent's pending tool call, or what the job
    /// needs from whoever sends the signal).
    Status {
        /// Operation id.
        op: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Show its input too (recorded in the audit trail as reveal_payloads).
        #[arg(long)]
        show_input: bool,
    },
    /// Why an operation is not running (or what it is doing): the one gate that holds it now,
    /// with its evidence.
    Why {
        /// Operation id.
        op: String,
        /// Print one JSON object (`headline`, `evidence`, and `detail` with the typed answer).
        #[arg(long)]
        json: bool,
    },
    /// List and search operations, newest first, one keyset page at a time (no inputs or results).
    List(ListArgs),
    /// Show an operation's journal, one step per line.
    Steps {
        /// Operation id.
        op: String,
        /// Print JSON Lines, one object per step.
        #[arg(long)]
        json: bool,
    },
    /// Send a signal to an operation (delivered to its wait, or kept for a later one).
    Signal {
        /// Operation id.
        op: String,
        /// Signal name.
        name: String,
        /// Payload (JSON).
        #[arg(long, default_value = "null")]
        payload: String,
        /// Who sends it (default: the OS user).
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Approve an operation waiting for approval (signal `approval`, `{"approved": true}`).
    Approve {
        op: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Reject an operation waiting for approval (signal `approval`, `{"approved": false}`).
    Reject {
        op: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Cancel an operation: at once unless running; a running one stops at its next step.
    Cancel {
        op: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Pause live work: one operation, or every operation of a kind, a tenant, a lane or a
    /// schedule, or everything (--all: drain mode). Paused operations are not claimed; running
    /// ones stop at their next step boundary, journal and attempt kept. Audited; --dry-run counts.
    Pause(crate::pauses::PauseArgs),
    /// Lift a pause (by what it names, or --pause ID) and re-dispatch what it held.
    Resume(crate::pauses::ResumeArgs),
    /// Token budgets: set or raise one on an operation or a batch, let a refused call through
    /// once, show the budgets over an operation.
    #[command(subcommand)]
    Budget(crate::budgets::BudgetCommand),
    /// Rate limits: tokens and requests of model calls per window, for a model or provider, a
    /// tenant, or a key operations name (--rate-key); shared by every worker.
    #[command(subcommand)]
    Limits(crate::limits::LimitsCommand),
    /// Services: where kinds written in any language run (the step protocol,
    /// docs/protocol.md). Register one by its URL; agentq serves the kinds its manifest lists.
    #[command(subcommand)]
    Services(crate::services::ServicesCommand),
    /// The pauses in force, oldest first, one page at a time: what each holds, who paused it,
    /// when and why.
    Pauses {
        #[arg(long)]
        tenant: Option<String>,
        /// Page size.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Continue after this cursor (printed after a full page).
        #[arg(long)]
        after: Option<String>,
        /// JSON Lines, one pause per line.
        #[arg(long)]
        json: bool,
    },
    /// API tokens: create (shown once, stored hashed), list, revoke.
    #[command(subcommand)]
    Tokens(crate::access::TokensCommand),
    /// Webhook sources (Standard Webhooks): add, rotate secrets, list.
    #[command(subcommand)]
    Webhooks(crate::access::WebhooksCommand),
    /// Stores: the directories and tables a tenant's doc_migration operations may read or write.
    #[command(subcommand)]
    Stores(crate::access::StoresCommand),
    /// Tenants: the kinds each may create operations of (an admin's list; `*` for the default).
    #[command(subcommand)]
    Tenants(crate::tenants::TenantsCommand),
    /// Model tokens used, per tenant and kind.
    Usage {
        #[arg(long)]
        tenant: Option<String>,
        /// Only usage since this time: RFC 3339, or a duration ago (30m, 2h, 7d).
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Drain the dead-letter queue: list, show, stats, retry, resolve, discard.
    #[command(subcommand)]
    Dlq(crate::dlq::DlqCommand),
    /// The kinds this binary runs (versions, input schema, webhook-only) and the tools an agent may name.
    Kinds {
        /// One kind: print its whole input schema.
        kind: Option<String>,
        /// Print one JSON object (`{"kinds": […], "tools": […]}`, or the one kind).
        #[arg(long)]
        json: bool,
    },
    /// Replay recorded journals against this binary's code (nothing is called or written): would
    /// a deploy of it replay the operations that wait today?
    Replay(crate::replay::ReplayArgs),
    /// Versions of kinds: which ones live workers run, the unfinished operations on each, and
    /// `upgrade` to move operations to another version.
    Versions(crate::versions::VersionsArgs),
    /// Batch campaigns: one operation per document, with canary, pause, resume, cancel, report.
    #[command(subcommand)]
    Batch(crate::batch::BatchCommand),
    /// Schedules: a kind and input fired as an operation on a cron expression (with a time
    /// zone) or an interval: add, list, pause, resume, delete.
    #[command(subcommand)]
    Schedules(crate::schedules::SchedulesCommand),
    /// Benchmarks (e2e, batch, steps, durable-steps, inflight, timers, waiting, http) in a throwaway database and namespace.
    Bench(BenchArgs),
    /// Health check for containers without curl: GET URL; exit 0 on a 2xx answer, 1 otherwise.
    Probe {
        /// e.g. http://127.0.0.1:9464/healthz (AGENTQ_METRICS_ADDR of any role) or
        /// http://127.0.0.1:8080/healthz (the API of agentq serve).
        url: String,
        /// Seconds to wait for the answer.
        #[arg(long, default_value_t = 5)]
        timeout_secs: u64,
    },
}

#[derive(clap::Args)]
pub struct EnqueueArgs {
    /// Tenant the operation belongs to.
    #[arg(long)]
    pub tenant: String,
    /// Job kind (e.g. echo).
    #[arg(long)]
    pub kind: String,
    /// Input as JSON (e.g. '{"text":"hi"}').
    #[arg(long)]
    pub input: String,
    /// Idempotency key: same tenant + key + input returns the same operation.
    #[arg(long)]
    pub key: Option<String>,
    /// Operations with the same ordering key run one at a time, in creation order.
    #[arg(long)]
    pub ordering_key: Option<String>,
    /// With --concurrency-limit: the tenant's operations sharing this key run at most that many at once.
    #[arg(long)]
    pub concurrency_key: Option<String>,
    /// How many operations of --concurrency-key may run at once (1-1000).
    #[arg(long)]
    pub concurrency_limit: Option<i32>,
    /// Its model calls count against the tenant's rate limits of this key (`agentq limits set
    /// --scope key --name KEY`).
    #[arg(long)]
    pub rate_key: Option<String>,
    /// interactive or batch: interactive work never waits behind batch work.
    #[arg(long, default_value = "interactive")]
    pub lane: Lane,
    /// Attempts before the operation goes to the DLQ (default AGENTQ_MAX_ATTEMPTS).
    #[arg(long)]
    pub max_attempts: Option<i32>,
    /// Stop it (dead, deadline_exceeded) if not finished by then: RFC 3339 or a duration from now (90s, 30m, 2h, 3d).
    #[arg(long)]
    pub deadline: Option<String>,
    /// A token budget: model calls that would pass it park the operation (waiting for budget).
    #[command(flatten)]
    pub budget: crate::budgets::BudgetFlags,
    /// Debounce on this key (1-256 characters, with --debounce): while the tenant's operation
    /// of the key is pending (queued, not started), this enqueue replaces its input and pushes
    /// its start back.
    #[arg(long, value_name = "KEY")]
    pub debounce_key: Option<String>,
    #[command(flatten)]
    pub debounce: crate::debounce::DebounceFlags,
    /// Print one JSON object: {"op_id", "created", "status"} (and "debounce" when debounced).
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct ListArgs {
    /// Only this tenant (default: all).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only these statuses (repeatable, or comma-separated): queued, running, sleeping,
    /// waiting, succeeded, dead, cancelled, discarded.
    #[arg(long)]
    pub status: Vec<String>,
    #[arg(long)]
    pub kind: Option<String>,
    /// Only the operations of this batch.
    #[arg(long)]
    pub batch: Option<String>,
    /// Only the operations this schedule fired.
    #[arg(long)]
    pub schedule: Option<String>,
    /// Only the children this operation spawned.
    #[arg(long)]
    pub parent: Option<String>,
    /// Created at or after: RFC 3339, or a duration ago (30m, 2h, 7d).
    #[arg(long)]
    pub created_after: Option<String>,
    /// Created before: RFC 3339, or a duration ago.
    #[arg(long)]
    pub created_before: Option<String>,
    /// Finished at or after: RFC 3339, or a duration ago.
    #[arg(long)]
    pub finished_after: Option<String>,
    /// Finished before: RFC 3339, or a duration ago.
    #[arg(long)]
    pub finished_before: Option<String>,
    /// Page size (1-1000).
    #[arg(long, default_value_t = 50)]
    pub limit: i64,
    /// Continue after this cursor (the `cursor` of the last item of the previous page).
    #[arg(long)]
    pub after: Option<String>,
    /// Print JSON Lines, one operation per line, each with its `cursor`.
    #[arg(long)]
    pub json: bool,
}

/// What `agentq bench` measures.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum Scenario {
    /// One-by-one enqueue from concurrent producers, `echo`, end to end (enqueue → succeeded).
    #[value(alias = "throughput")]
    E2e,
    /// `enqueue_many` in chunks of 1,000, then drain: jobs/s from first claim to last finish.
    Batch,
    /// A 10-step `script` of safe `work_ms: 0` steps against a 1-step one: journal cost per step.
    Steps,
    /// Operations of `--steps` steps, each committed before the next: durable steps/s, commits
    /// per step and step latency (no-op steps, then model steps of `--model-latency-ms`), and
    /// the crash cost: model calls an agent workload sends again per SIGKILL.
    DurableSteps,
    /// Long model calls (`--model-latency-ms`, default 2000): operations in flight and memory.
    Inflight,
    /// The timer loop: wake lag with many sleepers and a due rate, idle CPU, query plans.
    Timers,
    /// Worker memory with many operations waiting for approval.
    Waiting,
    /// `POST /v1/operations` under load from an in-process client: requests/s, latency, and
    /// that every 202 became exactly one operation.
    Http,
    /// Operations of --steps safe steps in Rust (`script`) and in the Python example service
    /// (`ten_steps`, over the step protocol): steps/s, time per step, and the bytes sent to the
    /// service per step (python3 and agentq's source tree's sdk/python).
    Remote,
}

#[derive(clap::Args, Clone)]
pub struct BenchArgs {
    /// What to measure.
    #[arg(long, value_enum, default_value = "e2e")]
    pub scenario: Scenario,
    /// timers: sleeping operations not due during the run.
    #[arg(long, default_value_t = 1_000_000)]
    pub sleepers: i64,
    /// timers: operations coming due per second.
    #[arg(long, default_value_t = 10_000)]
    pub due_per_sec: i64,
    /// timers: seconds during which operations come due.
    #[arg(long, default_value_t = 10)]
    pub due_secs: i64,
    /// timers: parents parked on a join as well (another tenant's), each over --join-children
    /// unfinished children: the wake sweep's cost with them, and its read timed two ways.
    #[arg(long, default_value_t = 0)]
    pub join_parents: i64,
    /// timers: unfinished children each of --join-parents joins.
    #[arg(long, default_value_t = 15_000)]
    pub join_children: i64,
    /// waiting: operations left waiting for approval.
    #[arg(long, default_value_t = 50_000)]
    pub waiting: usize,
    /// Operations to run.
    #[arg(long, default_value_t = 2000)]
    pub jobs: usize,
    /// durable-steps, remote: steps per operation.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// durable-steps: worker SIGKILLs in the crash-cost phase (0 skips it).
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// e2e, batch, inflight: answer model calls from an in-process fake provider after this
    /// many ms, instead of the built-in model (inflight: default 2000).
    #[arg(long)]
    pub model_latency_ms: Option<u64>,
    /// With --model-latency-ms: model calls a worker has in flight at once, and per tenant
    /// (default: the deployment's AGENTQ_MODEL_CONCURRENCY, auto unless set).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub model_calls: Option<u16>,
    /// With --model-latency-ms: the fake provider answers this many calls at once and refuses
    /// a call past them at once with a 503, as a provider's concurrency limit does.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub model_capacity: Option<u64>,
    /// e2e, batch: every operation names rate key `bench`, under a limit of this many tokens
    /// a minute (a limit nobody is near measures what checking a limit costs).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub rate_limit_tokens: Option<i64>,
    /// Operations a worker runs at once (per lane).
    #[arg(long, default_value_t = 64)]
    pub concurrency: u16,
    /// Lane to enqueue on.
    #[arg(long, default_value = "interactive")]
    pub lane: Lane,
    /// Concurrent one-by-one enqueuers (like webhook requests arriving at once).
    #[arg(long, default_value_t = 32)]
    pub producers: usize,
    /// e2e, batch, steps, inflight: worker processes (children of the bench; default 1).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Keep the benchmark database and namespace afterwards (for inspection).
    #[arg(long)]
    pub keep: bool,
    /// http: concurrent keep-alive connections, each sending requests back to back.
    #[arg(long, default_value_t = 64)]
    pub connections: usize,
    /// http: seconds of measured load (after a 1 s warm-up).
    #[arg(long, default_value_t = 20)]
    pub duration_secs: u64,
    /// Give up if the run has not finished after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subcommand's own flag with the id of a global setting shadows it, and panics when it
    /// is read if their types differ (a bench flag once named `model_concurrency`, a `u16`,
    /// where the setting is a `usize`). The ones kept are checked here by name:
    /// `--max-attempts` of `enqueue` and `schedules add` is the operation's own value of the
    /// global default, an `i32` both.
    #[test]
    fn no_subcommand_flag_shares_an_id_with_a_global_setting() {
        const OVERRIDES: [&str; 2] = ["enqueue max_attempts", "schedules add max_attempts"];
        let root = Cli::command();
        let globals: Vec<String> = root
            .get_arguments()
            .filter(|a| a.is_global_set())
            .map(|a| a.get_id().to_string())
            .collect();
        let mut clashes = Vec::new();
        let mut stack: Vec<(String, &clap::Command)> = root
            .get_subcommands()
            .map(|c| (c.get_name().to_string(), c))
            .collect();
        while let Some((path, cmd)) = stack.pop() {
            for a in cmd.get_arguments() {
                let clash = format!("{path} {}", a.get_id());
                if globals.iter().any(|g| g == a.get_id().as_str())
                    && !OVERRIDES.contains(&clash.as_str())
                {
                    clashes.push(clash);
                }
            }
            stack.extend(
                cmd.get_subcommands()
                    .map(|c| (format!("{path} {}", c.get_name()), c)),
            );
        }
        assert!(clashes.is_empty(), "{clashes:?}");
    }

    #[test]
    fn the_bench_flags_parse() {
        let matches = command()
            .try_get_matches_from([
                "agentq",
                "bench",
                "--scenario",
                "inflight",
                "--model-latency-ms",
                "1000",
                "--model-calls",
                "8",
                "--model-capacity",
                "300",
            ])
            .unwrap();
        let cli = Cli::from_arg_matches(&matches).unwrap();
        let Command::Bench(args) = cli.command else {
            panic!("not bench")
        };
        assert_eq!(
            (args.model_latency_ms, args.model_calls, args.model_capacity),
            (Some(1000), Some(8), Some(300))
        );
    }
}
