//! Versioned kinds: workers of two versions of one kind side by side, operations that wait for a
//! version no live worker runs, operators' upgrades (of a waiting operation and of a
//! `nondeterminism` dead letter), and `ctx.patched` across crashes and replays.
//!
//! The built-in `script` kind stands in for a kind whose code changes: `AGENTQ_SCRIPT_VERSIONS`
//! chooses the versions a worker registers, and the input's `variants` the steps each version
//! (or, with `AGENTQ_SCRIPT_VARIANT`, each build of one version) runs.

use agentq_core::db;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::console::Browser;
use crate::harness::{DEADLINE, TestApp};

/// An unsafe ledger step labelled `label`: every run of it inserts a row, so a repeat shows.
fn effect(label: &str) -> Value {
    json!({ "tool": "ledger", "replay": "unsafe", "label": label })
}

/// An unsafe ledger step the ledger can reconcile, whose answer takes `after_ms` after its
/// effect happened (a test kills the worker in that window).
fn slow_effect(label: &str, after_ms: u64) -> Value {
    json!({ "tool": "ledger", "replay": "unsafe", "label": label, "after_ms": after_ms, "reconcile": true })
}

fn wait(signal: &str) -> Value {
    json!({ "wait_signal": signal, "timeout_ms": 3_600_000 })
}

/// Enqueues a `script` operation with `steps` and `variants`; returns its id.
fn enqueue(app: &TestApp, steps: Value, variants: Value) -> String {
    let input = json!({ "steps": steps, "variants": variants }).to_string();
    let v = app.agentq_json(&[
        "enqueue", "--tenant", "t1", "--kind", "script", "--input", &input, "--json",
    ]);
    v["op_id"].as_str().unwrap().to_string()
}

