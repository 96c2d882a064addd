//! What the `agentq bench` scenarios share: the throwaway setup and cleanup, the worker and
//! scheduler child processes (started from this executable, so their peak RSS is their own),
//! commit counting from `pg_stat_database`, percentiles, and the report format (a table, then
//! one JSON line).

use crate::Deployment;
use std::time::Duration;

use agentq_core::db;
use anyhow::Context;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::fixtures;

#[derive(Default, Clone, Copy)]
pub(crate) struct Percentiles {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
}

pub(crate) fn percentiles(mut ms: Vec<f64>) -> Percentiles {
    if ms.is_empty() {
        return Percentiles::default();
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    Percentiles {
        p50: at(0.50),
        p99: at(0.99),
    }
}

/// Resident memory of a process now (`VmRSS`) and at its peak (`VmHWM`), in KiB.
pub(crate) fn rss_kib(pid: &str) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Peak resident memory of this process (producers, load generators, in-process parts).
pub(crate) fn max_rss_kib() -> u64 {
    rss_kib("self").1
}

/// CPU seconds (user + system) a process has used, from /proc/PID/stat.
pub(crate) fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // After the ")": state is field 0, utime field 11, stime field 12; 100 ticks per second.
    (ticks(11) + ticks(12)) / 100.0
}

/// A worker or scheduler started as a child process of the bench, on the bench's database and
/// namespace. Killed if dropped.
pub(crate) struct Proc {
    pub(crate) role: &'static str,
    child: tokio::process::Child,
    pid: String,
}

impl Proc {
    /// Starts `agentq <role> <args>` with the bench's configuration (and the model provider's,
    /// when one is set).
    pub(crate) fn spawn(
        config: &Deployment,
        role: &'static str,
        args: &[String],
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding the agentq executable")?;
        let child = tokio::process::Command::new(&exe)
            .arg(role)
            .args(args)
            .env("DATABASE_URL", &config.database_url)
            .env("AMQP_URL", &config.amqp_url)
            .env("AGENTQ_NAMESPACE", &config.namespace)
            .env(
                "AGENTQ_MODEL_CONCURRENCY",
                config.model_concurrency.to_string(),
            )
            .env(
                "AGENTQ_MODEL_FIRST_BYTE_SECS",
                config.model_first_byte_secs.to_string(),
            )
            .envs(
                config
                    .model_tenant_concurrency
                    .map(|n| ("AGENTQ_MODEL_TENANT_CONCURRENCY", n.to_string())),
            )
            .env("AGENTQ_LEASE_TTL_SECS", config.lease_ttl_secs.to_string())
            .env("AGENTQ_RESTART_LIMIT", config.restart_limit.to_string())
            .envs(
                config
                    .model_base_url
                    .as_ref()
                    .map(|u| ("AGENTQ_MODEL_BASE_URL", u.clone())),
            )
            // Several children would fight over one metrics port.
            .env_remove("AGENTQ_METRICS_ADDR")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting an agentq {role} process"))?;
        let pid = child.id().context("child pid")?.to_string();
        Ok(Self { role, child, pid })
    }

    /// `agentq worker --concurrency C`.
    pub(crate) fn worker(config: &Deployment, concurrency: u16) -> anyhow::Result<Self> {
        Self::spawn(
            config,
            "worker",
            &["--concurrency".into(), concurrency.to_string()],
        )
    }

    /// (now, peak) resident memory in KiB.
    pub(crate) fn rss_kib(&self) -> (u64, u64) {
        rss_kib(&self.pid)
    }

    pub(crate) fn cpu_seconds(&self) -> f64 {
        cpu_seconds(&self.pid)
    }

    /// Reads the peak RSS, then kills the process and waits for it.
    pub(crate) async fn stop(mut self) -> u64 {
        let (_, peak) = self.rss_kib();
        let _ = self.child.kill().await;
        peak
    }
}

