//! Configuration: every setting is an environment variable and a command-line flag, with a
//! default that works against PostgreSQL and RabbitMQ on the local machine.
//!
//! `Config` deliberately does not implement `Debug`: URLs may carry passwords and the model API
//! key is a secret. Use [`Config::redacted`] to describe it in logs.

use std::time::Duration;

/// Shared settings of every agentq process (`agentq --help` lists them with defaults, under
/// "Global options"; a subcommand's help shows its own options).
#[derive(clap::Args, Clone)]
#[command(next_help_heading = "Global options")]
pub struct Config {
    /// PostgreSQL URL; `agentq migrate` creates the database if it does not exist.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/agentq",
        global = true,
        hide_env_values = true
    )]
    pub database_url: String,

    /// RabbitMQ URL.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true
    )]
    pub amqp_url: String,

    /// Prefix of every exchange and queue name, so deployments and tests can share a broker.
    #[arg(
        long,
        env = "AGENTQ_NAMESPACE",
        default_value = "agentq",
        global = true
    )]
    pub namespace: String,

    /// Base URL of an OpenAI-compatible model API; unset → the built-in local model.
    #[arg(long, env = "AGENTQ_MODEL_BASE_URL", global = true)]
    pub model_base_url: Option<String>,

    /// API key for the model API (never logged).
    #[arg(
        long,
        env = "AGENTQ_MODEL_API_KEY",
        global = true,
        hide_env_values = true
    )]
    pub model_api_key: Option<String>,

    /// Model name sent to the model API.
    #[arg(long, env = "AGENTQ_MODEL", global = true)]
    pub model: Option<String>,

    /// Model per job kind, overriding AGENTQ_MODEL: `kind=model,kind=model`.
    #[arg(long, env = "AGENTQ_MODEL_BY_KIND", global = true)]
    pub model_by_kind: Option<String>,

    /// Origins the built-in tools (`http_get`, `triage`'s callback) may call:
    /// `https://api.example.com,http://127.0.0.1:8080`; a bare host allows its default ports.
    #[arg(long, env = "AGENTQ_AGENT_HTTP_ALLOW", global = true)]
    pub agent_http_allow: Option<String>,

    /// Stream model answers (SSE) instead of waiting for the whole body.
    #[arg(
        long,
        env = "AGENTQ_MODEL_STREAM",
        default_value_t = false,
        global = true
    )]
    pub model_stream: bool,

    /// Seconds a whole model call may take.
    #[arg(
        long,
        env = "AGENTQ_MODEL_TIMEOUT_SECS",
        default_value_t = 600,
        global = true
    )]
    pub model_timeout_secs: u64,

    /// Seconds to wait for a model call's response headers.
    #[arg(
        long,
        env = "AGENTQ_MODEL_FIRST_BYTE_SECS",
        default_value_t = 120,
        global = true
    )]
    pub model_first_byte_secs: u64,

    /// Longest silence, in seconds, inside a model answer's body or stream.
    #[arg(
        long,
        env = "AGENTQ_MODEL_IDLE_SECS",
        default_value_t = 60,
        global = true
    )]
    pub model_idle_secs: u64,

    /// `max_tokens` of a model request that sets none (unset: the provider's default, which for
    /// some servers is "until the context is full").
    #[arg(long, env = "AGENTQ_MODEL_MAX_TOKENS", global = true)]
    pub model_max_tokens: Option<u32>,

    /// Model calls in flight per worker process: a number, or `auto` (found from the
    /// provider's pushback, between 4 and 3584).
    #[arg(
        long,
        env = "AGENTQ_MODEL_CONCURRENCY",
        default_value = "auto",
        global = true
    )]
    pub model_concurrency: CallLimit,

    /// Model calls in flight per tenant per worker process (unset: no cap of its own; waiting
    /// calls are granted a tenant at a time).
    #[arg(long, env = "AGENTQ_MODEL_TENANT_CONCURRENCY", global = true)]
    pub model_tenant_concurrency: Option<usize>,

    /// Lease length: a worker that stops heartbeating loses its operations after this long.
    #[arg(
        long,
        env = "AGENTQ_LEASE_TTL_SECS",
        default_value_t = 30,
        global = true
    )]
    pub lease_ttl_secs: u64,

    /// Crash recoveries allowed per operation before it goes to the DLQ as `crash_loop`.
    #[arg(long, env = "AGENTQ_RESTART_LIMIT", default_value_t = 3, global = true)]
    pub restart_limit: i32,

    /// Default attempts per operation (job-level retries), when the enqueue does not say.
    #[arg(long, env = "AGENTQ_MAX_ATTEMPTS", default_value_t = 5, global = true)]
    pub max_attempts: i32,

    /// Operations run at once per worker process on the interactive lane. 512: measured on 2
    /// vCPUs, no-op drains and ten-step jobs speed up to about 512 and no further (batch drain
    /// 1,500/s at 16, 3,200 at 64, 6,300 at 256, 7,200 at 512, 7,300 at 1,024; ten durable
    /// steps 6,000 steps/s at 64, 8,900 at 256, 9,700 at 512, 10,400 at 1,024; worker peak RSS
    /// 42 MiB at 64, 72 at 512), and 1 s model calls fill the model gate's 256
    /// (docs/benchmarks.md, "Default slots").
    #[arg(
        long,
        env = "AGENTQ_CONCURRENCY_INTERACTIVE",
        default_value_t = 512,
        global = true
    )]
    pub concurrency_interactive: u16,

    /// Operations run at once per worker process on the batch lane. Held at 16 so that a bulk
    /// backlog leaves the database to interactive work; raise it for a migration that should
    /// drain at full speed (no-op drains: 1,500/s at 16, 7,200/s at 512).
    #[arg(
        long,
        env = "AGENTQ_CONCURRENCY_BATCH",
        default_value_t = 16,
        global = true
    )]
    pub concurrency_batch: u16,

    /// Days a finished operation and its journal are kept.
    #[arg(
        long,
        env = "AGENTQ_RETENTION_DAYS",
        default_value_t = 30,
        global = true
    )]
    pub retention_days: u32,

    /// Address of the HTTP API (`agentq serve`, `agentq dev`).
    #[arg(
        long,
        env = "AGENTQ_LISTEN",
        default_value = "127.0.0.1:8080",
        global = true
    )]
    pub listen: String,

    /// Address where `agentq worker`, `agentq scheduler` and `agentq dev` serve `GET /metrics`
    /// (Prometheus text); unset → no metrics endpoint. `agentq serve` has `/metrics` on its
    /// API address.
    #[arg(long, env = "AGENTQ_METRICS_ADDR", global = true)]
    pub metrics_addr: Option<String>,

    /// Most unfinished operations (queued, running, sleeping, waiting) a tenant may have,
    /// however they are created: an enqueue (CLI, API, webhook) or a batch past it is refused
    /// (429 / exit 2), a spawn parks its parent until the count falls, a schedule's firing is
    /// skipped.
    #[arg(
        long,
        env = "AGENTQ_TENANT_MAX_UNFINISHED",
        default_value_t = 100_000,
        global = true
    )]
    pub tenant_max_unfinished: i64,

    /// The most of a lane's slots on one worker that one tenant runs while another tenant has
    /// work queued in that lane (0 < share ≤ 1; 1 turns fair shares off). Alone, a tenant uses
    /// every slot.
    #[arg(
        long,
        env = "AGENTQ_TENANT_SHARE",
        default_value_t = 0.5,
        global = true
    )]
    pub tenant_share: f64,

    /// Seconds a tenant past its share may keep the slots it owes others: meanwhile each of
    /// its operations that reaches a step boundary gives one back there (nothing is cut); past
    /// this, the ones whose step began last are stopped mid-step (never an unsafe call) and
    /// resume later from their journals.
    #[arg(
        long,
        env = "AGENTQ_TENANT_SHARE_GRACE_SECS",
        default_value_t = 5,
        global = true
    )]
    pub tenant_share_grace_secs: u64,

    /// Most children one operation may spawn (`ctx.spawn`); a spawn past it fails the parent
    /// (non-retryable).
    #[arg(
        long,
        env = "AGENTQ_MAX_CHILDREN",
        default_value_t = 10_000,
        global = true
    )]
    pub max_children: i64,

    /// Most spawns below its root an operation may be (a child of a child of …); a spawn past
    /// it fails the parent (non-retryable).
    #[arg(
        long,
        env = "AGENTQ_MAX_SPAWN_DEPTH",
        default_value_t = 32,
        global = true
    )]
    pub max_spawn_depth: i64,

    /// Most steps (journal rows) one operation may record; the step past it fails the
    /// operation (non-retryable, `journal_limit`).
    #[arg(
        long,
        env = "AGENTQ_JOURNAL_MAX_STEPS",
        default_value_t = 10_000,
        global = true
    )]
    pub journal_max_steps: i64,

    /// Most bytes of step outputs and errors (as JSON) one operation's journal may hold; the
    /// step after the one that passes it fails the operation (non-retryable, `journal_limit`).
    #[arg(
        long,
        env = "AGENTQ_JOURNAL_MAX_BYTES",
        default_value_t = 64 << 20,
        global = true
    )]
    pub journal_max_bytes: i64,

    /// Bytes one worker's remote runs may hold, all together, for the journals they keep for
    /// their services (each its journal's JSON and what its next request carries); when it is
    /// held, the run holding the most waits for room (up to 10 s) and the others go back to
    /// the queue at once, their attempts given back.
    #[arg(
        long,
        env = "AGENTQ_REMOTE_JOURNAL_MEMORY",
        default_value_t = 256 << 20,
        global = true
    )]
    pub remote_journal_memory: u64,

    /// Bytes of journals (outputs and errors) a worker keeps in memory from its runs, so that
    /// an operation's next run on it reads only the rows that can have changed; 0 keeps none.
    #[arg(
        long,
        env = "AGENTQ_JOURNAL_CACHE_MEMORY",
        default_value_t = 64 << 20,
        global = true
    )]
    pub journal_cache_memory: u64,

    /// Most schedules a tenant may have.
    #[arg(
        long,
        env = "AGENTQ_TENANT_MAX_SCHEDULES",
        default_value_t = 100,
        global = true
    )]
    pub tenant_max_schedules: i64,

    /// Most pauses in force a tenant may have (an admin's deployment-wide pauses, those naming
    /// no tenant, count together as one more tenant's); another answers 429.
    #[arg(
        long,
        env = "AGENTQ_TENANT_MAX_PAUSES",
        default_value_t = 100,
        global = true
    )]
    pub tenant_max_pauses: i64,

    /// Shortest time between two firings of a schedule, in seconds (an interval, or the
    /// closest two ticks of a cron expression).
    #[arg(
        long,
        env = "AGENTQ_SCHEDULE_MIN_INTERVAL_SECS",
        default_value_t = 10,
        global = true
    )]
    pub schedule_min_interval_secs: u64,

    /// Request units a second each API token may use on one `agentq serve` (a request is one,
    /// a list page one more per 20 rows of its `limit`); past it, 429 with `Retry-After`. 0
    /// turns the limit off.
    #[arg(
        long,
        env = "AGENTQ_API_TOKEN_RATE",
        default_value_t = 500,
        global = true
    )]
    pub api_token_rate: u32,

    /// Event streams (`GET …/events`) one token may hold open at once; more answer 429.
    #[arg(
        long,
        env = "AGENTQ_STREAMS_PER_TOKEN",
        default_value_t = 16,
        global = true
    )]
    pub streams_per_token: usize,

    /// Event streams one `agentq serve` holds open at once, all tokens together; more answer 429.
    #[arg(
        long,
        env = "AGENTQ_STREAMS_MAX",
        default_value_t = 1000,
        global = true
    )]
    pub streams_max: usize,

    /// Let a producer token approve or reject (signals `approval` and `review`) its own tenant's
    /// operations over the API. Off by default: approving is an operator's act on every
    /// surface; turn it on for a tenant whose own service is the reviewer.
    #[arg(
        long,
        env = "AGENTQ_PRODUCER_MAY_APPROVE",
        default_value_t = false,
        global = true
    )]
    pub producer_may_approve: bool,

    /// JSON keys whose values the console shows as `[redacted]` even when an operator reveals
    /// an operation's payloads (comma-separated, any depth; e.g. `email,ssn,api_key`).
    #[arg(long, env = "AGENTQ_CONSOLE_REDACT", global = true)]
    pub console_redact: Option<String>,

    /// Seconds a committed operation may wait for its producer's publish before the scheduler
    /// publishes it instead (a producer that crashed between commit and publish).
    #[arg(
        long,
        env = "AGENTQ_DISPATCH_GRACE_SECS",
        default_value_t = 5,
        global = true
    )]
    pub dispatch_grace_secs: u64,

    /// On SIGTERM, seconds a worker lets running operations finish before it stops them and
    /// hands them back to the queue.
    #[arg(
        long,
        env = "AGENTQ_SHUTDOWN_GRACE_SECS",
        default_value_t = 20,
        global = true
    )]
    pub shutdown_grace_secs: u64,

    /// Replicas of each lane's quorum queue when agentq first declares it (default: 3 when
    /// `AMQP_URL` lists several nodes, the broker's default otherwise).
    #[arg(long, env = "AGENTQ_QUORUM_SIZE", global = true)]
    pub quorum_size: Option<u32>,

    /// Connections in this process's PostgreSQL pool.
    #[arg(long, env = "AGENTQ_DB_POOL", default_value_t = 16, global = true)]
    pub db_pool: u32,

    /// Deadline of one engine call to PostgreSQL (claim, lease renewal, journal and outcome
    /// writes, each scheduler pass) and of a pooled connection's release check; a connection
    /// that misses it is closed, never reused.
    #[arg(
        long,
        env = "AGENTQ_DB_TIMEOUT_SECS",
        default_value_t = 10,
        global = true
    )]
    pub db_timeout_secs: u64,
}

