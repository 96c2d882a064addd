//! agentq-producer: accept work, give it an operation id, store it in Postgres and publish a
//! pointer to RabbitMQ.
//!
//! Invariant kept here: bad input is refused before anything is written ([`Error::Invalid`]),
//! and an operation is committed before its pointer is published, so a crash between the two
//! leaves a row the scheduler's dispatch sweeper publishes later: never a lost job.

use std::sync::Arc;

use agentq_core::db::stores::{self, Need};
use agentq_core::db::{self, operations::Inserted, operations::NewOperation};
use agentq_core::dispatch::{Dispatcher, Target};
use agentq_core::group_commit::GroupCommit;
use agentq_core::kinds::{self, Catalog};
use agentq_core::metrics;
use agentq_core::operation::{Lane, OperationId, Origin, Requires, Status, TenantId, input_sha256};
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

pub use agentq_core::operation::MAX_INPUT_BYTES;
/// Longest accepted dedupe or ordering key.
pub const MAX_KEY_LEN: usize = 256;
/// The largest concurrency limit a key may have (as the `operations` table checks).
pub const MAX_CONCURRENCY_LIMIT: i32 = 1000;

/// What a caller asks to run.
#[derive(Clone, Debug, Default)]
pub struct EnqueueRequest {
    pub tenant: String,
    pub kind: String,
    pub input: Value,
    /// Idempotency key: same tenant + key + input → the same operation.
    pub dedupe_key: Option<String>,
    /// Operations sharing an ordering key run one at a time, in creation order.
    pub ordering_key: Option<String>,
    /// With `concurrency_limit`: operations of the tenant sharing this key run at most that
    /// many at once (claimed oldest first; one waiting for a signal or a sleep holds no slot).
    pub concurrency_key: Option<String>,
    pub concurrency_limit: Option<i32>,
    /// Its model calls count against the tenant's rate limits of this key (`agentq limits`).
    pub rate_key: Option<String>,
    /// Which queue and which worker slots it takes: `interactive` never waits behind `batch`.
    pub lane: Lane,
    /// Attempts before the operation is dead; `None` → the configured default.
    pub max_attempts: Option<i32>,
    /// Do not start before this time.
    pub run_at: Option<DateTime<Utc>>,
    /// Stop (dead, `deadline_exceeded`) if not finished by then.
    pub deadline: Option<DateTime<Utc>>,
    pub batch_id: Option<Uuid>,
    pub request_id: Option<String>,
    pub traceparent: Option<String>,
    /// What "the same request" means for the dedupe key: a hash the caller computes (the HTTP
    /// API hashes the whole request body). Default: the hash of `input`.
    pub fingerprint: Option<String>,
    /// Who asks: a kind that runs only for webhook deliveries refuses anything else.
    pub origin: Origin,
    /// A token budget on the operation: model calls that would pass it park it.
    pub budget: Option<agentq_core::db::budgets::Spec>,
}

/// The answer to an enqueue.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Enqueued {
    pub op_id: OperationId,
    /// False when the dedupe key named an existing operation with the same input.
    pub created: bool,
    pub status: Status,
}

/// Why an enqueue was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request itself is wrong; nothing was written. The message says what to change.
    #[error("{message}")]
    Invalid {
        /// The request field at fault, as the HTTP API names it (`/kind`, `/input`,
        /// `/ordering_key`, `/concurrency_key`, `/concurrency_limit`, `Idempotency-Key`,
        /// `/max_attempts`, `/deadline`, `/tenant`), or a JSON Pointer into the input
        /// (`/input/steps/0/work_ms`).
        field: String,
        message: String,
    },
    /// The dedupe key already names an operation with a different input; nothing was written.
    #[error(
        "dedupe key {key:?} already names operation {op_id} with a different input; \
         use a new key, or send the same input to get that operation back"
    )]
    KeyConflict { key: String, op_id: OperationId },
    /// The database failed.
    #[error("storing the operation: {0}")]
    Db(#[from] db::Error),
}

