//! Prometheus metrics: one process-global registry of counters, gauges and histograms, and its
//! text rendering (`# HELP`, `# TYPE`, samples).
//!
//! The values, the registry and the text encoding are the `prometheus` crate's
//! (tikv/rust-prometheus), not `prometheus-client`: its `TextEncoder` writes the classic text
//! format 0.0.4 that `/metrics` has always served, with the names as declared (counters keep
//! their `_total` in `# TYPE`) and the help texts as written, where `prometheus-client` writes
//! OpenMetrics (`# EOF`, `le="1.0"`), refuses a counter name ending in `_total` and adds a
//! period to every help text. How the series are held on top of it, and the one adapter on its
//! output, are in [`Registry`]'s module.
//!
//! Every metric is a `pub const` [`Metric`] declared once, with its help text, type, label names
//! and buckets, in the one table below ([`ALL`]); code records through those constants
//! (`metrics::OPERATIONS_ENQUEUED.inc(&[kind])`), never through a name typed elsewhere.
//!
//! Invariant: label values are ids of kinds, classes, lanes, statuses, providers, step kinds,
//! route templates and standard HTTP methods: never an input, a prompt, an output, a token or a
//! secret, and never a value a client picks freely (a made-up HTTP method is `other`, a path
//! no route matches `unmatched`). A metric that meets more than [`MAX_SERIES`] label sets folds
//! the rest into `_other`, so a bug cannot grow memory.

use std::sync::{LazyLock, Mutex};

use sqlx::PgPool;

mod registry;

pub use registry::Registry;

/// What a metric is, as Prometheus names it in `# TYPE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric's declaration: the single place its name and help text are written.
#[derive(Debug)]
pub struct Metric {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    /// Label names, in the order values are passed.
    pub labels: &'static [&'static str],
    /// Upper bounds of a histogram's buckets (seconds); empty for counters and gauges.
    pub buckets: &'static [f64],
}

/// Most label sets kept per metric; more are counted under `_other`.
pub const MAX_SERIES: usize = 2000;

const NO_BUCKETS: &[f64] = &[];
/// HTTP requests: milliseconds to seconds.
const HTTP_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];
/// Steps and attempts: a local step takes milliseconds, an agent's attempt minutes.
const RUN_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Model calls: a local model answers in microseconds, a provider in up to minutes.
const MODEL_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];
/// Group commit: operations written by one statement (a count, not seconds).
const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
/// Journal durability: a step's rows reach the writer → committed (one group commit).
const COMMIT_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
/// Timer lag: one scheduler tick is 200 ms.
const LAG_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

