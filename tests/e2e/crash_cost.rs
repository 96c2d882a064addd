//! What a crash costs: a step that finished is never paid for twice.
//!
//! Real worker processes run many operations against the fake provider (with latency per
//! call) and are SIGKILLed at random points, again and again. The provider checks every
//! request against the journal as it arrives, which needs no timing assumption:
//! - every earlier step of the operation is already committed (`completed`): a step is durable
//!   before the next one starts;
//! - the step asked for now is not committed: a journaled model call is never sent again.
//!
//! After each kill the test also snapshots the committed journal; at the end every row of
//! every snapshot still has the epoch it had (it was never re-run), and usage counts each
//! journaled model call once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_core::Lane;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

use crate::fake_model::{FakeModel, Hook, Mode, assistant_turns, last_user};
use crate::harness::{DEADLINE, TestApp};

/// Longer than the shared [`DEADLINE`], for the waits that span killed workers: each one's
/// operations run again only once their leases have run out.
const CRASH_DEADLINE: Duration = Duration::from_secs(120);
const KILLS: usize = 5;

/// A small deterministic generator (xorshift), seeded from the clock and printed, so a failing
/// run's kill points can be replayed by setting `AGENTQ_TEST_SEED`.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn from_env_or_clock() -> Self {
        let seed = std::env::var("AGENTQ_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            })
            | 1;
        eprintln!("kill points seed: AGENTQ_TEST_SEED={seed}");
        Self(seed)
    }
    /// Uniform in `lo..=hi`.
    pub(crate) fn between(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + self.0 % (hi - lo + 1)
    }
}

/// What the provider saw: requests per (operation, step seq), and the journal rules broken.
#[derive(Default)]
pub(crate) struct Seen {
    pub(crate) sent: HashMap<(Uuid, i32), usize>,
    pub(crate) violations: Vec<String>,
}

/// Checks a model request for step `seq` of `op` against the committed journal, and counts it.
pub(crate) async fn check_request(pool: &PgPool, seen: &Mutex<Seen>, op: Uuid, seq: i32) {
    let rows: Vec<(i32, String)> =
        sqlx::query_as("SELECT seq, status FROM operation_steps WHERE op_id = $1 ORDER BY seq")
            .bind(op)
            .fetch_all(pool)
            .await
            .unwrap();
    let completed: HashSet<i32> = rows
        .iter()
        .filter(|(_, s)| s == "completed")
        .map(|(q, _)| *q)
        .collect();
    let mut seen = seen.lock().unwrap();
    *seen.sent.entry((op, seq)).or_default() += 1;
    if let Some(missing) = (0..seq).find(|s| !completed.contains(s)) {
        seen.violations.push(format!(
            "{op}: step {seq} was sent while step {missing} was not durable"
        ));
    }
    if completed.contains(&seq) {
        seen.violations.push(format!(
            "{op}: step {seq} was journaled completed and sent again"
        ));
    }
}

/// Committed journal rows (op, seq) → epoch.
pub(crate) async fn committed(pool: &PgPool) -> HashMap<(Uuid, i32), i64> {
    let rows: Vec<(Uuid, i32, i64)> =
        sqlx::query_as("SELECT op_id, seq, epoch FROM operation_steps WHERE status = 'completed'")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().map(|(o, s, e)| ((o, s), e)).collect()
}

/// Runs the workload through `KILLS` SIGKILLed workers at random points, then a last worker
/// to the end; returns the journal snapshots taken right after each kill. Each worker is
/// killed after `first_kill` to `first_kill + 16` further model calls.
async fn kill_repeatedly(
    app: &mut TestApp,
    fake: &FakeModel,
    ops: &[Uuid],
    rng: &mut Rng,
    first_kill: u64,
) -> Vec<HashMap<(Uuid, i32), i64>> {
    app.spawn(&["scheduler"]);
    let mut snapshots = Vec::new();
    for kill in 0..KILLS {
        let w = app.spawn(&["worker"]);
        // A random point: after a random number of further model calls, then a random part of
        // one call (a delay that picks the point; nothing waits on it).
        let target = fake.requests() + rng.between(first_kill, first_kill + 16) as usize;
        app.wait_for(
            &format!("model calls before kill {kill}"),
            CRASH_DEADLINE,
            || async { fake.requests() >= target },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.between(0, 200))).await;
        app.kill(w);
        snapshots.push(committed(&app.pool).await);
    }
    app.spawn(&["worker"]);
    for op in ops {
        app.wait_status(&op.to_string(), "succeeded", CRASH_DEADLINE)
            .await;
    }
    snapshots
}

