//! Schedules end to end: two schedulers firing a 1-second schedule for a minute (every tick
//! once, none twice, none missed), the three overlap policies with a slow `script`, catch-up
//! after both schedulers were down, refusals that write nothing (CLI and API, another
//! tenant's id included), and the API and console controls with their audit trail.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::api::{Api, send};
use crate::console::{Browser, csrf_of};
use crate::harness::{DEADLINE, TestApp};

/// One operation a schedule fired: its tick (from the dedupe key) and its life.
#[derive(Debug, Clone)]
struct Firing {
    tick: DateTime<Utc>,
    created: DateTime<Utc>,
    finished: Option<DateTime<Utc>>,
    status: String,
}

/// An operation's dedupe key, creation, end and status.
type Row = (String, DateTime<Utc>, Option<DateTime<Utc>>, String);

/// The operations `schedule` fired, by tick.
async fn firings(app: &TestApp, schedule: &str) -> Vec<Firing> {
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT dedupe_key, created_at, finished_at, status FROM operations
          WHERE schedule_id = $1::uuid",
    )
    .bind(schedule)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let prefix = format!("schedule:{schedule}:");
    let mut out: Vec<Firing> = rows
        .into_iter()
        .map(|(key, created, finished, status)| {
            let tick = key
                .strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("dedupe key {key:?} does not start with {prefix}"));
            Firing {
                tick: DateTime::parse_from_rfc3339(tick)
                    .unwrap_or_else(|e| panic!("{key}: {e}"))
                    .with_timezone(&Utc),
                created,
                finished,
                status,
            }
        })
        .collect();
    out.sort_by_key(|f| f.tick);
    out
}

/// Waits (up to `deadline`) until the firings of `schedule` satisfy `done`.
async fn wait_firings(
    app: &TestApp,
    schedule: &str,
    what: &str,
    deadline: Duration,
    done: impl Fn(&[Firing]) -> bool,
) {
    app.wait_for(what, deadline, || async {
        done(&firings(app, schedule).await)
    })
    .await;
}

