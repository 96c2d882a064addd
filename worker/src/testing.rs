//! The replay tester: checks a kind against every crash it can meet, without PostgreSQL or
//! RabbitMQ.
//!
//! [`Tester::run`] runs a kind to completion on an in-memory journal, against a scripted model
//! ([`ModelScript`]) and fake tools ([`FakeTool`]), delivering scripted signals and child
//! outcomes when it parks. It records every durable write of the journal and every effect (a
//! tool call, an unsafe step's body). Then it crashes it at every one of those points: for each,
//! it starts again from the journal as that point left it, with the effects that had happened
//! by then, and runs it to the end. A [`Report`] lists what went wrong, naming the step:
//!
//! - **nondeterminism**: a run asked for other steps than the first (a name or a branch that
//!   depends on something the journal does not hold: the clock, a random number, a global);
//! - **ran again**: an unsafe effect happened twice for one idempotency key, because a crash
//!   hit after it and the step ran again (a reconcile that said "not happened", an effect
//!   made outside the journal);
//! - **no reconcile**: an unsafe step a crash interrupted cannot be reconciled, so the
//!   operation would stop as `unknown_side_effect` and wait for a human;
//! - **failed**: a run ended otherwise than the first (a panic, an error).
//!
//! [`replay_journal`] replays a journal exported from production (`agentq steps OP --json`,
//! read by [`journal_from_steps`]) against the code at hand, to see whether a deploy would
//! replay the operations that wait today; `agentq replay` runs it from the command line.
//!
//! ```
//! use agentq_worker::testing::{FakeTool, ModelScript, Tester};
//! use agentq_worker::{JobContext, JobError, ModelResponse, Registry, Replay};
//! use serde_json::{Value, json};
//!
//! async fn refund(ctx: JobContext, input: Value) -> Result<Value, JobError> {
//!     let tool = ctx.registered_tool("refund").expect("registered");
//!     let done = ctx.tool(tool.as_ref(), input).await?;
//!     ctx.step("notify", Replay::Safe, |_key| async { Ok(json!("sent")) }).await?;
//!     Ok(done)
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let mut registry = Registry::new();
//! registry.register("refund", refund);
//! let report = Tester::new(&registry, "refund", json!({ "cents": 500 }))
//!     .fake_tool(FakeTool::new("refund", Replay::Unsafe, |_args| json!({ "refunded": true })).reconciles())
//!     .run()
//!     .await;
//! report.assert_ok(); // every crash point: one refund, the same steps
//! assert_eq!(report.output(), Some(&json!({ "refunded": true })));
//! # });
//! ```
//!
//! Invariant kept here: the tester runs the same `JobContext` code as a worker (the same replay
//! decisions, the same journal rows); only where the rows go (memory, not PostgreSQL) differs.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use agentq_core::db::{self, JournalEntry, StepWrite};
use agentq_core::operation::{JOIN_WAIT, OperationId, StepView, step_idempotency_key};
use agentq_core::origins::Origins;
use agentq_core::state::{Status, StepKind, StepStatus};
use async_trait::async_trait;
use chrono::Utc;
use futures_util::FutureExt;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::context::{ChildOutcome, JobContext, OperationInfo, Services};
use crate::error::JobError;
use crate::gate::{GateSettings, ModelGate};
use crate::group_commit::GroupCommit;
use crate::model::{ModelClient, ModelError, ModelRequest, ModelResponse};
use crate::registry::Registry;
use crate::store::Store;
use crate::tool::{Reconciled, Replay, Tool, ToolContext};

/// Attempts a run gets for retryable failures before the tester takes the failure as its end.
const ATTEMPTS: u32 = 5;

/// Parks a run may go through before the tester gives up on it (a kind that waits forever).
const MAX_PARKS: u32 = 1_000;

/// A scripted model's answer to a request, from the request and the model step's number.
pub type ModelFn = Arc<dyn Fn(&ModelRequest, usize) -> ModelResponse + Send + Sync>;

/// What a scripted model answers.
#[derive(Clone)]
pub enum ModelScript {
    /// The `n`-th model step of the operation (counted from 0 in journal order, whatever run
    /// makes it) gets the `n`-th answer; past the end, the last one.
    Replies(Vec<ModelResponse>),
    /// Each call answered by a function of the request and of the model step's number.
    Function(ModelFn),
    /// The built-in local model: it answers with the last user message.
    Echo,
}

impl ModelScript {
    /// Answers in order (see [`ModelScript::Replies`]).
    pub fn replies(replies: impl IntoIterator<Item = ModelResponse>) -> Self {
        ModelScript::Replies(replies.into_iter().collect())
    }

    /// Answers from a function of the request and the model step's number.
    pub fn function(
        f: impl Fn(&ModelRequest, usize) -> ModelResponse + Send + Sync + 'static,
    ) -> Self {
        ModelScript::Function(Arc::new(f))
    }
}

/// A tool standing in for a real one of the same name while the tester runs: it answers from
/// a function of its arguments, and, where it [`FakeTool::reconciles`], says an effect
/// happened exactly when one happened before the crash the tester is simulating.
#[derive(Clone)]
pub struct FakeTool {
    name: String,
    replay: Replay,
    reconciles: bool,
    approval: bool,
    respond: Arc<dyn Fn(&Value) -> Value + Send + Sync>,
}

