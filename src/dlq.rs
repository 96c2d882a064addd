//! `agentq dlq …`: the operators' tools for the dead-letter queue, over `agentq_app::dlq` (the
//! flows the API and the console call too): list, show, stats, and the bulk forms, whose
//! selection and dry run are the application layer's; every action is audited there.

use crate::wiring::Deployment;
use agentq_app as app;
use agentq_core::operation::OperationId;
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::bulk::BulkArgs;
use crate::wiring::{cli_app, cli_error, done, flag_error_app, refuse};

#[derive(Subcommand)]
pub enum DlqCommand {
    /// List dead letters, newest first, one page at a time.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Page size.
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Continue after this cursor (the `cursor` of the last item of the previous page).
        #[arg(long)]
        after: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter: error, attempts, the failed step, the journal, operator history.
    Show {
        /// Operation id, or the dead letter's own id.
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Open dead letters grouped by class, kind and error fingerprint.
    Stats {
        #[command(flatten)]
        filter: FilterArgs,
        #[arg(long)]
        json: bool,
    },
    /// Re-queue dead operations from their failed step (completed steps are not re-run).
    Retry {
        /// Operation ids or dead letter ids; or select with the filters.
        ids: Vec<String>,
        #[command(flatten)]
        filter: FilterArgs,
        /// A JSON merge patch (RFC 7386) applied to the input before the retry.
        #[arg(long)]
        patch_input: Option<String>,
        /// Run them on this version of their kind (a live worker must run it): how a
        /// `nondeterminism` dead letter is recovered. The journal is replayed on that version
        /// and, from the first step it asks for differently, runs anew.
        #[arg(long)]
        to_version: Option<String>,
        #[command(flatten)]
        bulk: BulkArgs,
    },
    /// State the outcome of an `unknown_side_effect` step, then resume the operation.
    Resolve {
        /// Operation id or dead letter id.
        id: String,
        /// The effect happened; the step is recorded as completed (with --output).
        #[arg(long, conflicts_with = "did_not_happen")]
        happened: bool,
        /// The effect did not happen; the step runs again.
        #[arg(long)]
        did_not_happen: bool,
        /// What the step returned (JSON), with --happened.
        #[arg(long, requires = "happened")]
        output: Option<String>,
        /// Who is acting (default: the OS user).
        #[arg(long = "as")]
        actor: Option<String>,
        /// Why (kept in the audit trail).
        #[arg(long)]
        reason: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Drop dead letters for good (their operations become `discarded`). A reason is required.
    Discard {
        /// Operation ids or dead letter ids; or select with the filters.
        ids: Vec<String>,
        #[command(flatten)]
        filter: FilterArgs,
        #[command(flatten)]
        bulk: BulkArgs,
    },
}

#[derive(Args, Clone, Default)]
pub struct FilterArgs {
    #[arg(long)]
    pub tenant: Option<String>,
    #[arg(long)]
    pub kind: Option<String>,
    /// Failure class (retries_exhausted, non_retryable, crash_loop, unknown_side_effect, …).
    #[arg(long)]
    pub class: Option<String>,
    /// Only dead letters since this time: RFC 3339, or a duration ago (30m, 2h, 7d).
    #[arg(long)]
    pub since: Option<String>,
    /// Only operations of this batch.
    #[arg(long)]
    pub batch: Option<String>,
    /// Dead-letter status (open, retried, resolved, discarded); default open.
    #[arg(long)]
    pub status: Option<String>,
}

impl FilterArgs {
    fn query(&self) -> app::dlq::Query<'_> {
        app::dlq::Query {
            tenant: self.tenant.as_deref(),
            kind: self.kind.as_deref(),
            class: self.class.as_deref(),
            since: self.since.as_deref(),
            batch: self.batch.as_deref(),
            status: self.status.as_deref(),
        }
    }

    fn is_empty(&self) -> bool {
        self.tenant.is_none()
            && self.kind.is_none()
            && self.class.is_none()
            && self.since.is_none()
            && self.batch.is_none()
    }
}

fn parse_ids(ids: &[String]) -> anyhow::Result<Vec<Uuid>> {
    ids.iter()
        .map(|s| OperationId::parse(s).map(|o| o.0).map_err(refuse))
        .collect()
}

pub async fn run(config: Deployment, cmd: DlqCommand) -> anyhow::Result<()> {
    match cmd {
        DlqCommand::List {
            filter,
            limit,
            after,
            json,
        } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let page = app::dlq::list(&app, &caller, filter.query(), limit, after.as_deref()).await;
            let page = done(app, page.map_err(flag_error_app)).await?;
            for d in &page.items {
                if json {
                    println!("{}", serde_json::to_string(&app::dlq::listed(d))?);
                } else {
                    println!(
                        "{}  {}  {:<20} {:<12} {:<10} attempts {:<3} {}",
                        d.created_at.format("%Y-%m-%d %H:%M:%S"),
                        d.op_id
                            .map(|o| o.to_string())
                            .unwrap_or_else(|| format!("(message {})", d.id)),
                        d.class,
                        d.kind.as_deref().unwrap_or("-"),
                        d.tenant.as_deref().unwrap_or("-"),
                        d.attempts,
                        truncate(&d.reason, 80)
                    );
                }
            }
            if let (false, Some(next)) = (json, &page.next_cursor) {
                eprintln!("next page: --after {next}");
            }
            Ok(())
        }
        DlqCommand::Show { id, json } => show(&config, &id, json).await,
        DlqCommand::Stats { filter, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let groups = app::dlq::stats(&app, &caller, filter.query()).await;
            for s in done(app, groups.map_err(flag_error_app)).await? {
                if json {
                    println!("{}", serde_json::to_value(&s)?);
                } else {
                    println!(
                        "{:>7}  {:<20} {:<12} {}",
                        s.count,
                        s.class,
                        s.kind.as_deref().unwrap_or("-"),
                        s.fingerprint
                    );
                }
            }
            Ok(())
        }
        DlqCommand::Retry {
            ids,
            filter,
            patch_input,
            to_version,
            bulk,
        } => {
            let patch = patch_input
                .as_deref()
                .map(|p| {
                    serde_json::from_str::<Value>(p)
                        .map_err(|e| refuse(format!("--patch-input is not valid JSON ({e})")))
                })
                .transpose()?;
            bulk_action(
                &config,
                &ids,
                &filter,
                &bulk,
                Kind::Retry(patch, to_version),
            )
            .await
        }
        DlqCommand::Resolve {
            id,
            happened,
            did_not_happen,
            output,
            actor,
            reason,
            json,
        } => {
            let happened = match (happened, did_not_happen) {
                (true, false) => true,
                (false, true) => false,
                _ => {
                    return Err(refuse(
                        "say what happened: --happened [--output JSON] or --did-not-happen",
                    ));
                }
            };
            let output = output
                .as_deref()
                .map(|o| {
                    serde_json::from_str(o)
                        .map_err(|e| refuse(format!("--output is not valid JSON ({e})")))
                })
                .transpose()?;
            let id = parse_ids(std::slice::from_ref(&id))?[0];
            let (app, caller) = cli_app(&config, &actor).await?;
            let request = app::dlq::Request::Resolve { happened, output };
            let acted = app::dlq::act(&app, &caller, id, request, reason).await;
            let acted = done(app, acted).await?;
            report(json, id, acted.done, acted.op_id, None);
            Ok(())
        }
        DlqCommand::Discard { ids, filter, bulk } => {
            if bulk.reason.as_deref().is_none_or(|r| r.trim().is_empty()) {
                return Err(refuse(
                    "discarding needs --reason TEXT: it is kept in the audit trail",
                ));
            }
            bulk_action(&config, &ids, &filter, &bulk, Kind::Discard).await
        }
    }
}

