//! `agentq budget`: set or raise an operation's or a batch's token budget, let an operation's
//! next refused model call through once, show the budgets over an operation. The flows are
//! `agentq_app::budgets`; this module parses flags and prints.

use agentq_app::budgets::{self, BudgetRequest, Measure};
use clap::{Args, Subcommand};

use crate::wiring::{Deployment, cli_app, done};

/// A budget as flags.
#[derive(Args, Clone, Debug)]
pub struct BudgetFlags {
    /// Tokens the budget allows.
    #[arg(long = "budget-tokens", value_name = "N")]
    pub tokens: Option<i64>,
    /// Which tokens count: input (prompt), output (completion) or total (default).
    #[arg(long = "budget-measure", value_name = "MEASURE", value_parser = parse_measure)]
    pub measure: Option<Measure>,
    /// How long an operation the budget refuses waits for a raise before it is dead
    /// (budget_exceeded): 90s, 30m, 2h, 3d (default 1d).
    #[arg(long = "budget-timeout", value_name = "DURATION")]
    pub timeout: Option<String>,
}

fn parse_measure(s: &str) -> Result<Measure, String> {
    Measure::parse(s).ok_or_else(|| format!("{s:?}: use input, output or total"))
}

impl BudgetFlags {
    /// The budget these flags ask for: none without `--budget-tokens`.
    pub fn request(&self) -> anyhow::Result<Option<BudgetRequest>> {
        let Some(tokens) = self.tokens else {
            if self.measure.is_some() || self.timeout.is_some() {
                return Err(crate::wiring::refuse(
                    "--budget-measure and --budget-timeout need --budget-tokens",
                ));
            }
            return Ok(None);
        };
        let timeout_secs = match &self.timeout {
            None => None,
            Some(t) => Some(
                agentq_app::time::parse_duration(t, "--budget-timeout")
                    .ok()
                    .and_then(|s| i32::try_from(s).ok())
                    .ok_or_else(|| {
                        crate::wiring::refuse(format!(
                            "--budget-timeout {t:?}: use a duration like 90s, 30m, 2h, 3d (at most 30d)"
                        ))
                    })?,
            ),
        };
        Ok(Some(BudgetRequest {
            tokens,
            measure: self.measure,
            timeout_secs,
        }))
    }
}