impl FakeTool {
    /// A fake of the tool `name` with `replay`'s policy, answering `respond(args)`.
    pub fn new(
        name: &str,
        replay: Replay,
        respond: impl Fn(&Value) -> Value + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.to_string(),
            replay,
            reconciles: false,
            approval: false,
            respond: Arc::new(respond),
        }
    }

    /// It can be reconciled (the real tool implements [`Tool::reconcile`]).
    pub fn reconciles(mut self) -> Self {
        self.reconciles = true;
        self
    }

    /// Every call waits for a human's approval first (the real tool's `requires_approval`).
    pub fn requires_approval(mut self) -> Self {
        self.approval = true;
        self
    }
}

/// How a child operation ends, for [`Tester::children`].
#[derive(Clone, Debug, PartialEq)]
pub enum ChildEnd {
    Succeeded(Value),
    Dead { class: String, message: String },
}

type ChildFn = Arc<dyn Fn(&str, &Value) -> ChildEnd + Send + Sync>;

/// Runs a kind once, then from every crash point of that run (see the module docs).
pub struct Tester {
    registry: Registry,
    kind: String,
    version: Option<String>,
    input: Value,
    tenant: String,
    model: ModelScript,
    fakes: BTreeMap<String, FakeTool>,
    signals: Vec<(String, Value)>,
    children: ChildFn,
    pool: Option<PgPool>,
    http_allow: Origins,
}

impl Tester {
    /// A tester of `kind` (its newest version in `registry`) with `input`. The model is the
    /// built-in echo until [`Tester::model`] scripts it; tools are the registry's until
    /// [`Tester::fake_tool`] replaces them.
    pub fn new(registry: &Registry, kind: &str, input: Value) -> Self {
        Self {
            registry: registry.clone(),
            kind: kind.to_string(),
            version: None,
            input,
            tenant: "test".into(),
            model: ModelScript::Echo,
            fakes: BTreeMap::new(),
            signals: Vec::new(),
            children: Arc::new(|_, _| ChildEnd::Succeeded(Value::Null)),
            pool: None,
            http_allow: Origins::default(),
        }
    }

    /// Runs `version` of the kind instead of its newest.
    pub fn version(mut self, version: &str) -> Self {
        self.version = Some(version.to_string());
        self
    }

    /// The operation's tenant (default `test`).
    pub fn tenant(mut self, tenant: &str) -> Self {
        self.tenant = tenant.to_string();
        self
    }

    /// What the model answers.
    pub fn model(mut self, script: ModelScript) -> Self {
        self.model = script;
        self
    }

    /// Replaces the registered tool of the same name (or adds one) while testing.
    pub fn fake_tool(mut self, tool: FakeTool) -> Self {
        self.fakes.insert(tool.name.clone(), tool);
        self
    }

    /// A signal for a wait on `name`: the waits on `name` get these payloads in order, each
    /// when the operation has parked on it; a wait with none left times out.
    pub fn signal(mut self, name: &str, payload: Value) -> Self {
        self.signals.push((name.to_string(), payload));
        self
    }

    /// How each spawned child ends (default: it succeeds with `null`), from its kind and input.
    pub fn children(
        mut self,
        f: impl Fn(&str, &Value) -> ChildEnd + Send + Sync + 'static,
    ) -> Self {
        self.children = Arc::new(f);
        self
    }

    /// A pool for a kind or tool that reads its own tables ([`JobContext::pool`]). Without
    /// one, the pool a kind gets fails every connection.
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The origins a kind's outbound calls may reach ([`JobContext::http_allow`]).
    pub fn http_allow(mut self, origins: Origins) -> Self {
        self.http_allow = origins;
        self
    }

