//! agentq-testkit: end-to-end tests of an agentq binary (agentq's own, or a deployment's built
//! on `agentq::main`) against real PostgreSQL and RabbitMQ. A [`World`] is a fresh database
//! and a fresh broker namespace per test, the binary run as child processes (`worker`,
//! `scheduler`, `serve`, any subcommand), polling with deadlines (never bare sleeps), and
//! cleanup of everything it created, even when a test fails; [`fake_model`] is an
//! OpenAI-compatible provider on `127.0.0.1:0` that tests script, over [`http_server`], the
//! one small HTTP server of the tree (the benchmarks' fake provider uses it too);
//! [`process`] starts and stops processes of the binary for suites that run outside a
//! `World` (the chaos suites), and [`rng::Lcg`] is their reproducible random workload.
//!
//! Test support, not product code: it reads and writes the test's database directly.
//!
//! In an integration test of the crate whose binary it runs, name it with
//! `env!("CARGO_BIN_EXE_<name>")`:
//!
//! ```no_run
//! # async fn t(binary: &str) {
//! let mut world = agentq_testkit::World::start(binary).await;
//! world.spawn(&["worker"]);
//! world.spawn(&["scheduler"]);
//! let op = world.enqueue_echo("hello");
//! world.wait_status(&op, "succeeded", agentq_testkit::DEADLINE).await;
//! world.cleanup().await;
//! # }
//! ```

pub mod fake_model;
pub mod http_server;
pub mod process;
pub mod rng;

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use agentq_core::broker::{self, Names};
use agentq_core::db;
use agentq_core::operation::OperationView;
use serde_json::Value;
use sqlx::PgPool;

/// How long a test waits for something that should happen promptly (an operation to finish, a
/// process to react) before it fails: generous for a loaded 2-core machine, where a wait that
/// needs more than this is a hang rather than slowness. Waits that truly need longer keep a
/// named constant saying why.
pub const DEADLINE: Duration = Duration::from_secs(40);

/// A fresh test world of `binary` with one scheduler and one worker running.
pub async fn running(binary: impl Into<PathBuf>) -> World {
    let mut world = World::start(binary).await;
    world.spawn(&["scheduler"]);
    world.spawn(&["worker"]);
    world
}

/// Where the test databases live (the server of `DATABASE_URL`, default local).
fn base_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// One test's world: its database, its namespace, its processes of `binary`.
pub struct World {
    /// The binary every command and process runs (`env!("CARGO_BIN_EXE_<name>")`).
    pub binary: PathBuf,
    pub database_url: String,
    pub amqp_url: String,
    pub namespace: String,
    pub pool: PgPool,
    /// Extra environment for every process this test starts (overrides the defaults).
    pub env: Vec<(String, String)>,
    children: Vec<Child>,
    logs: Vec<Option<std::path::PathBuf>>,
    cleaned: bool,
}