impl Error {
    /// True when the caller's input was refused (exit code 2, HTTP 4xx).
    pub fn is_refusal(&self) -> bool {
        matches!(self, Error::Invalid { .. } | Error::KeyConflict { .. })
    }
}

fn invalid(field: &str, message: impl Into<String>) -> Error {
    Error::Invalid {
        field: field.to_string(),
        message: message.into(),
    }
}

/// The answer to [`Producer::enqueue_many`].
#[derive(Clone, Debug, Default)]
pub struct Bulk {
    /// Operations stored now, in request order (minus the refused and the existing).
    pub created: Vec<OperationId>,
    /// Requests whose dedupe key already named an operation.
    pub existing: usize,
    /// Requests refused before anything was written: (index, why).
    pub refused: Vec<(usize, String)>,
}

/// What an enqueue keeps of its operation while the row is written: enough to answer
/// (created or existing) and to publish its pointer.
struct Stored {
    id: OperationId,
    tenant: String,
    kind: String,
    lane: Lane,
    traceparent: Option<String>,
    dedupe_key: Option<String>,
    input_sha256: String,
}

impl Stored {
    fn of(op: &NewOperation) -> Self {
        Self {
            id: op.id,
            tenant: op.tenant.clone(),
            kind: op.kind.clone(),
            lane: op.lane,
            traceparent: op.traceparent.clone(),
            dedupe_key: op.dedupe_key.clone(),
            input_sha256: op.input_sha256.clone(),
        }
    }

    /// The answer to an insert of the operation: created (its pointer to publish), the same
    /// operation stored before, or a dedupe key naming another input.
    fn pending(self, inserted: Inserted) -> Result<Pending, Error> {
        match inserted {
            Inserted::Created { id, epoch } => Ok(Pending {
                enqueued: Enqueued {
                    op_id: id,
                    created: true,
                    status: Status::Queued,
                },
                target: Some(Target {
                    op_id: id,
                    tenant: self.tenant,
                    kind: self.kind,
                    lane: self.lane,
                    epoch,
                    traceparent: self.traceparent,
                }),
            }),
            Inserted::Existing {
                id,
                status,
                input_sha256,
            } => {
                if input_sha256 != self.input_sha256 {
                    return Err(Error::KeyConflict {
                        key: self.dedupe_key.unwrap_or_default(),
                        op_id: id,
                    });
                }
                Ok(Pending {
                    enqueued: Enqueued {
                        op_id: id,
                        created: false,
                        status,
                    },
                    target: None,
                })
            }
        }
    }
}

/// An operation committed by [`Producer::enqueue_in`] whose pointer is not published yet.
#[derive(Clone, Debug)]
pub struct Pending {
    pub enqueued: Enqueued,
    target: Option<Target>,
}

/// The enqueue API. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Producer {
    pool: PgPool,
    /// Concurrent enqueues' rows, written many per statement.
    inserts: Arc<GroupCommit<NewOperation>>,
    dispatcher: Arc<Dispatcher>,
    /// The deployment's kinds, each input checked against them before anything is written.
    catalog: Arc<dyn Catalog>,
    default_max_attempts: i32,
}

impl Producer {
    /// A producer that accepts the job kinds of `catalog` (the deployment's registry: what its
    /// workers run), checking each input against its kind.
    pub fn new(
        pool: PgPool,
        dispatcher: Arc<Dispatcher>,
        catalog: Arc<dyn Catalog>,
        default_max_attempts: i32,
    ) -> Self {
        Self {
            inserts: Arc::new(GroupCommit::spawn(pool.clone())),
            pool,
            dispatcher,
            catalog,
            default_max_attempts,
        }
    }