    /// Runs the kind to its end, then again from every crash point of that run; see [`Report`].
    pub async fn run(self) -> Report {
        let version = match self
            .version
            .clone()
            .or_else(|| self.registry.newest(&self.kind).map(str::to_string))
        {
            Some(v) => v,
            None => {
                return Report::broken(format!(
                    "kind {:?} is not registered: the registry holds {}",
                    self.kind,
                    self.registry.kind_names().join(", ")
                ));
            }
        };
        if let Err(e) = self.registry.check_input(&self.kind, &self.input) {
            return Report::broken(format!("the input would be refused at enqueue: {e}"));
        }
        let world = World {
            op_id: OperationId(uuid::Uuid::new_v4()),
            children: Arc::new(Mutex::new(BTreeMap::new())),
        };
        let services_for = |memory: &Arc<Memory>| self.services(memory);

        // The first run: what every crash is compared with.
        let first = Arc::new(Memory::new(
            &world,
            Scenario::default(),
            &self.signals,
            true,
        ));
        let ended = self
            .drive(&world, &version, &first, &services_for(&first))
            .await;
        let (timeline, journal) = first.finish();
        let mut report = Report {
            outcome: ended.clone(),
            steps: journal
                .iter()
                .map(|r| (r.seq, r.name.clone(), r.kind))
                .collect(),
            crash_points: 0,
            violations: first.take_violations(),
        };
        if let End::Failed { class, message } = &ended
            && class != "non_retryable"
        {
            report.note(Violation {
                check: Check::Failed,
                seq: None,
                step: String::new(),
                at: "the first run".into(),
                message: format!("the operation ended {class}: {message}"),
            });
        }
        let expected: Vec<(i32, String, StepKind)> = completed(&journal);

        for (at, point) in crash_points(&timeline).into_iter().enumerate() {
            report.crash_points += 1;
            let label = point.describe(at);
            let memory = Arc::new(Memory::new(
                &world,
                Scenario {
                    journal: point.journal.clone(),
                    happened: point.happened.clone(),
                },
                &self.signals,
                false,
            ));
            let ended_again = self
                .drive(&world, &version, &memory, &services_for(&memory))
                .await;
            for mut v in memory.take_violations() {
                v.at = label.clone();
                report.note(v);
            }
            let (_, replayed) = memory.finish();
            if let End::Failed { class, message } = &ended_again {
                if class == "unknown_side_effect" {
                    // Named by the violation the context's fail-closed row produced below.
                    let row = replayed.iter().find(|r| r.status == StepStatus::Unknown);
                    report.note(Violation {
                        check: Check::NoReconcile,
                        seq: row.map(|r| r.seq),
                        step: row.map(|r| r.name.clone()).unwrap_or_default(),
                        at: label.clone(),
                        message: "an unsafe step a crash interrupted cannot be reconciled: the \
                                  operation would stop as unknown_side_effect and wait for a \
                                  human (give its tool a reconcile that asks the outside system \
                                  by the idempotency key, or make the step safe if repeating it \
                                  is harmless)"
                            .into(),
                    });
                    continue;
                }
                if class == "nondeterminism" {
                    report.note(Violation {
                        check: Check::Nondeterminism,
                        seq: None,
                        step: String::new(),
                        at: label.clone(),
                        message: message.clone(),
                    });
                    continue;
                }
            }
            let got = completed(&replayed);
            if got != expected {
                let diff = expected
                    .iter()
                    .zip(&got)
                    .find(|(a, b)| a != b)
                    .map(|(a, b)| {
                        (
                            a.0,
                            format!("{} ({})", a.1, a.2),
                            format!("{} ({})", b.1, b.2),
                        )
                    });
                let (seq, was, now) = diff.unwrap_or_else(|| {
                    let n = expected.len().min(got.len());
                    let name = |s: &[(i32, String, StepKind)]| {
                        s.get(n)
                            .map(|x| format!("{} ({})", x.1, x.2))
                            .unwrap_or_else(|| "nothing".into())
                    };
                    (n as i32, name(&expected), name(&got))
                });
                report.note(Violation {
                    check: Check::Nondeterminism,
                    seq: Some(seq),
                    step: was.clone(),
                    at: label.clone(),
                    message: format!(
                        "step {seq} was {was} in the first run but {now} after this crash: the \
                         steps depend on something the journal does not hold (the clock, a random \
                         number, a global); take it from a step (ctx.now, ctx.uuid, ctx.step)"
                    ),
                });
            }
            if ended_again.class() != ended.class() {
                report.note(Violation {
                    check: Check::Failed,
                    seq: None,
                    step: String::new(),
                    at: label.clone(),
                    message: format!("the first run {} but this one {}", ended, ended_again),
                });
            }
        }
        report
    }

    /// What a run's job context uses: the scripted model, the registry's tools with the fakes
    /// in their place, and `memory` for the journal.
    fn services(&self, memory: &Arc<Memory>) -> Arc<Services> {
        let mut tools = self.registry.tool_map();
        for (name, fake) in &self.fakes {
            tools.insert(
                name.clone(),
                Arc::new(BoundFake {
                    fake: fake.clone(),
                    memory: memory.clone(),
                }),
            );
        }
        let registry = self.registry.clone();
        let client: Arc<dyn ModelClient> = Arc::new(Scripted {
            script: self.model.clone(),
            memory: memory.clone(),
        });
        let gate = GateSettings {
            retries: 0,
            ..GateSettings::default()
        };
        Arc::new(Services {
            pool: self.pool.clone().unwrap_or_else(unreachable_pool),
            http_allow: Arc::new(self.http_allow.clone()),
            model: Arc::new(ModelGate::new(client, gate)),
            journal: GroupCommit::new(),
            check_child: Box::new(move |kind, input| registry.requires_or_why(kind, input)),
            tools,
            children: std::sync::OnceLock::new(),
            amqp_url: String::new(),
            names: agentq_core::broker::Names::new("replay-tester"),
            limits: Default::default(),
            counts: Default::default(),
            memory: Some(memory.clone() as Arc<dyn Store>),
        })
    }

    /// Runs the operation from `memory`'s journal to its end, through its parks and retries, as
    /// workers and the scheduler would.
    async fn drive(
        &self,
        world: &World,
        version: &str,
        memory: &Arc<Memory>,
        services: &Arc<Services>,
    ) -> End {
        drive(
            &self.registry,
            world,
            (&self.kind, version, &self.tenant),
            &self.input,
            memory,
            services,
            &self.children,
        )
        .await
    }
}

/// What every run of one test shares: the operation's id and the children it spawned.
struct World {
    op_id: OperationId,
    children: Arc<Mutex<BTreeMap<uuid::Uuid, (String, Value)>>>,
}

