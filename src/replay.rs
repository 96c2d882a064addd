//! `agentq replay`: replays recorded journals against this binary's code before it is
//! deployed, to see whether it would replay the operations that run or wait today
//! (`agentq_worker::testing::replay_operation`): operations read from the database, or a
//! journal exported with `agentq steps OP --json`. Nothing is called (no model, no tool, no
//! reconcile) and nothing is written: each replay stops where the code asks for a step its
//! journal does not hold yet.

use std::io::IsTerminal;
use std::path::PathBuf;

use agentq_app::operations::{ListQuery, Recorded};
use agentq_worker::testing::{self, End, JournalReplay};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use crate::wiring::{Deployment, cli_app, cli_error, refuse};

#[derive(Args)]
pub struct ReplayArgs {
    /// Operations to replay, read from the database (their kind, version, input and journal).
    pub ops: Vec<String>,
    /// Every unfinished operation of this kind (queued, sleeping, waiting), newest first, at
    /// most --max; with --journal, the kind the journal is replayed as.
    #[arg(long)]
    pub kind: Option<String>,
    /// Replay on this version of the kind instead of each operation's own: what `agentq versions
    /// upgrade --to V` would run.
    #[arg(long)]
    pub to_version: Option<String>,
    /// Offline: a journal `agentq steps OP --json` printed; needs --kind and --input.
    #[arg(long)]
    pub journal: Option<PathBuf>,
    /// With --journal: the operation's input (JSON, or @FILE).
    #[arg(long)]
    pub input: Option<String>,
    /// Most operations --kind selects.
    #[arg(long, default_value_t = 1000)]
    pub max: usize,
    /// Print one JSON object per operation.
    #[arg(long)]
    pub json: bool,
}

/// What one replay found.
struct Replayed {
    op: Option<uuid::Uuid>,
    kind: String,
    version: String,
    outcome: Result<JournalReplay, String>,
}

pub async fn run(config: Deployment, args: ReplayArgs) -> anyhow::Result<()> {
    let results = if let Some(path) = &args.journal {
        vec![offline(&config, &args, path).await?]
    } else {
        from_database(&config, &args).await?
    };
    let mut diverged = 0;
    for r in &results {
        let agrees = matches!(&r.outcome, Ok(j) if j.agrees());
        if !agrees {
            diverged += 1;
        }
        let (steps, what) = match &r.outcome {
            Ok(j) => (j.steps, describe(&j.outcome)),
            Err(why) => (0, why.clone()),
        };
        if args.json {
            println!(
                "{}",
                json!({
                    "op_id": r.op, "kind": r.kind, "version": r.version, "steps": steps,
                    "agrees": agrees, "outcome": what,
                })
            );
        } else {
            let op =
                r.op.map_or_else(|| "journal".to_string(), |id| id.to_string());
            let verdict = if agrees { "agrees" } else { "DIVERGES" };
            println!(
                "{op}  {}@{}  {verdict}: {what} ({steps} journal steps)",
                r.kind, r.version
            );
        }
    }
    let of = |n: usize| if n == 1 { "operation" } else { "operations" };
    if diverged > 0 {
        let advice = match &args.to_version {
            Some(v) => format!(
                "upgrading them to version {v} would stop them as nondeterminism; upgrade only \
                 the ones that agree, or put the change behind ctx.patched"
            ),
            None => "a deploy of this build would stop them as nondeterminism: give the changed \
                     kind a new version (keeping the old one registered) or put the change behind \
                     ctx.patched"
                .into(),
        };
        anyhow::bail!(
            "{diverged} of {} {} would not replay on this code: {advice}",
            results.len(),
            of(results.len())
        );
    }
    if !args.json {
        eprintln!(
            "{} {} replay on this code",
            results.len(),
            of(results.len())
        );
    }
    Ok(())
}

fn describe(outcome: &End) -> String {
    match outcome {
        End::ReachedEnd => "the code asks for the recorded steps, up to the journal's end".into(),
        End::Succeeded(_) => "the code finishes on the recorded steps".into(),
        End::Failed { class, message } => format!("{class}: {message}"),
    }
}