/// The schedule's row as `agentq schedules list --json` prints it.
fn listed(app: &TestApp, schedule: &str) -> Value {
    let out = app.agentq_ok(&["schedules", "list", "--json"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["schedule_id"] == schedule)
        .unwrap_or_else(|| panic!("schedule {schedule} is not listed"))
}

/// `agentq schedules add` of tenant t1's `name`, with `args` after the kind and input.
fn add_command(name: &str, kind: &str, input: &str, args: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = [
        "schedules",
        "add",
        "--tenant",
        "t1",
        "--name",
        name,
        "--kind",
        kind,
        "--input",
        input,
    ]
    .map(String::from)
    .to_vec();
    all.extend(args.iter().map(|a| a.to_string()));
    all
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `agentq schedules add` with `args` after the tenant, name, kind and input; returns its id.
fn add(app: &TestApp, name: &str, kind: &str, input: &Value, args: &[&str]) -> String {
    let mut args = args.to_vec();
    args.push("--json");
    let command = add_command(name, kind, &input.to_string(), &args);
    let v = app.agentq_json(&strs(&command));
    v["schedule_id"].as_str().unwrap().to_string()
}

async fn db_now(app: &TestApp) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// How far a firing's creation time may precede the end of the operation before it: the
/// firing pass's transaction starts a moment before it reads that end.
const MOMENT: chrono::Duration = chrono::Duration::milliseconds(100);

/// Whole seconds from `a` to `b`.
fn secs(a: DateTime<Utc>, b: DateTime<Utc>) -> i64 {
    (b - a).num_seconds()
}

/// Asserts the ticks are every second from the first to the last, each once.
fn assert_every_second_once(fired: &[Firing]) {
    let ticks: BTreeSet<DateTime<Utc>> = fired.iter().map(|f| f.tick).collect();
    assert_eq!(ticks.len(), fired.len(), "a tick fired twice");
    let (first, last) = (fired[0].tick, fired[fired.len() - 1].tick);
    let missing: Vec<String> = (0..=secs(first, last))
        .map(|i| first + chrono::Duration::seconds(i))
        .filter(|t| !ticks.contains(t))
        .map(|t| t.to_rfc3339())
        .collect();
    assert!(missing.is_empty(), "ticks never fired: {missing:?}");
}

#[tokio::test]
async fn schedules_two_schedulers_fire_a_one_second_schedule_for_a_minute_once_per_tick() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let id = add(
        &app,
        "every-second",
        "echo",
        &json!({ "text": "tick" }),
        &["--every", "1s", "--overlap", "allow"],
    );
    // A minute of ticks; the deadline allows a loaded machine's slow start.
    let minute = Duration::from_secs(60) + DEADLINE;
    wait_firings(&app, &id, "60 firings", minute, |f| f.len() >= 60).await;
    // Pausing waits for a pass that holds the schedule: afterwards nothing more fires.
    app.agentq_ok(&["schedules", "pause", &id]);
    let fired = firings(&app, &id).await;
    assert!(fired.len() >= 60, "{} firings", fired.len());
    assert_every_second_once(&fired);
    let s = listed(&app, &id);
    assert_eq!(s["fired"], json!(fired.len()), "{s}");
    assert_eq!(
        (&s["skipped_missed"], &s["skipped_overlap"]),
        (&json!(0), &json!(0))
    );
    assert_eq!(s["paused"], true);
    // None of them fired before its tick, and every one runs as an ordinary operation.
    for f in &fired {
        assert!(f.created >= f.tick, "{f:?} created before its tick");
    }
    wait_firings(&app, &id, "every firing to succeed", DEADLINE, |f| {
        f.iter().all(|f| f.status == "succeeded")
    })
    .await;
    app.cleanup().await;
}

/// A schedule every second of a `script` working 2.5 s.
fn slow(app: &TestApp, overlap: &str) -> String {
    add(
        app,
        &format!("slow-{overlap}"),
        "script",
        &json!({ "steps": [{ "work_ms": 2500 }] }),
        &["--every", "1s", "--overlap", overlap],
    )
}

#[tokio::test]
async fn schedules_overlap_policies_skip_buffer_one_and_allow_with_a_slow_kind() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let skip = slow(&app, "skip");
    let buffer = slow(&app, "buffer_one");
    let allow = slow(&app, "allow");
    // Three finished firings each of skip and buffer_one: about 8 s.
    app.wait_for(
        "three firings of skip and buffer_one to finish",
        DEADLINE,
        || async {
            let mut ok = true;
            for id in [&skip, &buffer] {
                ok &= firings(&app, id)
                    .await
                    .iter()
                    .filter(|f| f.status == "succeeded")
                    .count()
                    >= 3;
            }
            ok
        },
    )
    .await;
    for id in [&skip, &buffer, &allow] {
        app.agentq_ok(&["schedules", "pause", id]);
    }
    app.wait_for("the fired operations to finish", DEADLINE, || async {
        let mut done = true;
        for id in [&skip, &buffer, &allow] {
            done &= firings(&app, id).await.iter().all(|f| f.finished.is_some());
        }
        done
    })
    .await;

    // skip: never two at once, and the ticks in between were not fired but counted. (A firing
    // is stamped with its pass's start, which may precede by a moment the end it saw.)
    let fired = firings(&app, &skip).await;
    for w in fired.windows(2) {
        assert!(
            w[1].created + MOMENT >= w[0].finished.unwrap(),
            "skip: {:?} started while {:?} ran",
            w[1],
            w[0]
        );
        assert!(
            secs(w[0].tick, w[1].tick) >= 2,
            "skip: no tick skipped: {w:?}"
        );
    }
    let s = listed(&app, &skip);
    assert!(s["skipped_overlap"].as_i64().unwrap() >= 2, "{s}");
    assert_eq!(s["buffered_tick"], Value::Null, "{s}");

    // buffer_one: never two at once either; each next firing is a tick kept while the
    // previous ran (older than its end), fired right after that end; more ticks were skipped.
    let fired = firings(&app, &buffer).await;
    for w in fired.windows(2) {
        let ended = w[0].finished.unwrap();
        assert!(w[1].created + MOMENT >= ended, "buffer_one: overlap {w:?}");
        assert!(w[1].tick < ended, "buffer_one: {:?} was not buffered", w[1]);
        assert!(
            (w[1].created - ended) < chrono::Duration::seconds(5),
            "buffer_one: {:?} waited long after {:?} ended",
            w[1],
            w[0]
        );
    }
    let s = listed(&app, &buffer);
    assert!(s["skipped_overlap"].as_i64().unwrap() >= 1, "{s}");

    // allow: every tick fires, so firings overlap.
    let fired = firings(&app, &allow).await;
    assert!(fired.len() >= 6, "allow fired {}", fired.len());
    assert_every_second_once(&fired);
    assert!(
        fired
            .windows(2)
            .any(|w| w[1].created < w[0].finished.unwrap()),
        "allow: no two firings ran at once: {fired:?}"
    );
    assert_eq!(listed(&app, &allow)["skipped_overlap"], 0);
    app.cleanup().await;
}