async fn drive(
    registry: &Registry,
    world: &World,
    (kind, version, tenant): (&str, &str, &str),
    input: &Value,
    memory: &Arc<Memory>,
    services: &Arc<Services>,
    children: &ChildFn,
) -> End {
    let Some(handler) = registry.handler(kind, version) else {
        return End::Failed {
            class: "non_retryable".into(),
            message: format!("no version {version:?} of kind {kind:?} is registered"),
        };
    };
    let (mut attempt, mut parks) = (1, 0);
    for epoch in 1.. {
        let info = OperationInfo {
            op_id: world.op_id,
            tenant: tenant.to_string(),
            kind: kind.to_string(),
            version: version.to_string(),
            attempt: attempt as i32,
            epoch,
            deadline: None,
        };
        let ctx = JobContext::new(
            info,
            services.clone(),
            memory.entries(),
            None,
            CancellationToken::new(),
            CancellationToken::new(),
            Arc::default(),
        );
        let outcome = AssertUnwindSafe(handler(ctx.clone(), input.clone()))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| Err(JobError::Panicked(panic_text(&panic))));
        let (rows, _) = ctx.take_pending();
        memory.write(rows);
        match outcome {
            Ok(v) => return End::Succeeded(v),
            Err(JobError::Suspended) if memory.stopped() => return End::ReachedEnd,
            Err(JobError::Suspended) => {
                parks += 1;
                if parks > MAX_PARKS {
                    return End::Failed {
                        class: "tester".into(),
                        message: format!("parked more than {MAX_PARKS} times"),
                    };
                }
                match ctx.take_suspend() {
                    None => memory.wake_sleeps(),
                    Some((_, Some(waiting))) if waiting == JOIN_WAIT => {
                        memory.decide_joins(&world.children, children)
                    }
                    Some((_, Some(signal))) => memory.decide_wait(&signal),
                    Some((_, None)) => memory.wake_sleeps(),
                }
            }
            Err(e) => {
                let class = e.class().to_string();
                let again = matches!(
                    e,
                    JobError::Retryable { .. }
                        | JobError::Overloaded { .. }
                        | JobError::NoEffect(_)
                        | JobError::Panicked(_)
                );
                if again && attempt < ATTEMPTS {
                    attempt += 1;
                    continue;
                }
                return End::Failed {
                    class,
                    message: e.to_string(),
                };
            }
        }
    }
    unreachable!("the loop returns")
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

/// A pool whose every connection fails at once: a kind that reads agentq's database needs
/// [`Tester::pool`].
fn unreachable_pool() -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(std::time::Duration::from_millis(200))
        .connect_lazy("postgres://replay-tester@127.0.0.1:1/no-database-in-the-replay-tester")
        .expect("a valid URL")
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Succeeded(Value),
    Failed {
        class: String,
        message: String,
    },
    /// [`replay_journal`]: the code agreed with the journal up to its end.
    ReachedEnd,
}

impl End {
    fn class(&self) -> &str {
        match self {
            End::Succeeded(_) => "succeeded",
            End::Failed { class, .. } => class,
            End::ReachedEnd => "reached_end",
        }
    }
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Succeeded(_) => f.write_str("succeeded"),
            End::Failed { class, message } => write!(f, "failed ({class}: {message})"),
            End::ReachedEnd => f.write_str("agreed with the journal to its end"),
        }
    }
}

/// What the tester checks; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Check {
    Nondeterminism,
    RanAgain,
    NoReconcile,
    Failed,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Check::Nondeterminism => "nondeterminism",
            Check::RanAgain => "ran again",
            Check::NoReconcile => "no reconcile",
            Check::Failed => "failed",
        })
    }
}

/// One thing a crash would break.
#[derive(Clone, Debug)]
pub struct Violation {
    pub check: Check,
    /// The step, where one is to blame.
    pub seq: Option<i32>,
    pub step: String,
    /// The crash point (or "the first run").
    pub at: String,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.seq {
            Some(seq) => write!(
                f,
                "[{}] step {seq} ({}) at {}: {}",
                self.check, self.step, self.at, self.message
            ),
            None => write!(f, "[{}] at {}: {}", self.check, self.at, self.message),
        }
    }
}

/// What [`Tester::run`] found.
#[derive(Clone, Debug)]
pub struct Report {
    /// How the first run ended.
    pub outcome: End,
    /// The first run's journal: seq, step name, step kind.
    pub steps: Vec<(i32, String, StepKind)>,
    /// Crash points the tester replayed from.
    pub crash_points: usize,
    /// What went wrong, one entry per check and step.
    pub violations: Vec<Violation>,
}

impl Report {
    fn broken(why: String) -> Self {
        Report {
            outcome: End::Failed {
                class: "tester".into(),
                message: why.clone(),
            },
            steps: Vec::new(),
            crash_points: 0,
            violations: vec![Violation {
                check: Check::Failed,
                seq: None,
                step: String::new(),
                at: "the start".into(),
                message: why,
            }],
        }
    }

    /// Keeps the first violation of each check and step.
    fn note(&mut self, v: Violation) {
        let seen = self
            .violations
            .iter()
            .any(|o| o.check == v.check && o.seq == v.seq && o.step == v.step);
        if !seen {
            self.violations.push(v);
        }
    }

    /// Whether nothing went wrong.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// The first run's output, if it succeeded.
    pub fn output(&self) -> Option<&Value> {
        match &self.outcome {
            End::Succeeded(v) => Some(v),
            _ => None,
        }
    }

    /// The violations of `check`.
    pub fn found(&self, check: Check) -> Vec<&Violation> {
        self.violations
            .iter()
            .filter(|v| v.check == check)
            .collect()
    }

