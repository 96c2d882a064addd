//! The tester's runs: the first run of a kind, then one from each crash point of it, each
//! driven to its end through its parks and retries as workers and the scheduler would, and
//! compared with the first ([`Tester::run`]).

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use agentq_core::operation::{JOIN_WAIT, OperationId};
use agentq_core::state::{StepKind, StepStatus};
use futures_util::FutureExt;
use serde_json::Value;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::crash::{completed, crash_points};
use super::fakes::{BoundFake, Scripted};
use super::memory::{Memory, Scenario};
use super::report::{Check, End, Report, Violation};
use super::{ChildFn, Tester};
use crate::context::store::Store;
use crate::context::{JobRun, OperationInfo, Services};
use crate::error::{Engine, JobError, Stop};
use crate::gate::{GateSettings, ModelGate};
use crate::model::ModelClient;
use crate::served::ServedKinds;
use agentq_core::group_commit::GroupCommit;

/// Attempts a run gets for retryable failures before the tester takes the failure as its end.
const ATTEMPTS: u32 = 5;

/// Parks a run may go through before the tester gives up on it (a kind that waits forever).
const MAX_PARKS: u32 = 1_000;

impl Tester {
    /// Runs the kind to its end, then again from every crash point of that run; see [`Report`].
    pub async fn run(self) -> Report {
        let version = match self
            .version
            .clone()
            .or_else(|| self.kinds.newest(&self.kind))
        {
            Some(v) => v,
            None => {
                return Report::broken(format!(
                    "kind {:?} is not registered: the registry holds {}",
                    self.kind,
                    self.kinds.kind_names().join(", ")
                ));
            }
        };
        if let Err(e) = self.kinds.check_input(&self.kind, &self.input) {
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
            waits: super::crash::waits(&timeline),
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
            // Each timeline is an operation of its own, run for real up to its crash point:
            // the outside systems its effects reach hold this timeline's effects under its own
            // keys, so what a reconcile answers can be checked against what happened in it.
            let timeline_world = World {
                op_id: OperationId(uuid::Uuid::new_v4()),
                children: world.children.clone(),
            };
            let prefix = Arc::new(Memory::new(
                &timeline_world,
                Scenario::default(),
                &self.signals,
                true,
            ));
            prefix.crash_after(point.events);
            self.drive(&timeline_world, &version, &prefix, &services_for(&prefix))
                .await;
            // A run that ended before its crash point took another path than the first (the
            // replay below finds why): replay the first run's journal instead.
            let (world_at, scenario) = if prefix.crashed() {
                (&timeline_world, prefix.left())
            } else {
                let first_run = Scenario {
                    journal: point.journal.clone(),
                    happened: point.happened.clone(),
                    began: Default::default(),
                };
                (&world, first_run)
            };
            let memory = Arc::new(Memory::new(world_at, scenario, &self.signals, false));
            let ended_again = self
                .drive(world_at, &version, &memory, &services_for(&memory))
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
    pub(super) fn services(&self, memory: &Arc<Memory>) -> Arc<Services> {
        let mut tools = self.kinds.registry().tool_map();
        for (name, fake) in &self.fakes {
            tools.insert(
                name.clone(),
                Arc::new(BoundFake {
                    fake: fake.clone(),
                    memory: memory.clone(),
                }),
            );
        }
        let kinds = self.kinds.clone();
        let client: Arc<dyn ModelClient> = Arc::new(Scripted {
            script: self.model.clone(),
            memory: memory.clone(),
        });
        let gate = GateSettings {
            retries: 0,
            ..GateSettings::default()
        };
        let pool = self.pool.clone().unwrap_or_else(unreachable_pool);
        Arc::new(Services {
            call_limits: Arc::new(crate::limits::CallLimits::none(pool.clone())),
            pool,
            http_allow: Arc::new(self.http_allow.clone()),
            model: Arc::new(ModelGate::new(client, gate)),
            journal: GroupCommit::new(),
            check_child: Box::new(move |kind, input| kinds.requires_or_why(kind, input)),
            tools,
            provided: {
                let mut provided = self.kinds.registry().provided();
                if let Some(pool) = &self.pool {
                    provided.insert(crate::EnginePool(pool.clone()));
                }
                provided
            },
            children: std::sync::OnceLock::new(),
            amqp_url: String::new(),
            names: agentq_core::broker::Names::new("replay-tester"),
            limits: Default::default(),
            counts: Default::default(),
            remote_memory: Arc::new(crate::remote_memory::Memory::new(
                crate::context::JobLimits::default().remote_journal_memory,
            )),
            store: memory.clone() as Arc<dyn Store>,
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
            &self.kinds,
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
pub(super) struct World {
    pub(super) op_id: OperationId,
    pub(super) children: Arc<Mutex<BTreeMap<uuid::Uuid, (String, Value)>>>,
}

pub(super) async fn drive(
    kinds: &ServedKinds,
    world: &World,
    (kind, version, tenant): (&str, &str, &str),
    input: &Value,
    memory: &Arc<Memory>,
    services: &Arc<Services>,
    children: &ChildFn,
) -> End {
    let Some(handler) = kinds.handler(kind, version) else {
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
        let ctx = JobRun::new(
            info,
            services.clone(),
            memory.entries(),
            Default::default(),
            CancellationToken::new(),
            CancellationToken::new(),
            Arc::default(),
        );
        let outcome = AssertUnwindSafe(handler.call(ctx.clone(), input.clone()))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| Err(JobError::from(Engine::Panicked(panic_text(&panic)))));
        let (rows, _) = ctx.take_pending();
        memory.keep(rows);
        match outcome {
            Ok(v) => return End::Succeeded(v),
            Err(JobError::Stopped(Stop(Engine::Suspended))) if memory.stopped() => {
                return End::ReachedEnd;
            }
            Err(JobError::Stopped(Stop(Engine::Suspended))) => {
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
                        | JobError::Stopped(Stop(Engine::Overloaded { .. }))
                        | JobError::NoEffect(_)
                        | JobError::Stopped(Stop(Engine::Panicked(_)))
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
