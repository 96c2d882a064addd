//! One tenant against another, through what they share: pauses, a worker's slots, shared
//! limits, the journal writer, budgets over children, the kinds list, a worker's memory. Each
//! test is one way tenant `ta` (the attacker) tried to hurt tenant `tb` (the victim), and fails
//! without the fix that stopped it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_core::Lane;
use agentq_core::state::Replay;
use agentq_producer::EnqueueRequest;
use agentq_worker::{JobContext, JobError, LocalModel, Worker};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::fake_model::{FakeModel, Mode};
use crate::harness::{DEADLINE, TestApp};

/// Enqueues a `script` of `steps` for `tenant` with the CLI's `extra` flags; its id.
fn script_as(app: &TestApp, tenant: &str, steps: Value, extra: &[&str]) -> String {
    app.enqueue_as(tenant, "script", &json!({ "steps": steps }), extra)
}

// ---------------------------------------------------------------- pauses

/// `ta`'s operator used to create pauses for made-up kinds without end; every lease renewal,
/// claim and sweep read all of them for every row, until `tb`'s leases timed out. Now a
/// tenant's pauses are capped and name served kinds, and a pause test reads only the pauses of
/// the operation's own tenant (and the deployment's).
#[tokio::test]
async fn a_tenants_pauses_are_capped_name_served_kinds_and_never_read_for_another_tenant() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_TENANT_MAX_PAUSES", "3");
    let (_, base) = app.serve().await;
    let (ta, tb) = (app.token("ta", "operator"), app.token("tb", "operator"));
    let http = reqwest::Client::new();
    let pause = |token: &str, scope: Value| {
        let sent = http
            .post(format!("{base}/v1/pauses"))
            .bearer_auth(token)
            .json(&json!({ "scope": scope, "reason": "hostile" }))
            .send();
        async move {
            let r = sent.await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let pauses = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pauses")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };

    // A kind the deployment does not serve is refused, naming the field and the kinds.
    let (status, problem) = pause(&ta, json!({ "kind": "made-up-1" })).await;
    assert_eq!(status, 422, "{problem}");
    assert!(
        problem.to_string().contains("/kind") && problem.to_string().contains("echo"),
        "{problem}"
    );
    assert_eq!(pauses().await, 0);

    // Three pauses, then the cap: 429 naming the setting, nothing written.
    for scope in [
        json!({ "kind": "echo" }),
        json!({ "kind": "script" }),
        json!({ "lane": "batch" }),
    ] {
        let (status, made) = pause(&ta, scope.clone()).await;
        assert_eq!(status, 200, "{scope}: {made}");
    }
    let (status, problem) = pause(&ta, json!({ "kind": "agent" })).await;
    assert_eq!(status, 429, "{problem}");
    assert!(
        problem.to_string().contains("AGENTQ_TENANT_MAX_PAUSES"),
        "{problem}"
    );
    assert_eq!(pauses().await, 3);
    // A scope already paused is found, not made again, at the cap too.
    let (status, again) = pause(&ta, json!({ "kind": "echo" })).await;
    assert_eq!((status, &again["created"]), (200, &json!(false)), "{again}");
    // The cap is per tenant: tb pauses its own.
    let (status, made) = pause(&tb, json!({ "kind": "echo" })).await;
    assert_eq!(status, 200, "{made}");

    // The list is paged, oldest first.
    let get = |path: String| {
        let sent = http.get(format!("{base}{path}")).bearer_auth(&ta).send();
        async move { sent.await.unwrap().json::<Value>().await.unwrap() }
    };
    let first = get("/v1/pauses?limit=2".into()).await;
    assert_eq!(first["items"].as_array().unwrap().len(), 2, "{first}");
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a full page continues");
    let rest = get(format!("/v1/pauses?limit=2&after={cursor}")).await;
    assert_eq!(rest["items"].as_array().unwrap().len(), 1, "{rest}");
    assert!(rest["next_cursor"].is_null(), "{rest}");

    // What the cap now prevents, written by hand: 20,000 pauses of ta. A pause test of a tb
    // operation reads none of them (a whole scan of them read hundreds of pages per row).
    sqlx::query(
        "INSERT INTO pauses (id, tenant_id, kind, reason, paused_by)
         SELECT gen_random_uuid(), 'ta', 'made-up-' || g, 'hostile', 'ta'
           FROM generate_series(1, 20000) g",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE pauses")
        .execute(&app.pool)
        .await
        .unwrap();
    let plan: Value = sqlx::query_scalar(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
         SELECT count(*) FROM generate_series(1, 200) g
          WHERE NOT agentq_paused('tb', 'agent', 'interactive', NULL, gen_random_uuid())",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    let top = &plan[0]["Plan"];
    let pages =
        top["Shared Hit Blocks"].as_i64().unwrap() + top["Shared Read Blocks"].as_i64().unwrap();
    println!("200 pause tests of tb's operations read {pages} pages");
    assert!(
        pages < 200 * 20,
        "200 pause tests of tb's operations read {pages} pages: {plan}"
    );
    app.cleanup().await;
}

// ---------------------------------------------------------------- fair shares

/// `tb` runs every slot alone; one operation of `ta` arriving used to make the worker cut
/// half of tb's steps mid-way at once. Now tb owes exactly one slot, and the first of its
/// operations to reach a step boundary pays it there: no step begins twice.
#[tokio::test]
async fn a_waiting_operation_takes_one_slot_at_a_step_boundary_and_no_step_is_cut() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    const STEPS: usize = 6;
    // tb's kind: each step waits at the gate the test opens, and counts that it began.
    let gate = Arc::new(Semaphore::new(0));
    let begun = Arc::new(AtomicUsize::new(0));
    let mut registry = agentq_kinds::registry();
    {
        let (gate, begun) = (gate.clone(), begun.clone());
        registry.register("gated", move |ctx: JobContext, _input: Value| {
            let (gate, begun) = (gate.clone(), begun.clone());
            async move {
                for i in 0..STEPS {
                    let (gate, begun) = (gate.clone(), begun.clone());
                    ctx.step(&format!("s{i}"), || async move {
                        begun.fetch_add(1, Ordering::SeqCst);
                        gate.acquire().await.expect("open").forget();
                        Ok::<_, JobError>(i)
                    })
                    .await?;
                }
                Ok::<_, JobError>(json!({}))
            }
        });
    }
    // Four slots, a share of two; a debt stands a minute before anything is cut.
    let mut settings = crate::foundation::worker_settings(&app, Duration::from_secs(30));
    settings.tenant_share = 0.5;
    settings.tenant_share_grace = Duration::from_secs(60);
    let worker = Worker::new(
        settings,
        app.pool.clone(),
        registry.clone(),
        Arc::new(LocalModel),
    );
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    let (producer, dispatcher) = app.producer_with(registry);
    let enqueue = |tenant: &str, kind: &str, input: Value| {
        producer.enqueue(EnqueueRequest {
            tenant: tenant.into(),
            kind: kind.into(),
            input,
            lane: Lane::Interactive,
            ..Default::default()
        })
    };
    let mut victims = Vec::new();
    for _ in 0..4 {
        victims.push(enqueue("tb", "gated", json!({})).await.unwrap().op_id);
    }
    app.wait_for(
        "tb to hold every slot, each in its first step",
        DEADLINE,
        || async { begun.load(Ordering::SeqCst) == 4 },
    )
    .await;

    let echo = enqueue("ta", "echo", json!({ "text": "one" }))
        .await
        .unwrap()
        .op_id
        .to_string();
    // Open the gate one step at a time until the echo has run: some step boundary after the
    // worker counted the echo as waiting gives its slot.
    app.wait_for(
        "ta's echo to run in a slot given back",
        DEADLINE,
        || async {
            if app.operation(&echo).await.status == agentq_core::Status::Succeeded {
                return true;
            }
            if gate.available_permits() == 0 {
                gate.add_permits(1);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            false
        },
    )
    .await;
    gate.add_permits(4 * STEPS);
    for op in &victims {
        app.wait_status(&op.to_string(), "succeeded", DEADLINE)
            .await;
    }
    assert_eq!(
        begun.load(Ordering::SeqCst),
        4 * STEPS,
        "every step of tb began once: none was cut mid-way"
    );
    shutdown.cancel();
    running.await.unwrap().unwrap();
    dispatcher.close().await;
    app.cleanup().await;
}

/// `ta` queued work that cannot start (behind its own ordering key and concurrency key, and
/// paused); it used to count as "another tenant waiting", holding `tb` to its share while
/// slots sat idle. Now only work a worker could claim counts.
#[tokio::test]
async fn work_that_cannot_start_does_not_hold_another_tenant_to_its_share() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    let long = json!([{ "work_ms": 120_000 }]);
    let quick = json!([{ "work_ms": 1 }]);
    // Paused before any worker runs: it stays queued.
    let paused = script_as(&app, "ta", quick.clone(), &[]);
    app.agentq_ok(&["pause", &paused, "--reason", "held"]);
    // Eight slots, a share of four.
    app.spawn(&["worker", "--concurrency", "8"]);
    let head = script_as(&app, "ta", long.clone(), &["--ordering-key", "k"]);
    let keyed = script_as(
        &app,
        "ta",
        long.clone(),
        &["--concurrency-key", "c", "--concurrency-limit", "1"],
    );
    for op in [&head, &keyed] {
        app.wait_status(op, "running", DEADLINE).await;
    }
    for _ in 0..5 {
        script_as(&app, "ta", quick.clone(), &["--ordering-key", "k"]);
        script_as(
            &app,
            "ta",
            quick.clone(),
            &["--concurrency-key", "c", "--concurrency-limit", "1"],
        );
    }
    // tb's six take the six free slots: nothing of ta's could use them.
    for _ in 0..6 {
        script_as(&app, "tb", long.clone(), &[]);
    }
    app.wait_for("tb to run six", DEADLINE, || async {
        crate::capacity::running_of(&app, "tb").await == 6
    })
    .await;
    assert_eq!(crate::capacity::running_of(&app, "ta").await, 2);
    app.cleanup().await;
}

// ---------------------------------------------------------------- the API

/// `ta` read its own 1,000-row pages in sixteen loops, and `tb`'s list waited behind them
/// (p50 15 → 241 ms). Now each token has a request rate, a page costing by its rows: past it,
/// 429 with `Retry-After`, nothing done, and another token is not touched.
#[tokio::test]
async fn a_token_past_its_request_rate_is_refused_with_retry_after_and_others_are_not() {
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_API_TOKEN_RATE", "10");
    let (_, base) = app.serve().await;
    let (ta, tb) = (app.token("ta", "producer"), app.token("tb", "producer"));
    let http = reqwest::Client::new();
    let list = |token: &str| {
        let sent = http
            .get(format!("{base}/v1/operations?limit=1000"))
            .bearer_auth(token)
            .send();
        async move { sent.await.unwrap() }
    };
    // A page of 1,000 rows takes ta's whole bucket (two seconds of its rate).
    assert_eq!(list(&ta).await.status(), 200);
    let refused = list(&ta).await;
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=3).contains(&retry_after), "Retry-After {retry_after}");
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("AGENTQ_API_TOKEN_RATE"),
        "{problem}"
    );
    // Refused, an enqueue stores nothing.
    let enqueue = http
        .post(format!("{base}/v1/operations"))
        .bearer_auth(&ta)
        .json(&json!({ "kind": "echo", "input": { "text": "x" } }))
        .send()
        .await
        .unwrap();
    assert_eq!(enqueue.status(), 429);
    assert_eq!(app.operation_count().await, 0);
    // tb is not touched.
    assert_eq!(list(&tb).await.status(), 200);
    // ta's bucket fills again at its rate.
    app.wait_for("ta's bucket to fill again", DEADLINE, || async {
        list(&ta).await.status() == 200
    })
    .await;
    app.cleanup().await;
}

