//! The built-in `doc_migration` kind: one document, transformed by the model, validated,
//! reviewed by a human when confidence is low, and written to its target exactly once.
//!
//! Steps, in journal order: `read` (the source document and its SHA-256), `plan` (what the
//! transforms depend on: the instructions' hash and the chunking), `transform:{i}` (one model
//! step per chunk), `validate`, `signal:review` (only when confidence is low), `write` (an
//! atomic rename, or an upsert keyed by `doc_id`: a re-run writes the same bytes to the same
//! place). All are replay-safe.
//!
//! An operator's `dlq retry --patch-input` that changes `instructions` or `chunk_chars` makes
//! the recorded transforms stale: the job then passes over that round of its journal and runs a
//! new one (a new `plan`, new transforms), so a fixed instruction takes effect. A retry after a
//! failed review (rejected, timed out, unreadable decision) also starts a new round.
//!
//! Logs and error messages carry ids, sizes and counts only: never document text,
//! instructions or model output.

use std::io::{ErrorKind, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use agentq_core::db::docs;
use agentq_core::db::stores::{self, Access, Location, Need, Store};
use agentq_core::operation::Requires;
use agentq_core::state::StepStatus;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use agentq_worker::model::{Message, ModelRequest, Role};
use agentq_worker::{JobContext, JobError, Replay, SignalOutcome};

/// Largest source document accepted: the text, each chunk's answer and the result are all
/// journaled, and a journal row is a JSON value in PostgreSQL.
pub const MAX_DOCUMENT_BYTES: usize = 8 * 1024 * 1024;

/// A chunk answer below this confidence sends the document to a human review.
pub const LOW_CONFIDENCE: f64 = 0.5;

const DEFAULT_CHUNK_CHARS: usize = 8000;
const CHUNK_CHARS_RANGE: std::ops::RangeInclusive<usize> = 64..=1_000_000;
const DEFAULT_REVIEW_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// The fixed part of every transform's system message; the operator's instructions follow it.
const PREAMBLE: &str = "You migrate a document one part at a time. Apply the instructions below \
to the part of the document given in the user message. Answer with the transformed text only \
(no commentary, no code fences), then one last line `confidence: <a number from 0 to 1>` saying \
how sure you are that the result is correct and complete.";

/// Input of `doc_migration`, checked in full at enqueue (a bad one is refused, exit code 2),
/// the stores it names included: the tenant must have them (see [`requires`]).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "RawInput")]
pub struct DocMigrationInput {
    /// The document's identity: a path relative to the source store's directory, or the row
    /// key of a table store. Never absolute, never with a `..` segment.
    pub doc_id: String,
    /// The store read from (registered by an admin for the tenant, with read access).
    pub source: String,
    /// The store written to (registered with write access).
    pub target: String,
    pub instructions: String,
    /// Largest chunk sent to the model, in characters (Unicode scalar values).
    pub chunk_chars: usize,
    pub validate: Validate,
    /// How long a low-confidence document waits for its `review` signal.
    pub review_timeout: Duration,
}

/// What an input needs beyond its shape: its source store readable and its target store
/// writable by its tenant (the producer checks both before writing anything).
pub fn requires(input: &DocMigrationInput) -> Requires {
    Requires {
        stores: vec![
            Need {
                field: "source.store",
                store: input.source.clone(),
                access: Access::Read,
            },
            Need {
                field: "target.store",
                store: input.target.clone(),
                access: Access::Write,
            },
        ],
        ..Requires::default()
    }
}

/// Checks of the migrated text.
#[derive(Clone, Debug, Default, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Validate {
    /// Strings the output must contain; a missing one fails the document (non-retryable).
    #[serde(default)]
    pub required: Vec<String>,
    /// An output/input length ratio (in characters) below this flags low confidence.
    #[serde(default)]
    pub min_ratio: Option<f64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawInput {
    doc_id: String,
    source: RawStore,
    target: RawStore,
    instructions: String,
    #[serde(default)]
    chunk_chars: Option<usize>,
    #[serde(default)]
    validate: Validate,
    #[serde(default)]
    review: RawReview,
}

/// `{"store": NAME}`. The fields of the inputs before stores (`dir`, `table`, `id_column`,
/// `body_column`) are recognised only to say what to do instead.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawStore {
    /// The name of a store an admin registered for the tenant (`agentq stores add`).
    store: Option<String>,
    #[schemars(skip)]
    dir: Option<Value>,
    #[schemars(skip)]
    table: Option<Value>,
    #[schemars(skip)]
    id_column: Option<Value>,
    #[schemars(skip)]
    body_column: Option<Value>,
}

impl RawStore {
    fn name(self, field: &str, access: &str) -> Result<String, String> {
        let named_a_place = self.dir.is_some()
            || self.table.is_some()
            || self.id_column.is_some()
            || self.body_column.is_some();
        match self.store {
            Some(name) if !named_a_place => {
                stores::check_name(&name).map_err(|e| format!("{field}.store: {e}"))?;
                Ok(name)
            }
            _ if named_a_place => Err(format!(
                "{field}: an input names a store, never a directory or a table (a doc_migration \
                 reads and writes only what an admin registered for its tenant); register it \
                 with `agentq stores add --tenant T --name NAME --dir PATH|--table NAME --access \
                 {access}` and give {{\"store\": \"NAME\"}}"
            )),
            _ => Err(format!(
                "{field}: give {{\"store\": \"NAME\"}}, a store registered with `agentq stores add`"
            )),
        }
    }
}

