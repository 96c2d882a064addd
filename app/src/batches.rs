//! Batches: campaigns of one operation per document of a source store. Starting one (or
//! starting it again: its id is derived from what identifies it, so only missing documents are
//! enqueued), its controls — pause, resume (also the rest of a canary), cancel — and its
//! progress, and the list of batches. A batch is `completed` by the scheduler once every
//! document it enqueued has an outcome (`db::batches::complete`); a completed batch takes no
//! pause or cancel. Every control is audited and needs an operator of the batch's tenant.

use std::collections::HashSet;
use std::path::Path;

use agentq_core::db::batches::{self, Batch, Created};
use agentq_core::db::stores::{self, Access, Location, Need};
use agentq_core::db::{self};
use agentq_core::operation::{Lane, TenantId};
use agentq_core::state::BatchStatus;
use agentq_core::state::transition::batch;
use agentq_producer::EnqueueRequest;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::{App, AppError, Caller, Result, Role};

/// A group of a batch's failures, as its [`Overview`] lists them.
pub use agentq_core::db::batches::Failure;
/// A batch as [`list`] shows it.
pub use agentq_core::db::batches::Listed;

mod views;
pub use views::{Item, ListQuery, Overview, Page, Report, ReportLine, Usage, list, report, status};

/// Operations inserted per statement.
pub const CHUNK: usize = 1000;

/// Test-only: with this variable set to N, [`fill`] stops once N chunks are committed and waits
/// until its caller asks it to stop ([`Progress::stop_requested`]) or the process is killed, so a test interrupts an enqueue at a point it knows, on a
/// machine of any speed (`tests/e2e/batch.rs`). Never set outside tests.
pub const TEST_PAUSE_AFTER_CHUNKS: &str = "AGENTQ_TEST_PAUSE_AFTER_CHUNKS";

/// Where long work reports how far it got (the CLI draws a progress bar; others ignore it).
pub trait Progress: Sync {
    /// The work has `len` items.
    fn start(&self, _len: u64) {}
    /// `n` more items are done.
    fn inc(&self, _n: u64) {}
    /// One item was refused, and why (shown to the person at once).
    fn refused(&self, _item: &str, _why: &str) {}
    /// The work is over.
    fn finish(&self) {}
    /// The person asked to stop (Ctrl-C on the command line): the work stops before its next
    /// chunk, keeping every chunk already committed, and says how far it got.
    fn stop_requested(&self) -> bool {
        false
    }
}

/// A [`Progress`] that shows nothing.
pub struct Quiet;

impl Progress for Quiet {}

/// The batch `id` as the caller may see it.
pub async fn find(app: &App, caller: &Caller, id: Uuid) -> Result<Batch> {
    caller.require(Role::Operator)?;
    batches::find_batch(&app.pool, id, caller.scope())
        .await?
        .ok_or_else(|| AppError::NotFound(format!("no batch {id}")))
}

/// A store a batch names (`{"store": NAME}` in every input), checked now: the tenant must have
/// it, with the access the batch needs.
async fn store_ref(app: &App, tenant: &str, name: &str, access: Access) -> Result<Value> {
    let (field, flag) = if access == Access::Read {
        ("source", "--source")
    } else {
        ("target", "--target")
    };
    stores::check_name(name).map_err(|e| AppError::invalid(field, format!("{flag}: {e}")))?;
    let need = Need {
        field: flag,
        store: name.to_string(),
        access,
    };
    let mut conn = app.pool.acquire().await?;
    if let Some(why) = stores::refusal(&mut conn, tenant, &[need]).await? {
        return Err(AppError::invalid(field, why));
    }
    Ok(json!({ "store": name }))
}

/// The documents of a source store, sorted: relative paths of regular files under its
/// directory (hidden ones skipped), or its table's ids.
pub async fn list_documents(app: &App, tenant: &str, source: &Value) -> Result<Vec<String>> {
    let name = source["store"].as_str().unwrap_or_default();
    let store = stores::get(&app.pool, tenant, name).await?.ok_or_else(|| {
        AppError::Conflict(format!("tenant {tenant} has no store {name:?} (any more)"))
    })?;
    match &store.location {
        Location::Table {
            table, id_column, ..
        } => db::batch_source::list_ids(&app.pool, table.as_str(), id_column.as_str())
            .await
            .map_err(|e| match e {
                db::batch_source::Error::Schema(m) => AppError::Conflict(m),
                db::batch_source::Error::Db(e) => AppError::Db(e),
            }),
        Location::Dir(root) => list_files(root),
    }
}