#[derive(Subcommand)]
pub enum BudgetCommand {
    /// Set or raise a token budget: of an operation (OP), of a batch (--batch), or of a tenant
    /// per period (--tenant T --period 1d, an admin's). What waits for it is queued again; a
    /// batch its budget paused needs `batch resume`.
    Set {
        /// The operation's id.
        #[arg(required_unless_present_any = ["batch", "tenant"], conflicts_with_all = ["batch", "tenant"])]
        op: Option<String>,
        /// The batch's id or name.
        #[arg(long)]
        batch: Option<String>,
        /// With --batch: the tenant whose batch of that name is meant. Alone: the tenant's own
        /// budget per --period.
        #[arg(long)]
        tenant: Option<String>,
        /// A tenant's budget period (1h, 1d, 7d): its spend starts again at each period's
        /// start (periods are aligned to multiples of their length since the Unix epoch).
        #[arg(long, conflicts_with = "batch", requires = "tenant")]
        period: Option<String>,
        #[command(flatten)]
        budget: BudgetFlags,
        /// Kept in the audit trail.
        #[arg(long)]
        reason: Option<String>,
        /// Who acts (default: the OS user).
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Let the next model call an operation's own budget refuses through, once (audited), and
    /// queue it again if it waits for its budget.
    AllowOnce {
        op: String,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// The budgets over an operation (its own, its batch's, its tenant's), or with --tenant a
    /// tenant's budget per period: spent and held in the current period, when it ends.
    Show {
        #[arg(required_unless_present = "tenant", conflicts_with = "tenant")]
        op: Option<String>,
        /// A tenant's budget per period instead of an operation's.
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(config: Deployment, cmd: BudgetCommand) -> anyhow::Result<()> {
    match cmd {
        BudgetCommand::Set {
            op,
            batch,
            tenant,
            period,
            budget,
            reason,
            actor,
            json,
        } => {
            let Some(request) = budget.request()? else {
                return Err(crate::wiring::refuse(
                    "say how many tokens: --budget-tokens N",
                ));
            };
            let period = match (&op, &batch, &tenant, &period) {
                (None, None, Some(_), Some(p)) => Some(
                    agentq_app::time::parse_duration(p, "--period")
                        .ok()
                        .and_then(|s| i32::try_from(s).ok())
                        .ok_or_else(|| {
                            crate::wiring::refuse(format!(
                                "--period {p:?}: use a duration like 1h, 1d, 7d (at most 30d)"
                            ))
                        })?,
                ),
                (None, None, Some(_), None) => {
                    return Err(crate::wiring::refuse(
                        "a tenant's budget needs --period (1h, 1d, 7d); a batch's needs --batch",
                    ));
                }
                _ => None,
            };
            let (app, caller) = cli_app(&config, &actor).await?;
            let set = async {
                match (&op, &batch) {
                    (None, None) => {
                        let (tenant, period) = (
                            tenant.as_deref().expect("checked above"),
                            period.expect("checked above"),
                        );
                        budgets::set_for_tenant(
                            &app,
                            &caller,
                            tenant,
                            period,
                            &request,
                            reason.as_deref(),
                        )
                        .await
                    }
                    (Some(op), _) => {
                        let op = agentq_app::operations::parse_id(op)?;
                        budgets::set_for_operation(&app, &caller, op, &request, reason.as_deref())
                            .await
                    }
                    (None, Some(b)) => {
                        budgets::set_for_batch(
                            &app,
                            &caller,
                            b,
                            tenant.as_deref(),
                            &request,
                            reason.as_deref(),
                        )
                        .await
                    }
                }
            }
            .await;
            let set = done(app, set).await?;
            if json {
                println!("{}", serde_json::to_string(&set)?);
            } else {
                println!("{}", set.summary());
            }
            Ok(())
        }
        BudgetCommand::AllowOnce { op, reason, actor } => {
            let (app, caller) = cli_app(&config, &actor).await?;
            let allowed = async {
                let op = agentq_app::operations::parse_id(&op)?;
                budgets::allow_once(&app, &caller, op, reason.as_deref()).await
            }
            .await;
            let resumed = done(app, allowed).await?;
            println!(
                "the next call its budget refuses will be let through{}",
                if resumed {
                    "; the operation is queued again"
                } else {
                    ""
                }
            );
            Ok(())
        }
        BudgetCommand::Show { op, tenant, json } => {
            let (app, caller) = cli_app(&config, &None).await?;
            let shown = async {
                match op {
                    Some(op) => {
                        let op = agentq_app::operations::parse_id(&op)?;
                        budgets::over_operation(&app, &caller, op).await
                    }
                    None => Ok(vec![
                        budgets::of_tenant(&app, &caller, tenant.as_deref()).await?,
                    ]),
                }
            }
            .await;
            let shown = done(app, shown).await?;
            for b in &shown {
                if json {
                    println!("{}", serde_json::to_string(b)?);
                } else {
                    println!(
                        "{:<9} {} of {} {} tokens spent, {} held{}{}{}",
                        b.scope,
                        b.spent_tokens,
                        b.limit_tokens,
                        b.measure,
                        b.held_tokens,
                        match b.estimated_calls {
                            0 => String::new(),
                            n => format!(" ({n} calls charged by estimate)"),
                        },
                        match b.exceeded_at {
                            Some(t) => format!("; refused a call since {}", t.to_rfc3339()),
                            None => String::new(),
                        },
                        match b.period_ends {
                            Some(t) => format!("; this period ends {}", t.to_rfc3339()),
                            None => String::new(),
                        }
                    );
                }
            }
            if shown.is_empty() && !json {
                println!("no token budget is over this operation");
            }
            Ok(())
        }
    }
}