#[derive(Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RawReview {
    timeout_ms: Option<u64>,
}

impl TryFrom<RawInput> for DocMigrationInput {
    type Error = String;

    fn try_from(raw: RawInput) -> Result<Self, String> {
        check_doc_id(&raw.doc_id)?;
        let source = raw.source.name("source", "read")?;
        let target = raw.target.name("target", "write")?;
        let chunk_chars = raw.chunk_chars.unwrap_or(DEFAULT_CHUNK_CHARS);
        if !CHUNK_CHARS_RANGE.contains(&chunk_chars) {
            return Err(format!(
                "chunk_chars must be between {} and {}",
                CHUNK_CHARS_RANGE.start(),
                CHUNK_CHARS_RANGE.end()
            ));
        }
        if raw.validate.required.iter().any(String::is_empty) {
            return Err("validate.required: the strings must not be empty".into());
        }
        if let Some(r) = raw.validate.min_ratio
            && !(r.is_finite() && r >= 0.0)
        {
            return Err("validate.min_ratio must be a number ≥ 0".into());
        }
        let timeout_ms = raw.review.timeout_ms.unwrap_or(DEFAULT_REVIEW_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err("review.timeout_ms must be more than 0".into());
        }
        agentq_worker::context::check_park("review.timeout_ms", Duration::from_millis(timeout_ms))?;
        Ok(Self {
            doc_id: raw.doc_id,
            source,
            target,
            instructions: raw.instructions,
            chunk_chars,
            validate: raw.validate,
            review_timeout: Duration::from_millis(timeout_ms),
        })
    }
}

/// A document identity may name a file under a root, so it must stay under it.
fn check_doc_id(doc_id: &str) -> Result<(), String> {
    if doc_id.is_empty() {
        return Err("doc_id must not be empty".into());
    }
    if doc_id.len() > 1024 || doc_id.contains('\0') {
        return Err("doc_id must be at most 1024 bytes, without NUL".into());
    }
    if doc_id.starts_with('/') || Path::new(doc_id).is_absolute() {
        return Err(format!("doc_id {doc_id:?} must be relative, not absolute"));
    }
    if doc_id.split('/').any(|s| s == "..") {
        return Err(format!(
            "doc_id {doc_id:?} must not contain a \"..\" segment"
        ));
    }
    if !Path::new(doc_id)
        .components()
        .any(|c| matches!(c, Component::Normal(_)))
    {
        return Err(format!("doc_id {doc_id:?} names no file"));
    }
    Ok(())
}

/// Output of `doc_migration`.
#[derive(Debug, Deserialize, Serialize)]
pub struct DocMigrationOutput {
    pub doc_id: String,
    /// SHA-256 (hex) of the bytes written.
    pub sha256: String,
    pub bytes: usize,
    pub chunks: usize,
    /// Whether a human reviewed it (approved or edited).
    pub reviewed: bool,
    /// The lowest confidence any chunk's answer reported (1.0 when none reported one).
    pub confidence: f64,
}

/// Output of the `read` step.
#[derive(Debug, Deserialize, Serialize)]
struct Document {
    /// Which document this is (`doc_id` at `source`), so a replay notices a patched identity.
    doc_id: String,
    source: String,
    sha256: String,
    bytes: usize,
    text: String,
}

/// Output of the `plan` step: what the transforms of one round were computed from. A recorded
/// plan that differs from the input's makes that round stale.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
struct Plan {
    instructions_sha256: String,
    chunk_chars: usize,
    chunks: usize,
}

/// Output of the `validate` step.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
struct Verdict {
    confidence: f64,
    ratio: f64,
    low_confidence: bool,
    chars_in: usize,
    chars_out: usize,
}

/// Output of the `write` step.
#[derive(Debug, Deserialize, Serialize)]
struct Written {
    /// The file's path, or `table:NAME`.
    target: String,
    sha256: String,
    bytes: usize,
}