// ---------------------------------------------------------------- the journal writer

/// A spawn fan-out deadlocked the journal writer every tenant's steps go through: a statement
/// locked its batch in id order, then the child-finished trigger locked each finished child's
/// parent, which another statement held (117 deadlocks in 15 minutes, a second and a rewrite
/// of the group each). Forced here: each statement holds its own running parent and the other
/// one's child, then both finish (before the fix: 40P01). Now a child's end never waits for its
/// parent: with the parent's lock taken, it leaves a count change the join and the wake sweep
/// add; then, with both parents held by another transaction, two children end and their
/// parents, parked with the count their joins saw, wake on those changes.
#[tokio::test]
async fn journal_statements_finishing_each_others_children_never_deadlock_on_the_parents() {
    use agentq_core::db::{settle, steps, timers};
    use agentq_core::state::StepStatus;
    let app = TestApp::start().await;
    // Ids fix the lock order: each statement locks its parent and the other's child first,
    // then waits at the gate's row.
    let id = Uuid::from_u128;
    let (p1, p2, a, b, c, d, z1, z2) = (id(1), id(2), id(3), id(4), id(5), id(6), id(10), id(11));
    for (op, parent) in [
        (p1, None),
        (p2, None),
        (a, Some(p1)),
        (b, Some(p2)),
        (c, Some(p1)),
        (d, Some(p2)),
        (z1, None),
        (z2, None),
    ] {
        sqlx::query(
            "INSERT INTO operations (id, tenant_id, kind, lane, input, input_sha256, status,
                                     attempt, epoch, parent_id)
             VALUES ($1, 'ta', 'script', 'interactive', '{}', 'x', 'running', 1, 1, $2)",
        )
        .bind(op)
        .bind(parent)
        .execute(&app.pool)
        .await
        .unwrap();
    }
    let mut gate = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM operations WHERE id = ANY($1) FOR NO KEY UPDATE")
        .bind([z1, z2])
        .execute(&mut *gate)
        .await
        .unwrap();
    let write = |parent: Uuid, child: Uuid, other: Uuid| {
        let pool = app.pool.clone();
        let row = |op| crate::api::journal_row(op, 0, Replay::Safe, StepStatus::Completed);
        let steps = |op| {
            settle::RunWrite::Steps(steps::StepBatch {
                id: op,
                epoch: 1,
                steps: vec![row(op)],
            })
        };
        let batch = vec![
            steps(parent),
            settle::RunWrite::Complete(settle::Completion {
                id: child,
                epoch: 1,
                result: json!({}),
                steps: vec![row(child)],
            }),
            steps(other),
        ];
        tokio::spawn(async move { settle::write_runs(&pool, &batch).await })
    };
    let (s1, s2) = (write(p1, b, z1), write(p2, a, z2));
    app.wait_for("both statements to wait at the gate", DEADLINE, || async {
        crate::foundation::waiting_on_a_lock(&app, "WITH input AS%").await == 2
    })
    .await;
    gate.commit().await.unwrap();
    for (s, n) in [(s1, 3), (s2, 3)] {
        let written = s.await.unwrap().expect("no deadlock");
        assert_eq!(written.len(), n);
    }
    // Each statement's child's end met its parent locked by the other statement, or (where
    // the other had committed first) found it free: one or two were appended, none waited.
    let deltas = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM join_deltas")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let first = deltas().await;
    assert!((1..=2).contains(&first), "{first} count changes appended");

    // Both parents held by another transaction (as a heartbeat or a cancel would): the
    // children's ends are appended, whatever the timing.
    let mut holder = app.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM operations WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE")
        .bind([p1, p2])
        .execute(&mut *holder)
        .await
        .unwrap();
    let ends = [c, d].map(|child| {
        settle::RunWrite::Complete(settle::Completion {
            id: child,
            epoch: 1,
            result: json!({}),
            steps: vec![crate::api::journal_row(
                child,
                0,
                Replay::Safe,
                StepStatus::Completed,
            )],
        })
    });
    let written = tokio::time::timeout(DEADLINE, settle::write_runs(&app.pool, &ends))
        .await
        .expect("a child's end never waits for its parent's lock")
        .unwrap();
    assert_eq!(written.len(), 2);
    assert_eq!(deltas().await, first + 2);
    holder.commit().await.unwrap();
    // The parents park on those children with the count their joins saw (one each): the
    // wake sweep adds the appended changes and wakes both.
    sqlx::query(
        "UPDATE operations SET status = 'waiting', waiting_for = '(children)',
                joining = CASE id WHEN $1 THEN ARRAY[$3] ELSE ARRAY[$4] END, join_pending = 1
          WHERE id IN ($1, $2)",
    )
    .bind(p1)
    .bind(p2)
    .bind(c)
    .bind(d)
    .execute(&app.pool)
    .await
    .unwrap();
    let mut woken: Vec<Uuid> = timers::wake_due(&app.pool, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.id)
        .collect();
    woken.sort();
    assert_eq!(woken, [p1, p2]);
    app.cleanup().await;
}

