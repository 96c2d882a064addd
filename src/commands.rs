//! The subcommands. Each builds what it needs from [`Config`] and calls into the library crates;
//! none contains SQL or AMQP.

use agentq_app::operations::{EnqueueRequest, Signalled};
use agentq_core::operation::{OperationId, OperationView, StepView};
use agentq_core::telemetry;
use anyhow::Context;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::cli::{Cli, Command, EnqueueArgs, ListArgs};
use crate::wiring::{
    Deployment, app, cli_app, cli_error, connect_deployment, connect_serving, done, flag_error_app,
    parse_moment, parse_time, refuse, scheduler, shutdown_on_signal, watch_services, worker,
};

/// The user's input was refused: exit code 2, nothing was changed.
pub async fn run(cli: Cli, registry: agentq_worker::Registry) -> anyhow::Result<()> {
    let config = Deployment {
        config: cli.config,
        kinds: registry.into(),
    };
    config.validate().map_err(refuse)?;
    // Process-wide settings of the two clients, before anything connects.
    agentq_core::broker::set_quorum_size(config.quorum_size());
    agentq_app::database::set_call_deadline(std::time::Duration::from_secs(config.db_timeout_secs));
    match cli.command {
        Command::Migrate => {
            agentq_app::database::migrate(&config.database_url)
                .await
                .context("migrating the database")?;
            println!(
                "database migrated: {}",
                agentq_core::config::redact_url(&config.database_url)
            );
            Ok(())
        }
        Command::Worker { concurrency } => {
            let shutdown = shutdown_on_signal();
            let Some(pool) = connect_serving(&config, &shutdown).await? else {
                return Ok(());
            };
            let worker = worker(&config, pool, concurrency)?;
            let progress = vec![worker.progress()];
            with_metrics(&config, None, progress, worker.run(shutdown)).await
        }
        Command::Scheduler => {
            let shutdown = shutdown_on_signal();
            let Some(pool) = connect_serving(&config, &shutdown).await? else {
                return Ok(());
            };
            let scheduler = scheduler(&config, pool.clone());
            watch_services(&config, pool.clone(), &shutdown);
            let progress = vec![scheduler.progress()];
            with_metrics(&config, Some(pool), progress, scheduler.run(shutdown)).await
        }
        Command::Dev => dev(config).await,
        Command::Serve => {
            let shutdown = shutdown_on_signal();
            let Some(pool) = connect_serving(&config, &shutdown).await? else {
                return Ok(());
            };
            let metrics_pool = pool.clone();
            with_metrics(
                &config,
                Some(metrics_pool),
                Vec::new(),
                agentq_http::serve(&config, app(&config, pool, "api"), &config.listen, shutdown),
            )
            .await
        }
        Command::Enqueue(args) => enqueue(config, args).await,
        Command::Status {
            op,
            json,
            show_input,
        } => status(config, &op, json, show_input).await,
        Command::Why { op, json } => crate::why::run(config, &op, json).await,
        Command::List(args) => list(&config, args).await,
        Command::Steps { op, json } => steps(config, &op, json).await,
        Command::Signal {
            op,
            name,
            payload,
            actor,
            json,
        } => {
            let payload: serde_json::Value = serde_json::from_str(&payload)
                .map_err(|e| refuse(format!("--payload is not valid JSON ({e})")))?;
            signal(&config, &op, &name, payload, &actor, json).await
        }
        Command::Approve {
            op,
            actor,
            reason,
            json,
        } => approval(&config, &op, true, actor, reason, json).await,
        Command::Reject {
            op,
            actor,
            reason,
            json,
        } => approval(&config, &op, false, actor, reason, json).await,
        Command::Cancel {
            op,
            actor,
            reason,
            json,
        } => cancel(&config, &op, &actor, reason.as_deref(), json).await,
        Command::Usage {
            tenant,
            since,
            json,
        } => {
            let since = since
                .as_deref()
                .map(|s| parse_moment(s, "--since", false))
                .transpose()?;
            let (app, caller) = cli_app(&config, &None).await?;
            let summed = agentq_app::usage::summary(&app, &caller, tenant.as_deref(), since).await;
            let rows = done(app, summed).await?;
            for r in rows {
                if json {
                    println!("{}", serde_json::to_string(&r)?);
                } else {
                    println!(
                        "{:<20} {:<14} {:>8} operations {:>8} model calls {:>12} prompt {:>12} completion tokens{}",
                        r.tenant,
                        r.kind,
                        r.operations,
                        r.model_calls,
                        r.prompt_tokens,
                        r.completion_tokens,
                        if r.unreported_calls > 0 {
                            format!(
                                " ({} calls uncounted: the provider reported no usage)",
                                r.unreported_calls
                            )
                        } else {
                            String::new()
                        }
                    );
                }
            }
            Ok(())
        }
        Command::Tokens(cmd) => crate::access::tokens(config, cmd).await,
        Command::Webhooks(cmd) => crate::access::webhooks(config, cmd).await,
        Command::Stores(cmd) => crate::access::stores(config, cmd).await,
        Command::Tenants(cmd) => crate::tenants::run(config, cmd).await,
        Command::Dlq(cmd) => crate::dlq::run(config, cmd).await,
        Command::Batch(cmd) => crate::batch::run(config, cmd).await,
        Command::Versions(args) => crate::versions::run(config, args).await,
        Command::Kinds { kind, json } => crate::kinds::run(config, kind, json).await,
        Command::Replay(args) => crate::replay::run(config, args).await,
        Command::Schedules(cmd) => crate::schedules::run(config, cmd).await,
        Command::Pause(args) => crate::pauses::pause(config, args).await,
        Command::Budget(cmd) => crate::budgets::run(config, cmd).await,
        Command::Limits(cmd) => crate::limits::run(config, cmd).await,
        Command::Services(cmd) => crate::services::run(config, cmd).await,
        Command::Resume(args) => crate::pauses::resume(config, args).await,
        Command::Pauses {
            tenant,
            limit,
            after,
            json,
        } => crate::pauses::list(config, tenant, limit, after, json).await,
        #[cfg(feature = "bench")]
        Command::Bench(args) => crate::bench::run(config, args).await,
        #[cfg(not(feature = "bench"))]
        Command::Bench(_) => Err(crate::wiring::refuse(
            "this agentq was built without its benchmarks (a deployment's binary does not link \
             them): build agentq's own binary with them, `cargo build --release --features bench`, \
             and run target/release/agentq bench",
        )),
        // `main` runs it before the runtime; here for completeness.
        Command::Probe { url, timeout_secs } => {
            crate::probe::run(&url, std::time::Duration::from_secs(timeout_secs))
        }
    }
}