impl World {
    /// Creates and migrates a fresh database and declares a fresh namespace, for `binary`.
    pub async fn start(binary: impl Into<PathBuf>) -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        let database_url = db::with_database(&base_url(), &format!("agentq_test_{tag}")).unwrap();
        db::migrate(&database_url)
            .await
            .expect("migrating the test database");
        let pool = db::connect(&database_url, 8).await.unwrap();
        let namespace = format!("test-{tag}");
        let amqp_url = amqp_url();
        let conn = broker::connect(&amqp_url, "test").await.unwrap();
        broker::declare_topology(&conn, &Names::new(&namespace))
            .await
            .unwrap();
        let _ = conn.close(200, "declared".into()).await;
        Self {
            binary: binary.into(),
            database_url,
            amqp_url,
            namespace,
            pool,
            env: Vec::new(),
            children: Vec::new(),
            logs: Vec::new(),
            cleaned: false,
        }
    }

    /// The broker names of this test's namespace.
    pub fn names(&self) -> Names {
        Names::new(&self.namespace)
    }

    /// A command running the real binary against this test's database and namespace.
    pub fn command(&self, args: &[&str]) -> Command {
        let defaults = [
            ("DATABASE_URL", self.database_url.as_str()),
            ("AMQP_URL", &self.amqp_url),
            ("AGENTQ_NAMESPACE", &self.namespace),
            ("AGENTQ_DISPATCH_GRACE_SECS", "1"),
            ("AGENTQ_LEASE_TTL_SECS", "6"),
            // Tests fire schedules every second (production's shortest interval is 10 s).
            ("AGENTQ_SCHEDULE_MIN_INTERVAL_SECS", "1"),
            ("RUST_LOG", "warn"),
        ];
        let own = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        process::command(&self.binary, args, defaults.into_iter().chain(own))
    }

    /// Sets an environment variable for every process started from now on.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_string(), value.to_string()));
    }

    /// Stops setting an environment variable for the processes started from now on.
    pub fn unset_env(&mut self, key: &str) {
        self.env.retain(|(k, _)| k != key);
    }

    /// Runs `agentq ARGS` to completion.
    pub fn agentq(&self, args: &[&str]) -> Output {
        self.command(args)
            .stdin(Stdio::null())
            .output()
            .expect("running agentq")
    }

    /// Runs `agentq ARGS` and expects it to succeed (the failure shows its stderr).
    pub fn agentq_ok(&self, args: &[&str]) -> Output {
        let out = self.agentq(args);
        assert!(
            out.status.success(),
            "agentq {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Registers a store for `tenant` (`agentq stores add`): `place` is `["--dir", PATH]` or
    /// `["--table", NAME, …]`, `access` read, write or read_write.
    pub fn add_store(&self, tenant: &str, name: &str, place: &[&str], access: &str) {
        let mut args = vec![
            "stores", "add", "--tenant", tenant, "--name", name, "--access", access,
        ];
        args.extend_from_slice(place);
        self.agentq_ok(&args);
    }

    /// Registers `dir` as a store of `tenant` named after its last component, unless it is
    /// already; returns the store's name.
    pub fn dir_store(&self, tenant: &str, dir: &std::path::Path, access: &str) -> String {
        let name = dir.file_name().unwrap().to_str().unwrap().to_string();
        let listed = self.agentq_ok(&["stores", "list", "--tenant", tenant, "--json"]);
        let known = String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|v| v["name"] == name.as_str());
        if !known {
            self.add_store(tenant, &name, &["--dir", dir.to_str().unwrap()], access);
        }
        name
    }

    /// Runs `agentq ARGS`, expects success and parses stdout as one JSON object.
    pub fn agentq_json(&self, args: &[&str]) -> Value {
        let out = self.agentq_ok(args);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "agentq {args:?} printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// Runs `agentq ARGS`, expects success and parses each line of stdout as a JSON value.
    pub fn agentq_json_lines(&self, args: &[&str]) -> Vec<Value> {
        let out = self.agentq_ok(args);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| {
                    panic!("agentq {args:?} printed a line that is no JSON ({e}): {l}")
                })
            })
            .collect()
    }

    /// Starts a long-running `agentq ARGS` process (killed at cleanup); returns its index.
    pub fn spawn(&mut self, args: &[&str]) -> usize {
        let child = self
            .command(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("starting agentq");
        self.children.push(child);
        self.logs.push(None);
        self.children.len() - 1
    }

    /// Like [`World::spawn`], started as a POSIX shell starts a background job (`cmd &` in a
    /// script, `nohup … &`): with SIGINT ignored, which the process inherits. A command that
    /// relies on SIGINT's default action never stops on Ctrl-C there; one that installs its own
    /// handler does. The shell `exec`s agentq, so the index's pid is agentq's.
    pub fn spawn_in_background(&mut self, args: &[&str]) -> usize {
        let plain = self.command(args);
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("trap '' INT; exec \"$0\" \"$@\"")
            .arg(&self.binary)
            .args(args);
        for (k, v) in plain.get_envs() {
            if let Some(v) = v {
                cmd.env(k, v);
            }
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("starting agentq under sh");
        self.children.push(child);
        self.logs.push(None);
        self.children.len() - 1
    }

    /// Like [`World::spawn`], with the process's output (its log at `info`, or at the level a
    /// test set with `set_env("RUST_LOG", …)`, and stdout) kept for [`World::log`].
    pub fn spawn_logged(&mut self, args: &[&str]) -> usize {
        let level = self
            .env
            .iter()
            .find(|(k, _)| k == "RUST_LOG")
            .map_or("info".to_string(), |(_, v)| v.clone());
        let path = std::env::temp_dir().join(format!(
            "agentq-test-{}-{}.log",
            self.namespace,
            self.children.len()
        ));
        let child = process::spawn_logged(self.command(args).env("RUST_LOG", level), &path);
        self.children.push(child);
        self.logs.push(Some(path));
        self.children.len() - 1
    }

    /// What a process started by [`World::spawn_logged`] has logged so far.
    pub fn log(&self, index: usize) -> String {
        self.logs[index]
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// The OS process id of a spawned process.
    pub fn pid(&self, index: usize) -> u32 {
        self.children[index].id()
    }

    /// Sends a signal (`STOP`, `CONT`, `TERM`, …) to a spawned process.
    pub fn signal(&self, index: usize, signal: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid(index).to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{signal} failed");
    }

    /// `kill -9` of a process started by [`World::spawn`].
    pub fn kill(&mut self, index: usize) {
        process::stop(&mut self.children[index]);
    }

    /// Waits for a spawned process to exit by itself, up to `deadline`; true if it did.
    pub async fn wait_exit(&mut self, index: usize, deadline: Duration) -> bool {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            if let Ok(Some(_)) = self.children[index].try_wait() {
                return true;
            }
            if tokio::time::Instant::now() >= end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Enqueues an operation of `kind` for `tenant` through the CLI (`agentq enqueue`, with
    /// `extra` flags); returns its id.
    pub fn enqueue_as(&self, tenant: &str, kind: &str, input: &Value, extra: &[&str]) -> String {
        let input = input.to_string();
        let mut args = vec![
            "enqueue", "--tenant", tenant, "--kind", kind, "--input", &input, "--json",
        ];
        args.extend_from_slice(extra);
        let v = self.agentq_json(&args);
        v["op_id"].as_str().unwrap().to_string()
    }

    /// Enqueues a `script` operation (its program is the `steps` array); returns its id.
    pub fn enqueue_script(&self, steps: Value, extra: &[&str]) -> String {
        self.enqueue_as(
            "t1",
            "script",
            &serde_json::json!({ "steps": steps }),
            extra,
        )
    }

    /// The exit code of a process started by [`World::spawn`] that has exited (`None` while it
    /// runs, or when a signal ended it).
    pub fn exit_code(&mut self, index: usize) -> Option<i32> {
        self.children[index]
            .try_wait()
            .ok()
            .flatten()
            .and_then(|s| s.code())
    }

    /// Ledger effects recorded for an operation.
    pub async fn effects(&self, op: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ledger_effects WHERE op_id = $1::uuid")
            .bind(op)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Enqueues an `echo` operation through the CLI; returns its id.
    pub fn enqueue_echo(&self, text: &str) -> String {
        self.enqueue_as("t1", "echo", &serde_json::json!({ "text": text }), &[])
    }

    /// Reads an operation straight from the database.
    pub async fn operation(&self, op: &str) -> OperationView {
        let id = agentq_core::OperationId::parse(op).unwrap();
        db::operations::find_operation(&self.pool, id, None)
            .await
            .unwrap()
            .expect("operation exists")
    }

    /// Polls until the operation has `status`, panicking with its last state after `deadline`.
    pub async fn wait_status(&self, op: &str, status: &str, deadline: Duration) -> OperationView {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            let v = self.operation(op).await;
            if v.status.as_str() == status {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "operation {op} did not reach {status} within {deadline:?}; last seen {:?} {:?} {:?}",
                v.status,
                v.error_class,
                v.error_message
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Polls `f` until it is true, panicking with `what` after `deadline`.
    pub async fn wait_for<F, Fut>(&self, what: &str, deadline: Duration, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let end = tokio::time::Instant::now() + deadline;
        while !f().await {
            assert!(
                tokio::time::Instant::now() < end,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Polls `f` until it returns `Some`, panicking with `what` after `deadline`.
    pub async fn wait_until<T, F, Fut>(&self, what: &str, deadline: Duration, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let end = tokio::time::Instant::now() + deadline;
        loop {
            if let Some(v) = f().await {
                return v;
            }
            assert!(
                tokio::time::Instant::now() < end,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Starts `agentq serve` on a free loopback port; returns its index and base URL
    /// (`http://127.0.0.1:PORT`), once it accepts requests.
    pub async fn serve(&mut self) -> (usize, String) {
        let index = self.spawn_logged(&["serve", "--listen", "127.0.0.1:0"]);
        let base = self
            .wait_until("agentq serve to listen", Duration::from_secs(30), || {
                let log = self.log(index);
                async move {
                    let at = log.find("listening on http://")?;
                    let url = log[at + "listening on ".len()..]
                        .split_whitespace()
                        .next()?
                        .to_string();
                    Some(url)
                }
            })
            .await;
        (index, base)
    }

    /// A new API token of `tenant` with `role` (`producer`, `operator` or `admin`).
    pub fn token(&self, tenant: &str, role: &str) -> String {
        let v = self.agentq_json(&[
            "tokens", "create", "--tenant", tenant, "--role", role, "--json",
        ]);
        v["token"].as_str().unwrap().to_string()
    }

    /// Rows in `operations`.
    pub async fn operation_count(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM operations")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Stops the processes and deletes the database and the namespace.
    pub async fn cleanup(mut self) {
        self.cleanup_inner().await;
    }

    async fn cleanup_inner(&mut self) {
        if self.cleaned {
            return;
        }
        self.cleaned = true;
        self.children.iter_mut().for_each(process::stop);
        for p in self.logs.iter().flatten() {
            let _ = std::fs::remove_file(p);
        }
        self.pool.close().await;
        let _ = db::drop_database(&self.database_url).await;
        if let Ok(conn) = broker::connect(&self.amqp_url, "test-cleanup").await {
            let _ = broker::delete_topology(&conn, &self.names()).await;
            let _ = conn.close(200, "cleaned".into()).await;
        }
    }
}

impl Drop for World {
    /// A failed test still cleans up: on a thread with its own runtime, since Drop cannot await.
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        self.children.iter_mut().for_each(process::stop);
        self.children.clear();
        for p in self.logs.iter().flatten() {
            let _ = std::fs::remove_file(p);
        }
        let database_url = self.database_url.clone();
        let amqp_url = self.amqp_url.clone();
        let names = self.names();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let _ = db::drop_database(&database_url).await;
                if let Ok(conn) = broker::connect(&amqp_url, "test-cleanup").await {
                    let _ = broker::delete_topology(&conn, &names).await;
                }
            });
        })
        .join();
    }
}
