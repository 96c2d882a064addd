//! `agentq versions`: which versions of each kind live workers run and which unfinished
//! operations run on each (the report of `agentq_app::versions`), and `agentq versions
//! upgrade`: move operations to another version, one `agentq_app::versions::upgrade` per
//! operation at a chosen rate, after an optional dry run.

use crate::wiring::Deployment;
use agentq_app as app;
use agentq_app::versions::UpgradeFilter;
use clap::{Args, Subcommand};
use serde_json::json;
use uuid::Uuid;

use crate::bulk::BulkArgs;
use crate::wiring::{cli_app, cli_error, done, refuse};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct VersionsArgs {
    #[command(subcommand)]
    pub command: Option<VersionsCommand>,
    /// Only this kind.
    #[arg(long)]
    pub kind: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand)]
pub enum VersionsCommand {
    /// Move queued, sleeping or waiting operations to another version of their kind. Their next
    /// run replays the journal on it and, from the first step it asks for differently, runs
    /// anew; completed steps before that point are not repeated.
    Upgrade(UpgradeArgs),
}

#[derive(Args)]
pub struct UpgradeArgs {
    /// Operation ids; or select with --kind/--from/--status/--tenant (with --all).
    pub ids: Vec<String>,
    /// The version to move them to (a live worker must run it).
    #[arg(long)]
    pub to: String,
    #[arg(long)]
    pub kind: Option<String>,
    /// Only operations on this version.
    #[arg(long)]
    pub from: Option<String>,
    /// Only operations in this status: queued, sleeping or waiting.
    #[arg(long)]
    pub status: Option<String>,
    #[arg(long)]
    pub tenant: Option<String>,
    #[command(flatten)]
    pub bulk: BulkArgs,
}

pub async fn run(config: Deployment, args: VersionsArgs) -> anyhow::Result<()> {
    match args.command {
        None => report(&config, args.kind.as_deref(), args.json).await,
        Some(VersionsCommand::Upgrade(up)) => upgrade(&config, up).await,
    }
}

async fn report(config: &Deployment, kind: Option<&str>, json: bool) -> anyhow::Result<()> {
    let (app, caller) = cli_app(config, &None).await?;
    let report = done(
        app.clone(),
        app::versions::report(&app, &caller, kind).await,
    )
    .await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if report.kinds.is_empty() {
        println!("no live worker and no unfinished operation");
    }
    for k in &report.kinds {
        let newest = k.newest_live.as_deref().map_or_else(
            || "no live worker runs it: new operations wait".to_string(),
            |v| format!("new operations run on {v}"),
        );
        println!("{} ({newest})", k.kind);
        println!(
            "  {:<12} {:>7} {:>7} {:>7} {:>8} {:>7} {:>5} {:>6}  oldest waiting since",
            "version", "workers", "queued", "running", "sleeping", "waiting", "dead", "parked"
        );
        for l in &k.versions {
            let c = l.counts();
            let note = if l.unserved {
                "  <- no live worker runs it: waits until one does or an operator upgrades it"
            } else if l.retirable && l.version.is_some() {
                "  (no unfinished operation: its code may be retired)"
            } else {
                ""
            };
            println!(
                "  {:<12} {:>7} {:>7} {:>7} {:>8} {:>7} {:>5} {:>6}  {}{note}",
                l.version.as_deref().unwrap_or("(not run)"),
                l.live_workers,
                c[0],
                c[1],
                c[2],
                c[3],
                c[4],
                l.parked,
                l.oldest_waiting_since
                    .map_or("-".to_string(), |t| t.to_rfc3339()),
            );
        }
    }
    println!("live workers: {}", report.workers.len());
    for w in &report.workers {
        let runs: Vec<String> = w
            .kinds
            .iter()
            .zip(&w.versions)
            .map(|(k, v)| format!("{k}@{v}"))
            .collect();
        println!(
            "  {} (seen {}): {}",
            w.owner,
            w.seen_at.to_rfc3339(),
            runs.join(" ")
        );
    }
    Ok(())
}

async fn upgrade(config: &Deployment, up: UpgradeArgs) -> anyhow::Result<()> {
    let rate = crate::bulk::parse_rate(&up.bulk.rate)?;
    let to = app::versions::parse_version("to", &up.to).map_err(cli_error)?;
    let ids = up
        .ids
        .iter()
        .map(|s| {
            Uuid::parse_str(s.trim())
                .map_err(|_| refuse(format!("{s:?} is not an operation id (a UUID)")))
        })
        .collect::<anyhow::Result<Vec<Uuid>>>()?;
    let filtered =
        up.kind.is_some() || up.from.is_some() || up.status.is_some() || up.tenant.is_some();
    if ids.is_empty() && !filtered && !up.bulk.all {
        return Err(refuse(
            "name operations by id, or select them with --kind/--from/--status/--tenant (or --all)",
        ));
    }
    if !ids.is_empty() && (filtered || up.bulk.all) {
        return Err(refuse("give ids or filters, not both"));
    }
    let (app, caller) = cli_app(config, &up.bulk.actor).await?;
    let filter = UpgradeFilter {
        tenant: up.tenant.clone(),
        kind: up.kind.clone(),
        from_version: up.from.clone(),
        status: up.status.clone(),
        ids: (!ids.is_empty()).then_some(ids.clone()),
    };
    let selected = match app::versions::select(&app, &caller, filter, up.bulk.max).await {
        Ok(s) => s,
        Err(e) => return done(app, Err(e)).await,
    };
    for id in &ids {
        if !selected.iter().any(|s| s.id == *id) {
            eprintln!(
                "{id}: not upgradable here (no such operation, or not queued, sleeping or waiting)"
            );
        }
    }
    if up.bulk.dry_run {
        for s in &selected {
            if up.bulk.json {
                println!(
                    "{}",
                    json!({ "would": "upgrade", "operation": s, "to_version": to })
                );
            } else {
                println!(
                    "would upgrade {} ({} {}, {}, {} journal rows) to {to}",
                    s.id,
                    s.kind,
                    s.version.as_deref().unwrap_or("(not run)"),
                    s.status,
                    s.steps
                );
            }
        }
        eprintln!(
            "dry run: {} operations would be upgraded to {to}; nothing was changed",
            selected.len()
        );
        return done(app, Ok(())).await;
    }
    let targets: Vec<Uuid> = selected.iter().map(|s| s.id).collect();
    if targets.is_empty() {
        app.dispatcher.close().await;
        return Err(refuse("no queued, sleeping or waiting operation matched"));
    }
    let json = up.bulk.json;
    crate::bulk::each(
        &app,
        &targets,
        rate,
        ("upgrade", "upgraded", "operations"),
        |id| app::versions::upgrade(&app, &caller, id, &to, up.bulk.reason.as_deref()),
        |id, outcome| match outcome {
            Ok(u) if json => println!(
                "{}",
                json!({ "id": id, "result": "upgraded", "upgraded": u })
            ),
            Ok(u) => println!(
                "{id}: upgraded {} {} -> {} ({})",
                u.kind,
                u.from_version.as_deref().unwrap_or("(not run)"),
                u.to_version,
                u.status
            ),
            Err(e) if json => println!(
                "{}",
                json!({ "id": id, "result": "failed", "error": e.to_string() })
            ),
            Err(e) => eprintln!("{id}: failed: {e}"),
        },
    )
    .await
}