macro_rules! metrics {
    ($( $(#[$doc:meta])* $ident:ident = $name:literal, $kind:ident, [$($label:literal),*], $buckets:expr, $help:literal; )*) => {
        $( $(#[$doc])* pub const $ident: Metric = Metric {
            name: $name,
            help: $help,
            kind: Kind::$kind,
            labels: &[$($label),*],
            buckets: $buckets,
        }; )*
        /// Every metric agentq exports, in the order they are rendered.
        pub const ALL: &[Metric] = &[$($ident),*];
    };
}

metrics! {
    /// Counted by the producer after the insert (`agentq serve`, library producers).
    OPERATIONS_ENQUEUED = "agentq_operations_enqueued_total", Counter, ["kind"], NO_BUCKETS,
        "Operations stored by a producer, by kind.";
    /// Counted by `agentq_app::debounce` after its commit.
    DEBOUNCED = "agentq_debounced_total", Counter, ["kind", "outcome"], NO_BUCKETS,
        "Debounced deliveries and enqueues that made no operation of their own, by kind and outcome (joined: folded into the key's pending operation, its input replaced; skipped: answered with the key's running operation, policy skip).";
    /// Counted by the worker's `settle` once the outcome is written, and by the scheduler for
    /// the operations it ends (`deadline_exceeded`, `crash_loop`). Not counted: a cancel or
    /// discard of an operation no worker holds (the `agentq_operations` gauge shows those).
    OPERATIONS_FINISHED = "agentq_operations_finished_total", Counter, ["kind", "outcome"], NO_BUCKETS,
        "Operation attempts ended by a worker, and operations the scheduler ended (deadline, crash loop), by kind and outcome (succeeded, dead, cancelled, retry, parked).";
    /// Every failed attempt with its failure class (a retry's class is `retryable`).
    OPERATION_FAILURES = "agentq_operation_failures_total", Counter, ["kind", "class"], NO_BUCKETS,
        "Failed operation attempts written by a worker, and operations the scheduler ended, by kind and failure class.";
    STEP_DURATION = "agentq_step_duration_seconds", Histogram, ["step_kind"], RUN_BUCKETS,
        "Time a step ran (not replayed), by step kind (model, tool, custom).";
    /// Observed by the worker's journal writer for every durable step write.
    JOURNAL_COMMIT_DURATION = "agentq_journal_commit_duration_seconds", Histogram, [], COMMIT_BUCKETS,
        "Time from a step's journal rows reaching the worker's writer to their commit (the wait a step adds before the next one starts).";
    /// Observed by the worker for every grouped statement.
    GROUP_COMMIT_SIZE = "agentq_group_commit_operations", Histogram, ["writer"], BATCH_BUCKETS,
        "Operations written by one grouped statement of a worker, by writer (journal, completion).";
    /// Counted by the worker as a claim loads the journal it replays.
    JOURNAL_ROWS_READ = "agentq_journal_rows_read_total", Counter, ["source"], NO_BUCKETS,
        "Journal rows the worker's runs loaded to replay, by where from (database: read by the claim; memory: kept from the operation's previous run on this worker, AGENTQ_JOURNAL_CACHE_MEMORY).";
    ATTEMPT_DURATION = "agentq_operation_attempt_duration_seconds", Histogram, ["kind"], RUN_BUCKETS,
        "Time from claim to settled outcome of one operation attempt, by kind.";
    LEASES_EXPIRED = "agentq_leases_expired_total", Counter, ["kind"], NO_BUCKETS,
        "Running operations whose lease expired (worker died or hung), found by the reaper, by kind.";
    LEASES_RESCUED = "agentq_leases_rescued_total", Counter, ["kind"], NO_BUCKETS,
        "Expired leases the reaper put back to queued, by kind.";
    CRASH_LOOPS = "agentq_crash_loops_total", Counter, ["kind"], NO_BUCKETS,
        "Operations the reaper moved to dead as crash_loop (restarts over the limit), by kind.";
    BREAKER_STATE = "agentq_circuit_breaker_state", Gauge, ["provider"], NO_BUCKETS,
        "Model circuit breaker of this worker per provider: 0 closed, 1 half-open, 2 open.";
    MODEL_CALL_LIMIT = "agentq_model_call_limit", Gauge, ["provider"], NO_BUCKETS,
        "Model calls this worker sends at once to the provider: AGENTQ_MODEL_CONCURRENCY, or the limit it found (auto).";
    MODEL_CALL_DURATION = "agentq_model_call_duration_seconds", Histogram, ["provider"], MODEL_BUCKETS,
        "Time of one model call to the provider (each in-step retry counts), by provider.";
    MODEL_CALL_ERRORS = "agentq_model_call_errors_total", Counter, ["provider", "class"], NO_BUCKETS,
        "Failed model calls by provider and class (retryable, overloaded, non_retryable, parked by the breaker).";
    MODEL_TOKENS = "agentq_model_tokens_total", Counter, ["kind", "type"], NO_BUCKETS,
        "Model tokens used, by operation kind and type (prompt, completion).";
    BUDGET_REFUSALS = "agentq_budget_refusals_total", Counter, ["scope"], NO_BUCKETS,
        "Model calls a token budget refused before they were sent, by the budget's scope (operation: parked waiting for budget; batch: the batch paused).";
    RATE_LIMITED = "agentq_rate_limited_total", Counter, ["scope", "outcome"], NO_BUCKETS,
        "Model calls a rate limit's window held back before they were sent, by the limit's scope and what the call did (waited: in its slot, a short wait; parked: the operation went back to wait for the window without a slot; never: its reservation alone is more than the limit).";
    REMOTE_CALLS = "agentq_remote_calls_total", Counter, ["service", "outcome"], NO_BUCKETS,
        "Step protocol calls to remote kinds' services, by service and outcome (ok, resend, or the failure: unreachable, timeout, refused, status, oversized, malformed, signature, protocol; memory: the worker's memory for remote journals was held by others, the operation went back to the queue; parked: the service's circuit was open, nothing was sent).";
    SERVICE_DRIFT = "agentq_service_drift", Gauge, ["service"], NO_BUCKETS,
        "Differences between a registered service's live manifest and its registration, as the scheduler's last check found (0: none; register it again to clear).";
    SERVICE_BREAKER_STATE = "agentq_service_breaker_state", Gauge, ["service"], NO_BUCKETS,
        "Circuit breaker of this worker per registered service: 0 closed, 1 half-open, 2 open (its operations parked, their attempts given back).";
    REMOTE_BYTES_SENT = "agentq_remote_bytes_sent_total", Counter, ["service"], NO_BUCKETS,
        "Bytes of step protocol request bodies sent to remote kinds' services, by service.";
    TIMER_LAG = "agentq_timer_lag_seconds", Histogram, [], LAG_BUCKETS,
        "Time from a sleep's or wait's due time to the scheduler waking it.";
    /// Counted by the scheduler's firing pass.
    SCHEDULE_TICKS = "agentq_schedule_ticks_total", Counter, ["kind", "outcome"], NO_BUCKETS,
        "Schedule ticks a scheduler handled, by kind and outcome (fired; skipped_overlap: the previous firing was unfinished; missed: older than the catch-up window; skipped_capacity: the tenant had its cap of unfinished operations).";
    /// Database gauge, read at scrape time.
    OPERATIONS_BY_STATUS = "agentq_operations", Gauge, ["status"], NO_BUCKETS,
        "Operations by status (read from PostgreSQL at scrape time).";
    /// Database gauge, read at scrape time.
    QUEUE_DEPTH = "agentq_queue_depth", Gauge, ["lane"], NO_BUCKETS,
        "Queued operations that are due, by lane (read from PostgreSQL at scrape time).";
    /// Database gauge, read at scrape time.
    QUEUE_OLDEST_AGE = "agentq_queue_oldest_age_seconds", Gauge, ["lane"], NO_BUCKETS,
        "Age of the oldest due queued operation since its run_at, by lane (0 when none).";
    /// Database gauge, read at scrape time.
    DEAD_LETTERS_OPEN = "agentq_dead_letters_open", Gauge, ["class"], NO_BUCKETS,
        "Open dead letters by failure class (read from PostgreSQL at scrape time).";
    /// Database gauge, read at scrape time.
    VERSION_UNSERVED = "agentq_operations_version_unserved", Gauge, ["kind"], NO_BUCKETS,
        "Unfinished operations (queued, sleeping, waiting) pinned to a version of their kind that no live worker runs, by kind (read from PostgreSQL at scrape time).";
    HTTP_REQUESTS = "agentq_http_requests_total", Counter, ["method", "route", "status"], NO_BUCKETS,
        "HTTP requests answered, by method, route and status.";
    HTTP_REQUEST_DURATION = "agentq_http_request_duration_seconds", Histogram, ["method", "route"], HTTP_BUCKETS,
        "Time to answer an HTTP request, by method and route.";
}

static GLOBAL: LazyLock<Registry> = LazyLock::new(Registry::default);

/// The process's registry, which `/metrics` renders.
pub fn global() -> &'static Registry {
    &GLOBAL
}

impl Metric {
    /// Adds 1 to this counter in the process's registry.
    pub fn inc(&self, labels: &[&str]) {
        global().add(self, labels, 1.0);
    }

    /// Adds `v` to this counter in the process's registry.
    pub fn add(&self, labels: &[&str], v: f64) {
        global().add(self, labels, v);
    }

    /// Sets this gauge in the process's registry.
    pub fn set(&self, labels: &[&str], v: f64) {
        global().set(self, labels, v);
    }

    /// Records one observation of this histogram in the process's registry.
    pub fn observe(&self, labels: &[&str], v: f64) {
        global().observe(self, labels, v);
    }

    /// Creates this counter's series for `labels` at 0 unless it exists, for label values known
    /// when the process starts: Prometheus's `increase` and `rate` see nothing of a series
    /// whose first sample is already 1, so an alert on the first event needs the 0 before it.
    pub fn start_at_zero(&self, labels: &[&str]) {
        global().add(self, labels, 0.0);
    }
}

/// Reads the database gauges ([`OPERATIONS_BY_STATUS`], [`QUEUE_DEPTH`], [`QUEUE_OLDEST_AGE`],
/// [`DEAD_LETTERS_OPEN`], [`VERSION_UNSERVED`]) into the process's registry; a failed query is logged and leaves that
/// gauge as it was. Called by whoever serves `/metrics` with a pool, at scrape time.
pub async fn refresh_database_gauges(pool: &PgPool) {
    let registry = global();
    match crate::db::operations::count_by_status(pool).await {
        Ok(rows) => registry.replace(
            &OPERATIONS_BY_STATUS,
            rows.into_iter().map(|(s, n)| (vec![s], n as f64)).collect(),
        ),
        Err(e) => tracing::warn!(error = %e, "metrics: counting operations by status failed"),
    }
    match crate::db::gauges::queues_by_lane(pool).await {
        Ok(rows) => {
            // Every lane has a sample, 0 when empty, so "no data" never hides an alert.
            let lane = |l: crate::Lane| rows.iter().find(|r| r.lane == l.as_str());
            let all = crate::Lane::ALL;
            registry.replace(
                &QUEUE_DEPTH,
                all.iter()
                    .map(|l| {
                        let n = lane(*l).map_or(0, |r| r.depth);
                        (vec![l.as_str().to_string()], n as f64)
                    })
                    .collect(),
            );
            registry.replace(
                &QUEUE_OLDEST_AGE,
                all.iter()
                    .map(|l| {
                        let age = lane(*l).map_or(0.0, |r| r.oldest_age_secs.max(0.0));
                        (vec![l.as_str().to_string()], age)
                    })
                    .collect(),
            );
        }
        Err(e) => tracing::warn!(error = %e, "metrics: reading queue depth failed"),
    }
    match crate::db::gauges::open_dead_letters_by_class(pool).await {
        Ok(rows) => registry.replace(
            &DEAD_LETTERS_OPEN,
            rows.into_iter().map(|(c, n)| (vec![c], n as f64)).collect(),
        ),
        Err(e) => tracing::warn!(error = %e, "metrics: counting open dead letters failed"),
    }
    match crate::db::versions::without_live_worker(pool).await {
        Ok(rows) => registry.replace(
            &VERSION_UNSERVED,
            rows.into_iter().map(|(k, n)| (vec![k], n as f64)).collect(),
        ),
        Err(e) => {
            tracing::warn!(error = %e, "metrics: counting operations of unserved versions failed")
        }
    }
}

/// The `/metrics` body: with a pool, the database gauges are read first when the last read is
/// older than [`GAUGES_TTL`].
pub async fn scrape(pool: Option<&PgPool>) -> String {
    if let Some(pool) = pool
        && gauges_due()
    {
        refresh_database_gauges(pool).await;
    }
    global().render()
}

/// How long the database gauges are reused: however often `/metrics` is scraped (by several
/// Prometheus replicas, or a caller in a loop), the database sees at most one set of gauge
/// queries per process in this time.
pub const GAUGES_TTL: std::time::Duration = std::time::Duration::from_secs(5);

/// True when the gauges were last read [`GAUGES_TTL`] ago or never; claims the refresh.
fn gauges_due() -> bool {
    static LAST: Mutex<Option<std::time::Instant>> = Mutex::new(None);
    let mut last = LAST.lock().expect("gauges refresh lock");
    if last.is_some_and(|t| t.elapsed() < GAUGES_TTL) {
        return false;
    }
    *last = Some(std::time::Instant::now());
    true
}

/// The content type of [`Registry::render`]'s text: the `prometheus` crate's
/// [`TEXT_FORMAT`](prometheus::TEXT_FORMAT) with its charset.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_declared_metric_renders_with_help_and_type() {
        let registry = Registry::default();
        for m in ALL {
            assert!(m.name.starts_with("agentq_"), "{}", m.name);
            assert!(!m.help.is_empty(), "{} has no help", m.name);
            assert_eq!(
                m.kind == Kind::Histogram,
                !m.buckets.is_empty(),
                "{}",
                m.name
            );
            assert!(m.buckets.windows(2).all(|w| w[0] < w[1]), "{}", m.name);
            let labels: Vec<&str> = m.labels.iter().map(|_| "x").collect();
            match m.kind {
                Kind::Histogram => registry.observe(m, &labels, 0.3),
                _ => registry.add(m, &labels, 2.0),
            }
        }
        let names: std::collections::HashSet<_> = ALL.iter().map(|m| m.name).collect();
        assert_eq!(names.len(), ALL.len(), "a metric name is declared twice");
        let text = registry.render();
        for m in ALL {
            let kind = m.kind.as_str();
            assert!(text.contains(&format!("# HELP {} ", m.name)), "{}", m.name);
            assert!(
                text.contains(&format!("# TYPE {} {kind}\n", m.name)),
                "{}",
                m.name
            );
            let sample = match m.kind {
                Kind::Histogram => format!("{}_count", m.name),
                _ => m.name.to_string(),
            };
            assert!(
                text.lines().any(|l| l.starts_with(&sample)),
                "no sample of {}:\n{text}",
                m.name
            );
        }
        assert!(
            text.contains("agentq_timer_lag_seconds_bucket{le=\"0.5\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("agentq_timer_lag_seconds_bucket{le=\"+Inf\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("agentq_timer_lag_seconds_sum 0.3\n"),
            "{text}"
        );
        assert!(
            text.contains("agentq_step_duration_seconds_bucket{step_kind=\"x\",le=\"0.25\"} 0\n"),
            "{text}"
        );
        // Every line is a comment or `name{labels} value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
    }

    #[test]
    fn the_content_type_is_the_encoders_format() {
        assert_eq!(
            CONTENT_TYPE,
            format!("{}; charset=utf-8", prometheus::TEXT_FORMAT)
        );
    }

    #[test]
    fn label_values_are_escaped() {
        let registry = Registry::default();
        registry.add(&OPERATIONS_ENQUEUED, &["a\"b\\c\nd"], 1.0);
        let text = registry.render();
        assert!(
            text.contains("agentq_operations_enqueued_total{kind=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "{text}"
        );
        assert_eq!(text.lines().filter(|l| l.contains("a\\\"b")).count(), 1);
    }

    #[test]
    fn gauges_are_replaced_and_series_are_capped() {
        let registry = Registry::default();
        registry.replace(&OPERATIONS_BY_STATUS, vec![(vec!["queued".into()], 3.0)]);
        registry.replace(&OPERATIONS_BY_STATUS, vec![(vec!["dead".into()], 1.0)]);
        assert_eq!(registry.value(&OPERATIONS_BY_STATUS, &["queued"]), None);
        assert_eq!(registry.value(&OPERATIONS_BY_STATUS, &["dead"]), Some(1.0));
        for i in 0..MAX_SERIES + 5 {
            registry.add(&OPERATIONS_ENQUEUED, &[&format!("k{i}")], 1.0);
        }
        assert_eq!(registry.value(&OPERATIONS_ENQUEUED, &["_other"]), Some(5.0));
        registry.observe(&TIMER_LAG, &[], 1000.0);
        assert_eq!(registry.value(&TIMER_LAG, &[]), Some(1.0));
    }

    #[test]
    fn a_counter_started_at_zero_renders_0_and_keeps_its_count() {
        CRASH_LOOPS.start_at_zero(&["zero-test-kind"]);
        assert!(
            global()
                .render()
                .contains("agentq_crash_loops_total{kind=\"zero-test-kind\"} 0\n")
        );
        CRASH_LOOPS.inc(&["zero-test-kind"]);
        CRASH_LOOPS.start_at_zero(&["zero-test-kind"]);
        assert_eq!(global().value(&CRASH_LOOPS, &["zero-test-kind"]), Some(1.0));
    }
}
