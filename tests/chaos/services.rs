//! Private PostgreSQL and RabbitMQ servers for the chaos suite, on free ports, in a temporary
//! directory: the suite restarts and pauses these, never the shared servers other tests use.
//! Both are stopped and their directories deleted on drop, also when the test fails.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The temporary directory both servers live in (deleted last).
pub struct Scratch {
    pub path: PathBuf,
}

impl Scratch {
    pub fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("agentq-chaos-{tag}"));
        std::fs::create_dir_all(&path).unwrap();
        // The servers may run as their own users (initdb refuses root): let them in.
        run(Command::new("chmod").arg("755").arg(&path));
        Self { path }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A private PostgreSQL 15 cluster.
pub struct Postgres {
    dir: PathBuf,
    pub port: u16,
    /// `postgres` when this test runs as root.
    user: Option<&'static str>,
    stopped: bool,
}

impl Postgres {
    /// `initdb` + start on a free port (no fsync: no OS crash is injected, only process faults).
    pub fn start(scratch: &Path) -> Self {
        let dir = scratch.join("pg");
        std::fs::create_dir_all(&dir).unwrap();
        let user = is_root().then_some("postgres");
        if let Some(u) = user {
            run(Command::new("chown").arg(u).arg(&dir));
        }
        let pg = Self {
            dir,
            port: free_port(),
            user,
            stopped: false,
        };
        run(pg
            .cmd("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(pg.data()));
        pg.ctl(&["start", "-w", "-t", "60"]);
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn cmd(&self, bin: &str) -> Command {
        let path = format!("{PG_BIN}/{bin}");
        let mut c = match self.user {
            Some(u) => {
                let mut c = Command::new("runuser");
                c.args(["-u", u, "--", &path]);
                c
            }
            None => Command::new(path),
        };
        c.current_dir(&self.dir);
        c
    }

    fn ctl(&self, args: &[&str]) -> Output {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300",
            self.port,
            self.dir.display()
        );
        run(self
            .cmd("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.join("log"))
            .arg("-o")
            .arg(opts)
            .args(args))
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `pg_ctl restart -m fast`: every connection is terminated, the server comes back.
    pub fn restart_fast(&self) {
        self.ctl(&["restart", "-m", "fast", "-w", "-t", "60"]);
    }

    /// The postmaster and all its children.
    fn pids(&self) -> Vec<String> {
        let pidfile = std::fs::read_to_string(self.data().join("postmaster.pid")).unwrap();
        let main = pidfile.lines().next().unwrap().trim().to_string();
        let out = Command::new("ps")
            .args(["-o", "pid=", "--ppid", &main])
            .output()
            .unwrap();
        let mut pids = vec![main];
        pids.extend(
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_string),
        );
        pids
    }

    /// SIGSTOP (`pause`) or SIGCONT of the postmaster and its children.
    pub fn signal_all(&self, signal: &str) {
        for pid in self.pids() {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(&pid)
                .status();
        }
    }

    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        self.signal_all("CONT");
        let _ = self
            .cmd("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["stop", "-m", "immediate", "-w"])
            .output();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A private RabbitMQ node (`agentq-chaos-<tag>@localhost`) with its own config, data and logs.
pub struct Rabbit {
    pub node: String,
    pub port: u16,
    dir: PathBuf,
    dist_port: u16,
    stopped: bool,
}

impl Rabbit {
    /// Starts the node detached and waits until it accepts AMQP sessions.
    pub fn start(scratch: &Path, tag: &str) -> Self {
        Self::start_named(scratch, "rabbit", &format!("agentq-chaos-{tag}@localhost"))
    }

    /// Starts node `node` (`name@localhost`) with its files under `scratch/dir`.
    pub fn start_named(scratch: &Path, dir: &str, node: &str) -> Self {
        let dir = scratch.join(dir);
        for d in ["mnesia", "log"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let port = free_port();
        // The shared node's /etc/rabbitmq/rabbitmq.conf names port 5672: use a config of our own.
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\n"),
        )
        .unwrap();
        std::fs::write(dir.join("enabled_plugins"), "").unwrap();
        if is_root() {
            // The server script drops to the `rabbitmq` user.
            run(Command::new("chown").args(["-R", "rabbitmq"]).arg(&dir));
        }
        let mut rabbit = Self {
            node: node.to_string(),
            port,
            dir,
            dist_port: free_port(),
            stopped: true,
        };
        rabbit.boot();
        rabbit
    }

    /// Runs the server detached with this node's files and ports, and waits for it.
    fn boot(&mut self) {
        let dir = &self.dir;
        run(Command::new("rabbitmq-server")
            .arg("-detached")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq"))
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins")));
        self.stopped = false;
        self.await_startup();
    }

    /// Makes this (fresh) node a member of `other`'s cluster.
    pub fn join(&self, other: &Rabbit) {
        for args in [
            vec!["stop_app"],
            vec!["join_cluster", other.node.as_str()],
            vec!["start_app"],
        ] {
            let out = self.ctl(&args);
            assert!(out.status.success(), "{args:?} on {}: {out:?}", self.node);
        }
        self.await_startup();
    }

    /// The OS process id of the node's Erlang VM.
    fn os_pid(&self) -> Option<u32> {
        let out = self.ctl(&["eval", "os:getpid()."]);
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .trim_matches('"')
            .parse()
            .ok()
    }

    /// SIGKILLs the node's VM: no goodbye to its peers or clients.
    pub fn kill(&mut self) {
        let pid = self.os_pid().expect("the node's pid");
        run(Command::new("kill").args(["-9", &pid.to_string()]));
        self.stopped = true;
        let end = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(self.addr()).is_ok() {
            assert!(Instant::now() < end, "{} still listening", self.node);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a killed node again with its files: it rejoins its cluster.
    pub fn restart(&mut self) {
        self.boot();
    }

    /// What `rabbitmqctl` on this node prints for `args` (tab-separated rows, no headers).
    pub fn rows(&self, args: &[&str]) -> Vec<Vec<String>> {
        let mut all = args.to_vec();
        all.push("--no-table-headers");
        let out = self.ctl(&all);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split('\t').map(str::to_string).collect())
            .collect()
    }

    fn ctl(&self, args: &[&str]) -> Output {
        Command::new("rabbitmqctl")
            .args(["-q", "-n", &self.node])
            .args(args)
            .output()
            .expect("running rabbitmqctl")
    }

    /// Waits until the node runs its application (the node registers a moment after `-detached`).
    fn await_startup(&self) {
        let end = Instant::now() + Duration::from_secs(120);
        while !self
            .ctl(&["await_startup", "--timeout", "60"])
            .status
            .success()
        {
            assert!(
                Instant::now() < end,
                "rabbitmq node {} did not start",
                self.node
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `rabbitmqctl stop_app` then `start_app`: every connection is closed; quorum queues and
    /// their messages survive.
    pub fn restart_app(&self) {
        let out = self.ctl(&["stop_app"]);
        assert!(out.status.success(), "stop_app: {out:?}");
        let out = self.ctl(&["start_app"]);
        assert!(out.status.success(), "start_app: {out:?}");
        self.await_startup();
    }

    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let _ = self.ctl(&["stop"]);
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        self.stop();
    }
}
