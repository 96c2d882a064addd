//! The words of `agentq why`: an answer's headline and evidence lines, which every front end
//! shows as they are.

use agentq_core::db::why as facts;
use agentq_core::state::Status;
use chrono::{DateTime, Utc};

use super::Reason;

fn t(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn ago(at: DateTime<Utc>) -> String {
    let secs = (Utc::now() - at).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s => format!("{} h", s / 3600),
    }
}

fn error(class: &Option<String>, message: &Option<String>) -> Option<String> {
    class.as_ref().map(|c| {
        format!(
            "last error: [{c}] {}",
            message.as_deref().unwrap_or_default()
        )
    })
}

/// The headline and evidence lines of an answer: the text every front end shows.
pub fn describe(r: &Reason) -> (String, Vec<String>) {
    match r {
        Reason::Running {
            worker,
            since,
            attempt,
            max_attempts,
            lease_until,
        } => (
            format!(
                "running on worker {} since {} (attempt {attempt} of {max_attempts})",
                worker.as_deref().unwrap_or("?"),
                since.map(t).unwrap_or_else(|| "?".into())
            ),
            lease_until
                .map(|l| format!("lease until {}", t(l)))
                .into_iter()
                .collect(),
        ),
        Reason::Finished {
            status,
            at,
            error_class,
            error_message,
        } => (
            format!(
                "finished: {status} at {}",
                at.map(t).unwrap_or_else(|| "?".into())
            ),
            error(error_class, error_message).into_iter().collect(),
        ),
        Reason::Sleeping { until } => (
            format!("sleeping until {}", t(*until)),
            vec!["the scheduler queues it when the sleep is over".into()],
        ),
        Reason::WaitingForSignal {
            signal,
            timeout_at,
            pending,
        } => (
            format!(
                "waiting for signal {signal:?} (timeout at {})",
                t(*timeout_at)
            ),
            vec![match pending {
                0 => format!("no signal {signal:?} sent yet: `agentq signal OP {signal}`"),
                n => format!("{n} signal {signal:?} pending: the scheduler's next pass wakes it"),
            }],
        ),
        Reason::WaitingForRateLimit {
            scope,
            limit,
            reopens_at,
            window_tokens,
            max_tokens,
            window_requests,
            max_requests,
            window_secs,
        } => (
            format!(
                "waiting for rate limit {scope} {limit}: its window reopens at {}; the \
                 scheduler wakes it just before (or as soon as the limit changes)",
                t(*reopens_at)
            ),
            vec![
                format!(
                    "its next model call did not fit the window and was not sent; the window \
                     ({window_secs} s) holds {}",
                    [
                        max_tokens.map(|m| format!("{window_tokens} of {m} tokens")),
                        max_requests.map(|m| format!("{window_requests} of {m} requests")),
                    ]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(" and ")
                ),
                "an admin raises the limit (`agentq limits set --scope SCOPE --name NAME \
                 --tokens N`); a smaller max_tokens on the call reserves less"
                    .into(),
            ],
        ),
        Reason::WaitingForBudget {
            scope,
            limit_tokens,
            spent_tokens,
            held_tokens,
            measure,
            timeout_at,
        } => (
            if scope == "tenant" {
                format!(
                    "waiting for its tenant's token budget: {spent_tokens} of {limit_tokens} \
                     {measure} tokens spent this period ({held_tokens} held); runs again when \
                     the period ends at {}, or when an admin raises it",
                    t(*timeout_at)
                )
            } else if scope == "ancestor" || scope == "batch" {
                let whose = if scope == "batch" {
                    "its tree's batch's"
                } else {
                    "an operation's above it in its tree"
                };
                format!(
                    "waiting for {whose} token budget: {spent_tokens} of {limit_tokens} \
                     {measure} tokens spent ({held_tokens} held); dead as budget_exceeded at {} \
                     unless raised",
                    t(*timeout_at)
                )
            } else {
                format!(
                    "waiting for its token budget: {spent_tokens} of {limit_tokens} {measure} \
                     tokens spent ({held_tokens} held); dead as budget_exceeded at {} unless \
                     raised",
                    t(*timeout_at)
                )
            },
            vec![
                "its next model call does not fit the budget and was not sent".into(),
                if scope == "tenant" {
                    "an admin raises it: `agentq budget set --tenant T --period P \
                     --budget-tokens N`"
                        .into()
                } else if scope == "ancestor" || scope == "batch" {
                    "raise it where it is set (`agentq budget show OP` lists the budgets over \
                     an operation); a raise queues again what waits for it below"
                        .into()
                } else {
                    "raise it: `agentq budget set OP --budget-tokens N`, or let one call \
                     through: `agentq budget allow-once OP`"
                        .into()
                },
            ],
        ),
        Reason::WaitingForChildren {
            children,
            unfinished,
        } => (
            format!(
                "waiting on a join of {children} children ({} unfinished)",
                unfinished.len()
            ),
            unfinished
                .iter()
                .map(|c| format!("child {} is {}", c.id, c.status))
                .collect(),
        ),
        Reason::NotDue {
            retry_at,
            error_class,
            error_message,
        } => (
            format!("not due: retries at {}", t(*retry_at)),
            error(error_class, error_message).into_iter().collect(),
        ),
        Reason::Debouncing {
            debounce_key,
            starts_at,
            latest,
            joined,
        } => (
            format!(
                "not due: debouncing on key {debounce_key:?}; starts at {} unless a newer \
                 arrival of the key pushes it back",
                t(*starts_at)
            ),
            vec![
                format!("{joined} later arrival(s) replaced its input (last wins)"),
                format!(
                    "starts no later than {} (first arrival + max_delay)",
                    t(*latest)
                ),
            ],
        ),
        Reason::BreakerOpen {
            provider,
            may_close_at,
            retry_at,
        } => (
            format!(
                "not due: the model circuit breaker was open; may close at {}",
                t(*may_close_at)
            ),
            vec![
                format!("model provider {provider} failed repeatedly; its calls were parked"),
                format!("retries at {} (the attempt was given back)", t(*retry_at)),
            ],
        ),
        Reason::ServiceDown {
            service,
            detail,
            retry_at,
        } => (
            format!(
                "not due: remote service {service:?} is unavailable; calls it again at {}",
                t(*retry_at)
            ),
            vec![
                detail.clone(),
                "the attempt was given back: an operation fails only for what the service answers"
                    .into(),
                format!("`agentq services list` shows where {service:?} is registered"),
            ],
        ),
        Reason::Version {
            kind,
            pinned,
            newest_live,
            workers,
            version_parked,
        } => {
            let headline = match pinned {
                Some(v) => format!("version: no live worker runs {kind}@{v} (its pinned version)"),
                None => format!("version: no live worker runs kind {kind}"),
            };
            let mut lines: Vec<String> = workers
                .iter()
                .map(|w| format!("worker {} runs {kind}@{}", w.worker, w.versions.join(", @")))
                .collect();
            if let Some(n) = newest_live {
                lines.push(format!("newest live version of {kind}: {n}"));
            }
            if workers.is_empty() {
                lines.push(format!("no live worker runs any version of {kind}"));
            }
            if *version_parked {
                lines.push("a worker refused its pointer for its version (version_parked)".into());
            }
            lines.push(
                "start a worker of that version, or `agentq versions upgrade` it to a live one"
                    .into(),
            );
            (headline, lines)
        }
        Reason::OrderingKey { key, holder } => (
            format!("ordering key {key:?}: operation {} goes first", holder.id),
            vec![match (&holder.status, &holder.worker) {
                (Status::Running, w) => format!(
                    "{} is running on worker {} since {} ({})",
                    holder.id,
                    w.as_deref().unwrap_or("?"),
                    t(holder.since),
                    ago(holder.since)
                ),
                (s, _) => format!(
                    "{} is {s} (since {}, {})",
                    holder.id,
                    t(holder.since),
                    ago(holder.since)
                ),
            }],
        ),
        Reason::ConcurrencyKey {
            key,
            running,
            limit,
            ahead,
        } => (
            format!("concurrency key {key:?} is at its limit ({running} of {limit} running)"),
            vec![format!(
                "{ahead} queued operations of the key start before it"
            )],
        ),
        Reason::Paused { pause } => (
            format!("paused: {}", pause.describe()),
            vec![
                format!(
                    "paused by {} at {}: {}",
                    pause.paused_by,
                    pause.paused_at.to_rfc3339(),
                    pause.reason
                ),
                format!(
                    "`agentq resume --pause {}` (or `agentq pauses` to see every pause) lets it run",
                    pause.pause_id
                ),
            ],
        ),
        Reason::Batch {
            batch_id,
            batch_status,
            paused_reason,
        } => (
            format!("batch {batch_id} is {batch_status}"),
            paused_reason
                .iter()
                .cloned()
                .chain(std::iter::once(match batch_status.as_str() {
                    "paused" => format!("`agentq batch resume {batch_id}` starts it again"),
                    _ => "a cancelled batch starts nothing more".to_string(),
                }))
                .collect(),
        ),
        Reason::TenantShare {
            tenant,
            lane,
            running_in_lane,
            others_queued,
            share,
        } => (
            format!("held for fair share: tenant {tenant} is at its share of the {lane} lane"),
            vec![
                format!(
                    "tenant {tenant} runs {running_in_lane} operations in the {lane} lane{}",
                    share
                        .map(|s| format!(
                            "; its share is {:.0}% of each worker's lane slots",
                            s * 100.0
                        ))
                        .unwrap_or_default()
                ),
                match others_queued {
                    true => {
                        "other tenants have work queued in the lane (AGENTQ_TENANT_SHARE)".into()
                    }
                    false => "no other tenant waits now: a worker takes it within a second".into(),
                },
            ],
        ),
        Reason::Ready {
            lane,
            dispatched,
            queued_ahead,
            live_workers,
        } => {
            let ahead = match *queued_ahead {
                n if n >= facts::AHEAD_CAP => format!("at least {n}"),
                n => n.to_string(),
            };
            (
                match dispatched {
                    true => "queued and ready: waiting for a free worker slot".into(),
                    false => "queued and ready: not yet dispatched to a worker".into(),
                },
                vec![
                    format!("{ahead} due operations queued ahead of it in the {lane} lane"),
                    format!("{live_workers} live workers run its kind"),
                ],
            )
        }
    }
}
