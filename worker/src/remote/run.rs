//! The run of a remote operation: call the service with the journal's tail, do what it answers
//! through the `JobContext` call that answer names (journaled, durable, at the position the
//! journal is at), and call again, until it answers the output or an error.
//!
//! Bytes stay O(steps): a run is one session; each call sends only the journal's entries at or
//! past the first position that changed since the previous call (and the input only with a
//! whole journal). A service that lost the session answers `resend` and gets the whole journal
//! again, within an allowance: a run resends at most twice its journal's bytes and a MiB more
//! in all, so a service that asks for the whole journal at every call fails its run instead of
//! making the worker send the square of its journal (docs/protocol.md, "The request").
//!
//! The session's journal (its entries as JSON, kept as the text they are sent as) and the
//! whole of it a request may carry are held in the worker's budget for remote journals
//! ([`crate::remote_memory`]), grown before each call.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_core::db::steps::JournalEntry;
use agentq_core::state::StepStatus;
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::client::{Answer, CallError, ServiceDef, StepFailure};
use crate::context::{JobContext, JobRun, MAX_PARK, SignalOutcome};
use crate::error::{Engine, JobError};
use crate::tool::{Reconciled, Replay};
use agentq_sdk::context::{Backend, Body, Reconcile, Step};

/// The longest step name a service may give.
const MAX_NAME: usize = 256;

/// What a call asks beyond "what next": run an unsafe step, or reconcile one.
#[derive(Clone, Copy)]
enum Directive<'a> {
    Next,
    Run { seq: i32, key: &'a str },
    Reconcile { seq: i32, key: &'a str },
}

/// Bytes a run may resend beyond twice its journal.
const RESEND_SLACK: usize = 1 << 20;

struct Journal {
    /// The journal as the service sees it, by position, as the JSON it is sent as.
    entries: BTreeMap<i32, Box<RawValue>>,
    /// Their bytes.
    bytes: usize,
    /// The first position the service has not been sent as it is now.
    dirty_from: i32,
    /// Bytes sent again because the service asked for the whole journal.
    resent: usize,
}

impl Journal {
    fn new(entries: BTreeMap<i32, Box<RawValue>>) -> Self {
        let bytes = entries.values().map(|e| e.get().len()).sum();
        Self {
            entries,
            bytes,
            dirty_from: 0,
            resent: 0,
        }
    }

    fn end(&self) -> i32 {
        self.entries.keys().next_back().map_or(0, |s| s + 1)
    }

    fn set(&mut self, seq: i32, entry: Box<RawValue>) {
        self.bytes += entry.get().len();
        if let Some(old) = self.entries.insert(seq, entry) {
            self.bytes -= old.get().len();
        }
        self.dirty_from = self.dirty_from.min(seq);
    }

    /// Whether a resend of the whole journal now stays within the run's allowance (twice the
    /// journal's bytes and [`RESEND_SLACK`], over the run).
    fn may_resend(&self) -> bool {
        self.resent + self.bytes <= 2 * self.bytes + RESEND_SLACK
    }
}

struct Session<'c> {
    id: String,
    service: Arc<ServiceDef>,
    /// The run, for what only the runner has (the loaded journal, its cursor, durability).
    ctx: &'c JobRun,
    /// The kind's handle over the run: every step the service asks for is taken through it,
    /// as a Rust kind takes its steps.
    handle: JobContext,
    input: Value,
    journal: Mutex<Journal>,
    /// Its room in the worker's budget for remote journals.
    room: tokio::sync::Mutex<crate::remote_memory::Room>,
}

/// Runs the remote operation `ctx` with `input` on `service` to its end (or a park).
pub(crate) async fn run(
    service: Arc<ServiceDef>,
    ctx: JobRun,
    input: Value,
) -> Result<Value, JobError> {
    let entries = ctx.with_loaded_journal(|journal| {
        journal
            .iter()
            .map(|e| (e.seq, entry_json(e)))
            .collect::<BTreeMap<_, _>>()
    });
    let session = Session {
        id: uuid::Uuid::new_v4().simple().to_string(),
        service,
        ctx: &ctx,
        handle: ctx.handle(),
        input,
        journal: Mutex::new(Journal::new(entries)),
        room: tokio::sync::Mutex::new(ctx.services().remote_memory.room()),
    };
    loop {
        // The step just journaled commits before the service runs the next one (a Rust kind's
        // next step waits for it the same way).
        ctx.make_durable().await?;
        session.make_room().await?;
        let answer = session
            .call(Directive::Next)
            .await
            .map_err(CallError::into_job_error)?;
        match answer {
            Answer::Output { output } => return Ok(output),
            Answer::Error { class, message } => {
                return Err(match class.as_str() {
                    "non_retryable" => JobError::NonRetryable(message),
                    "nondeterminism" => JobError::from(Engine::Nondeterminism(message)),
                    _ => JobError::retryable(message),
                });
            }
            Answer::Reconciled { .. } | Answer::Resend {} => {
                return Err(session.protocol("answered a reconcile though none was asked for"));
            }
            asked => session.act(asked).await?,
        }
    }
}

