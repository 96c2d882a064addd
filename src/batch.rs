//! `agentq batch …`: campaigns of one `doc_migration` operation per document, with the
//! controls a large migration needs: a canary, pause / resume / cancel, automatic pause when
//! too many recent operations fail (the scheduler's job), progress, and a per-document report.
//! The flows are `agentq_app::batches` (the console's controls call the same); this module
//! parses flags and prints. Wherever a batch is named, its id or its name is taken
//! (`agentq_app::names`); `--tenant` picks the tenant of a name several tenants use.
//!
//! Re-running `batch start` with the same arguments finds the same batch (its id is derived
//! from tenant, kind, source, target and instructions) and enqueues only what is missing, so a
//! crash or Ctrl-C midway loses nothing and duplicates nothing.

use crate::wiring::Deployment;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use agentq_app::{self as app, batches::Progress};
use agentq_core::state::BatchStatus;
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;

use crate::interrupt::{Interrupt, Interrupted};
use crate::wiring::{cli_app, done, flag_error_app, refuse};

/// A batch as a command names it: its id or its name.
#[derive(Args)]
pub struct BatchRef {
    /// The batch's id, or its name.
    pub batch: String,
    /// The tenant whose batch of that name is meant (when several tenants use the name).
    #[arg(long)]
    pub tenant: Option<String>,
}

