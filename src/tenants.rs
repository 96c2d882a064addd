//! `agentq tenants kinds`: which kinds a tenant may create operations of (an admin's list per
//! tenant, and the default list `*` for tenants without one). The flow is
//! `agentq_app::tenants`; this module parses flags and prints.

use agentq_app::tenants::{self, Allow, TenantKinds};
use clap::Subcommand;

use crate::wiring::{Deployment, cli_app, done, refuse};

#[derive(Subcommand)]
pub enum TenantsCommand {
    /// Show or set the kinds a tenant may create operations of (by any way: enqueue, webhook,
    /// batch, schedule, spawn). Without a flag: show them.
    Kinds {
        /// The tenant, or `*` for the default list (of tenants without a list of their own).
        tenant: String,
        /// Allow exactly these kinds (comma-separated; `--allow ''` allows none).
        #[arg(long, conflicts_with_all = ["production", "unset"])]
        allow: Option<String>,
        /// Allow every kind this deployment runs that is not for tests (as of now).
        #[arg(long, conflicts_with = "unset")]
        production: bool,
        /// Remove the tenant's own list: the default list applies (for `*`: every kind).
        #[arg(long)]
        unset: bool,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(config: Deployment, cmd: TenantsCommand) -> anyhow::Result<()> {
    let TenantsCommand::Kinds {
        tenant,
        allow,
        production,
        unset,
        actor,
        json,
    } = cmd;
    let change = match (allow, production, unset) {
        (Some(list), _, _) => Some(Allow::Kinds(
            list.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect(),
        )),
        (None, true, _) => Some(Allow::Production),
        (None, false, true) => Some(Allow::Unset),
        (None, false, false) => None,
    };
    if change.is_none() && actor.is_some() {
        return Err(refuse(
            "--as names who makes a change: give --allow, --production or --unset",
        ));
    }
    let (app, caller) = cli_app(&config, &actor).await?;
    let shown = match change {
        Some(allow) => tenants::set_kinds(&app, &caller, &tenant, allow).await,
        None => tenants::kinds(&app, &caller, &tenant).await,
    };
    let k = done(app, shown).await?;
    if json {
        println!("{}", serde_json::to_string(&k)?);
    } else {
        print(&k);
    }
    Ok(())
}

fn print(k: &TenantKinds) {
    let who = if k.tenant == "*" {
        "tenants without a list of their own".to_string()
    } else {
        format!("tenant {}", k.tenant)
    };
    match (&k.allowed, k.source.as_str()) {
        (None, _) => println!("{who} may create operations of every kind"),
        (Some(kinds), source) => println!(
            "{who} may create operations of {}{}",
            if kinds.is_empty() {
                "no kind".to_string()
            } else {
                kinds.join(", ")
            },
            if source == "default" {
                " (the default list)"
            } else {
                ""
            }
        ),
    }
    if !k.paused_schedules.is_empty() {
        println!(
            "paused {} schedule(s) of kinds no longer allowed: {}",
            k.paused_schedules.len(),
            k.paused_schedules
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
