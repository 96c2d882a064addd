//! `agentq batch …`: campaigns of one `doc_migration` operation per document, with the
//! controls a large migration needs: a canary, pause / resume / cancel, automatic pause when
//! too many recent operations fail (the scheduler's job), progress, and a per-document report.
//!
//! Re-running `batch start` with the same arguments finds the same batch (its id is derived
//! from tenant, kind, source, target and instructions) and enqueues only what is missing, so a
//! crash or Ctrl-C midway loses nothing and duplicates nothing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentq_core::db::stores::{Access, Location, Need};
use agentq_core::db::{self, batches};
use agentq_core::dispatch::Target;
use agentq_core::operation::{Lane, TenantId};
use agentq_core::state::BatchStatus;
use agentq_core::{Config, db::batches::Batch};
use agentq_producer::EnqueueRequest;
use anyhow::Context;
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use crate::commands::{Refused, connect};

/// Operations inserted per statement.
const CHUNK: usize = 1000;

#[derive(Subcommand)]
pub enum BatchCommand {
    /// Create a batch (or find it again) and enqueue one operation per document it is missing.
    Start(StartArgs),
    /// Totals by status, rate, ETA, token usage and the top failure reasons.
    Status {
        batch: String,
        /// Redraw every 2 s until nothing is left to run (or the batch is paused).
        #[arg(long)]
        watch: bool,
        #[arg(long)]
        json: bool,
    },
    /// Stop starting the batch's operations (running ones finish their current run).
    Pause {
        batch: String,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// Resume a paused batch, or run the rest of a canary batch.
    Resume {
        batch: String,
        #[arg(long = "as")]
        actor: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Cancel every unfinished operation of the batch.
    Cancel {
        batch: String,
        #[arg(long)]
        reason: Option<String>,
        #[arg(long = "as")]
        actor: Option<String>,
    },
    /// One line per document: its operation, status, error and written hash (CSV or JSON Lines).
    Report {
        batch: String,
        /// csv or jsonl.
        #[arg(long, default_value = "jsonl")]
        format: String,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Args)]
pub struct StartArgs {
    #[arg(long)]
    pub tenant: String,
    #[arg(long, default_value = "doc_migration")]
    pub kind: String,
    /// The store documents are read from (`agentq stores add … --access read`): every file
    /// under its directory, or every row of its table, is a document.
    #[arg(long)]
    pub source: String,
    /// The store documents are written to (`--access write`).
    #[arg(long)]
    pub target: String,
    /// A file with the instructions for the model.
    #[arg(long)]
    pub instructions: PathBuf,
    /// Run only the first N documents, then wait for `agentq batch resume`.
    #[arg(long)]
    pub canary: Option<u32>,
    /// Auto-pause window: the newest M outcomes.
    #[arg(long, default_value_t = 20)]
    pub pause_window: i32,
    /// Auto-pause when at least this share of the window failed.
    #[arg(long, default_value_t = 0.5)]
    pub pause_ratio: f32,
    /// Strings every output must contain (validation; repeatable).
    #[arg(long = "require")]
    pub required: Vec<String>,
    /// Characters per model call (large documents are split).
    #[arg(long)]
    pub chunk_chars: Option<u32>,
    /// Operations per INSERT (tuning; smaller chunks show progress sooner).
    #[arg(long, default_value_t = CHUNK, hide = true)]
    pub chunk: usize,
    #[arg(long = "as")]
    pub actor: Option<String>,
    #[arg(long)]
    pub json: bool,
}

fn refuse(msg: impl Into<String>) -> anyhow::Error {
    Refused(msg.into()).into()
}

/// A store the batch names (`{"store": NAME}` in every input), checked now: the tenant must
/// have it, with the access the batch needs.
async fn store_ref(
    pool: &PgPool,
    tenant: &str,
    name: &str,
    what: &'static str,
    access: Access,
) -> anyhow::Result<Value> {
    db::stores::check_name(name).map_err(|e| refuse(format!("--{what}: {e}")))?;
    let need = Need {
        field: if access == Access::Read {
            "--source"
        } else {
            "--target"
        },
        store: name.to_string(),
        access,
    };
    let mut conn = pool.acquire().await?;
    if let Some(why) = db::stores::refusal(&mut conn, tenant, &[need]).await? {
        return Err(refuse(why));
    }
    Ok(json!({ "store": name }))
}

/// The documents of a source store, sorted: relative paths of regular files under its
/// directory (hidden ones skipped), or its table's ids.
async fn list_documents(
    pool: &PgPool,
    tenant: &str,
    source: &Value,
) -> anyhow::Result<Vec<String>> {
    let name = source["store"].as_str().unwrap_or_default();
    let store = db::stores::get(pool, tenant, name)
        .await?
        .ok_or_else(|| refuse(format!("tenant {tenant} has no store {name:?} (any more)")))?;
    let (table, id) = match &store.location {
        Location::Table {
            table, id_column, ..
        } => (table.as_str(), id_column.as_str()),
        Location::Dir(root) => return list_files(root),
    };
    Ok(db::docs::list_ids(pool, table, id).await?)
}

fn list_files(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).with_context(|| format!("listing {}", d.display()))? {
            let entry = entry?;
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_file() {
                let rel = entry.path();
                let rel = rel.strip_prefix(root).expect("under the root");
                match rel.to_str() {
                    Some(s) if !s.split('/').any(|c| c.starts_with('.')) => out.push(s.to_string()),
                    Some(_) => {} // hidden files (editors' and our own temp files)
                    None => eprintln!("skipping {}: its name is not UTF-8", rel.display()),
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The batch id: a hash of everything that identifies the campaign.
fn batch_id(tenant: &str, kind: &str, source: &Value, target: &Value, instructions: &str) -> Uuid {
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

fn doc_key(batch: Uuid, doc: &str) -> String {
    format!("batch:{batch}:{doc}")
}

fn progress(len: u64, msg: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(len),
        if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(msg.to_string());
    bar
}

/// What `fill` did.
struct Filled {
    enqueued: usize,
    existing: usize,
    refused: Vec<(String, String)>,
}

/// Enqueues the documents of `batch` it does not have yet (only the canary's while it is a
/// canary), in chunks: one INSERT per chunk, its pointers published concurrently.
async fn fill(
    config: &Config,
    pool: &PgPool,
    batch: &Batch,
    chunk: usize,
) -> anyhow::Result<Filled> {
    let source: Value = serde_json::from_str(&batch.source)?;
    let target: Value = serde_json::from_str(&batch.target)?;
    let mut docs = list_documents(pool, &batch.tenant, &source).await?;
    if batch.status == BatchStatus::Canary {
        docs.truncate(batch.canary.unwrap_or(0).max(0) as usize);
    }
    let have: HashSet<String> = batches::enqueued_keys(pool, batch.id)
        .await?
        .into_iter()
        .collect();
    let missing: Vec<String> = docs
        .iter()
        .filter(|d| !have.contains(&doc_key(batch.id, d)))
        .cloned()
        .collect();
    let mut filled = Filled {
        enqueued: 0,
        existing: docs.len() - missing.len(),
        refused: Vec::new(),
    };
    if missing.is_empty() {
        return Ok(filled);
    }
    let (producer, dispatcher) = crate::commands::producer(config, pool.clone(), "batch");
    let bar = progress(missing.len() as u64, "enqueue");
    for chunk in missing.chunks(chunk.max(1)) {
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
        let bulk = producer.enqueue_many(reqs).await?;
        filled.enqueued += bulk.created.len();
        filled.existing += bulk.existing;
        for (i, why) in bulk.refused {
            bar.suspend(|| eprintln!("{}: refused: {why}", chunk[i]));
            filled.refused.push((chunk[i].clone(), why));
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    dispatcher.close().await;
    Ok(filled)
}

fn parse_batch(s: &str) -> anyhow::Result<Uuid> {
    Uuid::parse_str(s.trim()).map_err(|_| {
        refuse(format!(
            "{s:?} is not a batch id (a UUID from `agentq batch start`)"
        ))
    })
}

/// What a control command (pause, cancel) needs: the pool, the batch id, the actor.
async fn control(
    config: &Config,
    batch: &str,
    actor: &Option<String>,
) -> anyhow::Result<(PgPool, Uuid, String)> {
    let id = parse_batch(batch)?;
    let pool = connect(config).await?;
    find(&pool, id).await?;
    Ok((pool, id, crate::dlq::actor_name(actor)))
}

async fn find(pool: &PgPool, id: Uuid) -> anyhow::Result<Batch> {
    batches::find_batch(pool, id, None)
        .await?
        .ok_or_else(|| refuse(format!("no batch {id}")))
}

pub async fn run(config: Config, cmd: BatchCommand) -> anyhow::Result<()> {
    match cmd {
        BatchCommand::Start(args) => start(config, args).await,
        BatchCommand::Status { batch, watch, json } => {
            let id = parse_batch(&batch)?;
            let pool = connect(&config).await?;
            find(&pool, id).await?;
            loop {
                let s = status(&pool, id).await?;
                if json {
                    println!("{s}");
                } else {
                    print_status(&s);
                }
                let open = s["unfinished"].as_i64().unwrap_or(0);
                if !watch || open == 0 || s["status"] != "running" {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
        BatchCommand::Pause {
            batch,
            reason,
            actor,
        } => {
            let (pool, id, actor) = control(&config, &batch, &actor).await?;
            match batches::transition(
                &pool,
                id,
                &[BatchStatus::Running, BatchStatus::Canary],
                BatchStatus::Paused,
                &actor,
                reason.as_deref(),
            )
            .await?
            {
                Some(_) => {
                    println!(
                        "batch {id} paused: nothing new starts; running operations finish their current run"
                    );
                    Ok(())
                }
                None => Err(refuse(format!(
                    "batch {id} is not running; nothing changed"
                ))),
            }
        }
        BatchCommand::Resume { batch, actor, json } => {
            let id = parse_batch(&batch)?;
            let pool = connect(&config).await?;
            let b = find(&pool, id).await?;
            let actor = crate::dlq::actor_name(&actor);
            let before = batches::transition(
                &pool,
                id,
                &[BatchStatus::Paused, BatchStatus::Canary],
                BatchStatus::Running,
                &actor,
                None,
            )
            .await?
            .ok_or_else(|| {
                refuse(format!(
                    "batch {id} is {}: only a paused or canary batch resumes",
                    b.status
                ))
            })?;
            let b = find(&pool, id).await?;
            let filled = fill(&config, &pool, &b, CHUNK).await?;
            let redispatched = redispatch(&config, &pool, id).await?;
            if json {
                println!(
                    "{}",
                    json!({ "batch_id": id, "was": before, "enqueued": filled.enqueued, "redispatched": redispatched })
                );
            } else {
                println!(
                    "batch {id} resumed (was {before}): {} enqueued, {redispatched} queued operations re-dispatched",
                    filled.enqueued
                );
            }
            Ok(())
        }
        BatchCommand::Cancel {
            batch,
            reason,
            actor,
        } => {
            let (pool, id, actor) = control(&config, &batch, &actor).await?;
            batches::transition(
                &pool,
                id,
                &[
                    BatchStatus::Running,
                    BatchStatus::Canary,
                    BatchStatus::Paused,
                ],
                BatchStatus::Cancelled,
                &actor,
                reason.as_deref(),
            )
            .await?
            .ok_or_else(|| refuse(format!("batch {id} is already cancelled")))?;
            let (now, requested) = batches::cancel_operations(&pool, id, &actor).await?;
            println!(
                "batch {id} cancelled: {now} operations cancelled, {requested} running ones stop at their next step"
            );
            Ok(())
        }
        BatchCommand::Report { batch, format, out } => report(config, &batch, &format, out).await,
    }
}

async fn start(config: Config, args: StartArgs) -> anyhow::Result<()> {
    TenantId::parse(&args.tenant).map_err(refuse)?;
    if !(1..=10_000).contains(&args.pause_window) {
        return Err(refuse("--pause-window must be between 1 and 10000"));
    }
    if !(args.pause_ratio > 0.0 && args.pause_ratio <= 1.0) {
        return Err(refuse("--pause-ratio must be above 0 and at most 1"));
    }
    if args.canary == Some(0) {
        return Err(refuse("--canary must be at least 1"));
    }
    let instructions = std::fs::read(&args.instructions)
        .map_err(|e| {
            refuse(format!(
                "--instructions {}: {e}",
                args.instructions.display()
            ))
        })
        .and_then(|b| {
            String::from_utf8(b).map_err(|_| refuse("--instructions is not UTF-8 text"))
        })?;
    if instructions.trim().is_empty() {
        return Err(refuse(
            "--instructions is empty: say what the model should do",
        ));
    }
    let mut options = serde_json::Map::new();
    if let Some(c) = args.chunk_chars {
        options.insert("chunk_chars".into(), json!(c));
    }
    if !args.required.is_empty() {
        options.insert("validate".into(), json!({ "required": args.required }));
    }
    let pool = connect(&config).await?;
    let source = store_ref(&pool, &args.tenant, &args.source, "source", Access::Read).await?;
    let target = store_ref(&pool, &args.tenant, &args.target, "target", Access::Write).await?;
    let docs = list_documents(&pool, &args.tenant, &source).await?;
    if docs.is_empty() {
        return Err(refuse(format!(
            "--source {:?} has no documents",
            args.source
        )));
    }
    let id = batch_id(&args.tenant, &args.kind, &source, &target, &instructions);
    let wanted = Batch {
        id,
        tenant: args.tenant.clone(),
        kind: args.kind.clone(),
        source: source.to_string(),
        target: target.to_string(),
        instructions,
        options: Value::Object(options),
        status: if args.canary.is_some() {
            BatchStatus::Canary
        } else {
            BatchStatus::Running
        },
        canary: args.canary.map(|c| c as i32),
        documents: docs.len() as i32,
        pause_window: args.pause_window,
        pause_ratio: args.pause_ratio,
        paused_reason: None,
        created_at: chrono::Utc::now(),
        updated_at: chrono::Utc::now(),
    };
    let actor = crate::dlq::actor_name(&args.actor);
    let (batch, created) = batches::create_batch(&pool, &wanted, &actor).await?;
    if batch.status == BatchStatus::Cancelled {
        return Err(refuse(format!(
            "batch {id} was cancelled; nothing was enqueued"
        )));
    }
    let filled = fill(&config, &pool, &batch, args.chunk).await?;
    if args.json {
        println!(
            "{}",
            json!({ "batch_id": id, "created": created, "status": batch.status, "documents": docs.len(),
                    "enqueued": filled.enqueued, "existing": filled.existing, "refused": filled.refused.len() })
        );
    } else {
        println!(
            "batch {id} ({}): {} documents, {} enqueued now, {} already enqueued{}",
            batch.status,
            docs.len(),
            filled.enqueued,
            filled.existing,
            if filled.refused.is_empty() {
                String::new()
            } else {
                format!(", {} refused (see above)", filled.refused.len())
            }
        );
        if batch.status == BatchStatus::Canary {
            println!(
                "canary: the first {} run; check them, then: agentq batch resume {id}",
                batch.canary.unwrap_or(0)
            );
        }
        println!("watch it: agentq batch status {id} --watch");
    }
    Ok(())
}

/// Re-publishes the queued operations of a resumed batch (their pointers were dropped while
/// it was paused). Returns how many were published.
async fn redispatch(config: &Config, pool: &PgPool, batch: Uuid) -> anyhow::Result<usize> {
    let (_, dispatcher) = crate::commands::producer(config, pool.clone(), "batch");
    let total = redispatch_with(pool, &dispatcher, batch).await;
    dispatcher.close().await;
    total
}

/// Re-publishes the queued operations of a resumed batch through `dispatcher` (the CLI's
/// `batch resume` and the console's resume share it). Returns how many were published.
pub async fn redispatch_with(
    pool: &PgPool,
    dispatcher: &agentq_core::dispatch::Dispatcher,
    batch: Uuid,
) -> anyhow::Result<usize> {
    let cutoff = chrono::Utc::now();
    let mut total = 0;
    loop {
        let taken = batches::take_queued(pool, batch, cutoff, CHUNK as i64).await?;
        if taken.is_empty() {
            break;
        }
        let targets: Vec<Target> = taken.into_iter().map(Target::from).collect();
        let sent =
            futures_util::future::join_all(targets.iter().map(|t| dispatcher.publish(t))).await;
        let failed: Vec<(Uuid, i64)> = targets
            .iter()
            .zip(sent)
            .filter(|(_, r)| r.is_err())
            .map(|(t, _)| (t.op_id.0, t.epoch))
            .collect();
        total += targets.len() - failed.len();
        if !failed.is_empty() {
            // The sweeper publishes these once the broker is back.
            db::clear_dispatched(pool, &failed).await?;
            break;
        }
    }
    Ok(total)
}

/// The batch's progress as one JSON object.
async fn status(pool: &PgPool, id: Uuid) -> anyhow::Result<Value> {
    let b = find(pool, id).await?;
    let counts: BTreeMap<String, i64> = batches::counts(pool, id).await?.into_iter().collect();
    let get = |s: &str| counts.get(s).copied().unwrap_or(0);
    let unfinished = get("queued") + get("running") + get("sleeping") + get("waiting");
    let enqueued: i64 = counts.values().sum();
    let window = Duration::from_secs(60);
    let recent = batches::succeeded_since(pool, id, chrono::Utc::now() - window).await?;
    let rate = recent as f64 / window.as_secs_f64();
    let remaining = unfinished + (i64::from(b.documents) - enqueued).max(0);
    let eta = (rate > 0.0).then(|| (remaining as f64 / rate).round() as i64);
    let (calls, prompt, completion) = batches::usage(pool, id).await?;
    let failures = batches::top_failures(pool, id, 5).await?;
    Ok(json!({
        "batch_id": id, "tenant": b.tenant, "kind": b.kind, "status": b.status,
        "paused_reason": b.paused_reason, "canary": b.canary, "documents": b.documents,
        "enqueued": enqueued, "by_status": counts, "unfinished": unfinished,
        "succeeded_per_s": (rate * 100.0).round() / 100.0, "eta_secs": eta,
        "usage": { "model_calls": calls, "prompt_tokens": prompt, "completion_tokens": completion },
        "top_failures": failures,
    }))
}

fn print_status(s: &Value) {
    println!(
        "batch {}  {}{}",
        s["batch_id"].as_str().unwrap_or_default(),
        s["status"].as_str().unwrap_or_default(),
        s["paused_reason"]
            .as_str()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    let by: Vec<String> = s["by_status"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| format!("{k} {v}")).collect())
        .unwrap_or_default();
    println!(
        "  documents {}  enqueued {}  {}",
        s["documents"],
        s["enqueued"],
        by.join("  ")
    );
    println!(
        "  rate {}/s  eta {}  model calls {}  tokens {} prompt / {} completion",
        s["succeeded_per_s"],
        s["eta_secs"]
            .as_i64()
            .map(|e| format!("{e}s"))
            .unwrap_or_else(|| "-".into()),
        s["usage"]["model_calls"],
        s["usage"]["prompt_tokens"],
        s["usage"]["completion_tokens"]
    );
    for f in s["top_failures"].as_array().into_iter().flatten() {
        println!(
            "  {:>6}  {:<20} {}",
            f["count"],
            f["error_class"].as_str().unwrap_or_default(),
            f["reason"].as_str().unwrap_or_default()
        );
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

async fn report(
    config: Config,
    batch: &str,
    format: &str,
    out: Option<PathBuf>,
) -> anyhow::Result<()> {
    let id = parse_batch(batch)?;
    if !["csv", "jsonl"].contains(&format) {
        return Err(refuse(format!("--format {format:?}: use csv or jsonl")));
    }
    let pool = connect(&config).await?;
    let b = find(&pool, id).await?;
    let mut rows: HashMap<String, batches::ReportRow> = HashMap::new();
    let mut after = None;
    loop {
        let page = batches::report_page(&pool, id, after, 5000).await?;
        let Some(last) = page.last() else { break };
        after = Some(last.op_id);
        for r in page {
            rows.insert(r.doc_id.clone().unwrap_or_else(|| r.op_id.to_string()), r);
        }
    }
    // Every document of the source appears once, enqueued or not.
    let source: Value = serde_json::from_str(&b.source)?;
    let mut docs = list_documents(&pool, &b.tenant, &source)
        .await
        .unwrap_or_default();
    for d in rows.keys() {
        if !docs.contains(d) {
            docs.push(d.clone());
        }
    }
    docs.sort();
    let mut sink: Box<dyn Write> = match &out {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).map_err(|e| refuse(format!("--out {}: {e}", p.display())))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    if format == "csv" {
        writeln!(
            sink,
            "doc_id,op_id,status,attempt,error_class,error_message,sha256,finished_at"
        )?;
    }
    let mut totals: BTreeMap<String, usize> = BTreeMap::new();
    for doc in &docs {
        let r = rows.get(doc);
        let status = r
            .map(|r| r.status.clone())
            .unwrap_or_else(|| "not_enqueued".into());
        *totals.entry(status.clone()).or_default() += 1;
        if format == "jsonl" {
            writeln!(
                sink,
                "{}",
                json!({ "doc_id": doc, "op_id": r.map(|r| r.op_id), "status": status,
                        "attempt": r.map(|r| r.attempt), "error_class": r.and_then(|r| r.error_class.clone()),
                        "error_message": r.and_then(|r| r.error_message.clone()),
                        "sha256": r.and_then(|r| r.sha256.clone()), "finished_at": r.and_then(|r| r.finished_at) })
            )?;
        } else {
            let opt = |o: Option<String>| csv_field(&o.unwrap_or_default());
            writeln!(
                sink,
                "{},{},{},{},{},{},{},{}",
                csv_field(doc),
                opt(r.map(|r| r.op_id.to_string())),
                status,
                opt(r.map(|r| r.attempt.to_string())),
                opt(r.and_then(|r| r.error_class.clone())),
                opt(r.and_then(|r| r.error_message.clone())),
                opt(r.and_then(|r| r.sha256.clone())),
                opt(r.and_then(|r| r.finished_at.map(|f| f.to_rfc3339())))
            )?;
        }
    }
    sink.flush()?;
    let summary: Vec<String> = totals.iter().map(|(k, v)| format!("{k} {v}")).collect();
    eprintln!("{} documents: {}", docs.len(), summary.join(", "));
    Ok(())
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

    #[test]
    fn csv_quotes_when_needed() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