/// A pool for `config`, with an error that says what to do when the database is missing.
async fn dev(config: Deployment) -> anyhow::Result<()> {
    agentq_app::database::migrate(&config.database_url)
        .await
        .context("migrating the database")?;
    let pool = connect_deployment(&config).await?;
    let shutdown = shutdown_on_signal();
    tracing::info!(config = %config.redacted(), "agentq dev: worker + scheduler + API in one process");
    tracing::info!(
        "try: agentq enqueue --tenant demo --kind echo --input '{{\"text\":\"hello\"}}' --json"
    );
    let worker = worker(&config, pool.clone(), None)?;
    let scheduler = scheduler(&config, pool.clone());
    watch_services(&config, pool.clone(), &shutdown);
    let progress = vec![worker.progress(), scheduler.progress()];
    let all = async {
        let (w, s, a) = tokio::join!(
            worker.run(shutdown.clone()),
            scheduler.run(shutdown.clone()),
            async {
                let served = agentq_http::serve(
                    &config,
                    app(&config, pool.clone(), "api"),
                    &config.listen,
                    shutdown.clone(),
                )
                .await;
                if served.is_err() {
                    shutdown.cancel();
                }
                served
            }
        );
        w.and(s).and(a)
    };
    with_metrics(&config, Some(pool.clone()), progress, all).await
}

/// Runs `run` while serving `GET /metrics` and `GET /healthz` on `AGENTQ_METRICS_ADDR`, if set
/// (nothing is bound or printed otherwise); the endpoint stops when `run` returns. With `pool`
/// each scrape also reads the database gauges; workers pass none, as they scale out and the
/// gauges would be the same from every one of them. `/healthz` answers 503 when one of
/// `progress` is stale.
async fn with_metrics(
    config: &Deployment,
    pool: Option<PgPool>,
    progress: Vec<std::sync::Arc<agentq_core::health::Progress>>,
    run: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let Some(addr) = config.metrics_addr.as_deref() else {
        return run.await;
    };
    let endpoint = agentq_http::meta::MetricsEndpoint::bind(addr, pool, progress).await?;
    let stop = CancellationToken::new();
    let (ran, served) = tokio::join!(
        async {
            let ran = run.await;
            stop.cancel();
            ran
        },
        endpoint.serve(stop.clone())
    );
    ran.and(served)
}