/// Ledger effects of `op` labelled `label`.
async fn effects_of(app: &TestApp, op: &str, label: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger_effects WHERE op_id = $1::uuid AND label = $2")
        .bind(op)
        .bind(label)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// The journal of `op`: (seq, name, kind, status).
async fn journal(app: &TestApp, op: &str) -> Vec<(i32, String, String, String)> {
    sqlx::query_as(
        "SELECT seq, name, kind, status FROM operation_steps WHERE op_id = $1::uuid ORDER BY seq",
    )
    .bind(op)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

/// The registration of every worker: (versions, started_at, seen_at), oldest first.
async fn workers(app: &TestApp) -> Vec<(Vec<String>, DateTime<Utc>, DateTime<Utc>)> {
    sqlx::query_as("SELECT versions, started_at, seen_at FROM workers ORDER BY started_at")
        .fetch_all(&app.pool)
        .await
        .unwrap()
}

fn signal(app: &TestApp, op: &str, name: &str) {
    app.agentq_ok(&["signal", op, name, "--payload", "{}"]);
}

/// Starts a worker that runs `script` at `versions` (and the build `variant`, if any).
pub(crate) fn worker(app: &mut TestApp, versions: &str, variant: Option<&str>) -> usize {
    app.set_env("AGENTQ_SCRIPT_VERSIONS", versions);
    match variant {
        Some(v) => app.set_env("AGENTQ_SCRIPT_VARIANT", v),
        None => app.unset_env("AGENTQ_SCRIPT_VARIANT"),
    }
    let w = app.spawn(&["worker"]);
    app.unset_env("AGENTQ_SCRIPT_VERSIONS");
    app.unset_env("AGENTQ_SCRIPT_VARIANT");
    w
}

/// Stops worker `w` with SIGTERM and waits until it exited and removed its registration.
pub(crate) async fn stop_worker(app: &mut TestApp, w: usize, live_after: usize) {
    app.signal(w, "TERM");
    assert!(app.wait_exit(w, DEADLINE).await, "the worker did not stop");
    let n = workers(app).await.len();
    assert_eq!(n, live_after, "a stopped worker removes its registration");
}

/// The `ctx.patched` decisions an operation's result lists, in order.
fn path(result: &Value) -> Vec<String> {
    result["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| {
            o.get("patched")
                .map(|p| format!("patched:{p}={}", o["applies"]))
        })
        .collect()
}

#[tokio::test]
async fn two_versions_run_side_by_side_and_a_stranded_operation_waits_until_a_worker_or_an_upgrade_takes_it()
 {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    // Version 2 adds a review before the wait: a v1 journal replayed by v2 code would diverge.
    let v1 = json!([effect("draft"), wait("go"), effect("publish-v1")]);
    let variants =
        json!({ "2": [effect("draft"), effect("review"), wait("go"), effect("publish-v2")] });
    let w1 = worker(&mut app, "1", None);
    let old: Vec<String> = (0..3)
        .map(|_| enqueue(&app, v1.clone(), variants.clone()))
        .collect();
    for op in &old {
        let v = app.wait_status(op, "waiting", DEADLINE).await;
        assert_eq!(v.kind_version.as_deref(), Some("1"));
    }

    // Deploy version 2 next to it; new operations go to v2 once worker 1 has seen it (its
    // registration refreshed after worker 2 registered).
    let _w2 = worker(&mut app, "2", None);
    app.wait_for("worker 1 to see worker 2", DEADLINE, || async {
        let w = workers(&app).await;
        w.len() == 2 && w[0].2 > w[1].1
    })
    .await;
    let new = enqueue(&app, v1.clone(), variants.clone());
    let v = app.wait_status(&new, "waiting", DEADLINE).await;
    assert_eq!(
        v.kind_version.as_deref(),
        Some("2"),
        "a new operation runs on the newest live version"
    );

    // An old operation resumes on v1, the new one on v2: nothing is nondeterministic.
    signal(&app, &old[0], "go");
    signal(&app, &new, "go");
    app.wait_status(&old[0], "succeeded", DEADLINE).await;
    app.wait_status(&new, "succeeded", DEADLINE).await;
    assert_eq!(effects_of(&app, &old[0], "publish-v1").await, 1);
    assert_eq!(effects_of(&app, &old[0], "review").await, 0);
    assert_eq!(effects_of(&app, &new, "review").await, 1);
    assert_eq!(effects_of(&app, &new, "publish-v2").await, 1);

    // With no v1 worker, a woken v1 operation waits, parked and visible: not dead, not
    // bounced back and forth, not run by v2.
    stop_worker(&mut app, w1, 1).await;
    signal(&app, &old[1], "go");
    app.wait_for("the v1 operation to be parked", DEADLINE, || async {
        let v = app.operation(&old[1]).await;
        v.version_parked && v.status.as_str() == "queued"
    })
    .await;
    let parked_at = Utc::now();
    let epoch: i64 = sqlx::query_scalar("SELECT epoch FROM operations WHERE id = $1::uuid")
        .bind(&old[1])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    // Let worker 2 pull for parked work for two of its registration periods (it refreshes
    // every lease / 3, and pulls every second): it must leave the operation alone.
    app.wait_for("worker 2 to refresh twice", DEADLINE, || async {
        workers(&app).await[0].2 > parked_at + chrono::Duration::seconds(3)
    })
    .await;
    let v = app.operation(&old[1]).await;
    assert_eq!(v.status.as_str(), "queued");
    assert!(v.version_parked);
    let epoch_now: i64 = sqlx::query_scalar("SELECT epoch FROM operations WHERE id = $1::uuid")
        .bind(&old[1])
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(epoch_now, epoch, "no worker claimed it");
    let report = app.agentq_json(&["versions", "--kind", "script", "--json"]);
    let script = &report["kinds"][0];
    assert_eq!(script["newest_live"], "2");
    let line = script["versions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["version"] == "1")
        .expect("version 1 is listed")
        .clone();
    assert_eq!(line["unserved"], true, "{report}");
    assert_eq!(line["live_workers"], 0);
    assert_eq!(line["parked"], 1);
    assert_eq!(line["statuses"]["queued"], 1);
    assert_eq!(line["statuses"]["waiting"], 1);
    let unserved = db::versions::without_live_worker(&app.pool).await.unwrap();
    assert_eq!(unserved, vec![("script".to_string(), 2)]);
    let text = String::from_utf8(app.agentq_ok(&["versions"]).stdout).unwrap();
    assert!(text.contains("no live worker runs it"), "{text}");
    // The console shows the same: the versions page and the operation's version.
    let (_, base) = app.serve().await;
    let mut console = Browser::new(&base);
    assert_eq!(console.login(&app.token("t1", "operator")).await.0, 303);
    let (status, page) = console.get("/ui/versions").await;
    assert_eq!(status, 200);
    let script = &page[page.find("data-kind=\"script\"").expect("the script table")..];
    let v1_row = &script[script.find("data-version=\"1\"").expect("version 1 row")..];
    assert!(
        v1_row[..v1_row.find("</tr>").unwrap()].contains("no live worker"),
        "{page}"
    );
    let (_, page) = console.get(&format!("/ui/operations/{}", old[1])).await;
    assert!(page.contains("<dt>version</dt><dd>1 <span"), "{page}");
    assert!(page.contains("waiting for a worker that runs it"), "{page}");
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(dead, 0);

    // A v1 worker comes back: it takes the parked operation.
    let w1 = worker(&mut app, "1", None);
    app.wait_status(&old[1], "succeeded", DEADLINE).await;
    assert_eq!(effects_of(&app, &old[1], "publish-v1").await, 1);
    stop_worker(&mut app, w1, 1).await;

    // Or an operator upgrades it: a dry run changes nothing; the upgrade moves it to v2, whose
    // run replays the matching step (draft, not repeated), sets the diverging rest of the
    // journal aside, and runs v2's steps from there.
    signal(&app, &old[2], "go");
    app.wait_for("the last v1 operation to be parked", DEADLINE, || async {
        app.operation(&old[2]).await.version_parked
    })
    .await;
    let refused = app.agentq(&["versions", "upgrade", &old[2], "--to", "3"]);
    assert_eq!(refused.status.code(), Some(2));
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("no live worker runs version \"3\""), "{why}");
    let dry = app.agentq_ok(&["versions", "upgrade", &old[2], "--to", "2", "--dry-run"]);
    assert!(String::from_utf8_lossy(&dry.stdout).contains("would upgrade"));
    assert_eq!(
        app.operation(&old[2]).await.kind_version.as_deref(),
        Some("1")
    );
    app.agentq_ok(&[
        "versions",
        "upgrade",
        &old[2],
        "--to",
        "2",
        "--as",
        "ops",
        "--reason",
        "v1 retired",
    ]);
    // v2 waits for "go" at its own position: the v1 wait was set aside with the rest, still
    // unresolved, so the signal sent to it is unread and v2's wait receives it.
    let v = app.wait_status(&old[2], "succeeded", DEADLINE).await;
    assert_eq!(v.kind_version.as_deref(), Some("2"));
    assert_eq!(
        effects_of(&app, &old[2], "draft").await,
        1,
        "draft is not repeated"
    );
    assert_eq!(effects_of(&app, &old[2], "review").await, 1);
    assert_eq!(effects_of(&app, &old[2], "publish-v2").await, 1);
    assert_eq!(effects_of(&app, &old[2], "publish-v1").await, 0);
    let names: Vec<String> = journal(&app, &old[2])
        .await
        .into_iter()
        .map(|s| s.1)
        .collect();
    assert_eq!(
        names,
        [
            "ledger:draft",
            "ledger:review",
            "signal:go",
            "ledger:publish-v2"
        ]
    );
    let set_aside: Vec<(i32, String)> = sqlx::query_as(
        "SELECT seq, name FROM operation_steps_superseded WHERE op_id = $1::uuid ORDER BY seq",
    )
    .bind(&old[2])
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(set_aside, vec![(1, "signal:go".to_string())]);
    let audit: (String, Value) = sqlx::query_as(
        "SELECT actor, details FROM operator_actions WHERE op_id = $1::uuid AND action = 'upgrade'",
    )
    .bind(&old[2])
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(audit.0, "ops");
    assert_eq!(audit.1["from_version"], "1");
    assert_eq!(audit.1["to_version"], "2");
    app.cleanup().await;
}

#[tokio::test]
async fn patched_operations_keep_their_path_through_a_crash_and_every_later_replay() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    // The code before the patch, and the build that carries it: b-new for operations that
    // start with the patch, b-old for those recorded before it.
    let before = json!([
        effect("a"),
        effect("b-old"),
        wait("go"),
        slow_effect("c", 600_000),
        wait("again"),
        effect("d")
    ]);
    let variants = json!({ "patched": [
        effect("a"),
        { "patched": "p1", "then": [effect("b-new")], "else": [effect("b-old")] },
        wait("go"),
        slow_effect("c", 600_000),
        wait("again"),
        effect("d")
    ] });
    let w = worker(&mut app, "1", None);
    let old = enqueue(&app, before.clone(), variants.clone());
    app.wait_status(&old, "waiting", DEADLINE).await;
    app.kill(w);
    let w = worker(&mut app, "1", Some("patched"));
    let new = enqueue(&app, before.clone(), variants.clone());
    app.wait_status(&new, "waiting", DEADLINE).await;

    // Both resume on the patched build and are killed in the middle of step c (its effect
    // happened, its answer had not come): the next run replays everything before it.
    signal(&app, &old, "go");
    signal(&app, &new, "go");
    app.wait_for(
        "both operations' step c to take effect",
        DEADLINE,
        || async {
            effects_of(&app, &old, "c").await == 1 && effects_of(&app, &new, "c").await == 1
        },
    )
    .await;
    app.kill(w);
    let _w = worker(&mut app, "1", Some("patched"));
    // The reaper takes them back after the lease (6 s); the replay reconciles c.
    app.wait_status(&old, "waiting", DEADLINE).await;
    app.wait_status(&new, "waiting", DEADLINE).await;
    let second = (journal(&app, &old).await, journal(&app, &new).await);
    for (op, status) in [
        (&old, app.operation(&old).await),
        (&new, app.operation(&new).await),
    ] {
        assert_eq!(status.restarts, 1, "{op} was recovered from the crash");
    }

    // A third run replays both again and finishes.
    signal(&app, &old, "again");
    signal(&app, &new, "again");
    let old_done = app.wait_status(&old, "succeeded", DEADLINE).await;
    let new_done = app.wait_status(&new, "succeeded", DEADLINE).await;
    assert_eq!(
        path(old_done.result.as_ref().unwrap()),
        ["patched:\"p1\"=false"]
    );
    assert_eq!(
        path(new_done.result.as_ref().unwrap()),
        ["patched:\"p1\"=true"]
    );
    for (op, b, not_b) in [(&old, "b-old", "b-new"), (&new, "b-new", "b-old")] {
        for label in ["a", b, "c", "d"] {
            assert_eq!(
                effects_of(&app, op, label).await,
                1,
                "{op}: {label} ran once"
            );
        }
        assert_eq!(effects_of(&app, op, not_b).await, 0, "{op} took one path");
    }
    // The marker is in the patched operation's journal only; the third run agreed with the
    // second on every row it had recorded.
    let kinds = |j: &[(i32, String, String, String)]| -> Vec<String> {
        j.iter().map(|s| format!("{}:{}", s.2, s.1)).collect()
    };
    let old_journal = journal(&app, &old).await;
    let new_journal = journal(&app, &new).await;
    assert_eq!(
        kinds(&old_journal),
        [
            "tool:ledger:a",
            "tool:ledger:b-old",
            "signal:signal:go",
            "tool:ledger:c",
            "signal:signal:again",
            "tool:ledger:d"
        ]
    );
    assert_eq!(
        kinds(&new_journal),
        [
            "tool:ledger:a",
            "patch:p1",
            "tool:ledger:b-new",
            "signal:signal:go",
            "tool:ledger:c",
            "signal:signal:again",
            "tool:ledger:d"
        ]
    );
    assert_eq!(kinds(&second.0), kinds(&old_journal[..5]));
    assert_eq!(kinds(&second.1), kinds(&new_journal[..6]));
    app.cleanup().await;
}