// ---------------------------------------------------------------- the kinds list

/// An admin limited `ta` to production kinds; `ta`'s operator then retried a dead `script`
/// operation with a patched input, and a new script program ran. Now every act that makes
/// existing work run again checks the list as it is now: the retry (patched or not) and a
/// schedule's resume are refused, change nothing, and a discard still works.
#[tokio::test]
async fn a_shrunk_kinds_list_holds_for_dlq_retries_and_resumes() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let operator = app.token("ta", "operator");
    let dead = script_as(
        &app,
        "ta",
        json!([{ "fail": "non_retryable", "times": 9 }]),
        &[],
    );
    app.wait_status(&dead, "dead", DEADLINE).await;
    let schedule = app.agentq_json(&[
        "schedules",
        "add",
        "--tenant",
        "ta",
        "--name",
        "nightly",
        "--kind",
        "script",
        "--input",
        r#"{"steps":[{"work_ms":1}]}"#,
        "--every",
        "1h",
        "--json",
    ]);
    let schedule = schedule["schedule_id"].as_str().unwrap().to_string();
    app.agentq_ok(&["tenants", "kinds", "ta", "--production"]);

    let http = reqwest::Client::new();
    let retry = http
        .post(format!("{base}/v1/dlq/{dead}/retry"))
        .bearer_auth(&operator)
        .json(&json!({ "patch_input": { "steps": [{ "work_ms": 1 }] }, "reason": "again" }))
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 403);
    let problem: Value = retry.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("may not create operations of kind \"script\"")
            && detail.contains("was not retried and stays open"),
        "{detail}"
    );
    let cli = app.agentq(&["dlq", "retry", &dead, "--reason", "again"]);
    assert_eq!(cli.status.code(), Some(2), "{cli:?}");
    // Nothing changed: still dead, the same input, the dead letter open, no retry audited.
    let (status, input, open, retried): (String, Value, i64, i64) = sqlx::query_as(
        "SELECT o.status, o.input,
                (SELECT count(*) FROM dead_letters d WHERE d.op_id = o.id AND d.status = 'open'),
                (SELECT count(*) FROM operator_actions a WHERE a.op_id = o.id AND a.action = 'retry')
           FROM operations o WHERE o.id = $1::uuid",
    )
    .bind(&dead)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), open, retried), ("dead", 1, 0));
    assert_eq!(input["steps"][0]["fail"], "non_retryable", "{input}");

    // The list paused the schedule; resuming it is refused too.
    let resume = http
        .post(format!("{base}/v1/schedules/{schedule}/resume"))
        .bearer_auth(&operator)
        .send()
        .await
        .unwrap();
    assert_eq!(resume.status(), 403, "{:?}", resume.text().await);
    let paused: bool = sqlx::query_scalar("SELECT paused FROM schedules WHERE id = $1::uuid")
        .bind(&schedule)
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert!(paused);

    // A discard is always allowed.
    let discard = http
        .post(format!("{base}/v1/dlq/{dead}/discard"))
        .bearer_auth(&operator)
        .json(&json!({ "reason": "no longer ours" }))
        .send()
        .await
        .unwrap();
    assert_eq!(discard.status(), 200, "{:?}", discard.text().await);
    app.cleanup().await;
}