    /// Stores the operation and publishes its pointer. A publish failure is not an error: the
    /// row is committed and the dispatch sweeper publishes it later (a warning is logged).
    /// Concurrent enqueues share one `INSERT` (group commit); each returns, and its pointer
    /// goes out, only after its own row has committed.
    pub async fn enqueue(&self, req: EnqueueRequest) -> Result<Enqueued, Error> {
        let (op, needs) = self.validate(req)?;
        if !needs.is_empty() || op.concurrency_key.is_some() {
            let mut conn = self.pool.acquire().await.map_err(db::Error::from)?;
            self.check_stored(&mut conn, &op, &needs).await?;
        }
        let about = Stored::of(&op);
        let inserted = match self.inserts.write(&self.pool, op).await {
            Ok(true) => Inserted::Created {
                id: about.id,
                epoch: db::operations::NEW_EPOCH,
            },
            // Not created by this statement: the writer stopped with the write taken (then it
            // is stored or not), or its dedupe key names an operation (stored before, or by a
            // write earlier in the same statement).
            Ok(false) => {
                let mut conn = self.pool.acquire().await.map_err(db::Error::from)?;
                match db::operations::epoch_of(&mut conn, about.id.0).await? {
                    Some(epoch) => Inserted::Created {
                        id: about.id,
                        epoch,
                    },
                    None if about.dedupe_key.is_some() => {
                        let key = about.dedupe_key.as_deref();
                        db::operations::existing(&mut conn, &about.tenant, key).await?
                    }
                    None => return Err(db::Error::Unanswered.into()),
                }
            }
            Err(unwritten) => return Err(unwritten.error.into()),
        };
        let pending = about.pending(inserted)?;
        Ok(self.dispatch(pending).await)
    }

    /// Enqueues handed to the shared `INSERT` and not yet taken into a statement (while two
    /// statements are in flight, the next one grows).
    pub fn enqueues_waiting(&self) -> usize {
        self.inserts.waiting()
    }

    /// Stores the operation through the caller's connection or transaction. Call
    /// [`Producer::dispatch`] after the caller commits; if it never does, the sweeper will.
    pub async fn enqueue_in(
        &self,
        conn: &mut PgConnection,
        req: EnqueueRequest,
    ) -> Result<Pending, Error> {
        let op = self.prepare(conn, req).await?;
        let inserted = db::operations::insert_operation(conn, &op).await?;
        Stored::of(&op).pending(inserted)
    }

    /// Checks `req` as an enqueue does (the kind, the input against it and the stores it
    /// names, keys, sizes and limits) without writing anything; returns the operation an
    /// enqueue would insert (a schedule keeps it and fires copies of it).
    pub async fn prepare(
        &self,
        conn: &mut PgConnection,
        req: EnqueueRequest,
    ) -> Result<NewOperation, Error> {
        let (op, needs) = self.validate(req)?;
        self.check_stored(conn, &op, &needs).await?;
        Ok(op)
    }

    /// The checks of an enqueue that read the database: the stores `op`'s input names
    /// (`needs`), and its concurrency key's limit.
    async fn check_stored(
        &self,
        conn: &mut PgConnection,
        op: &NewOperation,
        needs: &[Need],
    ) -> Result<(), Error> {
        if let Some(why) = stores::refusal(conn, &op.tenant, needs).await? {
            return Err(invalid("/input", why));
        }
        if let (Some(key), Some(wanted)) = (&op.concurrency_key, op.concurrency_limit)
            && let Some(kept) =
                db::operations::concurrency_key_limit(conn, &op.tenant, key, wanted).await?
        {
            return Err(invalid(
                "/concurrency_limit",
                format!(
                    "concurrency key {key:?} has the limit {kept} while operations of it are \
                     unfinished; this one asks for {wanted}: send {kept}, or use another key \
                     (a key takes a new limit once none of its operations is unfinished)"
                ),
            ));
        }
        Ok(())
    }

