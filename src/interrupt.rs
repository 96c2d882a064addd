//! Ctrl-C for the command line's long work (`batch start`, `batch resume`, `batch status
//! --watch`, the bulk forms): the first Ctrl-C asks the work to stop at its next chunk or item
//! boundary, so it can say how far it got and how to continue; a second one ends the process at
//! once. Either way the exit code is 130, as for a shell's SIGINT.
//!
//! The handler is installed by the command itself rather than left to SIGINT's default action:
//! a process started in the background by a POSIX shell inherits SIGINT *ignored*, and the
//! default action then never comes; installing a handler replaces the ignored disposition.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The exit code of a command stopped by Ctrl-C (128 + SIGINT).
pub const EXIT_CODE: u8 = 130;

/// The error a command returns when Ctrl-C stopped it: its message says how far it got and how
/// to continue; `main` prints it and exits [`EXIT_CODE`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Interrupted(pub String);

/// Whether Ctrl-C was pressed since [`Interrupt::install`].
#[derive(Clone)]
pub struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    /// Installs the handler. Must be called inside the runtime.
    pub fn install() -> Self {
        let flag = Arc::new(AtomicBool::new(false));
        let seen = flag.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_err() {
                return; // no handler could be installed: SIGINT keeps its disposition
            }
            seen.store(true, Ordering::SeqCst);
            eprintln!("\nstopping after the current chunk or item (Ctrl-C again to stop at once)");
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(EXIT_CODE.into());
            }
        });
        Self(flag)
    }

    /// True once Ctrl-C was pressed.
    pub fn requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Resolves when Ctrl-C is pressed (polls the flag; for waits between rounds).
    pub async fn wait(&self) {
        while !self.requested() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}