fn list_files(root: &Path) -> Result<Vec<String>> {
    let unreadable =
        |d: &Path, e: std::io::Error| AppError::Conflict(format!("listing {}: {e}", d.display()));
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| unreadable(&d, e))? {
            let entry = entry.map_err(|e| unreadable(&d, e))?;
            let kind = entry.file_type().map_err(|e| unreadable(&d, e))?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let rel = entry.path();
                let rel = rel.strip_prefix(root).expect("under the root");
                match rel.to_str() {
                    // Hidden files (editors' and our own temp files) are not documents.
                    Some(s) if !s.split('/').any(|c| c.starts_with('.')) => out.push(s.to_string()),
                    Some(_) => {}
                    None => tracing::warn!("skipping a file whose name is not UTF-8"),
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The batch id: a hash of everything that identifies the campaign.
pub fn batch_id(
    tenant: &str,
    kind: &str,
    source: &Value,
    target: &Value,
    instructions: &str,
) -> Uuid {
    let mut h = Sha256::new();
    for part in [
        tenant,
        kind,
        &source.to_string(),
        &target.to_string(),
        instructions,
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    uuid::Builder::from_custom_bytes(digest[..16].try_into().expect("16 bytes")).into_uuid()
}

/// The dedupe key of a batch document's operation.
pub fn doc_key(batch: Uuid, doc: &str) -> String {
    format!("batch:{batch}:{doc}")
}

/// What [`fill`] did.
#[derive(Debug, Default)]
pub struct Filled {
    pub enqueued: usize,
    pub existing: usize,
    /// Documents refused, and why.
    pub refused: Vec<(String, String)>,
    /// Documents not enqueued because the caller asked to stop ([`Progress::stop_requested`]);
    /// 0 when the fill ran to its end.
    pub left: usize,
}

/// Enqueues the documents of `batch` it does not have yet (only the canary's while it is a
/// canary), in chunks of `chunk`: one INSERT per chunk, its pointers published concurrently.
/// Once every document is enqueued the batch is filled (it may complete); documents missing
/// from a completed batch reopen it first (as `actor`), and a fill stopped midway leaves it
/// unfilled until the next.
pub async fn fill(
    app: &App,
    batch: &Batch,
    chunk: usize,
    progress: &dyn Progress,
    actor: &str,
) -> Result<Filled> {
    let source: Value = serde_json::from_str(&batch.source).unwrap_or(Value::Null);
    let target: Value = serde_json::from_str(&batch.target).unwrap_or(Value::Null);
    let mut docs = list_documents(app, &batch.tenant, &source).await?;
    if batch.status == BatchStatus::Canary {
        docs.truncate(batch.canary.unwrap_or(0).max(0) as usize);
    }
    let have: HashSet<String> = batches::enqueued_keys(&app.pool, batch.id)
        .await?
        .into_iter()
        .collect();
    let missing: Vec<String> = docs
        .iter()
        .filter(|d| !have.contains(&doc_key(batch.id, d)))
        .cloned()
        .collect();
    let mut filled = Filled {
        existing: docs.len() - missing.len(),
        ..Filled::default()
    };
    let whole = batch.status != BatchStatus::Canary;
    if missing.is_empty() {
        if whole {
            batches::mark_filled(&app.pool, batch.id).await?;
        }
        return Ok(filled);
    }
    batches::begin_fill(&app.pool, batch.id, actor).await?;
    // Every document is an operation of the tenant: all of them fit under its cap, or none
    // is enqueued.
    crate::capacity::admit(app, &batch.tenant, &batch.kind, missing.len() as i64).await?;
    progress.start(missing.len() as u64);
    let pause_after = std::env::var(TEST_PAUSE_AFTER_CHUNKS)
        .ok()
        .and_then(|n| n.parse::<usize>().ok());
    let mut done = 0;
    for (committed, chunk) in missing.chunks(chunk.max(1)).enumerate() {
        if pause_after == Some(committed) {
            // Test hook: hold here (every earlier chunk committed) until asked to stop.
            while !progress.stop_requested() {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
        if progress.stop_requested() {
            filled.left = missing.len() - done;
            break;
        }
        done += chunk.len();
        let reqs: Vec<EnqueueRequest> = chunk
            .iter()
            .map(|doc| {
                let mut input = json!({
                    "doc_id": doc,
                    "source": source,
                    "target": target,
                    "instructions": batch.instructions,
                });
                if let Some(opts) = batch.options.as_object() {
                    for (k, v) in opts {
                        input[k] = v.clone();
                    }
                }
                EnqueueRequest {
                    tenant: batch.tenant.clone(),
                    kind: batch.kind.clone(),
                    input,
                    dedupe_key: Some(doc_key(batch.id, doc)),
                    lane: Lane::Batch,
                    batch_id: Some(batch.id),
                    ..EnqueueRequest::default()
                }
            })
            .collect();
        let bulk = app.producer.enqueue_many(reqs).await.map_err(|e| match e {
            agentq_producer::Error::Db(e) => AppError::Db(e),
            other => AppError::invalid("/input", other.to_string()),
        })?;
        filled.enqueued += bulk.created.len();
        filled.existing += bulk.existing;
        for (i, why) in bulk.refused {
            progress.refused(&chunk[i], &why);
            filled.refused.push((chunk[i].clone(), why));
        }
        progress.inc(chunk.len() as u64);
    }
    progress.finish();
    if whole && filled.left == 0 {
        batches::mark_filled(&app.pool, batch.id).await?;
    }
    Ok(filled)
}

/// What a new batch is: everything `agentq batch start` takes.
#[derive(Clone, Debug)]
pub struct NewBatch {
    pub tenant: String,
    pub kind: String,
    /// Store names.
    pub source: String,
    pub target: String,
    pub instructions: String,
    /// Options merged into every input (`chunk_chars`, `validate`).
    pub options: serde_json::Map<String, Value>,
    pub canary: Option<u32>,
    pub pause_window: i32,
    pub pause_ratio: f32,
    /// Unique in its tenant, accepted wherever the batch's id is.
    pub name: Option<String>,
    /// A token budget on the batch's operations together (`crate::budgets`), set before any
    /// is enqueued; on a re-run it replaces the batch's budget.
    pub budget: Option<crate::budgets::BudgetRequest>,
}

/// The options every input of a batch carries: the strings each output must contain
/// (`validate.required`) and the characters per model call (`chunk_chars`).
pub fn options(required: &[String], chunk_chars: Option<u32>) -> serde_json::Map<String, Value> {
    let mut options = serde_json::Map::new();
    if let Some(c) = chunk_chars {
        options.insert("chunk_chars".into(), json!(c));
    }
    if !required.is_empty() {
        options.insert("validate".into(), json!({ "required": required }));
    }
    options
}

/// What [`start`] did.
#[derive(Debug)]
pub struct Started {
    pub batch: Batch,
    /// False when the same batch existed (a re-run).
    pub created: bool,
    pub documents: usize,
    pub filled: Filled,
}

/// What starting a batch did, as `agentq batch start --json` and `POST /v1/batches` answer it.
#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchStarted")]
pub struct StartedSummary {
    pub batch_id: Uuid,
    pub name: Option<String>,
    /// False when the same batch existed (a re-run enqueues only what it is missing).
    pub created: bool,
    pub status: BatchStatus,
    /// Documents in its source store.
    pub documents: usize,
    /// Operations enqueued now.
    pub enqueued: usize,
    /// Operations it had already.
    pub existing: usize,
    /// Documents refused (their inputs do not fit the kind).
    pub refused: usize,
}

impl Started {
    pub fn summary(&self) -> StartedSummary {
        StartedSummary {
            batch_id: self.batch.id,
            name: self.batch.name.clone(),
            created: self.created,
            status: self.batch.status,
            documents: self.documents,
            enqueued: self.filled.enqueued,
            existing: self.filled.existing,
            refused: self.filled.refused.len(),
        }
    }
}

/// Creates a batch (or finds it again) and enqueues one operation per document it is missing.
pub async fn start(
    app: &App,
    caller: &Caller,
    new: NewBatch,
    chunk: usize,
    progress: &dyn Progress,
) -> Result<Started> {
    caller.require(Role::Operator)?;
    TenantId::parse(&new.tenant).map_err(|e| AppError::invalid("tenant", e))?;
    caller.tenant_for_write(Some(&new.tenant))?;
    crate::tenants::check_kind(app, &new.tenant, &new.kind).await?;
    if !(1..=10_000).contains(&new.pause_window) {
        return Err(AppError::invalid(
            "pause_window",
            "--pause-window must be between 1 and 10000",
        ));
    }
    if !(new.pause_ratio > 0.0 && new.pause_ratio <= 1.0) {
        return Err(AppError::invalid(
            "pause_ratio",
            "--pause-ratio must be above 0 and at most 1",
        ));
    }
    if let Some(name) = &new.name {
        crate::names::check(name, "batch", "name")?;
    }
    if new.canary == Some(0) {
        return Err(AppError::invalid("canary", "--canary must be at least 1"));
    }
    let budget = new.budget.as_ref().map(|b| b.spec()).transpose()?;
    if new.instructions.trim().is_empty() {
        return Err(AppError::invalid(
            "instructions",
            "--instructions is empty: say what the model should do",
        ));
    }
    let source = store_ref(app, &new.tenant, &new.source, Access::Read).await?;
    let target = store_ref(app, &new.tenant, &new.target, Access::Write).await?;
    let docs = list_documents(app, &new.tenant, &source).await?;
    if docs.is_empty() {
        return Err(AppError::invalid(
            "--source",
            format!("--source {:?} has no documents", new.source),
        ));
    }
    // A document's input as `fill` builds it: the kind must take it (a kind that cannot take
    // documents is refused here, before anything is stored).
    let mut sample = json!({
        "doc_id": docs[0],
        "source": source,
        "target": target,
        "instructions": new.instructions,
    });
    for (k, v) in &new.options {
        sample[k] = v.clone();
    }
    if let Err(e) = app.producer.check_input(&new.kind, &sample) {
        return Err(AppError::invalid(
            "kind",
            format!(
                "kind {:?} cannot take a batch's documents ({e}); a batch's kind reads \
                 {{\"doc_id\", \"source\", \"target\", \"instructions\", …}}, as doc_migration does",
                new.kind
            ),
        ));
    }
    let id = batch_id(&new.tenant, &new.kind, &source, &target, &new.instructions);
    let wanted = Batch {
        id,
        tenant: new.tenant.clone(),
        kind: new.kind.clone(),
        source: source.to_string(),
        target: target.to_string(),
        instructions: new.instructions,
        options: Value::Object(new.options),
        status: if new.canary.is_some() {
            BatchStatus::Canary
        } else {
            BatchStatus::Running
        },
        canary: new.canary.map(|c| c as i32),
        documents: docs.len() as i32,
        pause_window: new.pause_window,
        pause_ratio: new.pause_ratio,
        paused_reason: None,
        name: new.name.clone(),
        started_at: chrono::Utc::now(),
        finished_at: None,
        filled_at: None,
        running_secs: 0.0,
        created_at: chrono::Utc::now(),
        updated_at: chrono::Utc::now(),
    };
    let (batch, created) = match batches::create_batch(&app.pool, &wanted, &caller.actor).await? {
        Created::New(b) => (b, true),
        Created::Existing(b) => (b, false),
        Created::NameTaken => {
            return Err(AppError::Conflict(format!(
                "tenant {} already has a batch named {:?}; choose another name (nothing was \
                 started)",
                new.tenant,
                new.name.unwrap_or_default()
            )));
        }
    };
    if let Some(name) = &new.name
        && batch.name.as_ref() != Some(name)
    {
        return Err(AppError::Conflict(format!(
            "batch {id} is named {:?} already; start it again with that name or none \
             (nothing was enqueued)",
            batch.name.clone().unwrap_or_default()
        )));
    }
    if batch.status == BatchStatus::Cancelled {
        return Err(AppError::Conflict(format!(
            "batch {id} was cancelled; nothing was enqueued"
        )));
    }
    if let Some(spec) = budget {
        agentq_core::db::budgets::set(
            &app.pool,
            &batch.tenant,
            agentq_core::db::budgets::On::Batch(batch.id),
            spec,
            &caller.actor,
            Some("batch start"),
        )
        .await?;
    }
    let filled = fill(app, &batch, chunk, progress, &caller.actor).await?;
    Ok(Started {
        batch,
        created,
        documents: docs.len(),
        filled,
    })
}

/// Stops starting the batch's operations (running ones finish their current run).
pub async fn pause(app: &App, caller: &Caller, id: Uuid, reason: Option<&str>) -> Result<()> {
    find(app, caller, id).await?;
    let was = batches::transition(&app.pool, id, &[batch::PAUSE], &caller.actor, reason).await?;
    match was {
        Some(_) => Ok(()),
        None => Err(refused(app, caller, id, "paused").await),
    }
}

/// Why a control found the batch `id` in a status it does not start from.
async fn refused(app: &App, caller: &Caller, id: Uuid, act: &str) -> AppError {
    let status = match find(app, caller, id).await {
        Ok(b) => b.status,
        Err(e) => return e,
    };
    AppError::Conflict(match status {
        BatchStatus::Completed => format!(
            "batch {id} is completed: every document has an outcome, so it cannot be {act}; \
             nothing changed (`agentq dlq retry --batch {id}` reopens it)"
        ),
        BatchStatus::Cancelled => format!("batch {id} is cancelled; nothing changed"),
        s => format!("batch {id} is {s}: it cannot be {act}; nothing changed"),
    })
}

/// What resuming a batch did.
#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchResumed")]
pub struct Resumed {
    /// The status it had: `paused` or `canary`.
    pub was: BatchStatus,
    /// Documents enqueued now (the rest of a canary, or what an interrupted start missed).
    pub enqueued: usize,
    /// Queued operations whose pointers were published again.
    pub redispatched: usize,
    /// Documents not enqueued because the caller asked to stop (see [`Filled::left`]).
    #[serde(skip)]
    #[schemars(skip)]
    pub left: usize,
}

/// Resumes a paused batch, or runs the rest of a canary: enqueues the documents it is missing
/// (reading its source store) and re-publishes its queued operations.
pub async fn resume(
    app: &App,
    caller: &Caller,
    id: Uuid,
    progress: &dyn Progress,
) -> Result<Resumed> {
    let b = find(app, caller, id).await?;
    let what = format!("; batch {id} stays {}", b.status);
    crate::tenants::check_kind_now(app, &b.tenant, &b.kind, &what).await?;
    let was = batches::transition(
        &app.pool,
        id,
        &[batch::RESUME, batch::PROMOTE],
        &caller.actor,
        None,
    )
    .await?
    .ok_or_else(|| {
        AppError::Conflict(format!(
            "batch {id} is {}: only a paused or canary batch resumes",
            b.status
        ))
    })?;
    let b = find(app, caller, id).await?;
    let filled = fill(app, &b, CHUNK, progress, &caller.actor).await?;
    let redispatched = redispatch(app, id).await?;
    Ok(Resumed {
        was,
        enqueued: filled.enqueued,
        redispatched,
        left: filled.left,
    })
}

/// What cancelling a batch did.
#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "BatchCancelled")]
pub struct CancelledBatch {
    /// Operations cancelled at once.
    #[serde(rename = "cancelled")]
    pub now: u64,
    /// Running operations asked to stop at their next step.
    pub requested: u64,
}

/// Cancels every unfinished operation of the batch.
pub async fn cancel(
    app: &App,
    caller: &Caller,
    id: Uuid,
    reason: Option<&str>,
) -> Result<CancelledBatch> {
    find(app, caller, id).await?;
    let was = batches::transition(&app.pool, id, &[batch::CANCEL], &caller.actor, reason).await?;
    if was.is_none() {
        return Err(refused(app, caller, id, "cancelled").await);
    }
    let (now, requested) = batches::cancel_operations(&app.pool, id, &caller.actor).await?;
    Ok(CancelledBatch { now, requested })
}

/// Re-publishes the queued operations of a resumed batch (their pointers were dropped while
/// it was paused). Returns how many were published.
async fn redispatch(app: &App, batch: Uuid) -> Result<usize> {
    batches::cut_retry_delays(&app.pool, batch).await?;
    let cutoff = chrono::Utc::now();
    app.publish_all(|| async {
        Ok(batches::lock_queued(&app.pool, batch, cutoff, CHUNK as i64).await?)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_ids_are_stable_and_distinct() {
        let (s, t) = (json!({ "store": "a" }), json!({ "store": "b" }));
        let a = batch_id("t", "doc_migration", &s, &t, "do it");
        assert_eq!(a, batch_id("t", "doc_migration", &s, &t, "do it"));
        assert_ne!(a, batch_id("t", "doc_migration", &s, &t, "do it better"));
        assert_ne!(a, batch_id("u", "doc_migration", &s, &t, "do it"));
    }
}