    /// Publishes the pointer of a committed [`Pending`] operation.
    pub async fn dispatch(&self, pending: Pending) -> Enqueued {
        // Counted here, after the caller's commit: a rolled-back enqueue_in never gets this far.
        if let Some(target) = &pending.target {
            metrics::OPERATIONS_ENQUEUED.inc(&[&target.kind]);
        }
        if let Some(target) = &pending.target
            && let Err(e) = self.dispatcher.dispatch(target).await
        {
            tracing::warn!(
                op_id = %target.op_id, error = %e,
                "operation stored but its pointer was not published; the scheduler will dispatch it"
            );
        }
        pending.enqueued
    }

    /// Stores many operations with one INSERT, then publishes their pointers concurrently so
    /// the broker's confirms pipeline. A request that fails validation is returned in
    /// `refused` with its index and reason and is not written; a dedupe key that already
    /// names an operation is counted in `existing` (its input is not compared).
    pub async fn enqueue_many(&self, reqs: Vec<EnqueueRequest>) -> Result<Bulk, Error> {
        let mut ops = Vec::with_capacity(reqs.len());
        let mut refused = Vec::new();
        // The stores the requests name, checked once per distinct (tenant, needs).
        let mut checked: std::collections::HashMap<(String, Vec<Need>), Option<String>> =
            Default::default();
        let mut conn = None;
        for (i, req) in reqs.into_iter().enumerate() {
            match self.validate(req) {
                Ok((op, needs)) if needs.is_empty() => ops.push(op),
                Ok((op, needs)) => {
                    let key = (op.tenant.clone(), needs);
                    let why = match checked.get(&key) {
                        Some(why) => why.clone(),
                        None => {
                            let conn = match &mut conn {
                                Some(c) => c,
                                None => {
                                    conn.insert(self.pool.acquire().await.map_err(db::Error::from)?)
                                }
                            };
                            let why = stores::refusal(conn, &key.0, &key.1).await?;
                            checked.insert(key, why.clone());
                            why
                        }
                    };
                    match why {
                        None => ops.push(op),
                        Some(why) => refused.push((i, why)),
                    }
                }
                Err(e) => refused.push((i, e.to_string())),
            }
        }
        drop(conn);
        if ops.is_empty() {
            return Ok(Bulk {
                created: Vec::new(),
                existing: 0,
                refused,
            });
        }
        let created = db::operations::insert_operations(&self.pool, &ops).await?;
        let existing = ops.len() - created.len();
        let targets: Vec<Target> = created.into_iter().map(Target::from).collect();
        for t in &targets {
            metrics::OPERATIONS_ENQUEUED.inc(&[&t.kind]);
        }
        let sends = targets.iter().map(|t| self.dispatcher.dispatch(t));
        for (t, sent) in targets
            .iter()
            .zip(futures_util::future::join_all(sends).await)
        {
            if let Err(e) = sent {
                tracing::warn!(op_id = %t.op_id, error = %e, "stored but not published; the scheduler will dispatch it");
            }
        }
        Ok(Bulk {
            created: targets.into_iter().map(|t| t.op_id).collect(),
            existing,
            refused,
        })
    }

    /// Checks `input` against `kind` as an enqueue would (the kind is known, the input fits),
    /// without writing anything; returns what it requires beyond its shape, or what is wrong
    /// and where (a JSON Pointer from the request's root: `/kind`, `/input/steps/0`).
    pub fn check_input(&self, kind: &str, input: &Value) -> Result<Requires, Error> {
        if !self.catalog.has_kind(kind) {
            return Err(invalid(
                "/kind",
                format!(
                    "unknown kind {kind:?}; this deployment runs: {} (`agentq kinds` shows each \
                     one's input)",
                    kinds::names(self.catalog.as_ref())
                ),
            ));
        }
        self.catalog
            .requires(kind, input)
            .map_err(|e| Error::Invalid {
                field: format!("/input{}", e.pointer),
                message: format!("input does not fit kind {kind:?}: {e}"),
            })
    }

    /// The deployment's kinds and tools.
    pub fn catalog(&self) -> &Arc<dyn Catalog> {
        &self.catalog
    }