/// Stops `procs`, returning each one's peak RSS in KiB, then waits (up to 10 s) for every
/// other session on the database to end, so their commits are in `pg_stat_database`. Also
/// returns how many queries the wait made on `pool`.
pub(crate) async fn stop_all(pool: &PgPool, procs: Vec<Proc>) -> (Vec<(&'static str, u64)>, usize) {
    let mut peaks = Vec::new();
    for p in procs {
        let role = p.role;
        peaks.push((role, p.stop().await));
    }
    let mut polls = 0;
    crate::poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
        polls += 1;
        async { (fixtures::other_sessions(pool).await.ok()? == 0).then_some(()) }
    })
    .await;
    (peaks, polls)
}

/// Commits counted by `pg_stat_database` for the benchmark database. Read it from a fresh
/// pool with every other session gone: backends report their counts when they exit.
pub(crate) async fn commits_now(config: &Deployment) -> anyhow::Result<i64> {
    let pool = config.connect().await?;
    let n = db::commit_count(&pool).await?;
    pool.close().await;
    Ok(n)
}

/// A scenario's report: rows for the table and the same figures for the final JSON line.
pub(crate) struct Report {
    title: String,
    rows: Vec<(String, String)>,
    line: serde_json::Map<String, Value>,
}

impl Report {
    pub(crate) fn new(scenario: &str, title: String) -> Self {
        let mut line = serde_json::Map::new();
        line.insert("scenario".into(), json!(scenario));
        Self {
            title,
            rows: Vec::new(),
            line,
        }
    }

    /// A figure rounded to `decimals`, under `label` in the table and `key` in the JSON.
    pub(crate) fn num(&mut self, label: &str, key: &str, value: f64, decimals: usize) -> &mut Self {
        let scale = 10f64.powi(decimals as i32);
        self.rows
            .push((label.into(), format!("{value:.decimals$}")));
        self.line
            .insert(key.into(), json!((value * scale).round() / scale));
        self
    }

    /// A value shown as is.
    pub(crate) fn val(&mut self, label: &str, key: &str, value: Value) -> &mut Self {
        let shown = match &value {
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        self.rows.push((label.into(), shown));
        self.line.insert(key.into(), value);
        self
    }

    /// Peak RSS of each stopped process (`worker_1_peak_rss_kib`, …) and of the bench itself.
    pub(crate) fn rss(&mut self, peaks: &[(&'static str, u64)]) -> &mut Self {
        let mut seen = std::collections::BTreeMap::<&str, usize>::new();
        for (role, peak) in peaks {
            let n = seen.entry(role).or_default();
            *n += 1;
            self.val(
                &format!("{role} {n} peak RSS KiB"),
                &format!("{role}_{n}_peak_rss_kib"),
                json!(peak),
            );
        }
        self.val(
            "bench process peak RSS KiB",
            "bench_peak_rss_kib",
            json!(max_rss_kib()),
        )
    }

    pub(crate) fn print(&self) {
        println!("{}", self.title);
        let width = self
            .rows
            .iter()
            .map(|(l, _)| l.chars().count())
            .max()
            .unwrap_or(0);
        for (label, value) in &self.rows {
            println!("  {label:<width$}  {value:>12}");
        }
        println!("{}", Value::Object(self.line.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!(p.p50, 51.0);
        assert_eq!(p.p99, 99.0);
        assert_eq!(percentiles(Vec::new()).p50, 0.0);
    }

    #[test]
    fn report_rounds_figures_and_numbers_processes_by_role() {
        let mut r = Report::new("e2e", "t".into());
        r.num("jobs/s", "jobs_per_s", 1234.567, 0).rss(&[
            ("worker", 10),
            ("worker", 12),
            ("scheduler", 7),
        ]);
        assert_eq!(r.line["jobs_per_s"], json!(1235.0));
        assert_eq!(r.line["worker_2_peak_rss_kib"], json!(12));
        assert_eq!(r.line["scheduler_1_peak_rss_kib"], json!(7));
        assert_eq!(r.rows[0], ("jobs/s".into(), "1235".into()));
    }
}
