//! `agentq schedules …`: add, list, pause, resume and delete schedules (a kind and input fired
//! as an operation at every tick of a cron expression in a time zone, or of an interval). The
//! flows are `agentq_app::schedules` (the API and the console call the same); this module
//! parses flags and prints. A schedule is named by its id or its name (`--tenant` picks the
//! tenant of a name several tenants use).

use crate::wiring::Deployment;
use agentq_app::schedules::{self, Control, NewSchedule, ScheduleView};
use agentq_core::operation::Lane;
use agentq_core::state::Overlap;
use clap::{Args, Subcommand};

use crate::wiring::{cli_app, done, refuse};

#[derive(Subcommand)]
pub enum SchedulesCommand {
    /// Add a schedule: the input is checked against the kind now, as an enqueue would be.
    Add(Box<AddArgs>),
    /// List schedules with their next firings.
    List {
        #[arg(long)]
        tenant: Option<String>,
        /// JSON Lines, one schedule per line.
        #[arg(long)]
        json: bool,
    },
    /// Pause a schedule: nothing fires until it is resumed.
    Pause(ScheduleRef),
    /// Resume a paused schedule from its next tick after now (ticks while paused are not fired).
    Resume(ScheduleRef),
    /// Delete a schedule (its operations stay).
    Delete(ScheduleRef),
}

/// A schedule as a control names it, and who acts.
#[derive(Args)]
pub struct ScheduleRef {
    /// The schedule's id, or its name.
    id: String,
    /// The tenant whose schedule of that name is meant (when several tenants use it).
    #[arg(long)]
    tenant: Option<String>,
    #[arg(long = "as")]
    actor: Option<String>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct AddArgs {
    #[arg(long)]
    pub tenant: String,
    /// Unique in the tenant, not a UUID: the other `schedules` commands take it for the id.
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub kind: String,
    /// Every firing's input (JSON).
    #[arg(long)]
    pub input: String,
    /// A cron expression: "minute hour day-of-month month day-of-week", or six fields with
    /// seconds first (e.g. "0 9 * * MON-FRI", "*/10 * * * * *").
    #[arg(long, conflicts_with = "every")]
    pub cron: Option<String>,
    /// The IANA time zone the cron expression is read in.
    #[arg(long, default_value = "UTC", requires = "cron")]
    pub tz: String,
    /// Or fire at a fixed interval (90s, 15m, 2h, 1d), at its multiples since the Unix epoch.
    #[arg(long)]
    pub every: Option<String>,
    /// A tick while the previous firing's operation is unfinished: skip, buffer_one, allow.
    #[arg(long, default_value = "skip")]
    pub overlap: String,
    /// After downtime, ticks at most this old still fire; older ones are skipped (1s to 366d).
    #[arg(long, default_value = "1h")]
    pub catch_up: String,
    #[arg(long, default_value = "interactive")]
    pub lane: Lane,
    /// Attempts of each firing's operation (default AGENTQ_MAX_ATTEMPTS).
    #[arg(long)]
    pub max_attempts: Option<i32>,
    /// Add it paused.
    #[arg(long)]
    pub paused: bool,
    /// A token budget each firing's operation is born with.
    #[command(flatten)]
    pub budget: crate::budgets::BudgetFlags,
    #[arg(long = "as")]
    pub actor: Option<String>,
    #[arg(long)]
    pub json: bool,
}

pub async fn run(config: Deployment, cmd: SchedulesCommand) -> anyhow::Result<()> {
    match cmd {
        SchedulesCommand::Add(args) => {
            let AddArgs {
                tenant,
                name,
                kind,
                input,
                cron,
                tz,
                every,
                overlap,
                catch_up,
                lane,
                max_attempts,
                paused,
                budget,
                actor,
                json,
            } = *args;
            let input = serde_json::from_str(&input)
                .map_err(|e| refuse(format!("--input is not valid JSON ({e})")))?;
            let duration =
                |s: &str, what: &str| agentq_app::time::parse_duration(s, what).map_err(refuse);
            let new = NewSchedule {
                name,
                kind,
                input,
                tenant: Some(tenant),
                time_zone: cron.as_ref().map(|_| tz),
                cron,
                interval_secs: every.map(|e| duration(&e, "--every")).transpose()?,
                overlap: Some(
                    overlap
                        .parse::<Overlap>()
                        .map_err(|e| refuse(format!("--overlap: {e}")))?,
                ),
                catchup_window_secs: Some(duration(&catch_up, "--catch-up")?),
                lane: Some(lane),
                max_attempts,
                paused,
                budget: budget.request()?,
            };
            let (app, caller) = cli_app(&config, &actor).await?;
            let added = schedules::add(&app, &caller, new).await;
            print(&done(app, added).await?, json, "added")
        }
        SchedulesCommand::List { tenant, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let listed = schedules::list(&app, &caller, tenant.as_deref()).await;
            for s in done(app, listed).await? {
                if json {
                    println!("{}", serde_json::to_string(&s)?);
                } else {
                    print_line(&s);
                }
            }
            Ok(())
        }
        SchedulesCommand::Pause(r) => control(&config, r, Control::Pause).await,
        SchedulesCommand::Resume(r) => control(&config, r, Control::Resume).await,
        SchedulesCommand::Delete(r) => control(&config, r, Control::Delete).await,
    }
}

async fn control(config: &Deployment, r: ScheduleRef, what: Control) -> anyhow::Result<()> {
    let (app, caller) = cli_app(config, &r.actor).await?;
    let done_now = async {
        let id =
            agentq_app::names::resolve_schedule(&app, &caller, &r.id, r.tenant.as_deref()).await?;
        schedules::control(&app, &caller, id, what).await
    }
    .await;
    print(&done(app, done_now).await?, r.json, what.done())
}

fn print(s: &ScheduleView, json: bool, what: &str) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
    } else {
        println!("{what} schedule {}", s.schedule.schedule_id);
        print_line(s);
    }
    Ok(())
}

fn print_line(v: &ScheduleView) {
    let s = &v.schedule;
    let next = if s.paused {
        "paused".to_string()
    } else if !v.next_firings.is_empty() {
        let at: Vec<String> = v
            .next_firings
            .iter()
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .collect();
        format!("next {}", at.join(", "))
    } else {
        "no tick left".to_string()
    };
    println!(
        "{} {:<16} {:<24} {:<12} {} overlap {} · {next} · fired {}, skipped {} (overlap) {} (missed) {} (tenant at its cap)",
        s.schedule_id,
        s.tenant,
        s.name,
        s.kind,
        v.when(),
        s.overlap,
        s.fired,
        s.skipped_overlap,
        s.skipped_missed,
        s.skipped_capacity,
    );
}
