//! What the subcommands share: the [`Deployment`] (configuration and registry) every role is
//! built from, connecting, building the crates (worker, scheduler, producer, the application
//! layer), the acting operator's name, refusals (exit code 2), time parsing, shutdown on a
//! signal. Imports no other module of the crate, so the subcommand
//! modules can all use it without a cycle.
//!
//! Invariant kept here: every role of a process is built from the one registry its `main`
//! handed to [`crate::main`]; nothing reads a global registry.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use agentq_core::Config;
use agentq_core::broker::Names;
use agentq_core::dispatch::Dispatcher;
use agentq_producer::Producer;
use agentq_worker::{LocalModel, ModelClient, ServedKinds, Worker};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// What every subcommand is built from: the configuration (flags and environment) and the
/// kinds it serves (the deployment's registry, the kinds and tools its binary runs, and the
/// registered services' kinds once connected). It reads as its configuration
/// (`deployment.database_url`).
#[derive(Clone)]
pub struct Deployment {
    pub config: Config,
    pub kinds: ServedKinds,
}

impl Deref for Deployment {
    type Target = Config;

    fn deref(&self) -> &Config {
        &self.config
    }
}

impl DerefMut for Deployment {
    fn deref_mut(&mut self) -> &mut Config {
        &mut self.config
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A refusal of the caller's input: printed as is, exit code 2.
pub(crate) fn refuse(msg: impl Into<String>) -> anyhow::Error {
    Refused(msg.into()).into()
}

/// A pool for `config`, failing at once when PostgreSQL cannot be reached (a command).
pub async fn connect(config: &Config) -> anyhow::Result<PgPool> {
    agentq_app::database::connect(&config.database_url, config.db_pool)
        .await
        .map_err(|e| connect_error(config, e))
}

/// A connection failure, with what to check.
fn connect_error(config: &Config, e: agentq_app::database::Error) -> anyhow::Error {
    anyhow::Error::new(e).context(format!(
        "connecting to {} (is PostgreSQL running, and has `agentq migrate` been run?)",
        agentq_core::config::redact_url(&config.database_url)
    ))
}

/// A pool for `deployment`, its registry serving the remote kinds of the services an admin
/// registered (read now, then every few seconds for as long as the process runs).
pub async fn connect_deployment(deployment: &Deployment) -> anyhow::Result<PgPool> {
    let pool = connect(deployment).await?;
    Ok(serve_registered(deployment, pool).await)
}

/// [`connect_deployment`] for a long-running role (worker, scheduler, API server): while
/// PostgreSQL cannot be reached (stopped, restarting, starting up, a network fault) it says so
/// and tries again, 1 s after a failed attempt and doubling to 10 s, instead of exiting, so a
/// process started during an outage serves once the outage ends. A failure only the operator
/// can mend (a bad URL, a refused role, a missing database) still exits at once. `None` when
/// `shutdown` came first.
pub async fn connect_serving(
    deployment: &Deployment,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<PgPool>> {
    let mut wait = Duration::from_secs(1);
    loop {
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            attempt = agentq_app::database::connect(&deployment.database_url, deployment.db_pool) => attempt,
        };
        match attempt {
            Ok(pool) => return Ok(Some(serve_registered(deployment, pool).await)),
            Err(e) if e.is_unreachable() => {
                tracing::warn!(
                    error = %e,
                    database = %agentq_core::config::redact_url(&deployment.database_url),
                    "PostgreSQL cannot be reached; trying again in {wait:?}"
                );
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(Duration::from_secs(10));
            }
            Err(e) => return Err(connect_error(deployment, e)),
        }
    }
}

/// Makes `deployment`'s registry serve the remote kinds of the registered services: read now,
/// then watched for as long as the process runs.
async fn serve_registered(deployment: &Deployment, pool: PgPool) -> PgPool {
    if let Err(e) = deployment.kinds.load_services(&pool).await {
        // Before `agentq migrate` there is no services table: nothing remote to serve yet.
        tracing::warn!(error = %e, "reading the registered services failed; serving the binary's own kinds");
    }
    let (kinds, watched) = (deployment.kinds.clone(), pool.clone());
    tokio::spawn(agentq_worker::remote::watch(
        kinds,
        watched,
        CancellationToken::new(),
    ));
    pool
}

/// The model client the configuration asks for: an OpenAI-compatible provider, or the built-in
/// local model when `AGENTQ_MODEL_BASE_URL` is unset.
pub fn model_client(config: &Config) -> anyhow::Result<Arc<dyn ModelClient>> {
    // Empty counts as unset (compose passes `${AGENTQ_MODEL_BASE_URL:-}` through).
    let Some(base) = config
        .model_base_url
        .as_ref()
        .filter(|b| !b.trim().is_empty())
    else {
        tracing::info!("no AGENTQ_MODEL_BASE_URL: using the built-in deterministic local model");
        return Ok(Arc::new(LocalModel));
    };
    let model = config.model.clone().unwrap_or_else(|| "default".into());
    let timeouts = agentq_worker::openai::Timeouts {
        connect: Duration::from_secs(10),
        first_byte: Duration::from_secs(config.model_first_byte_secs.max(1)),
        idle: Duration::from_secs(config.model_idle_secs.max(1)),
        total: Duration::from_secs(config.model_timeout_secs.max(1)),
    };
    let client = agentq_worker::openai::OpenAiClient::new(
        base,
        config.model_api_key.clone(),
        &model,
        config.model_stream,
        timeouts,
    )
    .map_err(refuse)?
    .with_max_tokens(config.model_max_tokens);
    tracing::info!(
        provider = %agentq_core::config::redact_url(base), model = %model, stream = config.model_stream,
        "using an OpenAI-compatible model provider"
    );
    Ok(Arc::new(client))
}

/// A worker running the deployment's registry.
pub fn worker(
    config: &Deployment,
    pool: PgPool,
    concurrency: Option<u16>,
) -> anyhow::Result<Worker> {
    let settings = agentq_worker::Settings {
        amqp_url: config.amqp_url.clone(),
        namespace: config.namespace.clone(),
        lease_ttl: config.lease_ttl(),
        concurrency_interactive: concurrency.unwrap_or(config.concurrency_interactive),
        concurrency_batch: concurrency.unwrap_or(config.concurrency_batch),
        shutdown_grace: Duration::from_secs(config.shutdown_grace_secs),
        gate: agentq_worker::gate::GateSettings {
            concurrency: config.model_concurrency,
            per_tenant: config.model_tenant_concurrency,
            model_by_kind: config.model_by_kind().map_err(refuse)?,
            ..Default::default()
        },
        http_allow: config.agent_http_allow().map_err(refuse)?,
        tenant_share: config.tenant_share,
        tenant_share_grace: Duration::from_secs(config.tenant_share_grace_secs),
        job_limits: agentq_worker::context::JobLimits {
            max_children: config.max_children,
            max_spawn_depth: config.max_spawn_depth,
            tenant_max_unfinished: config.tenant_max_unfinished,
            journal_max_steps: config.journal_max_steps,
            journal_max_bytes: config.journal_max_bytes,
            remote_journal_memory: config.remote_journal_memory,
            journal_cache_memory: config.journal_cache_memory,
        },
    };
    Ok(Worker::new(
        settings,
        pool,
        config.kinds.clone(),
        model_client(config)?,
    ))
}

/// A scheduler, its metrics started at zero for the deployment's kinds.
pub fn scheduler(config: &Deployment, pool: PgPool) -> agentq_scheduler::Scheduler {
    let dispatcher = Arc::new(Dispatcher::new(
        pool.clone(),
        &config.amqp_url,
        Names::new(&config.namespace),
        "scheduler",
    ));
    let settings = agentq_scheduler::Settings {
        dispatch_grace: Duration::from_secs(config.dispatch_grace_secs),
        restart_limit: config.restart_limit,
        retention_days: config.retention_days,
        tenant_max_unfinished: config.tenant_max_unfinished,
        ..Default::default()
    };
    agentq_scheduler::start_counters_at_zero(&config.kinds.kind_names());
    agentq_scheduler::Scheduler::new(settings, pool, dispatcher, &config.namespace)
}

/// The application layer over `pool`: a producer and a dispatcher named `role`, and the
/// deployment's settings. Close `app.dispatcher` when done.
pub fn app(config: &Deployment, pool: PgPool, role: &str) -> agentq_app::App {
    let (producer, dispatcher) = producer(config, pool.clone(), role);
    agentq_app::App::new(
        pool,
        producer,
        dispatcher,
        agentq_app::Settings {
            producer_may_approve: config.producer_may_approve,
            limits: agentq_app::capacity::Limits {
                tenant_max_unfinished: config.tenant_max_unfinished,
                max_children: config.max_children,
                tenant_max_schedules: config.tenant_max_schedules,
                tenant_max_pauses: config.tenant_max_pauses,
                schedule_min_interval: Duration::from_secs(config.schedule_min_interval_secs),
            },
            redact: agentq_app::redact::redact_keys(config.console_redact.as_deref()),
            tenant_share: Some(config.tenant_share),
        },
    )
}

/// Compares the registered services' live manifests with their registrations every minute
/// until `shutdown` (`agentq_app::services::watch_drift`): the scheduler's job.
pub fn watch_services(config: &Deployment, pool: PgPool, shutdown: &CancellationToken) {
    tokio::spawn(agentq_app::services::watch_drift(
        app(config, pool, "scheduler"),
        shutdown.clone(),
    ));
}

/// A producer accepting the deployment's kinds, checking inputs against their types.
pub fn producer(config: &Deployment, pool: PgPool, role: &str) -> (Producer, Arc<Dispatcher>) {
    let dispatcher = Arc::new(Dispatcher::new(
        pool.clone(),
        &config.amqp_url,
        Names::new(&config.namespace),
        role,
    ));
    let producer = Producer::new(
        pool,
        dispatcher.clone(),
        Arc::new(config.kinds.clone()),
        config.max_attempts,
    );
    (producer, dispatcher)
}

/// An application-layer error on the command line: a refusal exits 2 with its message, a
/// failure exits 1.
pub fn cli_error(e: agentq_app::AppError) -> anyhow::Error {
    if e.is_refusal() {
        refuse(e.to_string())
    } else {
        anyhow::Error::new(e)
    }
}

/// Renames the field of a malformed value to the flag the command line spells it with
/// (`created_after` → `--created-after`); other errors pass unchanged.
pub(crate) fn flag_error_app(e: agentq_app::AppError) -> agentq_app::AppError {
    match e {
        agentq_app::AppError::Malformed { field, message } => {
            // The messages start with the field's name; on the command line it is a flag.
            let flag = format!("--{}", field.replace('_', "-"));
            let message = match message.strip_prefix(field) {
                Some(rest) => format!("{flag}{rest}"),
                None => format!("{flag}: {message}"),
            };
            agentq_app::AppError::Malformed { field, message }
        }
        other => other,
    }
}

/// The application layer for one command, acting as the operator named by `--as` (else the OS
/// user), with a dispatcher closed by [`done`].
pub(crate) async fn cli_app(
    config: &Deployment,
    actor: &Option<String>,
) -> anyhow::Result<(agentq_app::App, agentq_app::Caller)> {
    let pool = connect_deployment(config).await?;
    let app = app(config, pool, "operator");
    Ok((app, agentq_app::Caller::command_line(actor_name(actor))))
}

/// Closes what [`cli_app`] opened, returning `result`.
pub(crate) async fn done<T>(
    app: agentq_app::App,
    result: agentq_app::Result<T>,
) -> anyhow::Result<T> {
    app.dispatcher.close().await;
    result.map_err(cli_error)
}

/// Parses a point in time as `agentq_app::time::parse_moment` does; a bad one is refused
/// (exit 2) naming `what`.
pub fn parse_moment(
    s: &str,
    what: &str,
    ahead: bool,
) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    agentq_app::time::parse_moment(s, what, ahead).map_err(refuse)
}

/// A point in the future: RFC 3339, or a duration from now.
pub fn parse_time(s: &str, what: &str) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    parse_moment(s, what, true)
}

/// A token cancelled on SIGINT or SIGTERM.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        t.cancel();
    });
    token
}

/// The acting operator: `--as`, else the OS user.
pub fn actor_name(given: &Option<String>) -> String {
    given
        .clone()
        .or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("LOGNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
