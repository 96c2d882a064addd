//! `GET /v1/operations` (and `agentq list`): listing and searching operations, one keyset page
//! at a time, confined to the caller's tenant through every filter and every cursor; a walk
//! of all pages sees each operation exactly once while new ones arrive. And batches over HTTP:
//! start → status → pause → resume → cancel → report, on the same application flows as
//! `agentq batch`.

use std::collections::{BTreeMap, BTreeSet};

use agentq_core::Lane;
use agentq_producer::EnqueueRequest;
use reqwest::Method;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::api::{Api, enqueue_cli, send, urlencode};
use crate::batch::{TempDir, write_docs};
use crate::harness::{DEADLINE, TestApp, running_app};

/// Enqueues `n` echo operations per tenant in one statement each (library producer).
async fn enqueue(app: &TestApp, tenant: &str, n: usize, batch: Option<Uuid>) -> Vec<Uuid> {
    let (producer, dispatcher) = app.producer();
    let reqs = (0..n)
        .map(|i| EnqueueRequest {
            tenant: tenant.into(),
            kind: "echo".into(),
            input: json!({ "text": format!("{tenant} {i}") }),
            lane: Lane::Batch,
            batch_id: batch,
            ..Default::default()
        })
        .collect();
    let bulk = producer.enqueue_many(reqs).await.expect("enqueue_many");
    dispatcher.close().await;
    assert!(bulk.refused.is_empty(), "{:?}", bulk.refused);
    bulk.created.into_iter().map(|o| o.0).collect()
}

/// Every page of `GET /v1/operations?{query}` with `limit`, in order.
async fn walk(api: &Api, token: &str, query: &str, limit: usize) -> Vec<Value> {
    walk_after(api, token, query, limit, None).await
}

/// Every page of `GET /v1/operations?{query}` with `limit` after the cursor `after`, in order.
async fn walk_after(
    api: &Api,
    token: &str,
    query: &str,
    limit: usize,
    mut after: Option<String>,
) -> Vec<Value> {
    let mut items = Vec::new();
    for _ in 0..10_000 {
        let mut path = format!("/v1/operations?limit={limit}");
        if !query.is_empty() {
            path.push_str(&format!("&{query}"));
        }
        if let Some(a) = &after {
            path.push_str(&format!("&after={}", urlencode(a)));
        }
        let page = api.get(&path, Some(token)).await.expect(200);
        let got = page["items"].as_array().cloned().unwrap_or_default();
        assert!(got.len() <= limit, "{path}: {} items", got.len());
        items.extend(got);
        match page["next_cursor"].as_str() {
            Some(c) => after = Some(c.to_string()),
            None => return items,
        }
    }
    panic!("{query}: more than 10,000 pages");
}