impl Config {
    /// The quorum queues' replica count to declare: `AGENTQ_QUORUM_SIZE`, else 3 when
    /// `AMQP_URL` lists several nodes.
    pub fn quorum_size(&self) -> Option<u32> {
        self.quorum_size
            .or_else(|| (crate::broker::nodes(&self.amqp_url).len() > 1).then_some(3))
    }

    /// Lease length as a duration.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs.max(1))
    }

    /// Checks what clap cannot: values that would make the system misbehave rather than fail.
    pub fn validate(&self) -> Result<(), String> {
        crate::broker::validate_namespace(&self.namespace)?;
        if self.lease_ttl_secs < 3 {
            return Err(format!(
                "AGENTQ_LEASE_TTL_SECS must be at least 3 (got {}): heartbeats run every ttl/3",
                self.lease_ttl_secs
            ));
        }
        if self.quorum_size == Some(0) {
            return Err("AGENTQ_QUORUM_SIZE must be at least 1 (3 or 5 on a cluster)".into());
        }
        if self.db_timeout_secs < 1 {
            return Err("AGENTQ_DB_TIMEOUT_SECS must be at least 1".into());
        }
        if self.max_attempts < 1 {
            return Err("AGENTQ_MAX_ATTEMPTS must be at least 1".into());
        }
        if self.concurrency_interactive == 0 && self.concurrency_batch == 0 {
            return Err("at least one lane needs a concurrency above 0".into());
        }
        self.model_by_kind()?;
        self.agent_http_allow()?;
        if self.db_pool < 2 {
            return Err("AGENTQ_DB_POOL must be at least 2".into());
        }
        if !(self.tenant_share > 0.0 && self.tenant_share <= 1.0) {
            return Err(format!(
                "AGENTQ_TENANT_SHARE must be above 0 and at most 1 (got {}): the most of a \
                 worker's slots one tenant runs while others wait",
                self.tenant_share
            ));
        }
        for (name, value) in [
            ("AGENTQ_TENANT_MAX_UNFINISHED", self.tenant_max_unfinished),
            ("AGENTQ_MAX_CHILDREN", self.max_children),
            ("AGENTQ_MAX_SPAWN_DEPTH", self.max_spawn_depth),
            ("AGENTQ_JOURNAL_MAX_STEPS", self.journal_max_steps),
            ("AGENTQ_JOURNAL_MAX_BYTES", self.journal_max_bytes),
            ("AGENTQ_TENANT_MAX_SCHEDULES", self.tenant_max_schedules),
            ("AGENTQ_TENANT_MAX_PAUSES", self.tenant_max_pauses),
        ] {
            if value < 1 {
                return Err(format!("{name} must be at least 1 (got {value})"));
            }
        }
        Ok(())
    }

    /// `AGENTQ_MODEL_BY_KIND` as a map.
    pub fn model_by_kind(&self) -> Result<std::collections::HashMap<String, String>, String> {
        let mut map = std::collections::HashMap::new();
        for pair in self
            .model_by_kind
            .as_deref()
            .unwrap_or("")
            .split(',')
            .filter(|p| !p.trim().is_empty())
        {
            let (kind, model) = pair.split_once('=').ok_or_else(|| {
                format!("AGENTQ_MODEL_BY_KIND entry {pair:?} must be kind=model (e.g. agent=gpt-4o,echo=small)")
            })?;
            map.insert(kind.trim().to_string(), model.trim().to_string());
        }
        Ok(map)
    }

    /// `AGENTQ_AGENT_HTTP_ALLOW` as origins (see [`crate::origins`]); an entry that is not an
    /// origin or a host name is an error naming it.
    pub fn agent_http_allow(&self) -> Result<crate::origins::Origins, String> {
        let entries: Vec<String> = self
            .agent_http_allow
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .collect();
        crate::origins::Origins::parse(&entries)
    }

    /// A description safe to log: passwords in URLs are replaced and the API key is omitted.
    pub fn redacted(&self) -> String {
        format!(
            "database={} broker={} namespace={} model={} lease_ttl={}s",
            redact_url(&self.database_url),
            redact_url(&self.amqp_url),
            self.namespace,
            self.model_base_url
                .as_deref()
                .map(redact_url)
                .unwrap_or_else(|| "built-in local model".into()),
            self.lease_ttl_secs
        )
    }
}