/// `--journal FILE --kind K --input JSON`.
async fn offline(
    config: &Deployment,
    args: &ReplayArgs,
    path: &PathBuf,
) -> anyhow::Result<Replayed> {
    let Some(kind) = args.kind.clone() else {
        return Err(refuse(
            "--journal needs --kind: the kind the operation ran as",
        ));
    };
    let raw = args
        .input
        .as_deref()
        .ok_or_else(|| refuse("--journal needs --input: the operation's input (JSON, or @FILE)"))?;
    let raw = match raw.strip_prefix('@') {
        Some(file) => {
            std::fs::read_to_string(file).map_err(|e| refuse(format!("--input @{file}: {e}")))?
        }
        None => raw.to_string(),
    };
    let input: Value = serde_json::from_str(&raw)
        .map_err(|e| refuse(format!("--input is not valid JSON ({e})")))?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| refuse(format!("--journal {}: {e}", path.display())))?;
    let journal = testing::journal_from_steps(&text)
        .map_err(|e| refuse(format!("--journal {}: {e}", path.display())))?;
    let version = match &args.to_version {
        Some(v) => v.clone(),
        None => config
            .kinds
            .newest(&kind)
            .ok_or_else(|| {
                refuse(format!(
                    "this binary runs no kind {kind:?}; it runs {}",
                    config.kinds.kind_names().join(", ")
                ))
            })?
            .to_string(),
    };
    let outcome = Ok(testing::replay_journal(&config.kinds, &kind, &version, input, journal).await);
    Ok(Replayed {
        op: None,
        kind,
        version,
        outcome,
    })
}

/// Operations by id, or every unfinished one of `--kind`.
async fn from_database(config: &Deployment, args: &ReplayArgs) -> anyhow::Result<Vec<Replayed>> {
    let (app, caller) = cli_app(config, &None).await?;
    let result = async {
        let mut ids = Vec::new();
        for op in &args.ops {
            ids.push(agentq_app::operations::parse_id(op).map_err(cli_error)?);
        }
        if let Some(kind) = &args.kind {
            let query = ListQuery {
                kind: Some(kind.clone()),
                status: vec!["queued,sleeping,waiting".into()],
                ..ListQuery::default()
            };
            let mut after: Option<String> = None;
            while ids.len() < args.max {
                let limit = (args.max - ids.len()).min(1000) as i64;
                let page =
                    agentq_app::operations::list(&app, &caller, &query, limit, after.as_deref())
                        .await
                        .map_err(cli_error)?;
                ids.extend(page.items.iter().map(|s| agentq_core::OperationId(s.op_id)));
                match page.next_cursor {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        if ids.is_empty() {
            return Err(refuse(
                "name operations to replay, or --kind K for every unfinished one of a kind, or \
                 --journal FILE --kind K --input JSON",
            ));
        }
        let bar = progress(ids.len());
        let mut results = Vec::with_capacity(ids.len());
        for id in ids {
            let recorded = agentq_app::operations::recorded(&app, &caller, id)
                .await
                .map_err(cli_error)?;
            results.push(replay_one(config, args, recorded).await);
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok(results)
    }
    .await;
    app.dispatcher.close().await;
    result
}

async fn replay_one(config: &Deployment, args: &ReplayArgs, r: Recorded) -> Replayed {
    let op = r.operation;
    let version = args
        .to_version
        .clone()
        .or(op.kind_version.clone())
        .or_else(|| config.kinds.newest(&op.kind))
        .unwrap_or_default();
    let runs = config
        .kinds
        .versions()
        .iter()
        .any(|(k, v)| *k == op.kind && *v == version);
    let outcome = if runs {
        Ok(testing::replay_operation(
            &config.kinds,
            op.op_id.0,
            &op.kind,
            &version,
            r.input,
            testing::journal_from_views(r.steps),
        )
        .await)
    } else {
        Err(format!(
            "this binary does not run version {version:?} of kind {:?}: a worker of it would park \
             the operation (keep that version registered)",
            op.kind
        ))
    };
    Replayed {
        op: Some(op.op_id.0),
        kind: op.kind,
        version,
        outcome,
    }
}

/// A progress bar on a terminal's stderr, hidden otherwise.
fn progress(total: usize) -> ProgressBar {
    let bar = ProgressBar::new(total as u64);
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("replaying {bar:30} {pos}/{len} operations ({eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}
