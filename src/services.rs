//! `agentq services`: register, list and remove the services remote kinds run in (kinds
//! written in any language, called over the step protocol: docs/protocol.md). The flows are
//! `agentq_app::services`; this module parses flags and prints.

use agentq_app::services::{self, ServiceRequest, ServiceView};
use clap::Subcommand;

use crate::wiring::{Deployment, cli_app, done};

#[derive(Subcommand)]
pub enum ServicesCommand {
    /// Register the service at --url (or register its new manifest: how a service deploys a
    /// new version): agentq fetches `{url}/agentq/manifest` and serves the kinds it lists.
    /// A new service without --secret gets a new secret, printed once: start the service with
    /// it (AGENTQ_SERVICE_SECRET). Audited.
    Add {
        /// The service's base URL, e.g. http://127.0.0.1:8000.
        #[arg(long)]
        url: String,
        /// The signing secret (whsec_…) the service was started with.
        #[arg(long)]
        secret: Option<String>,
        /// How long a call may take before it fails as retryable (default 300).
        #[arg(long)]
        timeout_secs: Option<i32>,
        /// Let the URL lead to a link-local or cloud metadata address (169.254.169.254,
        /// fd00:ec2::254, 100.100.100.200), which agentq otherwise never calls.
        #[arg(long)]
        allow_link_local: bool,
        /// Who acts (default: the OS user).
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// The registered services and the kinds each serves.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Compare each service's live manifest with its registration (the scheduler does it every
    /// minute) and record what differs: a deploy not registered again. Exits 1 when one
    /// differs.
    Check {
        /// Only this service.
        name: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a service (audited): its kinds are no longer accepted, and operations of them
    /// wait until a service serves them again.
    Remove {
        name: String,
        #[arg(long = "as")]
        actor: Option<String>,
    },
}

fn print(s: &ServiceView) {
    let kinds: Vec<String> = s
        .kinds
        .iter()
        .map(|k| format!("{} v{}", k.name, k.version))
        .collect();
    println!(
        "{:<20} {:<36} timeout {:>5} s  kinds: {}",
        s.name,
        s.url,
        s.timeout_secs,
        kinds.join(", ")
    );
    for d in &s.drift {
        let at = s
            .checked_at
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
            .unwrap_or_default();
        println!("  DRIFT (checked {at}): {d}");
    }
    if !s.drift.is_empty() {
        println!(
            "  register it again to serve what it serves now: agentq services add --url {}",
            s.url
        );
    }
    for t in &s.tools {
        let reconcile = if t.reconcile { ", reconciles" } else { "" };
        println!(
            "  tool {:<16} {}{reconcile}  {}",
            t.name,
            t.replay.as_str(),
            t.description
        );
    }
}

pub async fn run(config: Deployment, cmd: ServicesCommand) -> anyhow::Result<()> {
    match cmd {
        ServicesCommand::Add {
            url,
            secret,
            timeout_secs,
            allow_link_local,
            actor,
            json,
        } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let request = ServiceRequest {
                url,
                secret,
                timeout_secs,
                allow_link_local,
            };
            let registered = services::register(&app, &caller, &request).await;
            let r = done(app, registered).await?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
                return Ok(());
            }
            print(&r.service);
            println!(
                "{} service {}; every role serves its kinds within a few seconds",
                if r.replaced {
                    "re-registered"
                } else {
                    "registered"
                },
                r.service.name
            );
            if let Some(secret) = r.secret {
                println!("signing secret (shown once; start the service with it):");
                println!("  AGENTQ_SERVICE_SECRET={secret}");
            }
            Ok(())
        }
        ServicesCommand::List { json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let listed = services::list(&app, &caller).await;
            let all = done(app, listed).await?;
            if json {
                println!("{}", serde_json::to_string(&all)?);
            } else if all.is_empty() {
                println!("no services: `agentq services add --url URL` registers one");
            } else {
                all.iter().for_each(print);
            }
            Ok(())
        }
        ServicesCommand::Check { name, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let checked = services::check(&app, &caller, name.as_deref()).await;
            let all = done(app, checked).await?;
            if json {
                println!("{}", serde_json::to_string(&all)?);
            } else if all.is_empty() {
                println!("no services: `agentq services add --url URL` registers one");
            }
            for c in all.iter().filter(|_| !json) {
                match (&c.unreachable, c.drift.is_empty()) {
                    (Some(why), _) => println!("{}: not checked: {why}", c.name),
                    (None, true) => println!("{}: serves what is registered", c.name),
                    (None, false) => {
                        println!(
                            "{}: DRIFT: its live manifest differs from its registration",
                            c.name
                        );
                        c.drift.iter().for_each(|d| println!("  {d}"));
                        println!("  register it again: agentq services add --url URL");
                    }
                }
            }
            let drifted = all.iter().filter(|c| !c.drift.is_empty()).count();
            if drifted > 0 {
                anyhow::bail!(
                    "{drifted} service(s) serve another manifest than registered (`agentq services add --url URL` registers what they serve now)"
                );
            }
            Ok(())
        }
        ServicesCommand::Remove { name, actor } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let removed = services::remove(&app, &caller, &name).await;
            done(app, removed).await?;
            println!("removed service {name}");
            Ok(())
        }
    }
}
