//! Starting and stopping processes of the binary under test: a command with the test's
//! environment, a child whose output goes to a log file, a kill that also reaps. [`crate::World`]
//! builds on these, and the chaos suites (which run their own servers, outside any `World`)
//! use them directly.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// `binary ARGS` with `env` set on top of this process's environment.
pub fn command<K, V>(
    binary: impl AsRef<OsStr>,
    args: &[&str],
    env: impl IntoIterator<Item = (K, V)>,
) -> Command
where
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    let mut cmd = Command::new(binary);
    cmd.args(args).envs(env);
    cmd
}

/// Starts `cmd` with no stdin and its stdout and stderr written to a new file at `log`.
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> Child {
    let file = std::fs::File::create(log)
        .unwrap_or_else(|e| panic!("creating the log file {}: {e}", log.display()));
    let out = file.try_clone().expect("cloning the log file's handle");
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(file)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {:?}: {e}", cmd.get_program()))
}

/// SIGKILLs a child and waits for it (a child that already exited is only reaped).
pub fn stop(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}