    /// Panics with the report unless nothing went wrong.
    #[track_caller]
    pub fn assert_ok(&self) {
        assert!(self.is_ok(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.violations.len();
        writeln!(
            f,
            "replay tester: {} steps, {}, {} crash points replayed, {n} {}",
            self.steps.len(),
            self.outcome,
            self.crash_points,
            if n == 1 { "problem" } else { "problems" }
        )?;
        for v in &self.violations {
            writeln!(f, "  {v}")?;
        }
        Ok(())
    }
}

/// The completed steps of a journal, in order.
fn completed(journal: &[StepWrite]) -> Vec<(i32, String, StepKind)> {
    journal
        .iter()
        .filter(|r| r.status == StepStatus::Completed)
        .map(|r| (r.seq, r.name.clone(), r.kind))
        .collect()
}

/// A point of the first run where a crash can hit: the journal as the last durable write left
/// it, and the effects that had happened by then.
#[derive(Clone, Debug)]
struct CrashPoint {
    journal: Vec<StepWrite>,
    happened: HashMap<String, Value>,
    /// The last thing that happened before it.
    after: String,
}

impl CrashPoint {
    fn describe(&self, n: usize) -> String {
        format!("crash point {} ({})", n + 1, self.after)
    }
}

/// What the first run did, in order.
#[derive(Clone, Debug)]
enum Event {
    /// A durable write: the journal after it.
    Durable(Vec<StepWrite>),
    /// An effect: its idempotency key, its step, and what it answered.
    Effect {
        key: String,
        step: String,
        output: Value,
    },
}

/// Every point of `timeline` where a crash leaves a different state: before anything, after
/// each durable write, and after each effect.
fn crash_points(timeline: &[Event]) -> Vec<CrashPoint> {
    let mut points = vec![CrashPoint {
        journal: Vec::new(),
        happened: HashMap::new(),
        after: "before the first step".into(),
    }];
    let mut journal: Vec<StepWrite> = Vec::new();
    let mut happened: HashMap<String, Value> = HashMap::new();
    for event in timeline {
        let after = match event {
            Event::Durable(j) => {
                journal = j.clone();
                match j.last() {
                    Some(r) => {
                        format!("after step {} ({}) was written {}", r.seq, r.name, r.status)
                    }
                    None => "after a write".into(),
                }
            }
            Event::Effect { key, step, output } => {
                happened.insert(key.clone(), output.clone());
                format!("after the effect of {step}, before its journal write")
            }
        };
        let point = CrashPoint {
            journal: journal.clone(),
            happened: happened.clone(),
            after,
        };
        let same = points
            .last()
            .is_some_and(|p| same_rows(&p.journal, &point.journal) && p.happened == point.happened);
        if !same {
            points.push(point);
        }
    }
    points
}

/// Whether two journals hold the same rows (position, step, status, output).
fn same_rows(a: &[StepWrite], b: &[StepWrite]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (x.seq, &x.name, x.status, &x.output) == (y.seq, &y.name, y.status, &y.output)
        })
}

/// Where a run starts from: the journal and the effects a crash left.
#[derive(Default)]
struct Scenario {
    journal: Vec<StepWrite>,
    happened: HashMap<String, Value>,
}

/// The in-memory stand-in for an operation's rows in PostgreSQL during one run of the tester
/// (the journal, its waits and joins), which also watches every step and effect.
struct Memory {
    op_id: OperationId,
    /// Every child spawned in any run, by id: its kind and input.
    children: Arc<Mutex<BTreeMap<uuid::Uuid, (String, Value)>>>,
    state: Mutex<MemoryState>,
}

struct MemoryState {
    journal: BTreeMap<i32, StepWrite>,
    /// The first run records its timeline; replays check theirs against the scenario.
    recording: bool,
    timeline: Vec<Event>,
    /// Effects that happened before the crash (a replay), or so far (the first run).
    happened: HashMap<String, Value>,
    violations: Vec<Violation>,
    /// The kind of each step asked for at a position this run.
    seen: BTreeMap<i32, StepKind>,
    /// The model step running now.
    model_at: Option<i32>,
    /// The tool step running now.
    tool_step: String,
    /// The signals still to deliver, per name.
    signals: HashMap<String, VecDeque<Value>>,
    /// Waits (by seq) decided since they parked: their journaled output.
    waits: HashMap<i32, Value>,
    /// Joins (by seq) decided since they parked: the outcomes of their children.
    joins: HashMap<i32, Value>,
    /// [`replay_journal`]: stop where the code asks for a step past the journal's end.
    stop_at_end: bool,
    stopped: bool,
}