    /// The operation to insert and the stores its input names (checked by the caller against
    /// the tenant's, in the database).
    fn validate(&self, req: EnqueueRequest) -> Result<(NewOperation, Vec<Need>), Error> {
        let tenant = TenantId::parse(&req.tenant).map_err(|e| invalid("/tenant", e))?;
        if let Some(at) = agentq_core::operation::nul_at(&req.input) {
            return Err(invalid(
                "/input",
                format!(
                    "input{} contains the NUL character (\\u0000), which cannot be stored; remove it",
                    if at == "/" {
                        String::new()
                    } else {
                        format!(" at {at}")
                    }
                ),
            ));
        }
        let requires = self.check_input(&req.kind, &req.input)?;
        if requires.webhook_only && req.origin != Origin::Webhook {
            return Err(invalid(
                "/kind",
                format!(
                    "kind {:?} runs only for the deliveries of a webhook source, which hold its \
                 configuration; an admin adds one with `agentq webhooks add --kind {} --config …`",
                    req.kind, req.kind
                ),
            ));
        }
        agentq_core::operation::check_input_size(&req.input).map_err(|e| invalid("/input", e))?;
        for (what, field, key) in [
            ("dedupe key", "Idempotency-Key", &req.dedupe_key),
            ("ordering key", "/ordering_key", &req.ordering_key),
            ("concurrency key", "/concurrency_key", &req.concurrency_key),
            ("rate key", "/rate_key", &req.rate_key),
        ] {
            if let Some(k) = key
                && (k.is_empty() || k.len() > MAX_KEY_LEN)
            {
                return Err(invalid(
                    field,
                    format!(
                        "{what} must be 1-{MAX_KEY_LEN} characters (got {})",
                        k.len()
                    ),
                ));
            }
        }
        match (&req.concurrency_key, req.concurrency_limit) {
            (None, None) => {}
            (Some(_), Some(n)) if (1..=MAX_CONCURRENCY_LIMIT).contains(&n) => {}
            (Some(_), Some(n)) => {
                return Err(invalid(
                    "/concurrency_limit",
                    format!(
                        "a concurrency limit must be between 1 and {MAX_CONCURRENCY_LIMIT} \
                         (got {n})"
                    ),
                ));
            }
            (Some(_), None) => {
                return Err(invalid(
                    "/concurrency_limit",
                    "a concurrency key needs a concurrency limit: how many of its operations \
                     may run at once (1 or more)",
                ));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "/concurrency_key",
                    "a concurrency limit needs a concurrency key: the operations it limits are \
                     the tenant's that share the key",
                ));
            }
        }
        let max_attempts = req.max_attempts.unwrap_or(self.default_max_attempts);
        if !(1..=1000).contains(&max_attempts) {
            return Err(invalid(
                "/max_attempts",
                format!("max attempts must be between 1 and 1000 (got {max_attempts})"),
            ));
        }
        if let (Some(run_at), Some(deadline)) = (req.run_at, req.deadline)
            && deadline <= run_at
        {
            return Err(invalid("/deadline", "deadline must be after run_at"));
        }
        if let Some(b) = &req.budget {
            agentq_core::db::budgets::check(b).map_err(|(field, m)| invalid(field, m))?;
        }
        let op = NewOperation {
            id: OperationId::new(),
            tenant: tenant.to_string(),
            input_sha256: req.fingerprint.unwrap_or_else(|| input_sha256(&req.input)),
            kind: req.kind,
            lane: req.lane,
            input: req.input,
            dedupe_key: req.dedupe_key,
            ordering_key: req.ordering_key,
            concurrency_key: req.concurrency_key,
            concurrency_limit: req.concurrency_limit,
            rate_key: req.rate_key,
            batch_id: req.batch_id,
            max_attempts,
            run_at: req.run_at,
            deadline: req.deadline,
            request_id: req.request_id,
            traceparent: req.traceparent,
            schedule_id: None,
            parent_id: None,
            budget: req.budget,
        };
        Ok((op, requires.stores))
    }
}