/// Every row of every snapshot is still there with the same epoch: never re-run.
fn assert_kept(snapshots: &[HashMap<(Uuid, i32), i64>], last: &HashMap<(Uuid, i32), i64>) {
    let mut kept = 0;
    for (k, snap) in snapshots.iter().enumerate() {
        for (row, epoch) in snap {
            assert_eq!(
                last.get(row),
                Some(epoch),
                "step {row:?} was committed at epoch {epoch} before kill {k}, then re-run"
            );
            kept += 1;
        }
    }
    assert!(kept > 0, "no snapshot held a committed step");
}

/// A test world with short leases, room for every kill to hit the same operation, and the
/// fake provider as the model.
async fn crash_app(fake: &FakeModel) -> TestApp {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_LEASE_TTL_SECS", "3");
    app.set_env("AGENTQ_RESTART_LIMIT", "20");
    // Eight at a time, so a kill after a few calls finds operations at every stage.
    app.set_env("AGENTQ_CONCURRENCY_INTERACTIVE", "8");
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app
}

/// A hook mapping a request to (operation, step seq) by `locate` and checking it.
fn hook(
    pool: PgPool,
    seen: Arc<Mutex<Seen>>,
    locate: impl Fn(&Value) -> Option<(Uuid, i32)> + Send + Sync + 'static,
) -> Hook {
    let locate = Arc::new(locate);
    Arc::new(move |body: Value| {
        let (pool, seen, locate) = (pool.clone(), seen.clone(), locate.clone());
        Box::pin(async move {
            match locate(&body) {
                Some((op, seq)) => check_request(&pool, &seen, op, seq).await,
                None => seen
                    .lock()
                    .unwrap()
                    .violations
                    .push(format!("a request for no known operation: {body}")),
            }
        })
    })
}

#[tokio::test]
async fn sigkilled_agents_never_resend_a_finished_turn() {
    const AGENTS: usize = 24;
    const TURNS: usize = 6;
    let fake = FakeModel::start(Mode::AgentTurns {
        turns: TURNS,
        latency: Duration::from_millis(150),
    })
    .await;
    let mut app = crash_app(&fake).await;
    let mut rng = Rng::from_env_or_clock();
    let inputs = (0..AGENTS)
        .map(|i| json!({ "user": format!("agent {i}"), "tools": ["kv_put"], "max_turns": TURNS }));
    let ops = app.enqueue_many("agent", Lane::Interactive, inputs).await;
    let by_user: HashMap<String, Uuid> = ops
        .iter()
        .enumerate()
        .map(|(i, id)| (format!("agent {i}"), *id))
        .collect();
    let seen = Arc::new(Mutex::new(Seen::default()));
    // Turn t is the model step at seq 2t: each turn before the last is a model step and one
    // kv_put step.
    fake.set_hook(hook(app.pool.clone(), seen.clone(), move |body| {
        let bytes = body.to_string().into_bytes();
        let op = *by_user.get(&last_user(&bytes))?;
        let turn = assistant_turns(&bytes) as i32;
        Some((op, 2 * turn))
    }));

    // Nine calls or more: the eight operations a worker runs at once send their first turns,
    // then at least one asks for its second, so every snapshot holds a committed turn.
    let snapshots = kill_repeatedly(&mut app, &fake, &ops, &mut rng, 9).await;
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(seen.violations.is_empty(), "{:#?}", seen.violations);
    assert_kept(&snapshots, &committed(&app.pool).await);

    // Each turn was sent at least once; a turn was sent again only when a kill caught it in
    // flight, so an operation has at most one re-send per kill.
    for op in &ops {
        let resent: usize = (0..TURNS as i32)
            .map(|t| {
                let n = seen.sent.get(&(*op, 2 * t)).copied().unwrap_or(0);
                assert!(n >= 1, "{op}: turn {t} was never sent");
                n - 1
            })
            .sum();
        assert!(
            resent <= KILLS,
            "{op}: {resent} turns re-sent over {KILLS} kills"
        );
    }
    // Usage counts every journaled model call once: five tool-call turns of 5 + 5 tokens and
    // a final answer of 3 + 1 per agent.
    let usage: (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), sum((usage->>'prompt_tokens')::bigint)::bigint,
                sum((usage->>'completion_tokens')::bigint)::bigint
           FROM operation_steps WHERE kind = 'model' AND status = 'completed'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let n = AGENTS as i64;
    assert_eq!(usage, (n * TURNS as i64, n * (5 * 5 + 3), n * (5 * 5 + 1)));
    let report = app.agentq_json(&["usage", "--json"]);
    assert_eq!(report["model_calls"], json!(n * TURNS as i64), "{report}");
    app.cleanup().await;
}