fn ids(items: &[Value]) -> Vec<String> {
    items
        .iter()
        .map(|i| i["op_id"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// The ids the database has for `tenant` (all tenants when `None`) matching `sql_filter`.
async fn expected(app: &TestApp, tenant: Option<&str>, sql_filter: &str) -> BTreeSet<String> {
    let sql = format!(
        "SELECT id::text FROM operations WHERE ($1::text IS NULL OR tenant_id = $1) AND {sql_filter}"
    );
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .fetch_all(&app.pool)
        .await
        .unwrap_or_else(|e| panic!("{sql_filter}: {e}"))
        .into_iter()
        .collect()
}

#[tokio::test]
async fn api_list_shows_a_producer_only_its_tenant_through_every_filter_and_cursor() {
    let mut app = running_app().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let alpha = app.token("alpha", "producer");
    let beta = app.token("beta", "producer");
    let admin = app.token("ops", "admin");
    let batch = Uuid::new_v4();
    for tenant in ["alpha", "beta"] {
        enqueue(&app, tenant, 23, None).await;
        enqueue(&app, tenant, 5, Some(batch)).await;
        enqueue_cli(
            &app,
            tenant,
            "script",
            &json!({ "steps": [{ "fail": "non_retryable", "times": 9 }] }),
        );
        enqueue_cli(
            &app,
            tenant,
            "script",
            &json!({ "steps": [{ "wait_signal": "go", "timeout_ms": 600_000 }] }),
        );
    }
    app.wait_for(
        "every echo to succeed and the scripts to settle",
        DEADLINE,
        || async {
            expected(&app, None, "status IN ('queued', 'running')")
                .await
                .is_empty()
        },
    )
    .await;

    // Filters, as a query string and as the SQL they mean.
    let filters: Vec<(String, String)> = vec![
        (String::new(), "true".into()),
        ("status=succeeded".into(), "status = 'succeeded'".into()),
        (
            "status=dead,waiting".into(),
            "status IN ('dead', 'waiting')".into(),
        ),
        (
            "status=dead&status=succeeded".into(),
            "status IN ('dead', 'succeeded')".into(),
        ),
        ("kind=script".into(), "kind = 'script'".into()),
        (format!("batch={batch}"), format!("batch_id = '{batch}'")),
        (
            "created_after=1h".into(),
            "created_at >= now() - interval '1 hour'".into(),
        ),
        ("created_before=1h".into(), "false".into()),
        ("finished_after=1h".into(), "finished_at IS NOT NULL".into()),
        (
            "finished_before=2099-01-01T00:00:00Z&kind=echo".into(),
            "finished_at IS NOT NULL AND kind = 'echo'".into(),
        ),
        // Injection-looking values are values: they match nothing.
        ("kind=%27%20OR%20%271%27%3D%271".into(), "false".into()),
        (
            "kind=echo%3B%20DROP%20TABLE%20operations".into(),
            "false".into(),
        ),
    ];
    for (query, sql) in &filters {
        for (tenant, token) in [("alpha", &alpha), ("beta", &beta)] {
            let got = ids(&walk(&api, token, query, 4).await);
            let unique: BTreeSet<String> = got.iter().cloned().collect();
            assert_eq!(unique.len(), got.len(), "{tenant} ?{query}: an item twice");
            assert_eq!(
                unique,
                expected(&app, Some(tenant), sql).await,
                "{tenant} ?{query}"
            );
        }
        // The admin sees both tenants, or the one it names.
        let all: BTreeSet<String> = ids(&walk(&api, &admin, query, 50).await)
            .into_iter()
            .collect();
        assert_eq!(all, expected(&app, None, sql).await, "admin ?{query}");
        let sep = if query.is_empty() { "" } else { "&" };
        let named: BTreeSet<String> =
            ids(&walk(&api, &admin, &format!("tenant=beta{sep}{query}"), 50).await)
                .into_iter()
                .collect();
        assert_eq!(
            named,
            expected(&app, Some("beta"), sql).await,
            "admin beta ?{query}"
        );
    }

    // Newest first, each item compact: no input, result or error message.
    let page = api
        .get("/v1/operations?limit=1000", Some(&alpha))
        .await
        .expect(200);
    let items = page["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 30);
    assert!(page["next_cursor"].is_null(), "{page}");
    let order: Vec<(String, String)> = items
        .iter()
        .map(|i| {
            (
                i["created_at"].as_str().unwrap_or_default().to_string(),
                i["op_id"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let mut sorted = order.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(order, sorted, "newest first by (created_at, id)");
    for i in &items {
        for hidden in ["input", "result", "error_message", "request_id"] {
            assert!(i.get(hidden).is_none(), "{hidden} listed: {i}");
        }
        assert_eq!(i["tenant"], "alpha");
    }
    let dead = items
        .iter()
        .find(|i| i["status"] == "dead")
        .unwrap_or_else(|| panic!("no dead operation in {items:?}"));
    assert_eq!(dead["error_class"], "non_retryable");

    // Beta's cursors walk alpha's list only: a cursor names a place, never a tenant.
    let beta_page = api
        .get("/v1/operations?limit=3", Some(&beta))
        .await
        .expect(200);
    let beta_ids: BTreeSet<String> = expected(&app, Some("beta"), "true").await;
    for item in beta_page["items"].as_array().cloned().unwrap_or_default() {
        let cursor = item["cursor"].as_str().unwrap_or_default().to_string();
        let seen = ids(&walk_after(&api, &alpha, "", 7, Some(cursor)).await);
        assert!(
            seen.iter().all(|id| !beta_ids.contains(id)),
            "alpha after beta's cursor saw beta: {seen:?}"
        );
    }

    // Naming another tenant is refused, and so is every other try; nothing of beta leaks.
    for query in [
        "tenant=beta",
        "tenant=beta&kind=echo",
        "tenant=%2A",
        "tenant=alpha%27%20OR%201%3D1",
    ] {
        let r = api
            .get(&format!("/v1/operations?{query}"), Some(&alpha))
            .await;
        r.problem(403, "forbidden");
        assert!(
            !r.text()
                .contains(&beta_ids.iter().next().cloned().unwrap_or_default())
        );
    }
    let own = api
        .get("/v1/operations?tenant=alpha&limit=1", Some(&alpha))
        .await
        .expect(200);
    assert_eq!(own["items"][0]["tenant"], "alpha", "{own}");

    // The CLI runs the same flow.
    let out = app.agentq_ok(&[
        "list",
        "--tenant",
        "beta",
        "--status",
        "dead,waiting",
        "--json",
    ]);
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let cli: BTreeSet<String> = ids(&lines).into_iter().collect();
    assert_eq!(
        cli,
        expected(&app, Some("beta"), "status IN ('dead', 'waiting')").await
    );
    assert!(lines.iter().all(|l| l["cursor"].is_string()), "{lines:?}");
    let refused = app.agentq(&["list", "--created-after", "0001-01-01T00:00:00Z"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--created-after"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    app.cleanup().await;
}

#[tokio::test]
async fn api_list_walks_every_operation_exactly_once_while_new_ones_arrive() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let token = app.token("t1", "producer");
    // Several statements' worth, each sharing its created_at (one transaction): ties are
    // ordered by id.
    let mut before = Vec::new();
    for _ in 0..6 {
        before.extend(enqueue(&app, "t1", 50, None).await);
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let inserter = {
        let (producer, dispatcher) = app.producer();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut added = 0;
            while !stop.is_cancelled() {
                let reqs = (0..5)
                    .map(|i| EnqueueRequest {
                        tenant: "t1".into(),
                        kind: "echo".into(),
                        input: json!({ "text": format!("late {added} {i}") }),
                        lane: Lane::Batch,
                        ..Default::default()
                    })
                    .collect();
                added += producer
                    .enqueue_many(reqs)
                    .await
                    .expect("enqueue")
                    .created
                    .len();
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            dispatcher.close().await;
            added
        })
    };
    let seen = ids(&walk(&api, &token, "", 7).await);
    stop.cancel();
    let added = inserter.await.expect("the inserter");
    assert!(added > 0, "nothing was inserted during the walk");
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for id in &seen {
        *counts.entry(id.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "seen more than once: {twice:?}");
    let missed: Vec<_> = before
        .iter()
        .map(Uuid::to_string)
        .filter(|id| !counts.contains_key(id.as_str()))
        .collect();
    assert!(
        missed.is_empty(),
        "{} of {} missed: {missed:?}",
        missed.len(),
        before.len()
    );
    println!(
        "walked {} operations in pages of 7 ({} existed, {added} added meanwhile)",
        seen.len(),
        before.len()
    );
    app.cleanup().await;
}

#[tokio::test]
async fn api_batches_start_status_pause_resume_cancel_and_report_over_http() {
    let mut app = TestApp::start().await;
    let (_, base) = app.serve().await;
    let api = Api::new(&base);
    let operator = app.token("t1", "operator");
    let other = app.token("t2", "operator");
    let producer = app.token("t1", "producer");
    let src = TempDir::new("api-batch-src");
    let dst = TempDir::new("api-batch-dst");
    let docs = write_docs(&src.0, 5);
    let source = app.dir_store("t1", &src.0, "read");
    let target = app.dir_store("t1", &dst.0, "write");
    let body = json!({ "source": source, "target": target, "instructions": "Keep it.",
                       "canary": 2, "require": ["Title:"] });

    // Refusals first: nothing is created by any of them.
    api.post("/v1/batches", Some(&producer), &body)
        .await
        .problem(403, "forbidden");
    let mut elsewhere = body.clone();
    elsewhere["tenant"] = json!("t2");
    api.post("/v1/batches", Some(&operator), &elsewhere)
        .await
        .problem(403, "forbidden");
    for (bad, field) in [
        (
            json!({ "source": source, "target": target }),
            "instructions",
        ),
        (
            json!({ "source": "nope", "target": target, "instructions": "x" }),
            "source",
        ),
        (
            json!({ "source": source, "target": target, "instructions": "x", "pause_ratio": 2 }),
            "pause_ratio",
        ),
        (
            json!({ "source": source, "target": target, "instructions": "x", "extra": 1 }),
            "extra",
        ),
    ] {
        let p = api
            .post("/v1/batches", Some(&operator), &bad)
            .await
            .problem(422, "unprocessable");
        let named = format!("{} {}", p["field"], p["detail"]);
        assert!(named.contains(field), "{bad}: {p}");
    }
    assert_eq!(app.operation_count().await, 0);

    // Start a canary, then start it again: the same batch, nothing more enqueued.
    let started = api
        .post("/v1/batches", Some(&operator), &body)
        .await
        .expect(201);
    assert_eq!(
        (
            &started["created"],
            &started["status"],
            &started["documents"],
            &started["enqueued"]
        ),
        (&json!(true), &json!("canary"), &json!(5), &json!(2)),
        "{started}"
    );
    let id = started["batch_id"].as_str().unwrap_or_default().to_string();
    let again = api
        .post("/v1/batches", Some(&operator), &body)
        .await
        .expect(200);
    assert_eq!(
        (
            &again["created"],
            &again["enqueued"],
            &again["existing"],
            &again["batch_id"]
        ),
        (&json!(false), &json!(0), &json!(2), &json!(id)),
        "{again}"
    );
    let status = api
        .get(&format!("/v1/batches/{id}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(
        (&status["status"], &status["enqueued"]),
        (&json!("canary"), &json!(2))
    );
    // The operations carry the options every input gets.
    let input: Value =
        sqlx::query_scalar("SELECT input FROM operations WHERE batch_id = $1::uuid LIMIT 1")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .expect("a batch operation");
    assert_eq!(
        input["validate"],
        json!({ "required": ["Title:"] }),
        "{input}"
    );

    // Another tenant's operator finds no such batch.
    for (method, path) in [
        (Method::GET, format!("/v1/batches/{id}")),
        (Method::GET, format!("/v1/batches/{id}/report")),
        (Method::POST, format!("/v1/batches/{id}/pause")),
        (Method::POST, format!("/v1/batches/{id}/cancel")),
    ] {
        send(
            format!("{method} {path} as t2"),
            api.req(method.clone(), &path, Some(&other)),
        )
        .await
        .problem(404, "not-found");
    }

    let control = async |action: &str| {
        let path = format!("/v1/batches/{id}/{action}");
        api.post(&path, Some(&operator), &json!({ "reason": "http test" }))
            .await
    };
    let paused = control("pause").await.expect(200);
    assert_eq!(paused["result"], "paused", "{paused}");
    let status = api
        .get(&format!("/v1/batches/{id}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(status["status"], "paused");
    control("pause").await.problem(409, "conflict");
    let resumed = control("resume").await.expect(200);
    assert_eq!(
        (&resumed["result"], &resumed["was"], &resumed["enqueued"]),
        (&json!("resumed"), &json!("paused"), &json!(3)),
        "{resumed}"
    );
    let listed = walk(&api, &operator, &format!("batch={id}"), 2).await;
    assert_eq!(listed.len(), 5, "{listed:?}");
    let cancelled = control("cancel").await.expect(200);
    assert_eq!(
        (&cancelled["result"], &cancelled["cancelled"]),
        (&json!("cancelled"), &json!(5)),
        "{cancelled}"
    );
    let status = api
        .get(&format!("/v1/batches/{id}"), Some(&operator))
        .await
        .expect(200);
    assert_eq!(
        (&status["status"], &status["unfinished"]),
        (&json!("cancelled"), &json!(0))
    );
    let gone = walk(
        &api,
        &operator,
        &format!("batch={id}&status=cancelled"),
        100,
    )
    .await;
    assert_eq!(gone.len(), 5);

    // The report: every document once, as `agentq batch report` has it.
    let report = api
        .get(&format!("/v1/batches/{id}/report"), Some(&operator))
        .await
        .expect(200);
    let lines = report["documents"].as_array().cloned().unwrap_or_default();
    let reported: Vec<&str> = lines
        .iter()
        .map(|l| l["doc_id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        reported,
        docs.keys().map(String::as_str).collect::<Vec<_>>()
    );
    assert_eq!(report["totals"], json!({ "cancelled": 5 }), "{report}");
    let cli = app.agentq_ok(&["batch", "report", &id]);
    let cli: Vec<Value> = String::from_utf8_lossy(&cli.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(cli, lines, "the CLI and the API report the same");

    // Every control is audited under the token.
    let audited: Vec<String> = sqlx::query_scalar(
        "SELECT action FROM operator_actions WHERE details->>'batch_id' = $1 AND actor LIKE 'token:%' ORDER BY id",
    )
    .bind(&id)
    .fetch_all(&app.pool)
    .await
    .expect("the audit trail");
    assert!(audited.len() >= 4, "{audited:?}");
    app.cleanup().await;
}