/// A journal entry as the service reads it.
#[derive(Serialize)]
struct Entry<'a> {
    seq: i32,
    name: &'a str,
    kind: &'a str,
    replay: &'a str,
    status: &'a str,
    output: Option<&'a Value>,
    error: Option<&'a str>,
}

impl Entry<'_> {
    fn raw(&self) -> Box<RawValue> {
        let text = serde_json::to_string(self).expect("an entry serializes");
        RawValue::from_string(text).expect("serde_json wrote JSON")
    }
}

fn entry_json(e: &JournalEntry) -> Box<RawValue> {
    Entry {
        seq: e.seq,
        name: &e.name,
        kind: e.kind.as_str(),
        replay: e.replay.as_str(),
        status: e.status.as_str(),
        output: e.output.as_ref(),
        error: e.error.as_deref(),
    }
    .raw()
}

/// A request's body (docs/protocol.md, "The request").
#[derive(Serialize)]
struct Request<'a> {
    protocol: u32,
    operation: Value,
    session: &'a str,
    input: Option<&'a Value>,
    journal: RequestJournal<'a>,
    run: Value,
    reconcile: Value,
}

#[derive(Serialize)]
struct RequestJournal<'a> {
    base: i32,
    entries: Vec<&'a RawValue>,
}

impl Session<'_> {
    fn protocol(&self, what: impl std::fmt::Display) -> JobError {
        agentq_core::metrics::REMOTE_CALLS.inc(&[&self.service.name, "protocol"]);
        JobError::retryable(format!("remote service {:?}: {what}", self.service.name))
    }

    fn journal(&self) -> std::sync::MutexGuard<'_, Journal> {
        self.journal.lock().expect("session journal lock")
    }

    /// Sets the entry at `seq` (sent with the next call).
    fn record(&self, seq: i32, name: &str, kind: &str, replay: &str, status: &str, output: Value) {
        let entry = Entry {
            seq,
            name,
            kind,
            replay,
            status,
            output: Some(&output),
            error: None,
        }
        .raw();
        self.journal().set(seq, entry);
    }

    /// Grows the session's room in the worker's budget for remote journals to its journal's
    /// bytes and those its next request carries ([`crate::remote_memory`]); else its operation goes
    /// back to the queue.
    async fn make_room(&self) -> Result<(), JobError> {
        let bytes = {
            let j = self.journal();
            let tail: usize = j
                .entries
                .range(j.dirty_from..)
                .map(|(_, e)| e.get().len())
                .sum();
            j.bytes + tail
        };
        if self.room.lock().await.grow(bytes).await {
            return Ok(());
        }
        agentq_core::metrics::REMOTE_CALLS.inc(&[&self.service.name, "memory"]);
        Err(JobError::from(Engine::Overloaded {
            message: format!(
                "remote service {:?}: this worker's memory for remote journals \
                 (AGENTQ_REMOTE_JOURNAL_MEMORY) is held by other operations; this one needs \
                 {bytes} bytes and goes back to the queue",
                self.service.name
            ),
            not_before: Some(chrono::Utc::now() + chrono::Duration::seconds(5)),
        }))
    }

    fn body(&self, directive: Directive<'_>) -> (Vec<u8>, i32) {
        let info = self.ctx.info();
        let (run, reconcile) = match directive {
            Directive::Next => (Value::Null, Value::Null),
            Directive::Run { seq, key } => (json!({ "seq": seq, "key": key }), Value::Null),
            Directive::Reconcile { seq, key } => (Value::Null, json!({ "seq": seq, "key": key })),
        };
        let j = self.journal();
        let base = j.dirty_from;
        let body = Request {
            protocol: agentq_core::services::PROTOCOL,
            operation: json!({
                "id": info.op_id.0,
                "kind": info.kind,
                "version": info.version,
                "tenant": info.tenant,
                "attempt": info.attempt,
            }),
            session: &self.id,
            input: (base == 0).then_some(&self.input),
            journal: RequestJournal {
                base,
                entries: j.entries.range(base..).map(|(_, e)| e.as_ref()).collect(),
            },
            run,
            reconcile,
        };
        (serde_json::to_vec(&body).unwrap_or_default(), base)
    }

    /// One call (more when the service asks for the whole journal again, within the run's
    /// allowance).
    async fn call(&self, directive: Directive<'_>) -> Result<Answer, CallError> {
        loop {
            let (body, base) = self.body(directive);
            let answer = self.service.call(body).await?;
            let mut j = self.journal();
            if matches!(answer, Answer::Resend {}) {
                if base == 0 {
                    agentq_core::metrics::REMOTE_CALLS.inc(&[&self.service.name, "protocol"]);
                    return Err(CallError {
                        message: format!(
                            "remote service {:?}: asked to resend a journal it was sent whole",
                            self.service.name
                        ),
                        not_sent: false,
                        down: false,
                        open_until: None,
                    });
                }
                if !j.may_resend() {
                    agentq_core::metrics::REMOTE_CALLS.inc(&[&self.service.name, "protocol"]);
                    return Err(CallError {
                        message: format!(
                            "remote service {:?}: asked for the whole journal again after {} \
                             bytes resent in this run (a run resends at most twice its {}-byte \
                             journal and 1 MiB): the service must keep its sessions (send one \
                             session's calls to one replica, or keep more sessions)",
                            self.service.name, j.resent, j.bytes
                        ),
                        not_sent: false,
                        down: false,
                        open_until: None,
                    });
                }
                j.resent += j.bytes;
                j.dirty_from = 0;
                continue;
            }
            // The service holds the session's journal as sent.
            j.dirty_from = j.end();
            return Ok(answer);
        }
    }

    /// Moves the context's cursor to `seq`, over the steps earlier runs completed; refuses an
    /// answer for a position the journal does not ask for.
    fn advance(&self, seq: i32) -> Result<(), JobError> {
        let mut at = self.ctx.cursor();
        if seq < at {
            return Err(self.protocol(format!(
                "answered step {seq} but the journal asks for step {at}"
            )));
        }
        while at < seq {
            match self.ctx.peek_recorded() {
                Some((_, StepStatus::Completed)) => {
                    self.ctx.skip_recorded();
                    at += 1;
                }
                _ => {
                    return Err(self.protocol(format!(
                        "answered step {seq} but the journal asks for step {at}"
                    )));
                }
            }
        }
        Ok(())
    }

    fn check_name(&self, name: &str) -> Result<(), JobError> {
        if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
            return Err(self.protocol(format!(
                "a step name is 1-{MAX_NAME} characters without control characters (got {} characters)",
                name.len()
            )));
        }
        Ok(())
    }

    fn duration(&self, what: &str, seconds: f64) -> Result<Duration, JobError> {
        Duration::try_from_secs_f64(seconds)
            .ok()
            .filter(|d| *d <= MAX_PARK)
            .ok_or_else(|| {
                self.protocol(format!(
                    "{what} of {seconds} s is not 0 to {} s",
                    MAX_PARK.as_secs()
                ))
            })
    }

    /// Does what `asked` names at its position.
    async fn act(&self, asked: Answer) -> Result<(), JobError> {
        let Some(seq) = asked.seq() else {
            return Err(self.protocol("answered no position"));
        };
        self.advance(seq)?;
        let ctx = &self.handle;
        match asked {
            Answer::Step {
                name,
                output,
                error,
                ..
            } => {
                self.check_name(&name)?;
                let result = match error {
                    Some(f) => Err(failure(f)),
                    None => Ok(output.unwrap_or(Value::Null)),
                };
                let v: Value = ctx.step(&name, || async move { result }).await?;
                self.record(seq, &name, "custom", "safe", "completed", v);
            }
            Answer::Unsafe {
                name, reconcile, ..
            } => {
                self.check_name(&name)?;
                let v = self.unsafe_step(seq, &name, reconcile).await?;
                self.record(seq, &name, "custom", "unsafe", "completed", v);
            }
            Answer::Model { name, request, .. } => {
                self.check_name(&name)?;
                let resp = ctx.model(&name, request).await?;
                let v = serde_json::to_value(resp).unwrap_or(Value::Null);
                self.record(seq, &name, "model", "safe", "completed", v);
            }
            Answer::Sleep { seconds, .. } => {
                let d = self.duration("a sleep", seconds)?;
                ctx.sleep(d).await?;
                self.record(seq, "sleep", "sleep", "safe", "completed", Value::Null);
            }
            Answer::Signal {
                name,
                timeout_seconds,
                ..
            } => {
                self.check_name(&name)?;
                let d = self.duration("a wait", timeout_seconds)?;
                let v = match ctx.wait_for_signal(&name, d).await? {
                    SignalOutcome::Received { payload, sent_by } => {
                        json!({ "payload": payload, "sent_by": sent_by })
                    }
                    SignalOutcome::TimedOut => json!({ "timed_out": true }),
                };
                self.record(
                    seq,
                    &format!("signal:{name}"),
                    "signal",
                    "safe",
                    "completed",
                    v,
                );
            }
            Answer::Spawn { kind, input, .. } => {
                let id = ctx.spawn(&kind, input).await?;
                self.record(
                    seq,
                    &format!("spawn:{kind}"),
                    "spawn",
                    "safe",
                    "completed",
                    json!(id),
                );
            }
            Answer::Join { children, .. } => {
                let outcomes = ctx.join(&children).await?;
                let v = serde_json::to_value(outcomes).unwrap_or(Value::Null);
                self.record(seq, "join", "join", "safe", "completed", v);
            }
            Answer::Now { .. } => {
                let t = ctx.now().await?;
                self.record(seq, "now", "now", "safe", "completed", json!(t));
            }
            Answer::Uuid { .. } => {
                let u = ctx.uuid().await?;
                self.record(seq, "uuid", "now", "safe", "completed", json!(u));
            }
            Answer::Patch { name, .. } => {
                self.check_name(&name)?;
                // The service asks only at an open position, where this is a first execution.
                if !ctx.patched(&name)? {
                    return Err(self.protocol(format!(
                        "answered patch {name:?} at step {seq}, which the journal holds"
                    )));
                }
                self.record(seq, &name, "patch", "safe", "completed", json!(true));
            }
            Answer::Reconciled { .. }
            | Answer::Output { .. }
            | Answer::Error { .. }
            | Answer::Resend {} => return Err(self.protocol("answered no step")),
        }
        Ok(())
    }

    /// An unsafe step the service runs: `started` is durable (the context's runner) before the
    /// service is told to run it; a crash that lost its outcome asks the service's reconcile.
    async fn unsafe_step(&self, seq: i32, name: &str, reconcile: bool) -> Result<Value, JobError> {
        let ask: Option<Reconcile<'_>> = reconcile.then(|| {
            let ask: Reconcile<'_> = Box::new(
                move |key: String| -> BoxFuture<'_, Result<Reconciled, JobError>> {
                    Box::pin(async move { self.reconcile(seq, &key).await })
                },
            );
            ask
        });
        // The runner returns the output recorded by an earlier run, or nothing when the
        // service ran the step now: then its answer is kept here.
        let mut kept = None;
        let slot = &mut kept;
        let body: Body<'_> = Box::new(move |key: String| {
            Box::pin(async move {
                self.record(seq, name, "custom", "unsafe", "started", Value::Null);
                let answer = self
                    .call(Directive::Run { seq, key: &key })
                    .await
                    .map_err(CallError::into_step_error)?;
                let output = match answer {
                    Answer::Step {
                        seq: s,
                        name: n,
                        output,
                        error,
                    } if s == seq && n == name => match error {
                        Some(f) => Err(failure(f)),
                        None => Ok(output.unwrap_or(Value::Null)),
                    },
                    _ => Err(self.protocol(format!(
                        "was asked to run step {seq} ({name}) and answered something else"
                    ))),
                }?;
                *slot = Some(output.clone());
                Ok(output)
            })
        });
        let step = Step {
            name,
            replay: Replay::Unsafe,
            deferred: false,
            reconcile: ask,
            body,
        };
        let recorded = Backend::step(self.ctx, step).await?;
        Ok(recorded.or(kept).unwrap_or(Value::Null))
    }

    async fn reconcile(&self, seq: i32, key: &str) -> Result<Reconciled, JobError> {
        let answer = self
            .call(Directive::Reconcile { seq, key })
            .await
            .map_err(CallError::into_job_error)?;
        match answer {
            Answer::Reconciled {
                seq: s,
                unsupported: true,
                ..
            } if s == seq => Ok(Reconciled::Unsupported),
            Answer::Reconciled {
                seq: s,
                happened: true,
                output,
                ..
            } if s == seq => Ok(Reconciled::Happened(output.unwrap_or(Value::Null))),
            Answer::Reconciled { seq: s, .. } if s == seq => Ok(Reconciled::NotHappened),
            _ => Err(self.protocol(format!(
                "was asked to reconcile step {seq} and answered something else"
            ))),
        }
    }
}

/// A step's failure as the service reported it.
fn failure(f: StepFailure) -> JobError {
    match (f.no_effect, f.retryable) {
        (true, _) => JobError::no_effect(f.message),
        (false, true) => JobError::retryable(f.message),
        (false, false) => JobError::NonRetryable(f.message),
    }
}