/// Migrates one document (see the module documentation for the steps).
pub async fn doc_migration(
    ctx: JobContext,
    input: DocMigrationInput,
) -> Result<DocMigrationOutput, JobError> {
    let pool = ctx.pool().clone();
    let tenant = ctx.info().tenant.clone();
    let doc: Document = ctx
        .step("read", Replay::Safe, |_key| {
            read_document(&pool, &tenant, &input)
        })
        .await?;
    if doc.doc_id != input.doc_id || doc.source != describe_source(&input.source) {
        return Err(JobError::NonRetryable(
            "doc_id or source changed after the document was read (a patched input); enqueue \
             a new operation for the other document"
                .into(),
        ));
    }
    let chunks = split_chunks(&doc.text, input.chunk_chars);
    let plan = Plan {
        instructions_sha256: sha256_hex(input.instructions.as_bytes()),
        chunk_chars: input.chunk_chars,
        chunks: chunks.len(),
    };
    loop {
        let recorded: Plan = ctx
            .step("plan", Replay::Safe, |_key| {
                let plan = plan.clone();
                async move { Ok(plan) }
            })
            .await?;
        if recorded != plan {
            skip_round(&ctx);
            continue;
        }

        let mut output = String::with_capacity(doc.text.len());
        let mut confidence = 1.0_f64;
        for (i, chunk) in chunks.iter().enumerate() {
            let system = format!(
                "{PREAMBLE}\nThis is part {} of {}.\n\nInstructions:\n{}",
                i + 1,
                chunks.len(),
                input.instructions
            );
            let request = ModelRequest {
                messages: vec![
                    Message::text(Role::System, system),
                    Message::text(Role::User, chunk.body),
                ],
                ..ModelRequest::default()
            };
            let answer = ctx.model(&format!("transform:{i}"), request).await?;
            let (text, chunk_confidence) = strip_confidence(&answer.content);
            output.push_str(chunk.lead);
            output.push_str(text);
            output.push_str(chunk.tail);
            confidence = confidence.min(chunk_confidence);
        }

        let verdict: Verdict = ctx
            .step("validate", Replay::Safe, |_key| {
                let verdict = validate(&input.validate, &doc.text, &output, confidence);
                async move { verdict }
            })
            .await?;

        let mut reviewed = false;
        if verdict.low_confidence {
            // A decision an earlier run already took: if it failed the document, this run is an
            // operator's retry (or a crash right after the decision), so review anew.
            let replayed = ctx.peek_recorded().is_some_and(|(name, status)| {
                name == "signal:review" && status == StepStatus::Completed
            });
            let failure = match ctx.wait_for_signal("review", input.review_timeout).await? {
                SignalOutcome::Received { payload, .. } => match review_decision(&payload) {
                    Ok(Decision::Approve) => None,
                    Ok(Decision::Edit(text)) => {
                        output = text;
                        None
                    }
                    Ok(Decision::Reject(reason)) => Some(format!("rejected by reviewer: {reason}")),
                    Err(e) => Some(e),
                },
                SignalOutcome::TimedOut => Some(format!(
                    "no review within {} (the document had low confidence; send signal \
                     \"review\" with {{\"decision\": \"approve\"|\"edit\"|\"reject\"}})",
                    human_duration(input.review_timeout)
                )),
            };
            if let Some(message) = failure {
                if replayed {
                    continue;
                }
                return Err(JobError::NonRetryable(message));
            }
            reviewed = true;
        }

        let sha256 = sha256_hex(output.as_bytes());
        let op_id = ctx.info().op_id.0;
        let written: Written = ctx
            .step("write", Replay::Safe, |_key| {
                write_target(&pool, &tenant, &input, op_id, output, sha256)
            })
            .await?;
        tracing::debug!(
            chunks = chunks.len(),
            bytes = written.bytes,
            reviewed,
            "document migrated"
        );
        return Ok(DocMigrationOutput {
            doc_id: input.doc_id,
            sha256: written.sha256,
            bytes: written.bytes,
            chunks: chunks.len(),
            reviewed,
            confidence,
        });
    }
}

/// Passes over a stale round: every recorded step up to the next round's `plan` (or the point
/// where the journal stops or failed, where the new round starts).
fn skip_round(ctx: &JobContext) {
    while let Some((name, _)) = ctx.peek_recorded() {
        if name == "plan" {
            return;
        }
        ctx.skip_recorded();
    }
}

fn describe_source(store: &str) -> String {
    format!("store:{store}")
}