#[derive(Subcommand)]
pub enum BatchCommand {
    /// Create a batch (or find it again) and enqueue one operation per document it is missing.
    Start(StartArgs),
    /// List batches, newest first, with their progress (one keyset page at a time).
    List {
        #[arg(long)]
        tenant: Option<String>,
        /// canary, running, paused, cancelled or completed.
        #[arg(long)]
        status: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Continue after this cursor (the `cursor` of the last item of the previous page).
        #[arg(long)]
        after: Option<String>,
        /// JSON Lines, one batch per line.
        #[arg(long)]
        json: bool,
    },
    /// Totals by status, times, rate, ETA, token usage and the top failure reasons.
    Status {
        #[command(flatten)]
        batch: BatchRef,
        /// Redraw every 2 s until nothing is left to run (or the batch is paused).
        #[arg(long)]
        watch: bool,
        #[arg(long)]
        json: bool,
    },
    /// Stop starting the batch's operations (running ones finish their current run).
    Pause {
        #[command(flatten)]
        batch: BatchRef,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// Resume a paused batch, or run the rest of a canary batch.
    Resume {
        #[command(flatten)]
        batch: BatchRef,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Cancel every unfinished operation of the batch.
    Cancel {
        #[command(flatten)]
        batch: BatchRef,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// One line per document: its operation, status, error and written hash (CSV or JSON Lines).
    Report {
        #[command(flatten)]
        batch: BatchRef,
        /// csv or jsonl.
        #[arg(long, default_value = "jsonl")]
        format: String,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct StartArgs {
    #[arg(long)]
    pub tenant: String,
    #[arg(long, default_value = "doc_migration")]
    pub kind: String,
    /// The store documents are read from (`agentq stores add … --access read`): every file
    /// under its directory, or every row of its table, is a document.
    #[arg(long)]
    pub source: String,
    /// The store documents are written to (`--access write`).
    #[arg(long)]
    pub target: String,
    /// A file with the instructions for the model.
    #[arg(long)]
    pub instructions: PathBuf,
    /// Run only the first N documents, then wait for `agentq batch resume`.
    #[arg(long)]
    pub canary: Option<u32>,
    /// Auto-pause window: the newest M outcomes.
    #[arg(long, default_value_t = 20)]
    pub pause_window: i32,
    /// Auto-pause when at least this share of the window failed.
    #[arg(long, default_value_t = 0.5)]
    pub pause_ratio: f32,
    /// Strings every output must contain (validation; repeatable).
    #[arg(long = "require")]
    pub required: Vec<String>,
    /// Characters per model call (large documents are split).
    #[arg(long)]
    pub chunk_chars: Option<u32>,
    /// A name for the batch, unique in its tenant (not a UUID): every `agentq batch` command
    /// takes it instead of the id.
    #[arg(long)]
    pub name: Option<String>,
    /// A token budget on the batch's operations together: when it cannot cover a model call,
    /// the batch pauses (raise it with `agentq budget set --batch`, then `batch resume`).
    #[command(flatten)]
    pub budget: crate::budgets::BudgetFlags,
    /// Operations per INSERT (tuning; smaller chunks show progress sooner).
    #[arg(long, default_value_t = app::batches::CHUNK, hide = true)]
    pub chunk: usize,
    #[arg(long = "as")]
    pub actor: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// The CLI's progress bar for long batch work (hidden when stderr is not a terminal); it asks
/// the work to stop after Ctrl-C.
struct Bar(ProgressBar, Interrupt);

impl Bar {
    fn new(msg: &str) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if std::io::stderr().is_terminal() {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(msg.to_string());
        Self(bar, Interrupt::install())
    }
}

impl Progress for Bar {
    fn start(&self, len: u64) {
        self.0.set_length(len);
    }

    fn inc(&self, n: u64) {
        self.0.inc(n);
    }

    fn refused(&self, item: &str, why: &str) {
        self.0.suspend(|| eprintln!("{item}: refused: {why}"));
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }

    fn stop_requested(&self) -> bool {
        self.1.requested()
    }
}

/// The id of the batch `r` names (an id, or a name in the tenants the caller sees).
async fn resolve(app: &app::App, caller: &app::Caller, r: &BatchRef) -> app::Result<uuid::Uuid> {
    app::names::resolve_batch(app, caller, &r.batch, r.tenant.as_deref()).await
}

pub async fn run(config: Deployment, cmd: BatchCommand) -> anyhow::Result<()> {
    match cmd {
        BatchCommand::Start(args) => start(config, args).await,
        BatchCommand::List {
            tenant,
            status,
            limit,
            after,
            json,
        } => {
            let query = app::batches::ListQuery { tenant, status };
            let (app, caller) = cli_app(&config, &None).await?;
            let page = app::batches::list(&app, &caller, &query, limit, after.as_deref()).await;
            let page = done(app, page.map_err(flag_error_app)).await?;
            for b in &page.items {
                if json {
                    println!("{}", serde_json::to_string(&app::batches::Item::of(b))?);
                } else {
                    print_listed(b);
                }
            }
            if let (false, Some(next)) = (json, &page.next_cursor) {
                eprintln!("next page: --after {next}");
            }
            Ok(())
        }
        BatchCommand::Status { batch, watch, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let id = match resolve(&app, &caller, &batch).await {
                Ok(id) => id,
                Err(e) => return done(app, Err(e)).await,
            };
            let interrupt = Interrupt::install();
            loop {
                let s = match app::batches::status(&app, &caller, id).await {
                    Ok(s) => s,
                    Err(e) => return done(app, Err(e)).await,
                };
                if json {
                    println!("{}", serde_json::to_string(&s)?);
                } else {
                    print_status(&s);
                }
                if !watch || s.unfinished == 0 || s.status != BatchStatus::Running {
                    return done(app, Ok(())).await;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = interrupt.wait() => {
                        app.dispatcher.close().await;
                        return Err(Interrupted(format!(
                            "no longer watching batch {id}; it goes on (agentq batch status {id} --watch)"
                        ))
                        .into());
                    }
                }
            }
        }
        BatchCommand::Pause {
            batch,
            reason,
            actor,
        } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let paused = async {
                let id = resolve(&app, &caller, &batch).await?;
                app::batches::pause(&app, &caller, id, reason.as_deref()).await?;
                Ok(id)
            }
            .await;
            let id = done(app, paused).await?;
            println!(
                "batch {id} paused: nothing new starts; running operations finish their current run"
            );
            Ok(())
        }
        BatchCommand::Resume { batch, actor, json } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let resumed = async {
                let id = resolve(&app, &caller, &batch).await?;
                let r = app::batches::resume(&app, &caller, id, &Bar::new("enqueue")).await?;
                Ok((id, r))
            }
            .await;
            let (id, r) = done(app, resumed).await?;
            if r.left > 0 {
                return Err(Interrupted(format!(
                    "batch {id} is running with {} documents enqueued now and {} not enqueued; \
                     to enqueue the rest: agentq batch pause {id} && agentq batch resume {id}",
                    r.enqueued, r.left
                ))
                .into());
            }
            if json {
                println!(
                    "{}",
                    json!({ "batch_id": id, "was": r.was, "enqueued": r.enqueued, "redispatched": r.redispatched })
                );
            } else {
                println!(
                    "batch {id} resumed (was {}): {} enqueued, {} queued operations re-dispatched",
                    r.was, r.enqueued, r.redispatched
                );
            }
            Ok(())
        }
        BatchCommand::Cancel {
            batch,
            reason,
            actor,
        } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let cancelled = async {
                let id = resolve(&app, &caller, &batch).await?;
                let c = app::batches::cancel(&app, &caller, id, reason.as_deref()).await?;
                Ok((id, c))
            }
            .await;
            let (id, c) = done(app, cancelled).await?;
            println!(
                "batch {id} cancelled: {} operations cancelled, {} running ones stop at their next step",
                c.now, c.requested
            );
            Ok(())
        }
        BatchCommand::Report { batch, format, out } => report(config, &batch, &format, out).await,
    }
}

async fn start(config: Deployment, args: StartArgs) -> anyhow::Result<()> {
    let instructions = std::fs::read(&args.instructions)
        .map_err(|e| {
            refuse(format!(
                "--instructions {}: {e}",
                args.instructions.display()
            ))
        })
        .and_then(|b| {
            String::from_utf8(b).map_err(|_| refuse("--instructions is not UTF-8 text"))
        })?;
    let options = app::batches::options(&args.required, args.chunk_chars);
    let new = app::batches::NewBatch {
        tenant: args.tenant,
        kind: args.kind,
        source: args.source,
        target: args.target,
        instructions,
        options,
        canary: args.canary,
        pause_window: args.pause_window,
        pause_ratio: args.pause_ratio,
        name: args.name,
        budget: args.budget.request()?,
    };
    let (app, caller) = cli_app(&config, &args.actor).await?;
    let started = app::batches::start(&app, &caller, new, args.chunk, &Bar::new("enqueue")).await;
    let s = done(app, started).await?;
    let (id, batch, filled) = (s.batch.id, &s.batch, &s.filled);
    // How the next commands name it: by its name when it has one.
    let named = batch.name.clone().unwrap_or_else(|| id.to_string());
    if filled.left > 0 {
        return Err(Interrupted(format!(
            "batch {id}: {} of {} documents enqueued ({} now), {} not yet; run the same \
             `agentq batch start` again to enqueue only the rest",
            filled.existing + filled.enqueued,
            s.documents,
            filled.enqueued,
            filled.left
        ))
        .into());
    }
    if args.json {
        println!("{}", serde_json::to_string(&s.summary())?);
    } else {
        println!(
            "batch {id}{} ({}): {} documents, {} enqueued now, {} already enqueued{}",
            batch
                .name
                .as_deref()
                .map(|n| format!(" {n:?}"))
                .unwrap_or_default(),
            batch.status,
            s.documents,
            filled.enqueued,
            filled.existing,
            if filled.refused.is_empty() {
                String::new()
            } else {
                format!(", {} refused (see above)", filled.refused.len())
            }
        );
        if batch.status == agentq_core::state::BatchStatus::Canary {
            println!(
                "canary: the first {} run; check them, then: agentq batch resume {named}",
                batch.canary.unwrap_or(0)
            );
        }
        println!("watch it: agentq batch status {named} --watch");
    }
    Ok(())
}

fn print_status(s: &app::batches::Overview) {
    println!(
        "batch {}{}  {}{}",
        s.batch_id,
        s.name
            .as_deref()
            .map(|n| format!(" {n:?}"))
            .unwrap_or_default(),
        s.status,
        s.paused_reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    println!(
        "  started {}  finished {}  running {}",
        s.started_at
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        s.finished_at
            .map(|f| f.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_else(|| "-".into()),
        secs(s.running_secs.round() as i64),
    );
    let by: Vec<String> = s
        .by_status
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!(
        "  documents {}  enqueued {}  {}",
        s.documents,
        s.enqueued,
        by.join("  ")
    );
    println!(
        "  rate {:?}/s (of running time)  eta {}  model calls {}  tokens {} prompt / {} completion",
        s.succeeded_per_s,
        s.eta_secs.map(secs).unwrap_or_else(|| "-".into()),
        s.usage.model_calls,
        s.usage.prompt_tokens,
        s.usage.completion_tokens
    );
    if let Some(b) = &s.budget {
        println!(
            "  budget {} of {} {} tokens spent, {} held (raise it with agentq budget set --batch)",
            b.spent_tokens, b.limit_tokens, b.measure, b.held_tokens,
        );
    }
    for f in &s.top_failures {
        println!("  {:>6}  {:<20} {}", f.count, f.error_class, f.reason);
    }
}

/// Seconds as people read them: `42s`, `3m05s`, `2h10m`.
fn secs(s: i64) -> String {
    match s {
        ..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

fn print_listed(b: &app::batches::Listed) {
    println!(
        "{}  {}  {:<24} {:<12} {:<14} {:<9} {}/{} succeeded, {} failed, {} unfinished{}",
        b.created_at.format("%Y-%m-%d %H:%M:%S"),
        b.batch_id,
        b.name.as_deref().unwrap_or("-"),
        b.tenant,
        b.kind,
        b.status,
        b.succeeded,
        b.documents,
        b.failed,
        b.unfinished,
        b.finished_at
            .map(|f| format!("  finished {}", f.format("%Y-%m-%d %H:%M:%S")))
            .unwrap_or_default()
    );
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

async fn report(
    config: Deployment,
    batch: &BatchRef,
    format: &str,
    out: Option<PathBuf>,
) -> anyhow::Result<()> {
    if !["csv", "jsonl"].contains(&format) {
        return Err(refuse(format!("--format {format:?}: use csv or jsonl")));
    }
    let (app, caller) = cli_app(&config, &None).await?;
    let report = async {
        let id = resolve(&app, &caller, batch).await?;
        app::batches::report(&app, &caller, id).await
    }
    .await;
    let report = done(app, report).await?;
    let mut sink: Box<dyn Write> = match &out {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| refuse(format!("--out {}: {e}", p.display())))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    if format == "csv" {
        writeln!(
            sink,
            "doc_id,op_id,status,attempt,error_class,error_message,sha256,finished_at"
        )?;
    }
    for r in &report.documents {
        if format == "jsonl" {
            writeln!(sink, "{}", serde_json::to_string(r)?)?;
        } else {
            let opt = |o: Option<String>| csv_field(&o.unwrap_or_default());
            writeln!(
                sink,
                "{},{},{},{},{},{},{},{}",
                csv_field(&r.doc_id),
                opt(r.op_id.map(|o| o.to_string())),
                r.status,
                opt(r.attempt.map(|a| a.to_string())),
                opt(r.error_class.clone()),
                opt(r.error_message.clone()),
                opt(r.sha256.clone()),
                opt(r.finished_at.map(|f| f.to_rfc3339()))
            )?;
        }
    }
    sink.flush()?;
    let summary: Vec<String> = report
        .totals
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    eprintln!(
        "{} documents: {}",
        report.documents.len(),
        summary.join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_read_as_people_read_them() {
        assert_eq!(secs(42), "42s");
        assert_eq!(secs(185), "3m05s");
        assert_eq!(secs(7800), "2h10m");
    }

    #[test]
    fn csv_quotes_when_needed() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