// ---------------------------------------------------------------- what `why` tells

/// `why` told `ta`'s producer how much other tenants had queued ("303 due operations queued
/// ahead", all `tb`'s) and named the worker's host. Now a tenant's caller counts only its own
/// tenant's work, and sees a worker by its process suffix, never its host.
#[tokio::test]
async fn why_counts_only_the_callers_tenant_and_names_no_host() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let (ta, admin) = (app.token("ta", "producer"), app.token("ops", "admin"));
    // One slot, taken by ta's long operation; then tb queues five, then ta one more.
    app.spawn(&["worker", "--concurrency", "1"]);
    let long = script_as(&app, "ta", json!([{ "work_ms": 60_000 }]), &[]);
    app.wait_status(&long, "running", DEADLINE).await;
    for _ in 0..5 {
        script_as(&app, "tb", json!([{ "work_ms": 1 }]), &[]);
    }
    let mine = script_as(&app, "ta", json!([{ "work_ms": 1 }]), &[]);
    let http = reqwest::Client::new();
    let why = |op: String, token: String| {
        let sent = http
            .get(format!("{base}/v1/operations/{op}/why"))
            .bearer_auth(token)
            .send();
        async move { sent.await.unwrap().json::<Value>().await.unwrap() }
    };
    // ta's operation waits behind tb's five, which ta is not told about.
    let seen = why(mine.clone(), ta.clone()).await;
    assert_eq!(seen["detail"]["queued_ahead"], 0, "{seen}");
    let all = why(mine.clone(), admin.clone()).await;
    assert_eq!(all["detail"]["queued_ahead"], 5, "{all}");

    let owner: String =
        sqlx::query_scalar("SELECT lease_owner FROM operations WHERE id = $1::uuid")
            .bind(&long)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let host = owner.split('-').next().unwrap().to_string();
    let seen = why(long.clone(), ta).await;
    let worker = seen["detail"]["worker"].as_str().unwrap();
    assert!(
        worker.starts_with("worker-") && owner.ends_with(&worker["worker-".len()..]),
        "{seen}"
    );
    assert!(!seen.to_string().contains(&host), "{seen}");
    let all = why(long, admin).await;
    assert_eq!(all["detail"]["worker"], owner.as_str(), "{all}");
    app.cleanup().await;
}