/// The tenant's store `name`, resolved when the step runs (never from the input), with the
/// access the step needs. A store removed or narrowed since the enqueue fails the document.
async fn resolve(
    pool: &PgPool,
    tenant: &str,
    name: &str,
    access: Access,
) -> Result<Store, JobError> {
    let store = stores::get(pool, tenant, name)
        .await
        .map_err(|e| JobError::retryable(format!("database: {e}")))?
        .ok_or_else(|| {
            JobError::NonRetryable(format!(
                "store {name:?} is not registered for tenant {tenant} (removed after the \
                 enqueue?); an admin registers it with `agentq stores add`"
            ))
        })?;
    if !store.access.grants(access) {
        return Err(JobError::NonRetryable(format!(
            "store {name:?} is registered for {} only; this step needs {}",
            store.access.as_str(),
            access.as_str()
        )));
    }
    Ok(store)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

async fn read_document(
    pool: &PgPool,
    tenant: &str,
    input: &DocMigrationInput,
) -> Result<Document, JobError> {
    let store = resolve(pool, tenant, &input.source, Access::Read).await?;
    let text = match &store.location {
        Location::Dir(dir) => {
            let (dir, doc_id) = (dir.clone(), input.doc_id.clone());
            tokio::task::spawn_blocking(move || read_file(&dir, &doc_id))
                .await
                .map_err(|e| JobError::retryable(format!("reading the document: {e}")))??
        }
        Location::Table {
            table,
            id_column,
            body_column,
        } => {
            let rows = docs::read_source(pool, table, id_column, body_column, &input.doc_id)
                .await
                .map_err(db_failure)?;
            match rows.as_slice() {
                [] => {
                    return Err(JobError::NonRetryable(format!(
                        "document not found: no row of {} has {} = doc_id",
                        table.as_str(),
                        id_column.as_str()
                    )));
                }
                [body] => body.clone().unwrap_or_default(),
                _ => {
                    return Err(JobError::NonRetryable(format!(
                        "doc_id is not unique: several rows of {} have that {}",
                        table.as_str(),
                        id_column.as_str()
                    )));
                }
            }
        }
    };
    check_text(&text)?;
    Ok(Document {
        doc_id: input.doc_id.clone(),
        source: describe_source(&input.source),
        sha256: sha256_hex(text.as_bytes()),
        bytes: text.len(),
        text,
    })
}

fn check_text(text: &str) -> Result<(), JobError> {
    if text.trim().is_empty() {
        return Err(JobError::NonRetryable("document is empty".into()));
    }
    if text.len() > MAX_DOCUMENT_BYTES {
        return Err(too_large());
    }
    if text.contains('\0') {
        return Err(JobError::NonRetryable(
            "document contains NUL characters (not text)".into(),
        ));
    }
    Ok(())
}

fn too_large() -> JobError {
    JobError::NonRetryable(format!(
        "document is larger than {} MiB",
        MAX_DOCUMENT_BYTES / (1024 * 1024)
    ))
}

/// Reads `root/doc_id`, refusing anything that resolves outside `root` (a symlink included).
fn read_file(root: &Path, doc_id: &str) -> Result<String, JobError> {
    let root = root.canonicalize().map_err(|e| match e.kind() {
        ErrorKind::NotFound => JobError::NonRetryable(format!(
            "the source store's directory {} does not exist",
            root.display()
        )),
        _ => io_failure("opening the source store's directory", e),
    })?;
    let path = root
        .join(doc_id)
        .canonicalize()
        .map_err(|e| match e.kind() {
            ErrorKind::NotFound => {
                JobError::NonRetryable("document not found in the source store".into())
            }
            _ => io_failure("opening the document", e),
        })?;
    if !path.starts_with(&root) {
        return Err(JobError::NonRetryable(
            "document path resolves outside the source store's directory".into(),
        ));
    }
    let meta = std::fs::metadata(&path).map_err(|e| io_failure("opening the document", e))?;
    if !meta.is_file() {
        return Err(JobError::NonRetryable(
            "document is not a regular file".into(),
        ));
    }
    if meta.len() > MAX_DOCUMENT_BYTES as u64 {
        return Err(too_large());
    }
    let bytes = std::fs::read(&path).map_err(|e| io_failure("reading the document", e))?;
    String::from_utf8(bytes)
        .map_err(|_| JobError::NonRetryable("document is not UTF-8 text".into()))
}

/// A file-system error: permanent ones (permissions, a directory where a file should be, a
/// read-only file system, a name too long) are non-retryable, anything else retryable.
fn io_failure(doing: &str, e: std::io::Error) -> JobError {
    let permanent = matches!(
        e.kind(),
        ErrorKind::PermissionDenied
            | ErrorKind::IsADirectory
            | ErrorKind::NotADirectory
            | ErrorKind::DirectoryNotEmpty
            | ErrorKind::ReadOnlyFilesystem
            | ErrorKind::InvalidFilename
            | ErrorKind::InvalidInput
    );
    let message = format!("{doing}: {}", e.kind());
    if permanent {
        JobError::NonRetryable(message)
    } else {
        JobError::retryable(message)
    }
}

fn db_failure(e: docs::Error) -> JobError {
    match e {
        docs::Error::Schema(m) => JobError::NonRetryable(m),
        docs::Error::Db(e) => JobError::retryable(format!("database: {e}")),
    }
}

async fn write_target(
    pool: &PgPool,
    tenant: &str,
    input: &DocMigrationInput,
    op_id: Uuid,
    output: String,
    sha256: String,
) -> Result<Written, JobError> {
    let bytes = output.len();
    let store = resolve(pool, tenant, &input.target, Access::Write).await?;
    let target = match &store.location {
        Location::Dir(dir) => {
            let (dir, doc_id) = (dir.clone(), input.doc_id.clone());
            let path = tokio::task::spawn_blocking(move || {
                write_file(&dir, &doc_id, op_id, output.as_bytes())
            })
            .await
            .map_err(|e| JobError::retryable(format!("writing the document: {e}")))??;
            path.display().to_string()
        }
        Location::Table { table, .. } => {
            if output.contains('\0') {
                return Err(JobError::NonRetryable(
                    "the output contains NUL characters, which a text column cannot hold".into(),
                ));
            }
            docs::upsert_target(pool, table, &input.doc_id, &output, &sha256, op_id)
                .await
                .map_err(db_failure)?;
            format!("table:{}", table.as_str())
        }
    };
    Ok(Written {
        target,
        sha256,
        bytes,
    })
}

/// Writes `root/doc_id` atomically: a temporary file in the same directory, fsynced, renamed
/// over the target, then the directory fsynced. Writing the same bytes again leaves one file
/// with the same content. Refuses a path that resolves outside `root`.
fn write_file(root: &Path, doc_id: &str, op_id: Uuid, bytes: &[u8]) -> Result<PathBuf, JobError> {
    std::fs::create_dir_all(root)
        .map_err(|e| io_failure("creating the target store's directory", e))?;
    let root = root
        .canonicalize()
        .map_err(|e| io_failure("opening the target store's directory", e))?;
    let relative = Path::new(doc_id);
    let name = relative
        .file_name()
        .ok_or_else(|| JobError::NonRetryable("doc_id names no file".into()))?;
    let joined = root.join(relative);
    let parent = joined.parent().unwrap_or(&root);
    let inside = |dir: &Path| -> Result<PathBuf, JobError> {
        let dir = dir
            .canonicalize()
            .map_err(|e| io_failure("opening the target's directory", e))?;
        if dir.starts_with(&root) {
            Ok(dir)
        } else {
            Err(JobError::NonRetryable(
                "target path resolves outside the target store's directory".into(),
            ))
        }
    };
    // Check what exists before creating anything under it (a symlink may lead elsewhere).
    let mut existing = parent;
    while !existing.exists() {
        existing = existing.parent().unwrap_or(&root);
    }
    inside(existing)?;
    std::fs::create_dir_all(parent)
        .map_err(|e| io_failure("creating the target's directory", e))?;
    let parent = inside(parent)?;
    let dest = parent.join(name);
    let tmp = parent.join(format!(".{}.{op_id}.tmp", name.to_string_lossy()));
    let write = || -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, &dest)?;
        std::fs::File::open(&parent)?.sync_all()
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_failure("writing the document", e)
    })?;
    Ok(dest)
}