/// A budget's refusal, its field named as the flag (`--budget-tokens: …`).
fn budget_flag(message: String) -> String {
    if message.contains("timeout") {
        format!("--budget-timeout: {message}")
    } else {
        format!("--budget-tokens: {message}")
    }
}

async fn enqueue(config: Deployment, args: EnqueueArgs) -> anyhow::Result<()> {
    let input: serde_json::Value = serde_json::from_str(&args.input).map_err(|e| {
        refuse(format!(
            "--input is not valid JSON ({e}); pass an object such as '{{\"text\":\"hi\"}}'"
        ))
    })?;
    let deadline = args
        .deadline
        .as_deref()
        .map(|d| parse_time(d, "--deadline"))
        .transpose()?;
    let budget = match args.budget.request()? {
        Some(b) => Some(b.spec().map_err(|e| refuse(budget_flag(e.to_string())))?),
        None => None,
    };
    let debounce = args
        .debounce
        .request(args.debounce_key)
        .spec(agentq_app::debounce::Fields::CLI)
        .map_err(cli_error)?;
    let (app, caller) = cli_app(&config, &None).await?;
    // The enqueue is a span of its own: a child of `TRACEPARENT` when the caller sets one (the
    // OpenTelemetry convention for passing a trace to a process), else the root of a new trace.
    // The operation carries it to the worker, as one created over the API does.
    let span = tracing::info_span!(
        "enqueue",
        otel.kind = "producer",
        tenant = %args.tenant,
        kind = %args.kind
    );
    let incoming = std::env::var("TRACEPARENT")
        .ok()
        .and_then(|t| telemetry::valid_traceparent(&t));
    telemetry::set_parent(&span, incoming.as_deref());
    let req = EnqueueRequest {
        tenant: args.tenant,
        kind: args.kind,
        input,
        dedupe_key: args.key,
        ordering_key: args.ordering_key,
        concurrency_key: args.concurrency_key,
        concurrency_limit: args.concurrency_limit,
        rate_key: args.rate_key,
        lane: args.lane,
        max_attempts: args.max_attempts,
        deadline,
        traceparent: telemetry::traceparent_of(&span).or(incoming),
        budget,
        ..EnqueueRequest::default()
    };
    let result = tracing::Instrument::instrument(
        agentq_app::create::operation(&app, &caller, req, debounce.as_ref()),
        span,
    )
    .await
    .map(|c| (c.op_id, c.created, c.status, c.debounce));
    // The application layer's refusals name the API's fields; here they are flags.
    let result = result.map_err(|e| match e {
        agentq_app::AppError::Invalid { field, message } => {
            let flag = match field.as_str() {
                "Idempotency-Key" => Some("--key"),
                "/deadline" => Some("--deadline"),
                _ => None,
            };
            let message = match flag {
                Some(flag) => format!("{flag}: {message}"),
                None => message,
            };
            agentq_app::AppError::Invalid { field, message }
        }
        other => other,
    });
    let (op_id, created, status, debounce) = done(app, result).await?;
    if args.json {
        let mut out = serde_json::json!({ "op_id": op_id, "created": created, "status": status });
        if let Some(d) = &debounce {
            out["debounce"] = serde_json::to_value(d)?;
        }
        println!("{out}");
    } else {
        use agentq_app::debounce::Folded;
        let verb = match debounce.as_ref().map(|d| d.outcome) {
            Some(Folded::Joined) => "debounced into",
            Some(Folded::Skipped) => "skipped: the key's operation is running,",
            _ if created => "enqueued",
            _ => "already enqueued",
        };
        println!("{verb} {op_id} ({status})");
        if let Some(d) = debounce.as_ref().filter(|d| !d.kept.is_empty()) {
            println!(
                "the pending operation kept its own {} (a join replaces only the input)",
                d.kept.join(", ")
            );
        }
        if let Some(at) = debounce.as_ref().and_then(|d| d.run_at) {
            println!(
                "starts at {} unless a newer arrival pushes it back",
                at.to_rfc3339()
            );
        }
        println!("watch it: agentq status {op_id}");
    }
    Ok(())
}

