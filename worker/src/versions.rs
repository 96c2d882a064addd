//! Which operations this worker may claim, by the versions of their kinds.
//!
//! The claim statement is the one gate: it takes an operation pinned to a version only from a
//! worker that runs that version, and an operation not run yet only from a worker whose newest
//! version of its kind is the newest any live worker runs (and pins it to that version). This
//! module keeps what the worker passes to it ([`Runnable`]): the worker registers the versions
//! it runs in `workers` every `lease_ttl / 3` (the same period as its lease heartbeat), and
//! reads back what the other live workers run, so a worker left on an older version stops
//! taking new operations within one period of a newer one starting.
//!
//! A pointer this worker may not claim for its version is acked and its operation parked
//! (`version_parked`): RabbitMQ neither redelivers it nor counts it against the delivery
//! limit. [`pull`] is how a worker that runs the version takes it back: every
//! [`PULL_EVERY`] it claims parked operations it may run, with the same claim statement.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use agentq_core::db::versions::Runnable;
use agentq_core::db::{self};
use agentq_core::version;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// How often a worker looks for parked operations it may run.
pub(crate) const PULL_EVERY: Duration = Duration::from_secs(1);

/// Every `(kind, version)` a worker runs, read again at each refresh (a registry's remote
/// kinds change when a service is registered).
pub(crate) type Source = Box<dyn Fn() -> Vec<(String, String)> + Send + Sync>;

/// The versions this worker runs, and what it may claim given the other live workers.
pub(crate) struct Versions {
    source: Source,
    runnable: RwLock<Arc<Runnable>>,
}

/// The newest version of each kind in `mine`.
fn newest_of(mine: &[(String, String)]) -> BTreeMap<String, String> {
    let mut newest: BTreeMap<String, String> = BTreeMap::new();
    for (kind, v) in mine {
        let slot = newest.entry(kind.clone()).or_insert_with(|| v.clone());
        if version::compare(v, slot).is_gt() {
            *slot = v.clone();
        }
    }
    newest
}

impl Versions {
    /// `source`: every `(kind, version)` of the worker's registry. Until the first
    /// [`Versions::refresh`] the worker pins new operations to its newest versions.
    pub(crate) fn new(source: Source) -> Self {
        let mine = source();
        let runnable = Arc::new(runnable(&mine, &newest_of(&mine), &[]));
        Self {
            source,
            runnable: RwLock::new(runnable),
        }
    }

    /// What the claim statement takes from this worker now.
    pub(crate) fn runnable(&self) -> Arc<Runnable> {
        self.runnable.read().expect("versions lock").clone()
    }

    /// Registers this worker as alive for `ttl` with its versions and updates what it may
    /// claim from what the other live workers run.
    pub(crate) async fn refresh(
        &self,
        pool: &PgPool,
        owner: &str,
        ttl: Duration,
    ) -> db::Result<()> {
        let mine = (self.source)();
        let others = db::within(db::versions::register_worker(pool, owner, &mine, ttl)).await?;
        let next = Arc::new(runnable(&mine, &newest_of(&mine), &others));
        *self.runnable.write().expect("versions lock") = next;
        Ok(())
    }

    /// Refreshes every `ttl / 3` until `shutdown`, then removes the worker's row.
    pub(crate) async fn run(
        &self,
        pool: PgPool,
        owner: String,
        ttl: Duration,
        shutdown: CancellationToken,
        remote: Arc<crate::remote::RemoteKinds>,
    ) {
        let every = ttl / 3;
        loop {
            // A service registered (or removed): say so at once, not a period later.
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(every) => {}
                _ = remote.changed() => {}
            }
            if let Err(e) = self.refresh(&pool, &owner, ttl).await {
                tracing::warn!(error = %e, "registering the worker's versions failed");
            }
        }
        if let Err(e) = db::within(db::versions::deregister_worker(&pool, &owner)).await {
            tracing::warn!(error = %e, "removing the worker's registration failed; it lapses by itself");
        }
    }
}

/// What a worker running `mine` (newest per kind: `newest`) may claim while the other live
/// workers run `others`: every version it runs, and new operations of the kinds whose newest
/// live version it runs.
fn runnable(
    mine: &[(String, String)],
    newest: &BTreeMap<String, String>,
    others: &[(String, String)],
) -> Runnable {
    let pins: Vec<(&str, &str)> = newest
        .iter()
        .filter(|(kind, v)| {
            others
                .iter()
                .filter(|(k, _)| k == *kind)
                .all(|(_, other)| version::compare(other, v).is_le())
        })
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    Runnable::new(mine.iter().map(|(k, v)| (k.as_str(), v.as_str())), pins)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_worker_pins_new_operations_only_of_kinds_whose_newest_live_version_it_runs() {
        let mine = pairs(&[("a", "1"), ("a", "2"), ("b", "9")]);
        let source = mine.clone();
        let v = Versions::new(Box::new(move || source.clone()));
        // Alone: every kind at its newest.
        assert_eq!(
            *v.runnable(),
            Runnable::new(
                [("a", "1"), ("a", "2"), ("b", "9")],
                [("a", "2"), ("b", "9")]
            )
        );
        // Another worker runs a newer `b` and an older `a`: this one stops pinning `b` only.
        let others = pairs(&[("a", "1"), ("b", "10"), ("c", "1")]);
        assert_eq!(
            runnable(&mine, &newest_of(&mine), &others),
            Runnable::new([("a", "1"), ("a", "2"), ("b", "9")], [("a", "2")])
        );
        // The same newest version elsewhere: both pin it.
        let others = pairs(&[("a", "2")]);
        assert_eq!(
            runnable(&mine, &newest_of(&mine), &others),
            Runnable::new(
                [("a", "1"), ("a", "2"), ("b", "9")],
                [("a", "2"), ("b", "9")]
            )
        );
    }
}