fn report(json: bool, id: Uuid, done: &str, op: Option<Uuid>, error: Option<String>) {
    if json {
        println!(
            "{}",
            json!({ "id": id, "result": if error.is_some() { "failed" } else { done }, "op_id": op, "error": error })
        );
    } else if let Some(e) = error {
        eprintln!("{id}: failed: {e}");
    } else {
        println!(
            "{id}: {done}{}",
            op.map(|o| format!(" (operation {o} queued)"))
                .unwrap_or_default()
        );
    }
}

async fn bulk_action(
    config: &Deployment,
    ids: &[String],
    filter: &FilterArgs,
    bulk: &BulkArgs,
    kind: Kind,
) -> anyhow::Result<()> {
    let explicit = parse_ids(ids)?;
    let rate = crate::bulk::parse_rate(&bulk.rate)?;
    if explicit.is_empty() && filter.is_empty() && !bulk.all {
        return Err(refuse(
            "name dead letters by id, or select them with --tenant/--kind/--class/--since/--batch (or --all)",
        ));
    }
    if !explicit.is_empty() && (!filter.is_empty() || bulk.all) {
        return Err(refuse("give ids or filters, not both"));
    }
    let (app, caller) = cli_app(config, &bulk.actor).await?;
    let targets = if explicit.is_empty() {
        match app::dlq::select(&app, &caller, filter.query(), bulk.max).await {
            Ok(targets) => targets,
            Err(e) => return done(app, Err(flag_error_app(e))).await,
        }
    } else {
        explicit
    };
    let (verb, done) = match kind {
        Kind::Retry(..) => ("retry", "retried"),
        Kind::Discard => ("discard", "discarded"),
    };
    if bulk.dry_run {
        for id in &targets {
            match app::dlq::find(&app, &caller, *id).await {
                Ok(d) if bulk.json => {
                    println!(
                        "{}",
                        json!({ "would": verb, "dead_letter": app::dlq::listed(&d) })
                    )
                }
                Ok(d) => println!(
                    "would {verb} {} ({}, {}, {})",
                    d.id,
                    d.class,
                    d.status,
                    truncate(&d.reason, 60)
                ),
                Err(app::AppError::NotFound(_)) => eprintln!("{id}: no such dead letter"),
                Err(e) => return crate::wiring::done(app, Err(e)).await,
            }
        }
        app.dispatcher.close().await;
        eprintln!(
            "dry run: {} dead letters would be {done}; nothing was changed",
            targets.len()
        );
        return Ok(());
    }

    let request = |kind: &Kind| match kind {
        Kind::Discard => app::dlq::Request::Discard,
        Kind::Retry(patch, to_version) => app::dlq::Request::Retry {
            patch: patch.clone(),
            to_version: to_version.clone(),
        },
    };
    crate::bulk::each(
        &app,
        &targets,
        rate,
        (verb, done, "dead letters"),
        |id| app::dlq::act(&app, &caller, id, request(&kind), bulk.reason.clone()),
        |id, outcome| match outcome {
            Ok(acted) => report(bulk.json, id, done, acted.op_id, None),
            Err(e) => report(bulk.json, id, done, None, Some(e.to_string())),
        },
    )
    .await
}