// ---------------------------------------------------------------- shared rate limits

/// Under a model limit of 10 requests per 10 s, `ta`'s 200 queued calls got 161 through while
/// `tb`'s third call waited 156 s: the room went to whichever call asked first. Now the tenants
/// waiting on a limit take turns. Forced here: `ta`'s two calls in flight were sent two
/// seconds apart, so the window has room for another of `ta`'s calls when the first leaves it,
/// and for `tb`'s larger one only when the second does; `ta`'s parked calls are woken first,
/// yet `tb`'s is the next to reach the provider.
#[tokio::test]
async fn a_shared_rate_limit_gives_its_room_to_the_waiting_tenants_in_turn() {
    let fake = FakeModel::start(Mode::Echo).await;
    let arrivals: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        // Every call is recorded and held: what is in flight stays counted in the window.
        let (arrivals, gate) = (arrivals.clone(), Arc::new(Semaphore::new(0)));
        fake.set_hook(Arc::new(move |body: Value| {
            let user = crate::fake_model::last_user(body.to_string().as_bytes());
            arrivals.lock().unwrap().push(user);
            let gate = gate.clone();
            Box::pin(async move { gate.acquire().await.expect("open").forget() })
        }));
    }
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_MODEL", "shared");
    // A call of ta's reserves about 1,033 tokens (its message's bytes / 4 and the 1,024 of
    // output it may ask for), tb's about 2,033: two of ta's fit in 2,400, not three, and tb's
    // fits only beside none of them.
    app.agentq_ok(&[
        "limits", "set", "--scope", "model", "--name", "shared", "--tokens", "2400", "--window",
        "10s",
    ]);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let model =
        |tenant: &str, prompt: &str| script_as(&app, tenant, json!([{ "model": prompt }]), &[]);
    let arrived = |n: usize| {
        let arrivals = arrivals.clone();
        move || {
            let arrivals = arrivals.clone();
            async move { arrivals.lock().unwrap().len() >= n }
        }
    };
    // The window's buckets are a tenth of a second (a hundredth of the window).
    let bucket_now = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint / 100",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    model("ta", "ta 0");
    app.wait_for("ta's first call at the provider", DEADLINE, arrived(1))
        .await;
    let first = bucket_now().await;
    app.wait_for("two seconds of buckets", DEADLINE, || async {
        bucket_now().await >= first + 20
    })
    .await;
    model("ta", "ta 1");
    app.wait_for("ta's second call at the provider", DEADLINE, arrived(2))
        .await;
    for i in 2..5 {
        let op = model("ta", &format!("ta {i}"));
        app.wait_status(&op, "waiting", DEADLINE).await;
    }
    let tb = model("tb", &format!("tb {}", "x".repeat(4_000)));
    app.wait_status(&tb, "waiting", DEADLINE).await;
    app.wait_for(
        "the window's next call at the provider",
        DEADLINE,
        arrived(3),
    )
    .await;
    let third = arrivals.lock().unwrap()[2].clone();
    assert!(
        third.starts_with("tb "),
        "the third call was {third:?}, not tb's: {:?}",
        arrivals
            .lock()
            .unwrap()
            .iter()
            .map(|a| &a[..a.len().min(8)])
            .collect::<Vec<_>>()
    );
    app.cleanup().await;
}