#[tokio::test]
async fn a_nondeterminism_dead_letter_is_retried_on_a_version_and_rebased_without_repeating_steps()
{
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    let steps = json!([effect("a"), wait("go"), effect("b")]);
    // The same version with a step inserted: the author forgot to bump the version.
    let variants = json!({ "unbumped": [effect("a"), effect("x"), wait("go"), effect("b")] });
    let w = worker(&mut app, "1", None);
    let op = enqueue(&app, steps, variants);
    app.wait_status(&op, "waiting", DEADLINE).await;
    app.kill(w);
    let _w = worker(&mut app, "1", Some("unbumped"));
    signal(&app, &op, "go");
    let dead = app.wait_status(&op, "dead", DEADLINE).await;
    assert_eq!(dead.error_class.as_deref(), Some("nondeterminism"));

    // Retrying without a version fails the same way; with one (here the same version, the
    // author's mistake acknowledged) the run rebases where the code diverges.
    let bad = app.agentq(&["dlq", "retry", &op, "--to-version", "no such"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("kind version"));
    app.agentq_ok(&[
        "dlq",
        "retry",
        &op,
        "--to-version",
        "1",
        "--reason",
        "x was added",
    ]);
    // The wait the signal arrived for was set aside unresolved: the signal is still unread,
    // and the wait v1 now asks for at the next position receives it.
    app.wait_status(&op, "succeeded", DEADLINE).await;
    assert_eq!(effects_of(&app, &op, "a").await, 1, "a is not repeated");
    assert_eq!(effects_of(&app, &op, "x").await, 1);
    assert_eq!(effects_of(&app, &op, "b").await, 1);
    let details: Value = sqlx::query_scalar(
        "SELECT details FROM operator_actions WHERE op_id = $1::uuid AND action = 'retry'",
    )
    .bind(&op)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(details["to_version"], "1");
    app.cleanup().await;
}