/// `agentq status`: `agentq_app::decision::show`, the flow of `GET /v1/operations/{id}`.
async fn status(config: Deployment, op: &str, json: bool, show_input: bool) -> anyhow::Result<()> {
    let op = agentq_app::operations::parse_id(op).map_err(cli_error)?;
    let (app, caller) = cli_app(&config, &None).await?;
    let include = agentq_app::decision::Include { input: show_input };
    let shown = agentq_app::decision::show(&app, &caller, op, include, "cli").await;
    let shown = done(app, shown).await?;
    if json {
        println!("{}", serde_json::to_string(&shown)?);
        return Ok(());
    }
    let v = &shown.operation;
    println!("op_id:       {}", v.op_id);
    println!("status:      {}", v.status);
    println!(
        "kind:        {}  (tenant {}, lane {})",
        v.kind, v.tenant, v.lane
    );
    println!(
        "attempt:     {} of {} (restarts {})",
        v.attempt, v.max_attempts, v.restarts
    );
    println!("created_at:  {}", v.created_at);
    println!("updated_at:  {}", v.updated_at);
    if let Some(f) = v.finished_at {
        println!("finished_at: {f}");
    }
    if v.status == agentq_core::Status::Queued && v.run_at > chrono::Utc::now() {
        println!("retry_at:    {}", v.run_at);
    }
    if let Some(class) = &v.error_class {
        println!(
            "error:       [{class}] {}",
            v.error_message.as_deref().unwrap_or("")
        );
    }
    print_waiting(v, shown.waiting.as_ref());
    for b in &shown.budgets {
        println!(
            "budget:      {} {} of {} {} tokens spent, {} held",
            b.scope, b.spent_tokens, b.limit_tokens, b.measure, b.held_tokens
        );
    }
    if let Some(input) = &shown.input {
        println!("input:       {input}");
    }
    if let Some(r) = &v.result {
        println!("result:      {r}");
    }
    Ok(())
}

/// What a waiting operation waits for, in `agentq status`'s text.
fn print_waiting(v: &OperationView, pending: Option<&agentq_app::decision::Pending>) {
    let Some(signal) = v
        .waiting_for
        .as_deref()
        .filter(|_| v.status == agentq_core::Status::Waiting)
    else {
        return;
    };
    if signal == agentq_app::budgets::WAITING_FOR {
        println!(
            "waiting for: its token budget (a model call it cannot cover was not sent); dead \
             as budget_exceeded at {} unless raised: agentq budget set {} --budget-tokens N",
            v.run_at, v.op_id
        );
        return;
    }
    if let Some((scope, limit, reopens_at)) = agentq_app::rate_limits::parse_waiting_for(signal) {
        println!(
            "waiting for: rate limit {scope} {limit}, whose window reopens at {reopens_at} (the \
             model call was not sent; it reserves again then): agentq limits list"
        );
        return;
    }
    let Some(p) = pending else {
        println!("waiting for: signal {signal:?} (times out {})", v.run_at);
        return;
    };
    println!(
        "waiting for: signal {:?} (times out {}; step {})",
        p.signal, p.timeout_at, p.step
    );
    if let Some(call) = &p.tool_call {
        println!("tool call:   {} {}", call.tool, call.arguments);
        if !call.text.is_empty() {
            println!("model text:  {}", call.text);
        }
        println!(
            "decide:      agentq approve {0} | agentq reject {0}",
            v.op_id
        );
    } else if let Some(about) = &p.about {
        println!("needs:       {about}");
    }
}

/// `agentq list`: one page of `agentq_app::operations::list`, the flow of `GET /v1/operations`.
async fn list(config: &Deployment, args: ListArgs) -> anyhow::Result<()> {
    let query = agentq_app::operations::ListQuery {
        tenant: args.tenant,
        status: args.status,
        kind: args.kind,
        batch: args.batch,
        schedule: args.schedule,
        parent: args.parent,
        created_after: args.created_after,
        created_before: args.created_before,
        finished_after: args.finished_after,
        finished_before: args.finished_before,
    };
    let (app, caller) = cli_app(config, &None).await?;
    let page =
        agentq_app::operations::list(&app, &caller, &query, args.limit, args.after.as_deref())
            .await;
    let page = done(app, page.map_err(flag_error_app)).await?;
    for o in &page.items {
        if args.json {
            println!(
                "{}",
                serde_json::to_string(&agentq_app::operations::listed(o))?
            );
        } else {
            println!(
                "{}  {}  {:<10} {:<14} {:<12} attempt {}/{}{}",
                o.created_at.format("%Y-%m-%d %H:%M:%S"),
                o.op_id,
                o.status,
                o.kind,
                o.tenant,
                o.attempt,
                o.max_attempts,
                o.error_class
                    .as_deref()
                    .map(|c| format!("  [{c}]"))
                    .unwrap_or_default()
            );
        }
    }
    if let (false, Some(next)) = (args.json, &page.next_cursor) {
        eprintln!("next page: --after {next}");
    }
    Ok(())
}