#[tokio::test]
async fn sigkilled_scripts_never_rerun_a_finished_step() {
    const SCRIPTS: usize = 24;
    let fake = FakeModel::start(Mode::Slow(Duration::from_millis(120))).await;
    let mut app = crash_app(&fake).await;
    let mut rng = Rng::from_env_or_clock();
    // Ten steps: a 250 ms work step, then a model step whose prompt names its seq, five times.
    let inputs = (0..SCRIPTS).map(|i| {
        let steps: Vec<Value> = (0..10)
            .map(|seq| {
                if seq % 2 == 0 {
                    json!({ "work_ms": 250 })
                } else {
                    json!({ "model": format!("script {i} seq {seq}") })
                }
            })
            .collect();
        json!({ "steps": steps })
    });
    let ops = app.enqueue_many("script", Lane::Interactive, inputs).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let ids = ops.clone();
    fake.set_hook(hook(app.pool.clone(), seen.clone(), move |body| {
        let text = last_user(body.to_string().as_bytes());
        let mut words = text.split(' ').skip(1);
        let i: usize = words.next()?.parse().ok()?;
        let seq: i32 = words.nth(1)?.parse().ok()?;
        Some((*ids.get(i)?, seq))
    }));

    // Every model request (seq 1 and later) follows a committed work step.
    let snapshots = kill_repeatedly(&mut app, &fake, &ops, &mut rng, 4).await;
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(seen.violations.is_empty(), "{:#?}", seen.violations);
    let last = committed(&app.pool).await;
    assert_kept(&snapshots, &last);
    for op in &ops {
        assert!(
            (0..10).all(|seq| last.contains_key(&(*op, seq))),
            "{op}: every step journaled"
        );
    }
    app.cleanup().await;
}

#[tokio::test]
async fn deferred_steps_ride_the_next_durable_write() {
    let fake = FakeModel::start(Mode::Echo).await;
    let mut app = crash_app(&fake).await;
    let steps = json!([
        { "work_ms": 0, "deferred": true },
        { "work_ms": 0, "deferred": true },
        { "work_ms": 0, "deferred": true },
        { "model": "script 0 seq 3" },
        { "work_ms": 0 }
    ]);
    let op = app.enqueue_script(steps, &[]);
    let id: Uuid = op.parse().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    fake.set_hook(hook(app.pool.clone(), seen.clone(), move |_| Some((id, 3))));
    app.spawn(&["worker"]);
    app.wait_status(&op, "succeeded", DEADLINE).await;
    // The opt-in: the deferred rows were still in memory when the model call went out (a
    // crash then would have re-run them, as documented), and are all journaled in the end.
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(
        seen.violations,
        vec![format!(
            "{id}: step 3 was sent while step 0 was not durable"
        )]
    );
    let last = committed(&app.pool).await;
    assert!((0..5).all(|seq| last.contains_key(&(id, seq))), "{last:?}");
    app.cleanup().await;
}
