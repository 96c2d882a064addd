//! The bulk forms' loop (`agentq dlq retry|discard`, `agentq versions upgrade`): one
//! application-layer call per selected item at a chosen rate, behind a progress bar, each
//! result reported as it comes; a refusal is counted and the loop goes on, a failure stops it.
//! Ctrl-C stops it between two items, saying how many were done and that running the same
//! command again acts on what is left (the selection is read again).

use std::io::IsTerminal;
use std::time::Duration;

use agentq_app::{self as app, AppError};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use uuid::Uuid;

use crate::interrupt::{Interrupt, Interrupted};
use crate::wiring::refuse;

/// The flags of every bulk form.
#[derive(Args, Clone)]
pub struct BulkArgs {
    /// Act on everything the filters select (at most --max), even with no filter.
    #[arg(long)]
    pub all: bool,
    /// Show what would be done; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Actions per second (e.g. 50 or 50/s).
    #[arg(long, default_value = "100/s")]
    pub rate: String,
    /// Most items one filtered run acts on.
    #[arg(long, default_value_t = 10_000)]
    pub max: i64,
    /// Who is acting (default: the OS user).
    #[arg(long = "as")]
    pub actor: Option<String>,
    /// Why (kept in the audit trail; required for discard).
    #[arg(long)]
    pub reason: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// Parses `--rate` (`50` or `50/s`).
pub fn parse_rate(s: &str) -> anyhow::Result<f64> {
    let n = s.trim().trim_end_matches("/s").trim();
    match n.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(refuse(format!(
            "--rate {s:?}: use a positive number of actions per second, e.g. 50/s"
        ))),
    }
}

/// Calls `act` for each of `targets`, at most `rate` per second; `report` prints each outcome
/// (an error for a refused one). `verb` labels the bar, `done` the closing counts, `what` the
/// items ("dead letters"). Stops at the first failure that is not a refusal.
pub async fn each<T, F, Fut>(
    app: &app::App,
    targets: &[Uuid],
    rate: f64,
    (verb, done, what): (&str, &str, &str),
    mut act: F,
    report: impl Fn(Uuid, Result<&T, &AppError>),
) -> anyhow::Result<()>
where
    F: FnMut(Uuid) -> Fut,
    Fut: std::future::Future<Output = app::Result<T>>,
{
    let bar = ProgressBar::with_draw_target(
        Some(targets.len() as u64),
        if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(verb.to_string());
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let interrupt = Interrupt::install();
    let (mut ok, mut failed) = (0usize, 0usize);
    for (n, id) in targets.iter().enumerate() {
        ticks.tick().await;
        if interrupt.requested() {
            bar.finish_and_clear();
            app.dispatcher.close().await;
            return Err(Interrupted(format!(
                "{done} {ok}, failed {failed}, {} of {} {what} not acted on; run the same \
                 command again to act on what is left",
                targets.len() - n,
                targets.len()
            ))
            .into());
        }
        match act(*id).await {
            Ok(outcome) => {
                ok += 1;
                bar.suspend(|| report(*id, Ok(&outcome)));
            }
            Err(e) if e.is_refusal() => {
                failed += 1;
                bar.suspend(|| report(*id, Err(&e)));
            }
            Err(e) => {
                bar.finish_and_clear();
                app.dispatcher.close().await;
                return Err(crate::wiring::cli_error(e));
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    app.dispatcher.close().await;
    eprintln!("{done} {ok}, failed {failed}");
    if failed > 0 {
        if targets.len() == 1 {
            return Err(refuse(format!("the {verb} was refused (see above)")));
        }
        anyhow::bail!("{failed} of {} {what} could not be {done}", targets.len());
    }
    Ok(())
}