/// Wake-ups matched parked operations by the text `tenant:name`, and tenant ids may contain
/// `:`: `ta` changing its key `x:y` woke tenant `ta:x`'s operation parked on its key `y`. Now a
/// parked operation is matched to its limit by the limit's id.
#[tokio::test]
async fn changing_one_tenants_limit_never_wakes_an_operation_parked_on_another_with_the_same_label()
{
    let fake = FakeModel::start(Mode::Echo).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    let limit = |app: &TestApp, tenant: &str, key: &str, requests: &str| {
        app.agentq_ok(&[
            "limits",
            "set",
            "--scope",
            "key",
            "--name",
            key,
            "--tenant",
            tenant,
            "--requests",
            requests,
            "--window",
            "1h",
        ]);
    };
    limit(&app, "ta:x", "y", "1");
    // No scheduler: a woken operation stays `waiting` with its wake time moved to now.
    app.spawn(&["worker"]);
    let on_key = || {
        script_as(
            &app,
            "ta:x",
            json!([{ "model": "v" }]),
            &["--rate-key", "y"],
        )
    };
    let first = on_key();
    app.wait_status(&first, "succeeded", DEADLINE).await;
    let parked = on_key();
    app.wait_status(&parked, "waiting", DEADLINE).await;
    let run_at = app.operation(&parked).await.run_at;
    assert!(run_at > chrono::Utc::now() + chrono::Duration::minutes(30));

    // ta's key `x:y` reads `ta:x:y` too.
    limit(&app, "ta", "x:y", "5");
    assert_eq!(app.operation(&parked).await.run_at, run_at);
    app.agentq_ok(&[
        "limits", "delete", "--scope", "key", "--name", "x:y", "--tenant", "ta",
    ]);
    assert_eq!(app.operation(&parked).await.run_at, run_at);
    // Its own limit's change wakes it.
    limit(&app, "ta:x", "y", "2");
    assert!(app.operation(&parked).await.run_at <= chrono::Utc::now());
    app.cleanup().await;
}