#[tokio::test]
async fn schedules_catch_up_ticks_within_the_window_after_both_schedulers_were_down() {
    let mut app = TestApp::start().await;
    let a = app.spawn(&["scheduler"]);
    let b = app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let id = add(
        &app,
        "catch-up",
        "echo",
        &json!({ "text": "tick" }),
        &["--every", "1s", "--overlap", "allow", "--catch-up", "4s"],
    );
    wait_firings(&app, &id, "three firings", DEADLINE, |f| f.len() >= 3).await;
    app.kill(a);
    app.kill(b);
    let down = db_now(&app).await;
    // The downtime itself: 10 s by the database's clock.
    app.wait_for("10 s of downtime", Duration::from_secs(20), || async {
        secs(down, db_now(&app).await) >= 10
    })
    .await;
    let before = firings(&app, &id).await.len();
    let up = db_now(&app).await;
    assert!(secs(down, up) >= 10);
    app.spawn(&["scheduler"]);
    app.spawn(&["scheduler"]);
    let after = up + chrono::Duration::seconds(2);
    wait_firings(&app, &id, "a tick after the restart", DEADLINE, |f| {
        f.iter().any(|f| f.tick > after)
    })
    .await;
    app.agentq_ok(&["schedules", "pause", &id]);

    let fired = firings(&app, &id).await;
    let s = listed(&app, &id);
    let missed = s["skipped_missed"].as_i64().unwrap();
    // Every tick from the first to the last was either fired or counted as missed.
    let (first, last) = (fired[0].tick, fired[fired.len() - 1].tick);
    assert_eq!(
        fired.len() as i64 + missed,
        secs(first, last) + 1,
        "fired {} + missed {missed} ≠ ticks from {first} to {last}",
        fired.len()
    );
    assert!(missed >= 3, "only {missed} ticks missed in 10 s down: {s}");
    // The first pass after the restart caught up the ticks of the last 4 s, all at once (the
    // same pass, so the same creation time); and no firing after the restart is older than
    // the window.
    let restart = fired[before].created;
    let caught_up: Vec<&Firing> = fired[before..]
        .iter()
        .filter(|f| f.created == restart)
        .collect();
    assert!(
        caught_up.len() >= 4 && secs(caught_up[0].tick, restart) >= 3,
        "the first pass caught up {caught_up:?}"
    );
    for f in &fired[before..] {
        assert!(
            f.created - f.tick <= chrono::Duration::seconds(5),
            "{f:?} fired outside the 4 s catch-up window"
        );
    }
    // And the gap between the last firing before the downtime and the first caught-up one is
    // exactly the missed ticks.
    let gap = secs(fired[before - 1].tick, fired[before].tick) - 1;
    assert_eq!(gap, missed, "{fired:?}");
    app.cleanup().await;
}