async fn steps(config: Deployment, op: &str, json: bool) -> anyhow::Result<()> {
    let op = agentq_app::operations::parse_id(op).map_err(cli_error)?;
    let (app, caller) = cli_app(&config, &None).await?;
    // Page by page, so a long journal is never held whole.
    let mut after = None;
    loop {
        let page = match agentq_app::operations::steps(&app, &caller, op, after, 1000).await {
            Ok(page) => page,
            Err(e) => return done(app, Err(e)).await,
        };
        print_steps(&page.steps, json)?;
        match page.next_after {
            Some(seq) => after = Some(seq),
            None => break,
        }
    }
    done(app, Ok(())).await
}

fn print_steps(steps: &[StepView], json: bool) -> anyhow::Result<()> {
    for s in steps {
        if json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            let took = s
                .completed_at
                .map(|c| format!("{} ms", (c - s.started_at).num_milliseconds()))
                .unwrap_or_else(|| "-".into());
            // A parked step says when it wakes (a sleep) or gives up (a wait's timeout).
            let wakes = match (s.status, s.wake_at) {
                (agentq_core::state::StepStatus::Started, Some(at)) => {
                    format!(
                        "  until {}",
                        at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    )
                }
                _ if s.reconciled() => "  reconciled: its reconcile found the effect".into(),
                _ => String::new(),
            };
            println!(
                "{:>3}  {:<20} {:<7} {:<7} {:<10} {:>8}  key {}{wakes}",
                s.seq,
                s.name,
                s.kind,
                s.replay,
                s.status,
                took,
                &s.idempotency_key[..12]
            );
        }
    }
    Ok(())
}

fn signalled(op: OperationId, name: &str, sent: &Signalled, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::json!({ "op_id": op, "signal": name, "result": sent.as_str() })
        );
        return;
    }
    match sent {
        Signalled::Delivered => println!("signal {name:?} delivered to {op}; it resumes now"),
        Signalled::Kept {
            status,
            waiting_for,
        } => println!(
            "signal {name:?} kept for {op}: it is {status}{}; it will be delivered when it waits for {name:?}",
            waiting_for
                .as_deref()
                .map(|w| format!(" (waiting for {w:?})"))
                .unwrap_or_default()
        ),
    }
}

/// `agentq approve` / `reject`: the approval convention of the application layer.
async fn approval(
    config: &Deployment,
    op: &str,
    approved: bool,
    actor: Option<String>,
    reason: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    let op = agentq_app::operations::parse_id(op).map_err(cli_error)?;
    let (app, caller) = cli_app(config, &actor).await?;
    let sent = agentq_app::operations::decide(&app, &caller, op, approved, reason.as_deref()).await;
    let sent = done(app, sent).await?;
    signalled(op, "approval", &sent, json);
    Ok(())
}

async fn signal(
    config: &Deployment,
    op: &str,
    name: &str,
    payload: serde_json::Value,
    actor: &Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    let op = agentq_app::operations::parse_id(op).map_err(cli_error)?;
    agentq_app::operations::check_signal_name(name).map_err(cli_error)?;
    let (app, caller) = cli_app(config, actor).await?;
    let audit = agentq_app::operations::Audit {
        action: "signal",
        reason: None,
    };
    let sent = agentq_app::operations::signal(&app, &caller, op, name, &payload, audit).await;
    let sent = done(app, sent).await?;
    signalled(op, name, &sent, json);
    Ok(())
}

async fn cancel(
    config: &Deployment,
    op: &str,
    actor: &Option<String>,
    reason: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    let op = agentq_app::operations::parse_id(op).map_err(cli_error)?;
    let (app, caller) = cli_app(config, actor).await?;
    let outcome = agentq_app::operations::cancel(&app, &caller, op, reason).await;
    let outcome = done(app, outcome).await?;
    if json {
        println!(
            "{}",
            serde_json::json!({ "op_id": op, "result": outcome.as_str() })
        );
    } else if outcome == agentq_app::operations::Cancelled::Now {
        println!("operation {op} cancelled");
    } else {
        println!("operation {op} is running; its worker stops it at the next step boundary");
    }
    Ok(())
}
