//! The replay tester: checks a kind against every crash it can meet, without PostgreSQL or
//! RabbitMQ.
//!
//! [`Tester::run`] runs a kind to completion on an in-memory journal, against a scripted model
//! ([`ModelScript`]) and fake tools ([`FakeTool`]), delivering scripted signals and child
//! outcomes when it parks. It records every durable write of the journal and every effect (a
//! tool call, an unsafe step's body). Then it crashes it at every one of those points: for each,
//! it runs the kind again as an operation of its own (its own idempotency keys, so the outside
//! systems a real tool or step reaches hold only that timeline's effects) up to the point, drops
//! everything after it as a crash would, and runs it from what the crash left to the end. A
//! [`Report`] lists what went wrong, naming the step:
//!
//! - **nondeterminism**: a run asked for other steps than the first (a name or a branch that
//!   depends on something the journal does not hold: the clock, a random number, a global);
//! - **ran again**: an unsafe effect happened twice for one idempotency key, because a crash
//!   hit after it and the step ran again (a reconcile that said "not happened", an effect
//!   made outside the journal);
//! - **no reconcile**: an unsafe step a crash interrupted cannot be reconciled, so the
//!   operation would stop as `unknown_side_effect` and wait for a human;
//! - **wrong reconcile**: a reconcile answered "happened" when, in its timeline, the crash came
//!   before the effect (its body never began), or answered with another output than the
//!   effect's (a body that began and failed may have made its effect: either answer is right);
//! - **failed**: a run ended otherwise than the first (a panic, an error).
//!
//! [`Report::assert_ok`] also fails a first run that failed. What the tester cannot see: an
//! effect made outside a step (nothing records it), and a reconcile that is right only for the
//! keys it has seen (it is asked once per crash point, each with a fresh key).
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
//!     ctx.step("notify", || async { Ok(json!("sent")) }).await?;
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
//!
//! Its parts: the stand-ins a run uses in place of the outside world (`fakes`: the scripted
//! model, fake tools), the in-memory journal store that also watches every step and effect
//! (`memory`), the runs themselves (`run`: the first run, then one from each crash point,
//! through parks and retries), the crash points of a timeline (`crash`), what is reported
//! ([`Report`], [`Violation`], [`End`]), and the replay of an exported journal
//! (`replay`: [`replay_journal`]).

mod crash;
mod fakes;
mod memory;
mod replay;
mod report;
mod run;

use std::collections::BTreeMap;
use std::sync::Arc;

use agentq_core::origins::Origins;
use serde_json::Value;
use sqlx::PgPool;

use crate::served::{ServedKinds, Serves};

pub use fakes::{FakeTool, ModelFn, ModelScript};
pub use replay::{
    JournalReplay, journal_from_steps, journal_from_views, replay_journal, replay_operation,
};
pub use report::{Check, End, Report, Violation};

/// How a child operation ends, for [`Tester::children`].
#[derive(Clone, Debug, PartialEq)]
pub enum ChildEnd {
    Succeeded(Value),
    Dead { class: String, message: String },
}

type ChildFn = Arc<dyn Fn(&str, &Value) -> ChildEnd + Send + Sync>;

/// Runs a kind once, then from every crash point of that run (see the module docs).
pub struct Tester {
    kinds: ServedKinds,
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
    /// A tester of `kind` (its newest version in `registry`, a [`Registry`](crate::Registry))
    /// with `input`. The model is the built-in echo until [`Tester::model`] scripts it; tools
    /// are the registry's until [`Tester::fake_tool`] replaces them.
    pub fn new(registry: &impl Serves, kind: &str, input: Value) -> Self {
        Self {
            kinds: registry.served(),
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

    /// The engine's pool, for agentq's built-in kinds and tools that read their own tables
    /// ([`EnginePool`](crate::EnginePool)); a deployment's kinds are given theirs with
    /// [`Registry::provide`](crate::Registry::provide). Without one, the runs have no
    /// `EnginePool`.
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The origins a kind's outbound calls may reach ([`JobContext::http_allow`](crate::JobContext::http_allow)).
    pub fn http_allow(mut self, origins: Origins) -> Self {
        self.http_allow = origins;
        self
    }
}
