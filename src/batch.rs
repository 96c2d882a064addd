//! `agentq batch …`: campaigns of one `doc_migration` operation per document, with the
//! controls a large migration needs: a canary, pause / resume / cancel, automatic pause when
//! too many recent operations fail (the scheduler's job), progress, and a per-document report.
//! The flows are `agentq_app::batches` (the console's controls call the same); this module
//! parses flags and prints.
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
use crate::wiring::{cli_app, cli_error, done, refuse};

#[derive(Subcommand)]
pub enum BatchCommand {
    /// Create a batch (or find it again) and enqueue one operation per document it is missing.
    Start(StartArgs),
    /// Totals by status, rate, ETA, token usage and the top failure reasons.
    Status {
        batch: String,
        /// Redraw every 2 s until nothing is left to run (or the batch is paused).
        #[arg(long)]
        watch: bool,
        #[arg(long)]
        json: bool,
    },
    /// Stop starting the batch's operations (running ones finish their current run).
    Pause {
        batch: String,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// Resume a paused batch, or run the rest of a canary batch.
    Resume {
        batch: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Cancel every unfinished operation of the batch.
    Cancel {
        batch: String,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// One line per document: its operation, status, error and written hash (CSV or JSON Lines).
    Report {
        batch: String,
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

pub async fn run(config: Deployment, cmd: BatchCommand) -> anyhow::Result<()> {
    match cmd {
        BatchCommand::Start(args) => start(config, args).await,
        BatchCommand::Status { batch, watch, json } => {
            let id = app::batches::parse_id(&batch).map_err(cli_error)?;
            let (app, caller) = cli_app(&config, &None).await?;
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
            let id = app::batches::parse_id(&batch).map_err(cli_error)?;
            let (app, caller) = cli_app(&config, &actor).await?;
            let paused = app::batches::pause(&app, &caller, id, reason.as_deref()).await;
            done(app, paused).await?;
            println!(
                "batch {id} paused: nothing new starts; running operations finish their current run"
            );
            Ok(())
        }
        BatchCommand::Resume { batch, actor, json } => {
            let id = app::batches::parse_id(&batch).map_err(cli_error)?;
            let (app, caller) = cli_app(&config, &actor).await?;
            let resumed = app::batches::resume(&app, &caller, id, &Bar::new("enqueue")).await;
            let r = done(app, resumed).await?;
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
            let id = app::batches::parse_id(&batch).map_err(cli_error)?;
            let (app, caller) = cli_app(&config, &actor).await?;
            let cancelled = app::batches::cancel(&app, &caller, id, reason.as_deref()).await;
            let c = done(app, cancelled).await?;
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
    };
    let (app, caller) = cli_app(&config, &args.actor).await?;
    let started = app::batches::start(&app, &caller, new, args.chunk, &Bar::new("enqueue")).await;
    let s = done(app, started).await?;
    let (id, batch, filled) = (s.batch.id, &s.batch, &s.filled);
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
            "batch {id} ({}): {} documents, {} enqueued now, {} already enqueued{}",
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
                "canary: the first {} run; check them, then: agentq batch resume {id}",
                batch.canary.unwrap_or(0)
            );
        }
        println!("watch it: agentq batch status {id} --watch");
    }
    Ok(())
}

fn print_status(s: &app::batches::Overview) {
    println!(
        "batch {}  {}{}",
        s.batch_id,
        s.status,
        s.paused_reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
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
        "  rate {:?}/s  eta {}  model calls {}  tokens {} prompt / {} completion",
        s.succeeded_per_s,
        s.eta_secs
            .map(|e| format!("{e}s"))
            .unwrap_or_else(|| "-".into()),
        s.usage.model_calls,
        s.usage.prompt_tokens,
        s.usage.completion_tokens
    );
    for f in &s.top_failures {
        println!("  {:>6}  {:<20} {}", f.count, f.error_class, f.reason);
    }
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
    batch: &str,
    format: &str,
    out: Option<PathBuf>,
) -> anyhow::Result<()> {
    let id = app::batches::parse_id(batch).map_err(cli_error)?;
    if !["csv", "jsonl"].contains(&format) {
        return Err(refuse(format!("--format {format:?}: use csv or jsonl")));
    }
    let (app, caller) = cli_app(&config, &None).await?;
    let report = app::batches::report(&app, &caller, id).await;
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
    fn csv_quotes_when_needed() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
