//! `agentq limits`: set, remove and list rate limits (tokens and requests of model calls per
//! window, for a model or provider, a tenant, or a key operations name). The flows are
//! `agentq_app::rate_limits`; this module parses flags and prints.

use agentq_app::rate_limits::{self, LimitRequest, LimitScope, LimitView};
use clap::Subcommand;

use crate::wiring::{Deployment, cli_app, done, refuse};

fn parse_scope(s: &str) -> Result<LimitScope, String> {
    LimitScope::parse(s).ok_or_else(|| format!("{s:?}: use model, tenant or key"))
}

/// Which limit: its scope and name, and the tenant whose key it is.
#[derive(clap::Args, Debug)]
pub struct LimitName {
    #[arg(long, value_parser = parse_scope)]
    scope: LimitScope,
    #[arg(long)]
    name: String,
    /// The tenant whose key it is (--scope key).
    #[arg(long)]
    tenant: Option<String>,
}

#[derive(Subcommand)]
pub enum LimitsCommand {
    /// Set (or replace) a limit: at most --tokens tokens and/or --requests model calls in any
    /// window of --window, shared by every worker. `--scope model --name gpt-4o-mini` (a model;
    /// or a provider's host, or host/model), `--scope tenant --name T`, or `--scope key --name K
    /// --tenant T` (operations enqueued with `--rate-key K`). Audited.
    Set {
        #[command(flatten)]
        limit: LimitName,
        /// Tokens (prompt + completion) in any window.
        #[arg(long)]
        tokens: Option<i64>,
        /// Model calls in any window.
        #[arg(long)]
        requests: Option<i64>,
        /// The window: 10s, 1m (default), 1h.
        #[arg(long, default_value = "1m")]
        window: String,
        /// Kept in the audit trail.
        #[arg(long)]
        reason: Option<String>,
        /// Who acts (default: the OS user).
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a limit (audited).
    Delete {
        #[command(flatten)]
        limit: LimitName,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// The limits, each with what its current window holds.
    List {
        /// Only this tenant's (its key limits and its tenant limit).
        #[arg(long)]
        tenant: Option<String>,
        /// JSON Lines, one limit per line.
        #[arg(long)]
        json: bool,
    },
}

/// One limit in a line of text.
fn line(l: &LimitView) -> String {
    let name = if l.tenant.is_empty() {
        l.name.clone()
    } else {
        format!("{}:{}", l.tenant, l.name)
    };
    let cap = |used: i64, max: Option<i64>, what: &str| max.map(|m| format!("{used}/{m} {what}"));
    let caps: Vec<String> = [
        cap(l.window_tokens, l.max_tokens, "tokens"),
        cap(l.window_requests, l.max_requests, "requests"),
    ]
    .into_iter()
    .flatten()
    .collect();
    format!(
        "{:<7} {:<32} {} per {} s (reservations × {:.2})",
        l.scope,
        name,
        caps.join(", "),
        l.window_secs,
        l.usage_ratio
    )
}

pub async fn run(config: Deployment, cmd: LimitsCommand) -> anyhow::Result<()> {
    match cmd {
        LimitsCommand::Set {
            limit:
                LimitName {
                    scope,
                    name,
                    tenant,
                },
            tokens,
            requests,
            window,
            reason,
            actor,
            json,
        } => {
            let window_secs = agentq_app::time::parse_duration(&window, "--window")
                .ok()
                .and_then(|s| i32::try_from(s).ok())
                .filter(|s| (1..=86_400).contains(s))
                .ok_or_else(|| {
                    refuse(format!(
                        "--window {window:?}: use a duration from 1s to 1d, like 10s, 1m, 1h"
                    ))
                })?;
            if tokens.is_none() && requests.is_none() {
                return Err(refuse(
                    "say what the limit caps: --tokens N, --requests N, or both",
                ));
            }
            let request = LimitRequest {
                scope,
                name,
                tenant,
                window_secs: Some(window_secs),
                max_tokens: tokens,
                max_requests: requests,
                reason,
            };
            let (app, caller) = cli_app(&config, &actor).await?;
            let set = rate_limits::set(&app, &caller, &request).await;
            let set = done(app, set).await?;
            if json {
                println!("{}", serde_json::to_string(&set)?);
            } else {
                println!("{}", line(&set));
            }
            Ok(())
        }
        LimitsCommand::Delete {
            limit:
                LimitName {
                    scope,
                    name,
                    tenant,
                },
            actor,
        } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let gone = rate_limits::delete(&app, &caller, scope, &name, tenant.as_deref()).await;
            done(app, gone).await?;
            println!("removed the {} rate limit {name:?}", scope.as_str());
            Ok(())
        }
        LimitsCommand::List { tenant, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let listed = rate_limits::list(&app, &caller, tenant.as_deref()).await;
            let listed = done(app, listed).await?;
            for l in &listed {
                if json {
                    println!("{}", serde_json::to_string(l)?);
                } else {
                    println!("{}", line(l));
                }
            }
            if listed.is_empty() && !json {
                println!("no rate limits");
            }
            Ok(())
        }
    }
}