/// What the bulk forms do to each dead letter.
enum Kind {
    Retry(Option<Value>, Option<String>),
    Discard,
}

async fn show(config: &Deployment, id: &str, json: bool) -> anyhow::Result<()> {
    let id = parse_ids(&[id.to_string()])?[0];
    let (app, caller) = cli_app(config, &None).await?;
    let found = app::dlq::find(&app, &caller, id).await;
    let d = done(app.clone(), found).await?;
    let details = app::dlq::details(&app, &caller, id)
        .await
        .map_err(cli_error)?;
    if json {
        println!("{}", serde_json::to_string(&details)?);
        return Ok(());
    }
    let app::dlq::Details {
        operation: op,
        steps,
        history,
        raw_message_preview: preview,
        ..
    } = details;
    println!("dead letter {}  ({})", d.id, d.status);
    if let Some(o) = &op {
        println!(
            "operation   {}  {} (tenant {}, kind {})",
            o.op_id, o.status, o.tenant, o.kind
        );
    }
    println!("class       {}", d.class);
    println!("reason      {}", d.reason);
    println!("attempts    {}", d.attempts);
    if let Some(seq) = d.failed_step {
        println!("failed step {seq}");
    }
    println!("created     {}", d.created_at);
    if let Some(p) = preview {
        println!("message     {}", truncate(&p, 200));
    }
    if !steps.is_empty() {
        println!("journal:");
        for s in &steps {
            let mark = if Some(s.seq) == d.failed_step {
                "→"
            } else {
                " "
            };
            println!(
                " {mark}{:>3} {:<20} {:<6} {:<6} {:<9} {}  key {}{}",
                s.seq,
                s.name,
                s.kind,
                s.replay,
                s.status,
                s.started_at.format("%H:%M:%S%.3f"),
                &s.idempotency_key[..16],
                s.error
                    .as_deref()
                    .map(|e| format!("  error: {}", truncate(e, 60)))
                    .unwrap_or_default()
            );
        }
    }
    if !history.is_empty() {
        println!("history:");
        for h in &history {
            println!(
                "  {} {} by {} ({} → {}){}",
                h.created_at.format("%Y-%m-%d %H:%M:%S"),
                h.action,
                h.actor,
                h.status_before.as_deref().unwrap_or("-"),
                h.status_after.as_deref().unwrap_or("-"),
                h.reason
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}