/// `agentq schedules add` of `kind` and `input` with `args` exits 2 saying `says`.
fn refused_by_cli(app: &TestApp, kind: &str, input: &str, args: &[&str], says: &str) {
    let out = app.agentq(&strs(&add_command("bad", kind, input, args)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{kind} {input} {args:?}: {err}");
    assert!(err.contains(says), "{kind} {input} {args:?}: {err}");
}

#[tokio::test]
async fn schedules_refuse_bad_input_and_another_tenants_id_writing_nothing() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let operator = app.token("t1", "operator");
    let producer = app.token("t1", "producer");
    let other = app.token("t2", "operator");
    let audit_before: i64 = sqlx::query_scalar("SELECT count(*) FROM operator_actions")
        .fetch_one(&app.pool)
        .await
        .unwrap();

    let echo = json!({ "text": "x" }).to_string();
    // CLI: each refused with exit code 2 and a message naming the fault.
    for (args, says) in [
        (vec!["--cron", "every minute"], "is not valid"),
        (vec!["--cron", "61 * * * *"], "is not valid"),
        (
            vec!["--cron", "0 9 * * *", "--tz", "Mars/Olympus"],
            "unknown time zone",
        ),
        (vec!["--cron", "0 0 0 1 1 * 2001"], "would never fire"),
        (vec!["--every", "0s"], "an interval is 1 s to"),
        (vec!["--every", "400d"], "an interval is 1 s to"),
        (vec!["--every", "soon"], "use a duration"),
        (vec!["--every", "1s", "--catch-up", "0s"], "catch-up window"),
        (
            vec!["--every", "1s", "--overlap", "sometimes"],
            "unknown overlap policy",
        ),
        (vec![], "either a cron expression"),
    ] {
        refused_by_cli(&app, "echo", &echo, &args, says);
    }
    let every = ["--every", "1m"];
    let triage = json!({ "event": {}, "source": "s", "webhook_id": "w",
                         "config": { "callback_url": "https://example.com/cb" } });
    refused_by_cli(&app, "nope", &echo, &every, "unknown kind");
    refused_by_cli(&app, "echo", r#"{"txt":"x"}"#, &every, "unknown field");
    refused_by_cli(&app, "echo", "{", &every, "not valid JSON");
    refused_by_cli(
        &app,
        "triage",
        &triage.to_string(),
        &every,
        "webhook source",
    );

    // API: 422 naming the field.
    let good =
        json!({ "name": "ok", "kind": "echo", "input": { "text": "x" }, "interval_secs": 60 });
    let with = |patch: Value| {
        let mut b = good.clone();
        for (k, v) in patch.as_object().unwrap() {
            if v.is_null() {
                b.as_object_mut().unwrap().remove(k);
            } else {
                b[k] = v.clone();
            }
        }
        b
    };
    for (body, field) in [
        (with(json!({ "interval_secs": 0 })), "/interval_secs"),
        (
            with(json!({ "interval_secs": 99_999_999_999i64 })),
            "/interval_secs",
        ),
        (
            with(json!({ "interval_secs": null, "cron": "* * *" })),
            "/cron",
        ),
        (
            with(
                json!({ "interval_secs": null, "cron": "0 9 * * *", "time_zone": "Nowhere/City" }),
            ),
            "/time_zone",
        ),
        (with(json!({ "cron": "0 9 * * *" })), "/cron"),
        (with(json!({ "kind": "nope" })), "/kind"),
        (with(json!({ "input": { "txt": 1 } })), "/input/txt"),
        (with(json!({ "name": "has space" })), "/name"),
        (
            with(json!({ "catchup_window_secs": -1 })),
            "/catchup_window_secs",
        ),
        (with(json!({ "max_attempts": 0 })), "/max_attempts"),
    ] {
        let p = api
            .post("/v1/schedules", Some(&operator), &body)
            .await
            .problem(422, "unprocessable");
        assert_eq!(p["field"], field, "{body}: {p}");
    }
    for body in [
        with(json!({ "overlap": "sometimes" })),
        with(json!({ "surprise": 1 })),
        with(json!({ "interval_secs": "60" })),
    ] {
        let r = api.post("/v1/schedules", Some(&operator), &body).await;
        assert!(
            r.status == 400 || r.status == 422,
            "{body}: {} {}",
            r.status,
            r.text()
        );
    }
    api.post("/v1/schedules", Some(&producer), &good)
        .await
        .problem(403, "forbidden");
    api.post(
        "/v1/schedules",
        Some(&operator),
        &with(json!({ "tenant": "t2" })),
    )
    .await
    .problem(403, "forbidden");
    // Nothing was written by any of them.
    let count = |sql: &'static str| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(count("SELECT count(*) FROM schedules").await, 0);
    assert_eq!(
        count("SELECT count(*) FROM operator_actions").await,
        audit_before
    );

    // Another tenant's schedule: not found on every route, exactly like a missing one.
    let theirs = api
        .post("/v1/schedules", Some(&other), &good)
        .await
        .expect(201);
    let theirs = theirs["schedule_id"].as_str().unwrap().to_string();
    let missing = Uuid::new_v4().to_string();
    for (method, suffix) in [
        (Method::GET, ""),
        (Method::POST, "/pause"),
        (Method::POST, "/resume"),
        (Method::DELETE, ""),
    ] {
        let call = |id: &str| {
            let path = format!("/v1/schedules/{id}{suffix}");
            send(
                format!("{method} {path}"),
                api.req(method.clone(), &path, Some(&operator)),
            )
        };
        let p = call(&theirs).await.problem(404, "not-found");
        let q = call(&missing).await.problem(404, "not-found");
        assert_eq!(
            p["detail"].as_str().map(|d| d.replace(&theirs, "{id}")),
            q["detail"].as_str().map(|d| d.replace(&missing, "{id}")),
            "{method} {suffix}: another tenant's id answers differently from a missing one"
        );
    }
    let list = api.get("/v1/schedules", Some(&operator)).await.expect(200);
    assert_eq!(list["items"], json!([]), "{list}");
    // Neither an id nor a name is a 400; a name the tenant has no schedule of, a 404; the same
    // name twice, a 409.
    api.get("/v1/schedules/not%20a%20name", Some(&operator))
        .await
        .problem(400, "invalid-request");
    api.get("/v1/schedules/not-a-uuid", Some(&operator))
        .await
        .problem(404, "not-found");
    api.post("/v1/schedules", Some(&other), &good)
        .await
        .problem(409, "conflict");
    // Theirs is untouched, and only its addition was audited.
    let s = api
        .get(&format!("/v1/schedules/{theirs}"), Some(&other))
        .await
        .expect(200);
    assert_eq!((&s["paused"], &s["tenant"]), (&json!(false), &json!("t2")));
    assert_eq!(count("SELECT count(*) FROM schedules").await, 1);
    assert_eq!(
        count("SELECT count(*) FROM operator_actions").await,
        audit_before + 1
    );
    assert_eq!(count("SELECT count(*) FROM operations").await, 0);
    // A producer's key may not take a firing's.
    let r = send(
        "enqueue with a schedule: key",
        api.req(Method::POST, "/v1/operations", Some(&producer))
            .header(
                "idempotency-key",
                format!("schedule:{theirs}:2030-01-01T00:00:00Z"),
            )
            .json(&json!({ "kind": "echo", "input": { "text": "x" } })),
    )
    .await;
    r.problem(422, "unprocessable");
    app.cleanup().await;
}

#[tokio::test]
async fn schedules_over_the_api_and_in_the_console_fire_and_are_audited() {
    let mut app = TestApp::start().await;
    app.spawn(&["scheduler"]);
    app.spawn(&["worker"]);
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let operator = app.token("t1", "operator");

    // Every 2 s by a cron expression with seconds, read in Berlin.
    let created = api
        .post(
            "/v1/schedules",
            Some(&operator),
            &json!({
                "name": "nightly-ish", "kind": "echo", "input": { "text": "hello" },
                "cron": "*/2 * * * * *", "time_zone": "Europe/Berlin", "overlap": "buffer_one",
                "catchup_window_secs": 30
            }),
        )
        .await
        .expect(201);
    let id = created["schedule_id"].as_str().unwrap().to_string();
    let next: Vec<DateTime<Utc>> = serde_json::from_value(created["next_firings"].clone()).unwrap();
    assert_eq!(next.len(), 5, "{created}");
    for w in next.windows(2) {
        assert_eq!(secs(w[0], w[1]), 2, "{created}");
    }
    assert_eq!(created["time_zone"], "Europe/Berlin");
    assert_eq!(created["overlap"], "buffer_one");
    assert!(
        created.get("input").is_none(),
        "the view never shows the input"
    );

    // It fires ordinary operations that carry its id.
    wait_firings(&app, &id, "a firing to succeed", DEADLINE, |f| {
        f.iter().any(|f| f.status == "succeeded")
    })
    .await;
    let op = firings(&app, &id).await[0].clone();
    assert_eq!(op.tick.timestamp() % 2, 0, "{op:?}");
    let listed = api.get("/v1/schedules", Some(&operator)).await.expect(200);
    assert_eq!(listed["items"][0]["schedule_id"], json!(id), "{listed}");
    assert!(
        listed["items"][0]["fired"].as_i64().unwrap() >= 1,
        "{listed}"
    );
    let last = listed["items"][0]["last_op_id"]
        .as_str()
        .unwrap()
        .to_string();
    let shown = api
        .get(&format!("/v1/operations/{last}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(shown["schedule_id"], json!(id), "{shown}");

    // The console lists it with its next firings; pause needs the session's CSRF token.
    let mut ui = Browser::new(&base);
    let (status, _) = ui.login(&operator).await;
    assert_eq!(status, 303);
    let (status, page) = ui.get("/ui/schedules").await;
    assert_eq!(status, 200);
    assert!(
        page.contains("nightly-ish") && page.contains("Europe/Berlin"),
        "{page}"
    );
    assert!(page.contains(&format!("data-schedule=\"{id}\"")), "{page}");
    let csrf = csrf_of(&page);
    let path = format!("/ui/schedules/{id}/pause");
    let r = ui.post(&path, &[("csrf", "forged")]).await;
    assert_eq!(r.status().as_u16(), 403);
    assert_eq!(
        api.get(&format!("/v1/schedules/{id}"), Some(&operator))
            .await
            .expect(200)["paused"],
        false
    );
    let r = ui.post(&path, &[("csrf", &csrf)]).await;
    assert_eq!(r.status().as_u16(), 303);
    let paused = api
        .get(&format!("/v1/schedules/{id}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(paused["paused"], true, "{paused}");
    assert_eq!(paused["next_firings"], json!([]), "{paused}");
    let (_, page) = ui.get("/ui/schedules").await;
    assert!(
        page.contains("paused") && page.contains("/resume"),
        "{page}"
    );
    // Its name is taken wherever its id is: pausing again by name is a conflict; resuming by
    // name over the API fires again. Another tenant's operator finds no schedule of that name.
    let by_name = api
        .get("/v1/schedules/nightly-ish", Some(&operator))
        .await
        .expect(200);
    assert_eq!(by_name["schedule_id"], json!(id), "{by_name}");
    let other = app.token("t2", "operator");
    api.get("/v1/schedules/nightly-ish", Some(&other))
        .await
        .problem(404, "not-found");
    api.post("/v1/schedules/nightly-ish/resume", Some(&other), &json!({}))
        .await
        .problem(404, "not-found");
    // A name that reads as a UUID is refused: it would be taken for an id.
    let uuid_named = api
        .post(
            "/v1/schedules",
            Some(&operator),
            &json!({ "name": uuid::Uuid::new_v4().to_string(), "kind": "echo",
                     "input": { "text": "x" }, "interval_secs": 60 }),
        )
        .await
        .problem(422, "unprocessable");
    assert_eq!(uuid_named["field"], "/name", "{uuid_named}");
    api.post(
        "/v1/schedules/nightly-ish/pause",
        Some(&operator),
        &json!({}),
    )
    .await
    .problem(409, "conflict");
    let resumed = api
        .post(
            "/v1/schedules/nightly-ish/resume",
            Some(&operator),
            &json!({}),
        )
        .await
        .expect(200);
    assert_eq!(resumed["paused"], false);
    assert_eq!(resumed["next_firings"].as_array().unwrap().len(), 5);
    // Deleted from the console; its operations stay.
    let r = ui
        .post(&format!("/ui/schedules/{id}/delete"), &[("csrf", &csrf)])
        .await;
    assert_eq!(r.status().as_u16(), 303);
    api.get(&format!("/v1/schedules/{id}"), Some(&operator))
        .await
        .problem(404, "not-found");
    assert!(!firings(&app, &id).await.is_empty());
    let (_, page) = ui.get(&format!("/ui/operations?schedule={id}")).await;
    assert!(
        page.contains(&op_link(&last)),
        "the console lists the schedule's operations"
    );

    // Every change was audited under the token's prefix.
    let actions: Vec<(String, String)> = sqlx::query_as(
        "SELECT action, actor FROM operator_actions
          WHERE details->>'schedule_id' = $1 ORDER BY id",
    )
    .bind(&id)
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let names: Vec<&str> = actions.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(
        names,
        [
            "schedule_add",
            "schedule_pause",
            "schedule_resume",
            "schedule_delete"
        ]
    );
    assert!(
        actions
            .iter()
            .all(|(_, by)| by == &format!("token:{}", &operator[..12])),
        "{actions:?}"
    );
    app.cleanup().await;
}

fn op_link(op: &str) -> String {
    format!("/ui/operations/{op}")
}