/// How many model calls a worker sends at once (`AGENTQ_MODEL_CONCURRENCY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallLimit {
    /// This many.
    Fixed(usize),
    /// As many as the provider takes without pushing back (`worker::limiter`).
    Auto,
}

impl std::str::FromStr for CallLimit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(Self::Fixed(n)),
            _ => Err(format!(
                "{s:?} is not a number of model calls: give a whole number above 0, or auto"
            )),
        }
    }
}

impl std::fmt::Display for CallLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

/// Replaces the password of `scheme://user:password@host/...` with `***`.
pub fn redact_url(url: &str) -> String {
    // A list of nodes (`AMQP_URL`): each one redacted.
    if url.contains(',') {
        return url.split(',').map(redact_url).collect::<Vec<_>>().join(",");
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_limit_is_a_number_above_0_or_auto() {
        assert_eq!("auto".parse(), Ok(CallLimit::Auto));
        assert_eq!("AUTO".parse(), Ok(CallLimit::Auto));
        assert_eq!("12".parse(), Ok(CallLimit::Fixed(12)));
        for bad in ["0", "-1", "1.5", "", "many"] {
            let e = bad.parse::<CallLimit>().unwrap_err();
            assert!(
                e.contains("give a whole number above 0, or auto"),
                "{bad}: {e}"
            );
        }
        assert_eq!(CallLimit::Fixed(12).to_string(), "12");
        assert_eq!(CallLimit::Auto.to_string(), "auto");
    }

    #[test]
    fn redact_url_hides_the_password_of_every_node_of_a_list() {
        assert_eq!(
            redact_url("amqp://a:s1@h1:5672/%2f,amqp://b:s2@h2:5672/%2f"),
            "amqp://a:***@h1:5672/%2f,amqp://b:***@h2:5672/%2f"
        );
    }

    #[test]
    fn redact_url_hides_passwords_only() {
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("postgres://postgres@127.0.0.1/agentq"),
            "postgres://postgres@127.0.0.1/agentq"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