/// A piece of the document sent to the model on its own: `body` goes to the model, the
/// whitespace around it (`lead`, `tail`) is kept as it is, so the pieces of a document put
/// back together are the document, and an answer's surrounding whitespace does not matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk<'a> {
    pub lead: &'a str,
    pub body: &'a str,
    pub tail: &'a str,
}

/// Splits `text` into chunks whose bodies have at most `max_chars` characters: cut after
/// paragraph breaks (`\n\n`) where possible; a paragraph longer than that is cut at its last
/// line break or whitespace in the window (if that keeps at least half of it), else at the
/// limit, always on a character boundary. Whitespace-only pieces join their neighbours.
pub(crate) fn split_chunks(text: &str, max_chars: usize) -> Vec<Chunk<'_>> {
    let max = max_chars.max(1);
    let mut slices: Vec<(usize, usize)> = Vec::new();
    let (mut start, mut chars, mut pos) = (0, 0, 0);
    for para in text.split_inclusive("\n\n") {
        let n = para.chars().count();
        let end = pos + para.len();
        if chars + n <= max {
            chars += n;
            pos = end;
            continue;
        }
        if chars > 0 {
            slices.push((start, pos));
            start = pos;
        }
        let mut rest = n;
        while rest > max {
            let cut = hard_cut(text, start, max);
            rest -= text[start..cut].chars().count();
            slices.push((start, cut));
            start = cut;
        }
        chars = rest;
        pos = end;
    }
    if start < text.len() {
        slices.push((start, text.len()));
    }

    // [start, body start, body end, end] of each chunk.
    let mut spans: Vec<[usize; 4]> = Vec::new();
    let mut pending_lead: Option<usize> = None;
    for (a, b) in slices {
        let slice = &text[a..b];
        let body_start = a + (slice.len() - slice.trim_start().len());
        let body_end = a + slice.trim_end().len();
        if body_start >= body_end {
            match spans.last_mut() {
                Some(last) => last[3] = b,
                None => {
                    pending_lead.get_or_insert(a);
                }
            }
            continue;
        }
        spans.push([pending_lead.take().unwrap_or(a), body_start, body_end, b]);
    }
    spans
        .into_iter()
        .map(|[s, bs, be, e]| Chunk {
            lead: &text[s..bs],
            body: &text[bs..be],
            tail: &text[be..e],
        })
        .collect()
}

/// Where to cut a piece starting at `start` that is longer than `max` characters.
fn hard_cut(text: &str, start: usize, max: usize) -> usize {
    let limit = text[start..]
        .char_indices()
        .nth(max)
        .map_or(text.len(), |(i, _)| start + i);
    let window = &text[start..limit];
    let half = window.len() / 2;
    if let Some(i) = window.rfind('\n').filter(|&i| i + 1 >= half) {
        return start + i + 1;
    }
    if let Some((i, c)) = window
        .char_indices()
        .rev()
        .find(|(_, c)| c.is_whitespace())
        .filter(|&(i, _)| i + 1 >= half)
    {
        return start + i + c.len_utf8();
    }
    limit
}

/// Splits a chunk's answer into its text and the confidence of a trailing
/// `confidence: <0..1>` line (1.0 without one). A confidence line whose value is not a number
/// from 0 to 1 counts as 0: the model tried to say something about its certainty and failed.
pub(crate) fn strip_confidence(answer: &str) -> (&str, f64) {
    let trimmed = answer.trim_end();
    let (rest, last) = match trimmed.rfind('\n') {
        Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
        None => ("", trimmed),
    };
    match confidence_value(last) {
        Some(c) => (rest.trim(), c),
        None => (answer.trim(), 1.0),
    }
}