impl Memory {
    fn new(
        world: &World,
        scenario: Scenario,
        signals: &[(String, Value)],
        recording: bool,
    ) -> Self {
        let journal: BTreeMap<i32, StepWrite> =
            scenario.journal.into_iter().map(|r| (r.seq, r)).collect();
        // Signals consumed by waits the journal already completed are gone.
        let mut consumed: HashMap<&str, usize> = HashMap::new();
        for r in journal.values() {
            let payload = r.output.as_ref().and_then(|o| o.get("payload"));
            if r.kind == StepKind::Signal && r.status == StepStatus::Completed && payload.is_some()
            {
                let name = r.name.strip_prefix("signal:").unwrap_or(&r.name);
                *consumed.entry(name).or_default() += 1;
            }
        }
        let mut queues: HashMap<String, VecDeque<Value>> = HashMap::new();
        for (name, payload) in signals {
            let skip = consumed.get(name.as_str()).copied().unwrap_or(0);
            let queue = queues.entry(name.clone()).or_default();
            queue.push_back(payload.clone());
            if queue.len() <= skip {
                queue.pop_front();
                *consumed.get_mut(name.as_str()).expect("counted") -= 1;
            }
        }
        Self {
            op_id: world.op_id,
            children: world.children.clone(),
            state: Mutex::new(MemoryState {
                journal,
                recording,
                timeline: Vec::new(),
                happened: scenario.happened,
                violations: Vec::new(),
                seen: BTreeMap::new(),
                model_at: None,
                tool_step: String::new(),
                signals: queues,
                waits: HashMap::new(),
                joins: HashMap::new(),
                stop_at_end: false,
                stopped: false,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.state.lock().expect("replay tester state")
    }

    /// The journal as a claim loads it.
    fn entries(&self) -> Vec<JournalEntry> {
        self.state()
            .journal
            .values()
            .map(|r| JournalEntry {
                seq: r.seq,
                name: r.name.clone(),
                kind: r.kind,
                replay: r.replay,
                status: r.status,
                output: r.output.clone(),
                error: r.error.clone(),
                wake_at: r.wake_at,
            })
            .collect()
    }

    /// The scheduler's wake-up of a sleep: its wake time has come.
    fn wake_sleeps(&self) {
        let mut st = self.state();
        let past = Utc::now() - chrono::Duration::seconds(1);
        for r in st.journal.values_mut() {
            if r.kind == StepKind::Sleep && r.status == StepStatus::Started {
                r.wake_at = Some(past);
            }
        }
    }

    /// A parked wait on `signal` gets the next scripted payload, or times out.
    fn decide_wait(&self, signal: &str) {
        let mut st = self.state();
        let step = format!("signal:{signal}");
        let parked: Vec<i32> = st
            .journal
            .values()
            .filter(|r| {
                r.kind == StepKind::Signal && r.status == StepStatus::Started && r.name == step
            })
            .map(|r| r.seq)
            .collect();
        for seq in parked {
            let output = match st.signals.get_mut(signal).and_then(VecDeque::pop_front) {
                Some(payload) => json!({ "payload": payload, "sent_by": "replay-tester" }),
                None => json!({ "timed_out": true }),
            };
            st.waits.insert(seq, output);
        }
    }

    /// A parked join: every child it names ends as `outcome` says.
    fn decide_joins(
        &self,
        children: &Mutex<BTreeMap<uuid::Uuid, (String, Value)>>,
        outcome: &ChildFn,
    ) {
        let mut st = self.state();
        let parked: Vec<i32> = st
            .journal
            .values()
            .filter(|r| r.kind == StepKind::Join && r.status == StepStatus::Started)
            .map(|r| r.seq)
            .collect();
        // The children of this operation, in spawn order.
        let spawned: Vec<(uuid::Uuid, String)> = st
            .journal
            .values()
            .filter(|r| r.kind == StepKind::Spawn && r.status == StepStatus::Completed)
            .filter_map(|r| {
                let id = r.output.as_ref()?.as_str()?.parse().ok()?;
                Some((id, r.name.trim_start_matches("spawn:").to_string()))
            })
            .collect();
        let known = children.lock().expect("children");
        for seq in parked {
            let outcomes: Vec<ChildOutcome> = spawned
                .iter()
                .map(|(id, kind)| {
                    let input = known.get(id).map(|(_, i)| i.clone()).unwrap_or(Value::Null);
                    let (status, result, error_class, error_message) = match outcome(kind, &input) {
                        ChildEnd::Succeeded(v) => (Status::Succeeded, Some(v), None, None),
                        ChildEnd::Dead { class, message } => {
                            (Status::Dead, None, Some(class), Some(message))
                        }
                    };
                    ChildOutcome {
                        op_id: *id,
                        kind: kind.clone(),
                        status,
                        result,
                        error_class,
                        error_message,
                    }
                })
                .collect();
            st.joins
                .insert(seq, serde_json::to_value(outcomes).unwrap_or(Value::Null));
        }
    }

    /// The model step running now: its number among the operation's model steps.
    fn model_step(&self) -> usize {
        let st = self.state();
        let Some(at) = st.model_at else { return 0 };
        let recorded = st
            .journal
            .values()
            .filter(|r| r.seq < at && r.kind == StepKind::Model)
            .map(|r| r.seq);
        let seen = st
            .seen
            .iter()
            .filter(|(s, k)| **s < at && **k == StepKind::Model)
            .map(|(s, _)| *s);
        recorded.chain(seen).collect::<HashSet<i32>>().len()
    }

    fn stopped(&self) -> bool {
        self.state().stopped
    }

    fn take_violations(&self) -> Vec<Violation> {
        std::mem::take(&mut self.state().violations)
    }

    /// The timeline (first run) and the journal at the end.
    fn finish(&self) -> (Vec<Event>, Vec<StepWrite>) {
        let mut st = self.state();
        let timeline = std::mem::take(&mut st.timeline);
        (timeline, st.journal.values().cloned().collect())
    }
}

impl Store for Memory {
    /// A durable write of the journal (a flush, a suspend, the outcome's rows).
    fn write(&self, rows: Vec<StepWrite>) {
        if rows.is_empty() {
            return;
        }
        let mut st = self.state();
        for r in rows {
            st.journal.insert(r.seq, r);
        }
        if st.recording {
            let snapshot = st.journal.values().cloned().collect();
            st.timeline.push(Event::Durable(snapshot));
        }
    }

    /// A step about to run its body (or a park about to be recorded) at `seq`.
    fn step_runs(
        &self,
        seq: i32,
        name: &str,
        kind: StepKind,
        replay: Replay,
    ) -> Result<(), JobError> {
        let mut st = self.state();
        if st.stop_at_end {
            st.stopped = true;
            return Err(JobError::Suspended);
        }
        st.seen.insert(seq, kind);
        st.model_at = (kind == StepKind::Model).then_some(seq);
        if kind == StepKind::Custom && replay == Replay::Unsafe {
            // An unsafe step's body is its effect.
            let key = step_idempotency_key(self.op_id, seq, name);
            st.check_not_again(Some(seq), name, &key);
            st.effect(name, &key, Value::Null);
        }
        Ok(())
    }

    /// A recovery about to ask a tool whether an unsafe call happened.
    fn before_reconcile(&self) -> Result<(), JobError> {
        let mut st = self.state();
        if st.stop_at_end {
            // Asking would reach the outside system: the journal replay stops here.
            st.stopped = true;
            return Err(JobError::Suspended);
        }
        Ok(())
    }

    /// An unsafe or safe tool about to be called with the step's key.
    fn tool_called(&self, key: &str, name: &str, replay: Replay) -> Result<(), JobError> {
        let mut st = self.state();
        if replay == Replay::Unsafe {
            let seq = st.seen.keys().next_back().copied();
            st.check_not_again(seq, name, key);
        }
        st.tool_step = name.to_string();
        Ok(())
    }

    /// A tool call returned `output`: its effect happened.
    fn tool_done(&self, key: &str, output: &Value) {
        let mut st = self.state();
        let name = std::mem::take(&mut st.tool_step);
        st.effect(&name, key, output.clone());
    }

    /// A child spawned with the step's key: its id, the same in every run.
    fn spawn(&self, key: &str, kind: &str, input: &Value) -> uuid::Uuid {
        let id = child_id(key);
        self.children
            .lock()
            .expect("children")
            .insert(id, (kind.to_string(), input.clone()));
        id
    }

    /// Decides a wait as `db::timers::resolve_wait` does: a decision made since it parked
    /// completes its step (durably, with the decision as output).
    fn resolve_wait(
        &self,
        seq: i32,
        _name: &str,
        _deadline: chrono::DateTime<Utc>,
    ) -> db::timers::Wait {
        let mut st = self.state();
        if st.stop_at_end {
            st.stopped = true;
            return db::timers::Wait::Pending;
        }
        match st.waits.remove(&seq) {
            Some(output) => {
                st.complete(seq, output.clone());
                db::timers::Wait::Resolved(output)
            }
            None => db::timers::Wait::Pending,
        }
    }

    /// Decides a join as `db::children::resolve_join` does.
    fn resolve_join(&self, seq: i32, _ids: &[uuid::Uuid]) -> db::children::Join {
        let mut st = self.state();
        if st.stop_at_end {
            st.stopped = true;
            return db::children::Join::Pending;
        }
        match st.joins.remove(&seq) {
            Some(output) => {
                st.complete(seq, output.clone());
                db::children::Join::Resolved(output)
            }
            None => db::children::Join::Pending,
        }
    }
}

impl MemoryState {
    /// Notes a violation if the unsafe effect `key` had happened before the crash this run
    /// started from.
    fn check_not_again(&mut self, seq: Option<i32>, name: &str, key: &str) {
        if self.recording || !self.happened.contains_key(key) {
            return;
        }
        self.violations.push(Violation {
            check: Check::RanAgain,
            seq,
            step: name.to_string(),
            at: String::new(),
            message: format!(
                "its unsafe effect (idempotency key {key}) had happened before the crash and \
                 happened again: the effect would happen twice (a reconcile must find it by the \
                 key, and nothing unsafe may run outside a step)"
            ),
        });
    }

    fn effect(&mut self, name: &str, key: &str, output: Value) {
        if self.recording {
            self.timeline.push(Event::Effect {
                key: key.to_string(),
                step: if name.is_empty() {
                    "a tool call".into()
                } else {
                    name.to_string()
                },
                output: output.clone(),
            });
        }
        self.happened.insert(key.to_string(), output);
    }

    /// Completes the parked step `seq` with `output`, durably.
    fn complete(&mut self, seq: i32, output: Value) {
        if let Some(r) = self.journal.get_mut(&seq) {
            r.status = StepStatus::Completed;
            r.output = Some(output);
            r.completed_at = Some(Utc::now());
        }
        if self.recording {
            let snapshot = self.journal.values().cloned().collect();
            self.timeline.push(Event::Durable(snapshot));
        }
    }
}

/// A spawned child's id: derived from the spawn step's key, so every run spawns the same one.
fn child_id(key: &str) -> uuid::Uuid {
    let digest = Sha256::digest(key.as_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_random_bytes(bytes).into_uuid()
}

/// A fake tool bound to one run's memory, so its reconcile sees that run's scenario.
struct BoundFake {
    fake: FakeTool,
    memory: Arc<Memory>,
}

#[async_trait]
impl Tool for BoundFake {
    fn name(&self) -> &str {
        &self.fake.name
    }

    fn replay(&self) -> Replay {
        self.fake.replay
    }

    fn requires_approval(&self) -> bool {
        self.fake.approval
    }

    async fn call(&self, _cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
        Ok((self.fake.respond)(args))
    }

    async fn reconcile(&self, cx: &ToolContext<'_>, _args: &Value) -> Result<Reconciled, JobError> {
        if !self.fake.reconciles {
            return Ok(Reconciled::Unsupported);
        }
        let st = self.memory.state();
        Ok(match st.happened.get(cx.idempotency_key()) {
            Some(output) => Reconciled::Happened(output.clone()),
            None => Reconciled::NotHappened,
        })
    }
}

/// The scripted model of one run.
struct Scripted {
    script: ModelScript,
    memory: Arc<Memory>,
}

#[async_trait]
impl ModelClient for Scripted {
    fn provider(&self) -> &str {
        "replay-tester"
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelResponse, ModelError> {
        let n = self.memory.model_step();
        match &self.script {
            ModelScript::Replies(replies) => {
                replies
                    .get(n)
                    .or(replies.last())
                    .cloned()
                    .ok_or_else(|| ModelError::NonRetryable {
                        message: "the model script has no replies".into(),
                    })
            }
            ModelScript::Function(f) => Ok(f(request, n)),
            ModelScript::Echo => crate::model::LocalModel.complete(request).await,
        }
    }
}

/// Reads the journal `agentq steps OP --json` printed (JSON Lines of steps), for
/// [`replay_journal`].
pub fn journal_from_steps(jsonl: &str) -> Result<Vec<JournalEntry>, String> {
    let mut steps = Vec::new();
    for (n, line) in jsonl.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        steps
            .push(serde_json::from_str::<StepView>(line).map_err(|e| {
                format!("line {}: not a step of `agentq steps --json`: {e}", n + 1)
            })?);
    }
    Ok(journal_from_views(steps))
}

/// An operation's journal as its steps are shown (`GET /v1/operations/{id}/steps`), as a claim
/// loads it.
pub fn journal_from_views(steps: Vec<StepView>) -> Vec<JournalEntry> {
    let mut entries: Vec<JournalEntry> = steps
        .into_iter()
        .map(|step| JournalEntry {
            seq: step.seq,
            name: step.name,
            kind: step.kind,
            replay: step.replay,
            status: step.status,
            output: step.output,
            error: step.error,
            wake_at: step.wake_at,
        })
        .collect();
    entries.sort_by_key(|e| e.seq);
    entries
}

/// What [`replay_journal`] found.
#[derive(Clone, Debug)]
pub struct JournalReplay {
    /// Journal rows the code read back.
    pub steps: usize,
    /// How the replay ended: [`End::ReachedEnd`] when the code agreed with the journal up to
    /// its end (or finished), a failure naming the first step it asks for differently.
    pub outcome: End,
}

impl JournalReplay {
    /// Whether the code replays the journal without diverging.
    pub fn agrees(&self) -> bool {
        matches!(self.outcome, End::ReachedEnd | End::Succeeded(_))
    }
}

/// Replays an operation's journal (`journal`, e.g. from [`journal_from_steps`]) against
/// `version` of `kind` in `registry` with `input`, as a worker running this code would after
/// a deploy, stopping where the code asks for a step the journal does not hold yet: nothing is
/// called, nothing written. A step asked for differently than recorded is `nondeterminism`:
/// bump the kind's version, or use `ctx.patched`.
pub async fn replay_journal(
    registry: &Registry,
    kind: &str,
    version: &str,
    input: Value,
    journal: Vec<JournalEntry>,
) -> JournalReplay {
    replay_operation(
        registry,
        uuid::Uuid::new_v4(),
        kind,
        version,
        input,
        journal,
    )
    .await
}

/// [`replay_journal`] for the operation `op_id` (its id as [`JobContext::info`] shows it to the
/// kind, and in its steps' idempotency keys).
pub async fn replay_operation(
    registry: &Registry,
    op_id: uuid::Uuid,
    kind: &str,
    version: &str,
    input: Value,
    journal: Vec<JournalEntry>,
) -> JournalReplay {
    let steps = journal.len();
    let world = World {
        op_id: OperationId(op_id),
        children: Arc::new(Mutex::new(BTreeMap::new())),
    };
    let rows = journal
        .into_iter()
        .map(|e| StepWrite {
            seq: e.seq,
            idempotency_key: step_idempotency_key(world.op_id, e.seq, &e.name),
            name: e.name,
            kind: e.kind,
            replay: e.replay,
            status: e.status,
            output: e.output,
            error: e.error,
            started_at: Utc::now(),
            completed_at: None,
            usage: None,
            wake_at: e.wake_at,
        })
        .collect();
    let memory = Arc::new(Memory::new(
        &world,
        Scenario {
            journal: rows,
            happened: HashMap::new(),
        },
        &[],
        false,
    ));
    memory.state().stop_at_end = true;
    let tester = Tester::new(registry, kind, input.clone());
    let services = tester.services(&memory);
    let outcome = drive(
        registry,
        &world,
        (kind, version, "replay"),
        &input,
        &memory,
        &services,
        &tester.children,
    )
    .await;
    JournalReplay { steps, outcome }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ids_follow_the_spawn_key() {
        assert_eq!(child_id("k"), child_id("k"));
        assert_ne!(child_id("k"), child_id("l"));
    }
}