// ---------------------------------------------------------------- budgets over a tree

/// A spawn copied no budget: a parent under a 150-token budget spawned a child that spent
/// 1,000 tokens (it matters where the budget is not the producer's own: a schedule's, a webhook
/// source's, a batch's). Now every budget over an operation's ancestors is over it: the child's
/// call (about 1,030 tokens) is held against the parent's 150 and never sent, until the
/// parent's budget is raised; and a tree is at most AGENTQ_MAX_SPAWN_DEPTH spawns deep.
#[tokio::test]
async fn a_childs_model_calls_are_held_against_the_budgets_over_its_ancestors() {
    let fake = FakeModel::start(Mode::Echo).await;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_MODEL_BASE_URL", &fake.url);
    app.set_env("AGENTQ_MAX_SPAWN_DEPTH", "2");
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let parent = script_as(
        &app,
        "ta",
        json!([
            { "spawn": "script", "input": { "steps": [{ "model": "child's call" }] } },
            { "join": true }
        ]),
        &["--budget-tokens", "150"],
    );
    let child = app
        .wait_until("the child", DEADLINE, || async {
            sqlx::query_scalar::<_, uuid::Uuid>(
                "SELECT id FROM operations WHERE parent_id = $1::uuid",
            )
            .bind(&parent)
            .fetch_optional(&app.pool)
            .await
            .unwrap()
            .map(|id| id.to_string())
        })
        .await;
    app.wait_for("the child to wait for the budget", DEADLINE, || async {
        let op = app.operation(&child).await;
        op.status == agentq_core::Status::Waiting && op.waiting_for.as_deref() == Some("(budget)")
    })
    .await;
    assert_eq!(fake.requests(), 0, "the child's call was never sent");
    let shown = app.agentq_json_lines(&["budget", "show", &child, "--json"]);
    assert!(
        shown.iter().any(|b| b["scope"] == "ancestor"
            && b["limit_tokens"] == 150
            && b["op_id"] == parent.as_str()),
        "{shown:?}"
    );
    // Raising the parent's budget queues the child again.
    app.agentq_ok(&[
        "budget",
        "set",
        &parent,
        "--budget-tokens",
        "100000",
        "--reason",
        "more",
    ]);
    app.wait_status(&parent, "succeeded", DEADLINE).await;
    assert_eq!(fake.requests(), 1);

    // Two spawns deep at most: a grandchild's own spawn fails it.
    let deep = |steps: Value| json!({ "steps": steps });
    let root = script_as(
        &app,
        "ta",
        json!([
            { "spawn": "script", "input": deep(json!([
                { "spawn": "script", "input": deep(json!([
                    { "spawn": "script", "input": deep(json!([{ "work_ms": 1 }])) },
                    { "join": true }
                ])) },
                { "join": true }
            ])) },
            { "join": true }
        ]),
        &[],
    );
    app.wait_status(&root, "succeeded", DEADLINE).await;
    let failed: Vec<(String, String)> = sqlx::query_as(
        "SELECT error_class, error_message FROM operations
          WHERE cardinality(ancestors) = 2 AND $1::uuid = ancestors[1]",
    )
    .bind(&root)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, "non_retryable");
    assert!(failed[0].1.contains("AGENTQ_MAX_SPAWN_DEPTH"), "{failed:?}");
    app.cleanup().await;
}

// ---------------------------------------------------------------- debounce

