//! Child operations: `JobRun::spawn` (with the checks an enqueue makes, the tenant's
//! cap of unfinished operations, and the child's pointer published) and `JobRun::join`
//! (parks until every child has finished).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agentq_core::db;
use agentq_core::dispatch::{Dispatcher, Target};
use agentq_core::state::{StepKind, StepStatus};
use chrono::Utc;
use serde_json::Value;

use super::MAX_PARK;
use super::journal::StepSpec;
use super::{ChildOutcome, JobRun, OperationInfo, Services};
use agentq_core::operation::Requires;
use agentq_sdk::error::{Engine, JobError};
use agentq_sdk::tool::Replay;

/// A spawn's refusal: non-retryable, naming the kind.
fn refuse_spawn(kind: &str, why: String) -> JobError {
    JobError::NonRetryable(format!("spawning a {kind:?} child: {why}"))
}

/// Test hook (`AGENTQ_TEST_SPAWN_PAUSE_MS`): how long a spawn waits after storing its child
/// and before its step is journaled, so a crash test can kill a worker in that window.
fn spawn_pause() -> Option<Duration> {
    static PAUSE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *PAUSE.get_or_init(|| {
        std::env::var("AGENTQ_TEST_SPAWN_PAUSE_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map(Duration::from_millis)
    })
}

impl Services {
    /// Checks a child as an enqueue checks an operation: its kind, its input against the kind
    /// and its size. A kind that runs only for webhook deliveries cannot be a child. A misfit
    /// is non-retryable. Returns what the input requires (the stores it names).
    fn check_spawn(&self, kind: &str, input: &Value) -> Result<Requires, JobError> {
        let requires = (self.check_child)(kind, input).map_err(|why| refuse_spawn(kind, why))?;
        if requires.webhook_only {
            return Err(refuse_spawn(
                kind,
                "the kind runs only for the deliveries of a webhook source".into(),
            ));
        }
        agentq_core::operation::check_input_size(input).map_err(|why| refuse_spawn(kind, why))?;
        Ok(requires)
    }

    /// A spawn in PostgreSQL (the worker's store): the tenant's cap of unfinished operations,
    /// the stores the input names (the parent's tenant must have them), the child's row
    /// (deduplicated by `child:` and the step's `key`) and its pointer. An unreachable
    /// database is retryable.
    pub(crate) async fn spawn_stored(
        &self,
        info: &OperationInfo,
        key: &str,
        kind: &str,
        input: &Value,
        requires: &Requires,
    ) -> Result<uuid::Uuid, JobError> {
        let tenant = &info.tenant;
        self.check_tenant_cap(tenant).await?;
        if !requires.stores.is_empty() {
            let refusal = db::within(async {
                let mut conn = self.pool.acquire().await?;
                db::stores::refusal(&mut conn, tenant, &requires.stores).await
            })
            .await
            .map_err(|e| JobError::retryable(format!("checking a child's stores: {e}")))?;
            if let Some(why) = refusal {
                return Err(refuse_spawn(kind, why));
            }
        }
        let sha = agentq_core::operation::input_sha256(input);
        let spawned = db::within(db::children::spawn(
            &self.pool,
            info.op_id.0,
            &format!("child:{key}"),
            kind,
            input,
            &sha,
            self.limits.max_children,
            self.limits.max_spawn_depth,
        ))
        .await
        .map_err(|e| JobError::retryable(format!("spawning a child: {e}")))?;
        match spawned {
            db::children::Spawned::Created(child) => {
                let id = child.id;
                self.dispatch_child(child).await;
                if let Some(pause) = spawn_pause() {
                    // Test hook: hold the child stored but the step unjournaled.
                    tokio::time::sleep(pause).await;
                }
                Ok(id)
            }
            db::children::Spawned::Existing(id) => Ok(id),
            db::children::Spawned::NoParent => Err(JobError::from(Engine::LeaseLost)),
            db::children::Spawned::Capped(n) => Err(JobError::NonRetryable(format!(
                "this operation has spawned {n} children, the most one operation may \
                 (AGENTQ_MAX_CHILDREN); spawn fewer, or from the children themselves"
            ))),
            db::children::Spawned::TooDeep(n) => Err(JobError::NonRetryable(format!(
                "this operation is {n} spawns below its root, the deepest a tree of \
                 operations may be (AGENTQ_MAX_SPAWN_DEPTH); spawn from an operation \
                 nearer the root"
            ))),
            db::children::Spawned::KindNotAllowed => Err(JobError::NonRetryable(format!(
                "spawning a {kind:?} child: tenant {tenant:?} may not create operations of \
                 that kind (an admin's list, `agentq tenants kinds {tenant}`)"
            ))),
        }
    }

    /// A spawn is an operation born: past its tenant's cap of unfinished operations the spawn
    /// waits (the parent parks as overloaded, its attempt given back, and tries again later).
    /// The count is at most a second old.
    async fn check_tenant_cap(&self, tenant: &str) -> Result<(), JobError> {
        let cap = self.limits.tenant_max_unfinished;
        let cached = {
            let counts = self.counts.lock().expect("counts lock");
            counts
                .get(tenant)
                .filter(|(at, _)| at.elapsed() < Duration::from_secs(1))
                .map(|(_, n)| *n)
        };
        let count = match cached {
            Some(n) => n,
            None => {
                let n = db::within(db::operations::unfinished_count(&self.pool, tenant, cap))
                    .await
                    .map_err(|e| {
                        JobError::retryable(format!("counting the tenant's operations: {e}"))
                    })?;
                self.counts
                    .lock()
                    .expect("counts lock")
                    .insert(tenant.to_string(), (Instant::now(), n));
                n
            }
        };
        if count >= cap {
            return Err(JobError::from(Engine::Overloaded {
                message: format!(
                    "tenant {tenant:?} has {cap} or more unfinished operations, its cap \
                     (AGENTQ_TENANT_MAX_UNFINISHED): the spawn waits for some to finish"
                ),
                not_before: Some(Utc::now() + chrono::Duration::seconds(5)),
            }));
        }
        Ok(())
    }

    /// Publishes a new child's pointer; if that fails the dispatch sweeper publishes it.
    async fn dispatch_child(&self, child: db::dispatch::Dispatch) {
        let dispatcher = self.children.get_or_init(|| {
            Dispatcher::new(
                self.pool.clone(),
                &self.amqp_url,
                self.names.clone(),
                "worker",
            )
        });
        if let Err(e) = dispatcher.dispatch(&Target::from(child)).await {
            tracing::warn!(error = %e, "publishing a child's pointer failed; the dispatch sweeper will");
        }
    }
}

impl JobRun {
    /// The SDK handle's `spawn`: a child stored and published, journaled.
    pub(crate) async fn spawn(&self, kind: &str, input: Value) -> Result<uuid::Uuid, JobError> {
        let name = format!("spawn:{kind}");
        let spec = StepSpec::new(&name, StepKind::Spawn, Replay::Safe);
        let services = self.inner.services.clone();
        let info = &self.inner.info;
        self.run_step_with(spec, None, |key| async move {
            let requires = services.check_spawn(kind, &input)?;
            let store = services.store.clone();
            let id = store
                .spawn(&services, info, &key, kind, &input, &requires)
                .await?;
            Ok((id, None))
        })
        .await
    }

    /// The SDK handle's `join`: every child's outcome, parking while any is unfinished.
    pub(crate) async fn join(
        &self,
        children: &[uuid::Uuid],
    ) -> Result<Vec<ChildOutcome>, JobError> {
        let mut ids: Vec<uuid::Uuid> = Vec::with_capacity(children.len());
        for c in children {
            if !ids.contains(c) {
                ids.push(*c);
            }
        }
        let (seq, key) = self.begin_park("join", StepKind::Join).await?;
        let decode = |output: Option<Value>| {
            serde_json::from_value::<Vec<ChildOutcome>>(output.unwrap_or(Value::Array(vec![])))
                .map_err(|e| {
                    JobError::from(Engine::Nondeterminism(format!(
                        "step {seq} (join) recorded an output of another shape: {e}"
                    )))
                })
        };
        // A join parks with no timeout of its own (an operation deadline still applies).
        let until = Utc::now() + chrono::Duration::from_std(MAX_PARK).unwrap_or_default();
        match self.recorded(seq) {
            Some(e) if e.status == StepStatus::Completed => return decode(e.output),
            Some(_) => {}
            None if ids.is_empty() => {
                let mut row = self.park_row(seq, "join", StepKind::Join, key, until);
                row.status = StepStatus::Completed;
                row.output = Some(Value::Array(vec![]));
                row.completed_at = Some(Utc::now());
                self.push(row, true);
                return Ok(Vec::new());
            }
            None => {
                // The join step must exist before it can be resolved.
                self.push(self.park_row(seq, "join", StepKind::Join, key, until), true);
                self.flush().await?;
            }
        }
        let info = &self.inner.info;
        let services = &self.inner.services;
        let resolved = services
            .store
            .resolve_join(services, info, seq, &ids)
            .await
            .map_err(|e| JobError::retryable(format!("resolving a join: {e}")))?;
        match resolved {
            db::children::Join::Resolved(output) => decode(Some(output)),
            db::children::Join::Pending => {
                self.run_state().suspend =
                    Some((until, Some(agentq_core::operation::JOIN_WAIT.to_string())));
                Err(JobError::from(Engine::Suspended))
            }
            db::children::Join::NotChildren(strangers) => Err(JobError::NonRetryable(format!(
                "join named operations that are not this operation's children: {strangers:?}"
            ))),
            db::children::Join::LeaseLost => {
                self.inner.lost.store(true, Ordering::Release);
                Err(JobError::from(Engine::LeaseLost))
            }
        }
    }
}