fn confidence_value(line: &str) -> Option<f64> {
    let markup = |c: char| c == '*' || c == '`' || c == '_' || c.is_whitespace();
    let line = line.trim_matches(markup);
    let label = line.get(..11)?;
    if !label.eq_ignore_ascii_case("confidence:") {
        return None;
    }
    let value = line[11..].trim_matches(markup);
    let value = value.strip_suffix('.').unwrap_or(value);
    Some(match value.parse::<f64>() {
        Ok(c) if (0.0..=1.0).contains(&c) => c,
        _ => 0.0,
    })
}

/// The `validate` step: a failure is non-retryable (the same output fails the same way);
/// low confidence is a verdict, not a failure.
fn validate(
    rules: &Validate,
    input: &str,
    output: &str,
    confidence: f64,
) -> Result<Verdict, JobError> {
    if output.trim().is_empty() {
        return Err(JobError::NonRetryable(
            "validation failed: the output is empty".into(),
        ));
    }
    let missing: Vec<String> = rules
        .required
        .iter()
        .filter(|s| !output.contains(s.as_str()))
        .map(|s| format!("{s:?}"))
        .collect();
    if !missing.is_empty() {
        let what = if missing.len() == 1 {
            "string"
        } else {
            "strings"
        };
        return Err(JobError::NonRetryable(format!(
            "validation failed: the output lacks the required {what} {}",
            missing.join(", ")
        )));
    }
    let chars_in = input.chars().count();
    let chars_out = output.chars().count();
    let ratio = chars_out as f64 / chars_in.max(1) as f64;
    let low_confidence =
        confidence < LOW_CONFIDENCE || rules.min_ratio.is_some_and(|min| ratio < min);
    Ok(Verdict {
        confidence,
        ratio,
        low_confidence,
        chars_in,
        chars_out,
    })
}

/// A reviewer's answer, the payload of the `review` signal.
#[derive(Debug, PartialEq)]
enum Decision {
    Approve,
    Edit(String),
    Reject(String),
}

/// Reads `{"decision": "approve"}`, `{"decision": "edit", "text": …}` or `{"decision":
/// "reject", "reason": …}`; the approval convention's `{"approved": bool, "reason"}` works too.
/// An unreadable payload is an error naming the expected shapes.
fn review_decision(payload: &Value) -> Result<Decision, String> {
    let reason = || {
        payload
            .get("reason")
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty())
            .unwrap_or("no reason given")
            .to_string()
    };
    match (
        payload.get("decision").and_then(Value::as_str),
        payload.get("approved").and_then(Value::as_bool),
    ) {
        (Some("approve"), _) | (None, Some(true)) => Ok(Decision::Approve),
        (Some("reject"), _) | (None, Some(false)) => Ok(Decision::Reject(reason())),
        (Some("edit"), _) => match payload.get("text").and_then(Value::as_str) {
            Some(text) if !text.trim().is_empty() => Ok(Decision::Edit(text.to_string())),
            _ => Err("review signal: an \"edit\" decision needs a non-empty \"text\"".into()),
        },
        _ => Err(
            "review signal payload is not a decision: expected {\"decision\": \"approve\"}, \
             {\"decision\": \"edit\", \"text\": …} or {\"decision\": \"reject\", \"reason\": …}"
                .into(),
        ),
    }
}

fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(3_600_000) {
        format!("{} h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{} min", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::registry;

    fn joined(chunks: &[Chunk<'_>]) -> String {
        chunks
            .iter()
            .map(|c| format!("{}{}{}", c.lead, c.body, c.tail))
            .collect()
    }

    #[test]
    fn chunks_cut_after_paragraphs_and_put_back_together_exactly() {
        let text = "Title: one\n\nfirst paragraph\n\nsecond paragraph\n\n\n\nthird\n";
        let one = split_chunks(text, 8000);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].body, text.trim());
        assert_eq!(one[0].tail, "\n");

        let many = split_chunks(text, 20);
        assert_eq!(
            many.iter().map(|c| c.body).collect::<Vec<_>>(),
            ["Title: one", "first paragraph", "second paragraph", "third"]
        );
        assert_eq!(many[0].tail, "\n\n");
        assert_eq!(joined(&many), text);

        // Paragraphs that fit together share a chunk.
        let two = split_chunks("aa\n\nbb\n\ncc\n\ndd", 8);
        assert_eq!(
            two.iter().map(|c| c.body).collect::<Vec<_>>(),
            ["aa\n\nbb", "cc\n\ndd"]
        );
    }

    #[test]
    fn chunk_bodies_never_exceed_the_limit_nor_split_a_character() {
        let samples = [
            "é".repeat(50),
            "日本語のテキスト。".repeat(20),
            format!("{}\n\n{}", "word ".repeat(100), "🦀".repeat(33)),
            "  \n\n  leading whitespace\n\n\n\n   \n\ntrailing   \n\n".to_string(),
            "x".repeat(1000),
            "line one\nline two\nline three\n".repeat(40),
        ];
        for text in &samples {
            for max in [1, 2, 3, 7, 16, 64, 100, 8000] {
                let chunks = split_chunks(text, max);
                assert_eq!(&joined(&chunks), text, "max {max}");
                for c in &chunks {
                    assert!(c.body.chars().count() <= max, "max {max}: {:?}", c.body);
                    assert!(!c.body.trim().is_empty());
                    assert_eq!(c.body, c.body.trim());
                    assert!(c.lead.trim().is_empty() && c.tail.trim().is_empty());
                }
            }
        }
        // A long paragraph is cut at whitespace, not inside a word.
        let text = "word ".repeat(100);
        let words = split_chunks(&text, 64);
        assert!(words.iter().all(|c| c.body.split(' ').all(|w| w == "word")));
        // Without whitespace, at the limit: 3 crabs (4 bytes each) per chunk.
        let text = "🦀".repeat(7);
        let crabs = split_chunks(&text, 3);
        assert_eq!(
            crabs.iter().map(|c| c.body).collect::<Vec<_>>(),
            ["🦀🦀🦀", "🦀🦀🦀", "🦀"]
        );
        assert!(split_chunks(" \n\n \n", 10).is_empty());
    }

    #[test]
    fn a_trailing_confidence_line_is_parsed_and_stripped() {
        assert_eq!(strip_confidence("text"), ("text", 1.0));
        assert_eq!(
            strip_confidence("line 1\nline 2\nconfidence: 0.25\n"),
            ("line 1\nline 2", 0.25)
        );
        assert_eq!(strip_confidence("a\n\nConfidence: 1"), ("a", 1.0));
        assert_eq!(strip_confidence("a\n**Confidence:** 0.7."), ("a", 0.7));
        assert_eq!(strip_confidence("a\nconfidence: high"), ("a", 0.0));
        assert_eq!(strip_confidence("a\nconfidence: 7"), ("a", 0.0));
        assert_eq!(strip_confidence("confidence: 0.9"), ("", 0.9));
        // Only the last line counts.
        assert_eq!(
            strip_confidence("confidence: 0.1\nbody"),
            ("confidence: 0.1\nbody", 1.0)
        );
        assert_eq!(strip_confidence("  text  \n"), ("text", 1.0));
        assert_eq!(
            strip_confidence("naïve\nconfidenc"),
            ("naïve\nconfidenc", 1.0)
        );
    }

    #[test]
    fn validation_names_missing_strings_and_flags_low_confidence() {
        let rules = Validate {
            required: vec!["Title:".into(), "Date:".into()],
            min_ratio: Some(0.5),
        };
        let ok = validate(&rules, "Title: a\nDate: b", "Title: A\nDate: B", 0.9).unwrap();
        assert!(!ok.low_confidence);
        assert_eq!(ok.ratio, 1.0);

        let e = validate(&rules, "x", "Date: b", 1.0).unwrap_err();
        assert_eq!(e.class(), "non_retryable");
        assert_eq!(
            e.to_string(),
            "validation failed: the output lacks the required string \"Title:\""
        );
        let e = validate(&rules, "x", "nothing", 1.0).unwrap_err();
        assert!(
            e.to_string().contains("strings \"Title:\", \"Date:\""),
            "{e}"
        );
        let e = validate(&Validate::default(), "x", " \n ", 1.0).unwrap_err();
        assert_eq!(e.to_string(), "validation failed: the output is empty");

        assert!(
            validate(&rules, "x", "Title: Date:", 0.4)
                .unwrap()
                .low_confidence
        );
        let short = validate(&rules, &"x".repeat(100), "Title: Date:", 1.0).unwrap();
        assert!(short.low_confidence, "ratio {}", short.ratio);
        assert!(
            !validate(&Validate::default(), &"x".repeat(100), "y", 1.0)
                .unwrap()
                .low_confidence,
            "no min_ratio, no ratio check"
        );
    }

    #[test]
    fn review_payloads_decide() {
        assert_eq!(
            review_decision(&json!({ "decision": "approve" })),
            Ok(Decision::Approve)
        );
        assert_eq!(
            review_decision(&json!({ "decision": "edit", "text": "new" })),
            Ok(Decision::Edit("new".into()))
        );
        assert_eq!(
            review_decision(&json!({ "decision": "reject", "reason": "wrong tone" })),
            Ok(Decision::Reject("wrong tone".into()))
        );
        assert_eq!(
            review_decision(&json!({ "approved": false })),
            Ok(Decision::Reject("no reason given".into()))
        );
        assert_eq!(
            review_decision(&json!({ "approved": true })),
            Ok(Decision::Approve)
        );
        assert!(review_decision(&json!({ "decision": "edit" })).is_err());
        assert!(review_decision(&json!({ "decision": "maybe" })).is_err());
        assert!(review_decision(&Value::Null).is_err());
        assert_eq!(human_duration(Duration::from_millis(86_400_000)), "24 h");
        assert_eq!(human_duration(Duration::from_millis(1500)), "1500 ms");
    }

    fn input(v: Value) -> Result<(), String> {
        registry().check_input("doc_migration", &v)
    }

    #[test]
    fn inputs_are_checked_at_enqueue() {
        let good = json!({
            "doc_id": "reports/2024/q1.md",
            "source": { "store": "legacy" },
            "target": { "store": "migrated" },
            "instructions": "Convert to Markdown.",
        });
        input(good.clone()).unwrap();
        let needs =
            agentq_core::kinds::Catalog::requires(&registry(), "doc_migration", &good).unwrap();
        assert_eq!(
            needs.stores,
            vec![
                Need {
                    field: "source.store",
                    store: "legacy".into(),
                    access: Access::Read
                },
                Need {
                    field: "target.store",
                    store: "migrated".into(),
                    access: Access::Write
                },
            ]
        );
        assert!(!needs.webhook_only);
        let with = |patch: Value| {
            let mut v = good.clone();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            input(v)
        };
        with(json!({
            "chunk_chars": 4000,
            "validate": { "required": ["Title:"], "min_ratio": 0.2 },
            "review": { "timeout_ms": 60000 },
        }))
        .unwrap();

        for (patch, says) in [
            (json!({ "doc_id": "" }), "doc_id must not be empty"),
            (json!({ "doc_id": "../etc/passwd" }), "\"..\""),
            (json!({ "doc_id": "a/../../b" }), "\"..\""),
            (json!({ "doc_id": "/etc/passwd" }), "relative"),
            (json!({ "doc_id": "." }), "names no file"),
            // A place instead of a store is refused, saying what to register.
            (json!({ "source": { "dir": "/" } }), "agentq stores add"),
            (
                json!({ "source": { "table": "webhook_secrets" } }),
                "never a directory or a table",
            ),
            (
                json!({ "target": { "store": "out", "dir": "/tmp" } }),
                "never a directory or a table",
            ),
            (json!({ "source": {} }), "{\"store\": \"NAME\"}"),
            (json!({ "target": { "store": "a/b" } }), "target.store"),
            (json!({ "target": { "store": "" } }), "target.store"),
            (json!({ "chunk_chars": 0 }), "chunk_chars"),
            (json!({ "validate": { "required": [""] } }), "required"),
            (json!({ "validate": { "min_ratio": -1 } }), "min_ratio"),
            (json!({ "review": { "timeout_ms": 0 } }), "timeout_ms"),
            (json!({ "review": { "timeout": 5 } }), "unknown field"),
            (
                json!({ "source": { "store": "a", "path": "/" } }),
                "unknown field",
            ),
            (json!({ "extra": true }), "unknown field"),
        ] {
            let e = with(patch.clone()).expect_err(&patch.to_string());
            assert!(e.contains(says), "{patch}: {e}");
        }
        let mut missing = good.clone();
        missing.as_object_mut().unwrap().remove("instructions");
        assert!(input(missing).is_err());
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "agentq-doc-migration-{name}-{}",
            Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn files_outside_the_roots_are_refused() {
        let base = scratch("escape");
        let (src, out) = (base.join("src"), base.join("out"));
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("sub/doc.md"), "hello").unwrap();
        std::fs::write(base.join("secret.txt"), "secret").unwrap();
        std::fs::write(src.join("bin"), [0xff, 0xfe, 0x00]).unwrap();
        std::os::unix::fs::symlink(base.join("secret.txt"), src.join("link.txt")).unwrap();
        std::os::unix::fs::symlink(&base, src.join("up")).unwrap();

        assert_eq!(read_file(&src, "sub/doc.md").unwrap(), "hello");
        let refused = |r: Result<String, JobError>| match r {
            Err(e @ JobError::NonRetryable(_)) => e.to_string(),
            other => panic!("not refused: {other:?}"),
        };
        assert!(refused(read_file(&src, "link.txt")).contains("outside the source store"));
        assert!(refused(read_file(&src, "up/secret.txt")).contains("outside the source store"));
        assert!(refused(read_file(&src, "missing.md")).contains("not found"));
        assert!(refused(read_file(&src, "sub")).contains("not a regular file"));
        assert_eq!(
            refused(read_file(&src, "bin")),
            "document is not UTF-8 text"
        );
        assert!(refused(read_file(&base.join("nope"), "a")).contains("does not exist"));

        // Writing: atomic, idempotent, never outside the root.
        let op = Uuid::new_v4();
        let dest = write_file(&out, "a/b/c.md", op, b"one").unwrap();
        assert_eq!(dest, out.canonicalize().unwrap().join("a/b/c.md"));
        write_file(&out, "a/b/c.md", op, b"one").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"one");
        let names: Vec<_> = std::fs::read_dir(out.join("a/b")).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file is left behind");
        std::os::unix::fs::symlink(&base, out.join("up")).unwrap();
        for escape in ["up/x.md", "up/new/x.md"] {
            match write_file(&out, escape, op, b"x") {
                Err(JobError::NonRetryable(m)) => {
                    assert!(m.contains("outside the target store"), "{m}")
                }
                other => panic!("{escape} not refused: {other:?}"),
            }
        }
        assert!(!base.join("x.md").exists());
        assert!(
            !base.join("new").exists(),
            "nothing is created outside the root"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn empty_and_binary_texts_are_refused() {
        assert_eq!(
            check_text(" \n\n ").unwrap_err().to_string(),
            "document is empty"
        );
        assert!(check_text("a\0b").is_err());
        assert!(check_text("fine").is_ok());
    }
}