/// A debounce join silently kept the first arrival's budget, rate key and deadline: an arrival
/// asking a larger budget believed it had one. Now a join's answer names every option the
/// pending operation kept (a join replaces only the input).
#[tokio::test]
async fn a_debounce_join_says_which_options_the_pending_operation_kept() {
    let app = TestApp::start().await;
    let debounced = |extra: &[&str]| {
        let mut args = vec![
            "enqueue",
            "--tenant",
            "ta",
            "--kind",
            "echo",
            "--input",
            r#"{"text":"x"}"#,
            "--debounce-key",
            "doc-1",
            "--debounce",
            "1h",
            "--json",
        ];
        args.extend_from_slice(extra);
        app.agentq_json(&args)
    };
    let first = debounced(&["--budget-tokens", "100", "--rate-key", "k1"]);
    assert_eq!(first["debounce"]["outcome"], "pending", "{first}");
    // The same options: nothing kept that differs.
    let same = debounced(&["--budget-tokens", "100", "--rate-key", "k1"]);
    assert_eq!(same["debounce"]["outcome"], "joined", "{same}");
    assert!(same["debounce"].get("kept").is_none(), "{same}");
    let other = debounced(&[
        "--budget-tokens",
        "99999",
        "--rate-key",
        "k2",
        "--deadline",
        "2h",
    ]);
    assert_eq!(other["op_id"], first["op_id"]);
    assert_eq!(
        other["debounce"]["kept"],
        json!(["deadline", "rate_key", "budget"]),
        "{other}"
    );
    let text = app.agentq_ok(&[
        "enqueue",
        "--tenant",
        "ta",
        "--kind",
        "echo",
        "--input",
        r#"{"text":"y"}"#,
        "--debounce-key",
        "doc-1",
        "--debounce",
        "1h",
        "--lane",
        "batch",
    ]);
    let said = String::from_utf8_lossy(&text.stdout);
    assert!(
        said.contains("kept its own lane, rate_key, budget"),
        "{said}"
    );
    app.cleanup().await;
}

// ---------------------------------------------------------------- resumes

/// A script of 3,000 sleeps used to read its whole journal at every wake (the rows before it,
/// again and again: the database's work grew with the square of the sleeps). Now a worker keeps
/// the journal it loaded and its next run of the operation reads only the rows that can have
/// changed (the woken sleep's, and any after), proved current by the claim's epoch.
#[tokio::test]
async fn a_resume_reads_only_the_journal_rows_that_can_have_changed() {
    const SLEEPS: usize = 20;
    let mut app = TestApp::start().await;
    app.set_env("AGENTQ_METRICS_ADDR", "127.0.0.1:0");
    let worker = app.spawn_logged(&["worker"]);
    app.spawn(&["scheduler"]);
    let url = crate::metrics::metrics_url(&app, worker).await;
    let read = |s: &crate::metrics::Scrape, from: &str| {
        s.get("agentq_journal_rows_read_total", &[("source", from)])
    };
    let before = crate::metrics::Scrape::of(&url).await;
    let steps: Vec<Value> = (0..SLEEPS)
        .flat_map(|i| [json!({ "work_ms": 1 }), json!({ "sleep_ms": 300 + i })])
        .collect();
    let op = app.enqueue_script(json!(steps), &[]);
    let done = app.wait_status(&op, "succeeded", DEADLINE).await;
    let result = done.result.expect("a result").to_string();
    assert_eq!(result.matches("slept_ms").count(), SLEEPS, "{result}");
    assert_eq!(result.matches("worked_ms").count(), SLEEPS, "{result}");
    let after = crate::metrics::Scrape::of(&url).await;
    let (database, memory) = (
        read(&after, "database") - read(&before, "database"),
        read(&after, "memory") - read(&before, "memory"),
    );
    // Each wake reads three rows: the woken sleep's (it was `started`) and the two the last run
    // wrote after it, where reading the whole journal each time reads 2 + 4 + … + 2·SLEEPS
    // (420) rows.
    assert!(
        database <= (4 * SLEEPS) as f64,
        "{database} journal rows read from the database for {SLEEPS} wakes ({memory} kept)"
    );
    assert!(memory >= SLEEPS as f64, "{memory} rows kept");

    // With a second worker the operation moves between them: a journal kept by one is stale
    // once the other ran the operation, and the claim's epoch says so; the results are the same.
    app.spawn(&["worker"]);
    let ops: Vec<String> = (0..4)
        .map(|_| app.enqueue_script(json!(steps), &[]))
        .collect();
    for op in &ops {
        let done = app.wait_status(op, "succeeded", DEADLINE).await;
        let result = done.result.expect("a result").to_string();
        assert_eq!(result.matches("slept_ms").count(), SLEEPS, "{result}");
    }
    app.cleanup().await;
}
