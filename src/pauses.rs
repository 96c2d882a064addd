//! `agentq pause`, `agentq resume` and `agentq pauses`: hold live work without cancelling it
//! (one operation, every operation of a kind, a tenant, a lane or a schedule, or the whole
//! deployment), lift the hold, list the holds. The flows are `agentq_app::pauses` (the API and
//! the console call the same); this module parses flags and prints.

use agentq_app::pauses::{self, PauseView, Target};
use agentq_core::operation::Lane;
use clap::Args;

use crate::wiring::{Deployment, cli_app, done, flag_error_app};

/// What to pause or resume.
#[derive(Args, Clone, Debug)]
pub struct TargetArgs {
    /// One operation (its id).
    pub op: Option<String>,
    /// Every operation of this kind.
    #[arg(long)]
    pub kind: Option<String>,
    /// Every operation of this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Every operation of this lane (interactive or batch).
    #[arg(long)]
    pub lane: Option<Lane>,
    /// Every operation this schedule fired (its id or its name).
    #[arg(long)]
    pub schedule: Option<String>,
    /// Everything: the whole deployment (drain mode).
    #[arg(long, conflicts_with_all = ["op", "kind", "tenant", "lane", "schedule"])]
    pub all: bool,
}

impl TargetArgs {
    /// The target these flags name; a schedule by its id or its name (in `--tenant`, if
    /// given).
    fn target(&self) -> agentq_app::Result<Target> {
        let op = self
            .op
            .as_deref()
            .map(agentq_app::operations::parse_id)
            .transpose()?;
        Ok(Target {
            op_id: op.map(|o| o.0),
            tenant: self.tenant.clone(),
            kind: self.kind.clone(),
            lane: self.lane,
            schedule: self.schedule.clone(),
            everything: self.all,
        })
    }
}

/// `agentq pause`: the operations it names are not claimed while paused; running ones stop at
/// their next step boundary with their journal and attempt kept.
#[derive(Args)]
pub struct PauseArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// Why (required; kept in the audit trail).
    #[arg(long)]
    pub reason: String,
    /// Count what it would hold and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long = "as")]
    pub actor: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// `agentq resume`: lift a pause, by its id (`--pause`) or by what it names.
#[derive(Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    /// The pause's id (as `agentq pauses` lists it), instead of naming what it holds.
    #[arg(long, conflicts_with_all = ["op", "kind", "tenant", "lane", "schedule", "all"])]
    pub pause: Option<String>,
    /// Kept in the audit trail.
    #[arg(long)]
    pub reason: Option<String>,
    #[arg(long = "as")]
    pub actor: Option<String>,
    #[arg(long)]
    pub json: bool,
}

pub async fn pause(config: Deployment, args: PauseArgs) -> anyhow::Result<()> {
    let (app, caller) = cli_app(&config, &args.actor).await?;
    let paused = async {
        let target = args.target.target()?;
        pauses::pause(&app, &caller, &target, &args.reason, args.dry_run).await
    }
    .await;
    let paused = done(app, paused).await?;
    if args.json {
        println!("{}", serde_json::to_string(&paused)?);
        return Ok(());
    }
    println!("{}", paused.summary());
    Ok(())
}

pub async fn resume(config: Deployment, args: ResumeArgs) -> anyhow::Result<()> {
    let (app, caller) = cli_app(&config, &args.actor).await?;
    let reason = args.reason.as_deref();
    let resumed = match &args.pause {
        Some(id) => match pauses::parse_id(id) {
            Ok(id) => pauses::resume(&app, &caller, id, reason).await,
            Err(e) => Err(e),
        },
        None => match args.target.target() {
            Ok(target) => pauses::resume_target(&app, &caller, &target, reason).await,
            Err(e) => Err(e),
        },
    };
    let resumed = done(app, resumed).await?;
    if args.json {
        println!("{}", serde_json::to_string(&resumed)?);
    } else {
        println!("{}", resumed.summary());
    }
    Ok(())
}

/// `agentq pauses`: a page of the pauses in force.
pub async fn list(
    config: Deployment,
    tenant: Option<String>,
    limit: i64,
    after: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    let (app, caller) = cli_app(&config, &None).await?;
    let listed = pauses::list(&app, &caller, tenant.as_deref(), after.as_deref(), limit).await;
    let page = done(app, listed.map_err(flag_error_app)).await?;
    if page.items.is_empty() && after.is_none() && !json {
        println!("no pauses in force");
    }
    for p in &page.items {
        if json {
            println!("{}", serde_json::to_string(p)?);
        } else {
            print_line(p);
        }
    }
    if let (false, Some(next)) = (json, &page.next_cursor) {
        eprintln!("next page: --after {next}");
    }
    Ok(())
}

fn print_line(p: &PauseView) {
    println!(
        "{}  {}  by {} at {}: {}",
        p.pause_id,
        p.describe(),
        p.paused_by,
        p.paused_at.to_rfc3339(),
        p.reason
    );
}
