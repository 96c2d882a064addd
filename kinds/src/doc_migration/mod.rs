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

mod chunk;
mod input;
mod review;
mod store_io;

use agentq_core::state::StepStatus;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use agentq_worker::model::{Message, ModelRequest, Role};
use agentq_worker::{EnginePool, JobContext, JobError, SignalOutcome};

use chunk::{split_chunks, strip_confidence};
pub use input::{DocMigrationInput, Validate, requires};
use review::{Decision, human_duration, review_decision, validate};
use store_io::{read_document, write_target};

/// Largest source document accepted: the text, each chunk's answer and the result are all
/// journaled, and a journal row is a JSON value in PostgreSQL.
pub const MAX_DOCUMENT_BYTES: usize = 8 * 1024 * 1024;

/// A chunk answer below this confidence sends the document to a human review.
pub const LOW_CONFIDENCE: f64 = 0.5;

/// The fixed part of every transform's system message; the operator's instructions follow it.
const PREAMBLE: &str = "You migrate a document one part at a time. Apply the instructions below \
to the part of the document given in the user message. Answer with the transformed text only \
(no commentary, no code fences), then one last line `confidence: <a number from 0 to 1>` saying \
how sure you are that the result is correct and complete.";

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
    let pool = ctx.state::<EnginePool>()?.0.clone();
    let tenant = ctx.info().tenant.clone();
    let doc: Document = ctx
        .step("read", || read_document(&pool, &tenant, &input))
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
            .step("plan", || {
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
            .step("validate", || {
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
            let about = json!({
                "needs": "a review of a low-confidence document: send signal \"review\" with \
                          {\"decision\": \"approve\"|\"edit\"|\"reject\"}",
                "doc_id": input.doc_id,
                "confidence": verdict.confidence,
                "chars_in": verdict.chars_in,
                "chars_out": verdict.chars_out,
            });
            let failure = match ctx
                .wait_for_signal_about("review", input.review_timeout, about)
                .await?
            {
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
            .step("write", || {
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

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}
