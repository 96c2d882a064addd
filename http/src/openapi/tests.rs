//! Tests of the OpenAPI document: every route documented once, every schema generated from
//! a type and resolvable, and real answers and requests checked against their schemas.

use std::collections::BTreeSet;

use agentq_app::batches::Failure;
use agentq_app::dlq::{ActionView, DeadLetterView, StatRow};
use agentq_app::operations::Summary;
use agentq_core::operation::{Lane, OperationId, OperationView, Status, StepView};
use agentq_core::state::{BatchStatus, DeadLetterStatus, Overlap, Replay, StepKind, StepStatus};
use axum::response::IntoResponse;
use chrono::Utc;
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::*;
use crate::problem::ApiError;

#[test]
fn every_route_is_documented_once_with_its_parameters() {
    let doc = spec();
    let mut seen = std::collections::HashSet::new();
    for route in ROUTES {
        assert!(
            seen.insert((route.method, route.path)),
            "{} {} twice",
            route.method,
            route.path
        );
        let op = &doc["paths"][route.path][route.method];
        assert!(op.is_object(), "{} {} missing", route.method, route.path);
        let params = op["parameters"].as_array().unwrap();
        for p in route.path.split('/').filter_map(|s| s.strip_prefix('{')) {
            let name = p.trim_end_matches('}');
            assert!(
                params
                    .iter()
                    .any(|x| x["name"] == name && x["in"] == "path"),
                "{name}"
            );
        }
        for reference in op.to_string().split("#/components/schemas/").skip(1) {
            let name = reference.split('"').next().unwrap();
            assert!(
                doc["components"]["schemas"][name].is_object(),
                "schema {name} undefined"
            );
        }
    }
    assert_eq!(doc["openapi"], "3.1.0");
}

/// The names `types` put in `components.schemas`.
fn names(types: &[Describe]) -> BTreeSet<String> {
    let mut generator = settings().into_generator();
    types
        .iter()
        .map(|describe| {
            let reference = describe(&mut generator);
            reference
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix("#/components/schemas/"))
                .unwrap_or_else(|| panic!("{reference:?} is not a named type"))
                .to_string()
        })
        .collect()
}

/// Route schemas that are no Rust type: not JSON, or any JSON, or the document itself.
const NOT_TYPES: [&str; 4] = ["Metrics", "EventStream", "AnyJson", "OpenApi"];

#[test]
fn every_route_body_and_answer_is_a_generated_type() {
    let (requests, answers) = (names(REQUESTS), names(ANSWERS));
    let mut used = BTreeSet::from(["Problem".to_string(), "Accepted".to_string()]);
    for route in ROUTES {
        let (_, ok) = route.ok;
        for (name, generated) in route
            .body
            .map(|b| (b, &requests))
            .into_iter()
            .chain([(ok, &answers)])
        {
            assert!(
                generated.contains(name) || NOT_TYPES.contains(&name),
                "{} {} names {name}, which no type in REQUESTS/ANSWERS generates",
                route.method,
                route.path
            );
            used.insert(name.to_string());
        }
    }
    let unused: Vec<_> = requests
        .union(&answers)
        .filter(|n| !used.contains(*n))
        .collect();
    assert!(unused.is_empty(), "generated for no route: {unused:?}");
}

#[test]
fn every_ref_resolves() {
    fn walk(v: &Value, doc: &Value, refs: &mut usize) {
        match v {
            Value::Object(map) => {
                if let Some(r) = map.get("$ref") {
                    let r = r.as_str().expect("a $ref is a string");
                    assert!(r.starts_with("#/components/schemas/"), "{r}");
                    assert!(doc.pointer(&r[1..]).is_some(), "{r} resolves to nothing");
                    *refs += 1;
                }
                map.values().for_each(|x| walk(x, doc, refs));
            }
            Value::Array(items) => items.iter().for_each(|x| walk(x, doc, refs)),
            _ => {}
        }
    }
    let doc = spec();
    let mut refs = 0;
    walk(&doc, &doc, &mut refs);
    assert!(refs > ROUTES.len(), "only {refs} references");
    for (name, schema) in doc["components"]["schemas"].as_object().unwrap() {
        assert!(schema.is_object(), "{name}: {schema}");
        assert!(
            !schema.to_string().contains("[`"),
            "{name}'s description has a rustdoc link: {schema}"
        );
    }
}

#[test]
fn a_type_both_read_and_written_has_one_schema() {
    let read = generated(settings().for_deserialize(), REQUESTS);
    let written = generated(settings().for_serialize(), ANSWERS);
    for (name, schema) in &read {
        if let Some(w) = written.get(name) {
            assert_eq!(schema, w, "{name} is read and written differently");
        }
    }
}

/// Validates JSON against the document's schemas, more strictly than a client must: no
/// object may carry a property its schema does not name (`unevaluatedProperties: false`),
/// so a field renamed on one side only fails twice (missing and unexpected).
struct Checker {
    schemas: Value,
    checked: BTreeSet<String>,
}

impl Checker {
    fn new() -> Self {
        let mut schemas = spec()["components"]["schemas"].clone();
        // A schema another extends with properties of its own (`$ref` beside
        // `properties`) stays open; the one extending it is closed.
        let mut extended = BTreeSet::new();
        fn find(v: &Value, out: &mut BTreeSet<String>) {
            match v {
                Value::Object(m) => {
                    if let (Some(r), true) = (m.get("$ref"), m.contains_key("properties")) {
                        out.insert(r.as_str().unwrap().rsplit('/').next().unwrap().into());
                    }
                    m.values().for_each(|x| find(x, out));
                }
                Value::Array(a) => a.iter().for_each(|x| find(x, out)),
                _ => {}
            }
        }
        find(&schemas, &mut extended);
        for (name, schema) in schemas.as_object_mut().unwrap() {
            let o = schema.as_object_mut().unwrap();
            if !extended.contains(name)
                && (o.contains_key("properties") || o.contains_key("oneOf"))
                && !o.contains_key("additionalProperties")
            {
                o.insert("unevaluatedProperties".into(), false.into());
            }
        }
        Self {
            schemas,
            checked: BTreeSet::new(),
        }
    }

    /// What is wrong with `instance` as a `name`.
    fn errors(&mut self, name: &str, instance: &Value) -> Vec<String> {
        assert!(self.schemas.get(name).is_some(), "no schema {name}");
        self.checked.insert(name.to_string());
        let root = json!({
            "$ref": format!("#/components/schemas/{name}"),
            "components": { "schemas": self.schemas },
        });
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .should_validate_formats(true)
            .build(&root)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        validator
            .iter_errors(instance)
            .map(|e| {
                format!(
                    "at /{}: {e}",
                    e.instance_path().as_str().trim_start_matches('/')
                )
            })
            .collect()
    }

    /// `value` as sent matches the schema of its type.
    fn answer<T: Serialize + JsonSchema>(&mut self, value: &T) {
        let json = serde_json::to_value(value).unwrap();
        self.wire(&T::schema_name(), &json);
    }

    /// `json` matches the schema `name`.
    fn wire(&mut self, name: &str, json: &Value) {
        let errors = self.errors(name, json);
        assert!(errors.is_empty(), "{name} {json}:\n{}", errors.join("\n"));
    }

    /// The schema of `T` accepts `body` exactly when `T` reads it.
    fn request<T: DeserializeOwned + JsonSchema>(&mut self, body: Value) {
        let name = T::schema_name();
        let errors = self.errors(&name, &body);
        let read = serde_json::from_value::<T>(body.clone());
        assert_eq!(
            errors.is_empty(),
            read.is_ok(),
            "{name} {body}: the schema says {errors:?}, serde says {:?}",
            read.err()
        );
    }
}

fn operation(done: bool) -> OperationView {
    let now = Utc::now();
    let some = |s: &str| done.then(|| s.to_string());
    OperationView {
        op_id: OperationId::new(),
        tenant: "acme".into(),
        kind: "echo".into(),
        kind_version: Some("1".into()),
        version_parked: false,
        lane: if done { Lane::Interactive } else { Lane::Batch },
        status: if done {
            Status::Succeeded
        } else {
            Status::Waiting
        },
        attempt: 1,
        max_attempts: 5,
        restarts: 0,
        run_at: now,
        created_at: now,
        updated_at: now,
        finished_at: done.then_some(now),
        result: done.then(|| json!({ "text": "hi" })),
        error_class: some("retryable"),
        error_message: some("timeout"),
        waiting_for: (!done).then(|| "approval".into()),
        batch_id: done.then(Uuid::new_v4),
        dedupe_key: some("key-1"),
        ordering_key: some("order-1"),
        concurrency_key: some("account-7"),
        concurrency_limit: Some(3),
        request_id: some("req-1"),
        parent_id: done.then(Uuid::new_v4),
        schedule_id: done.then(Uuid::new_v4),
    }
}

fn step(seq: i32) -> StepView {
    let now = Utc::now();
    StepView {
        seq,
        name: "call".into(),
        kind: StepKind::Model,
        replay: Replay::Unsafe,
        status: if seq == 0 {
            StepStatus::Completed
        } else {
            StepStatus::Unknown
        },
        idempotency_key: "k".repeat(64),
        epoch: 2,
        started_at: now,
        completed_at: (seq == 0).then_some(now),
        wake_at: None,
        output: (seq == 0).then(|| json!([1, 2])),
        error: (seq != 0).then(|| "lost".into()),
        usage: (seq == 0).then(|| json!({ "prompt_tokens": 3 })),
    }
}

fn dead_letter(poison: bool) -> DeadLetterView {
    let op = (!poison).then(Uuid::new_v4);
    DeadLetterView {
        id: Uuid::new_v4(),
        op_id: op,
        tenant: op.map(|_| "acme".into()),
        kind: op.map(|_| "echo".into()),
        class: "retries_exhausted".into(),
        reason: "timeout".into(),
        attempts: 5,
        failed_step: op.map(|_| 1),
        created_at: Utc::now(),
        status: DeadLetterStatus::Retried,
        resolved_by: op.map(|_| "ops".into()),
        resolved_at: op.map(|_| Utc::now()),
        note: op.map(|_| "fixed".into()),
        batch_id: op,
        parent_id: op,
        raw_bytes: poison.then_some(12),
    }
}

/// A schedule as the application layer fills it: a cron one or an interval one.
fn schedule(cron: bool) -> app::schedules::ScheduleView {
    let now = Utc::now();
    app::schedules::ScheduleView {
        schedule: app::schedules::Schedule {
            schedule_id: Uuid::new_v4(),
            tenant: "acme".into(),
            name: "nightly".into(),
            kind: "echo".into(),
            lane: Lane::Interactive,
            max_attempts: 5,
            cron: cron.then(|| "0 9 * * *".into()),
            time_zone: cron.then(|| "Europe/Berlin".into()),
            interval_secs: (!cron).then_some(60),
            overlap: if cron {
                Overlap::BufferOne
            } else {
                Overlap::Skip
            },
            catchup_window_secs: 3600,
            paused: !cron,
            next_tick: Some(now),
            buffered_tick: cron.then_some(now),
            last_tick: cron.then_some(now),
            last_op_id: cron.then(Uuid::new_v4),
            fired: 3,
            skipped_overlap: 1,
            skipped_missed: 0,
            skipped_capacity: 2,
            created_by: "token:agq_ab".into(),
            created_at: now,
            updated_at: now,
            budget_tokens: cron.then_some(30_000),
            budget_measure: cron.then(|| "total".into()),
        },
        next_firings: if cron { vec![now, now] } else { Vec::new() },
    }
}

async fn body_of(response: axum::response::Response) -> Value {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test]
async fn answers_as_sent_match_their_schemas() {
    let mut c = Checker::new();
    let op = OperationId::new();

    // Built by the code that answers: the bytes on the wire.
    c.wire(
        "Accepted",
        &body_of(operations::accepted(op, true, Status::Queued, None)).await,
    );
    c.wire(
        "Accepted",
        &body_of(operations::accepted(op, false, Status::Succeeded, None)).await,
    );
    let joined = agentq_app::debounce::Answer {
        outcome: agentq_app::debounce::Folded::Joined,
        debounce_key: "doc-7".into(),
        run_at: Some(chrono::Utc::now()),
        cancelled: vec![OperationId::new()],
        kept: vec!["deadline".into()],
    };
    c.wire(
        "Accepted",
        &body_of(operations::accepted(
            op,
            false,
            Status::Queued,
            Some(joined),
        ))
        .await,
    );
    let refused = ApiError::unprocessable("no").field("/kind");
    c.wire("Problem", &body_of(refused.into_response()).await);
    let served = crate::problem::REQUEST_ID
        .scope("req-1".into(), async {
            body_of(ApiError::not_found("gone").into_response()).await
        })
        .await;
    assert_eq!(served["request_id"], "req-1");
    c.wire("Problem", &served);
    c.answer(&meta::healthz().await.0);

    // The handlers' answer types, filled as the application layer fills them.
    for done in [true, false] {
        c.answer(&app::decision::Shown {
            operation: operation(done),
            waiting: (!done).then(|| app::decision::Pending {
                signal: "approval".into(),
                step: 2,
                timeout_at: Utc::now(),
                about: Some(json!({ "tool": "kv_put", "arguments": {}, "text": "" })),
                tool_call: Some(app::decision::ToolCall {
                    tool: "kv_put".into(),
                    arguments: json!({ "key": "k", "api_key": "[redacted]" }),
                    text: "saving".into(),
                }),
            }),
            input: done.then(|| json!({ "message": "hi" })),
            budgets: if done { vec![] } else { vec![budget_view()] },
        });
        c.answer(&app::dlq::Acted {
            id: Uuid::new_v4(),
            done: "retried",
            op_id: done.then(Uuid::new_v4),
        });
        c.answer(&meta::Ready {
            postgres: done.into(),
            rabbitmq: (!done).into(),
        });
    }
    for done in [true, false] {
        let summary = |done: bool| Summary {
            op_id: Uuid::new_v4(),
            tenant: "acme".into(),
            kind: "echo".into(),
            status: if done { Status::Dead } else { Status::Queued },
            attempt: 1,
            max_attempts: 5,
            created_at: Utc::now(),
            updated_at: Utc::now(),
            finished_at: done.then(Utc::now),
            batch_id: done.then(Uuid::new_v4),
            dedupe_key: done.then(|| "key-1".into()),
            error_class: done.then(|| "non_retryable".into()),
            waiting_for: (!done).then(|| "approval".into()),
        };
        c.answer(&operations::OperationPage {
            items: vec![
                app::operations::listed(&summary(done)),
                app::operations::listed(&summary(!done)),
            ],
            next_cursor: done.then(|| "2026-01-01T00:00:00.000000Z/x".into()),
        });
    }
    for next_after in [Some(1), None] {
        c.answer(&operations::Steps {
            op_id: op,
            steps: vec![step(0), step(1)],
            next_after,
        });
    }
    for detail in app::why::one_of_each() {
        let (headline, evidence) = app::why::describe(&detail);
        c.answer(&app::why::Why {
            op_id: op,
            status: Status::Queued,
            headline,
            evidence,
            detail,
        });
    }
    for result in [operations::Delivery::Delivered, operations::Delivery::Kept] {
        c.answer(&operations::SignalResult {
            op_id: op,
            signal: "approval".into(),
            result,
        });
    }
    for result in [
        operations::Cancellation::Cancelled,
        operations::Cancellation::Requested,
    ] {
        c.answer(&operations::CancelResult { op_id: op, result });
    }
    c.answer(&dlq::DeadLetterPage {
        items: vec![
            app::dlq::listed(&dead_letter(false)),
            app::dlq::listed(&dead_letter(true)),
        ],
        next_cursor: Some("2026-01-01T00:00:00.000000Z/x".into()),
    });
    c.answer(&dlq::DeadLetterPage {
        items: Vec::new(),
        next_cursor: None,
    });
    c.answer(&dlq::DeadLetterStats {
        groups: vec![StatRow {
            class: "retries_exhausted".into(),
            kind: None,
            fingerprint: "timeout after <n> s".into(),
            count: 3,
            oldest: Utc::now(),
            newest: Utc::now(),
        }],
    });
    for poison in [false, true] {
        let d = dead_letter(poison);
        c.answer(&app::dlq::Details {
            dead_letter: app::dlq::listed(&d),
            operation: (!poison).then(|| operation(false)),
            steps: if poison { Vec::new() } else { vec![step(0)] },
            history: vec![ActionView {
                actor: "token:agq_ab".into(),
                action: "retry".into(),
                op_id: d.op_id,
                dead_letter_id: Some(d.id),
                reason: poison.then(|| "why".into()),
                status_before: Some("open".into()),
                status_after: Some("retried".into()),
                details: poison.then(|| json!({ "patched": true })),
                created_at: Utc::now(),
            }],
            raw_message_preview: poison.then(|| "{not json".into()),
        });
    }
    for (status, name, finished) in [
        (BatchStatus::Paused, Some("q3-migration"), None),
        (BatchStatus::Completed, None, Some(Utc::now())),
    ] {
        c.answer(&app::batches::Overview {
            batch_id: Uuid::new_v4(),
            name: name.map(String::from),
            tenant: "acme".into(),
            kind: "doc_migration".into(),
            status,
            paused_reason: Some("auto-paused".into()),
            canary: Some(10),
            started_at: Utc::now(),
            finished_at: finished,
            running_secs: 12.5,
            documents: 100,
            enqueued: 40,
            by_status: [("queued".to_string(), 30), ("dead".to_string(), 10)].into(),
            unfinished: 30,
            succeeded_per_s: 1.25,
            eta_secs: Some(24),
            usage: app::batches::Usage {
                model_calls: 7,
                prompt_tokens: 700,
                completion_tokens: 70,
            },
            budget: finished.is_none().then(|| {
                let mut b = budget_view();
                (b.scope, b.batch_id) = ("batch".into(), Some(Uuid::nil()));
                b
            }),
            top_failures: vec![Failure {
                error_class: "non_retryable".into(),
                reason: "bad input <n>".into(),
                count: 10,
            }],
        });
    }
    let batch_id = Uuid::new_v4();
    let listed = |name: Option<&str>, finished: bool| {
        app::batches::Item::of(&app::batches::Listed {
            batch_id: Uuid::new_v4(),
            name: name.map(String::from),
            tenant: "acme".into(),
            kind: "doc_migration".into(),
            status: if finished {
                BatchStatus::Completed
            } else {
                BatchStatus::Running
            },
            paused_reason: None,
            documents: 10,
            enqueued: 10,
            succeeded: 9,
            failed: 1,
            unfinished: 0,
            created_at: Utc::now(),
            started_at: Utc::now(),
            finished_at: finished.then(Utc::now),
        })
    };
    c.answer(&batches::BatchPage {
        items: vec![listed(Some("nightly"), true), listed(None, false)],
        next_cursor: Some("2026-01-01T00:00:00.000000Z/x".into()),
    });
    c.answer(&batches::BatchPage {
        items: Vec::new(),
        next_cursor: None,
    });
    for outcome in [
        batches::BatchOutcome::Paused,
        batches::BatchOutcome::Resumed(app::batches::Resumed {
            was: BatchStatus::Canary,
            enqueued: 90,
            redispatched: 3,
            left: 0,
        }),
        batches::BatchOutcome::Cancelled(app::batches::CancelledBatch {
            now: 4,
            requested: 1,
        }),
    ] {
        c.answer(&batches::BatchResult { batch_id, outcome });
    }
    for created in [true, false] {
        c.answer(&app::batches::StartedSummary {
            batch_id,
            name: created.then(|| "nightly".into()),
            created,
            status: if created {
                BatchStatus::Canary
            } else {
                BatchStatus::Running
            },
            documents: 10,
            enqueued: 3,
            existing: 7,
            refused: 0,
        });
    }
    c.answer(&app::batches::Report {
        batch_id,
        documents: vec![
            app::batches::ReportLine {
                doc_id: "a.md".into(),
                op_id: Some(Uuid::new_v4()),
                status: "succeeded".into(),
                attempt: Some(1),
                error_class: None,
                error_message: None,
                sha256: Some("ab".repeat(32)),
                finished_at: Some(Utc::now()),
            },
            app::batches::ReportLine {
                doc_id: "b.md".into(),
                op_id: None,
                status: "not_enqueued".into(),
                attempt: None,
                error_class: None,
                error_message: None,
                sha256: None,
                finished_at: None,
            },
        ],
        totals: [
            ("succeeded".to_string(), 1),
            ("not_enqueued".to_string(), 1),
        ]
        .into(),
    });
    let schedules: Vec<app::schedules::ScheduleView> =
        [true, false].into_iter().map(schedule).collect();
    for s in &schedules {
        c.answer(s);
    }
    c.answer(&schedules::ScheduleList { items: schedules });
    let kinds = app::kinds::Kinds {
        kinds: OneKind
            .kinds()
            .into_iter()
            .map(|kind| app::kinds::KindView {
                kind,
                live_versions: vec!["1".into()],
                service_drift: false,
            })
            .collect(),
        tools: vec![agentq_core::kinds::ToolInfo {
            name: "refund".into(),
            description: "Refund an order.".into(),
            parameters: json!({ "type": "object" }),
            replay: Replay::Unsafe,
            requires_approval: true,
        }],
    };
    c.answer(&kinds);
    c.answer(&app::tenants::TenantKinds {
        tenant: "acme".into(),
        allowed: Some(vec!["echo".into()]),
        source: "own".into(),
        paused_schedules: vec![uuid::Uuid::nil()],
    });
    let pause = app::pauses::PauseView {
        pause_id: Uuid::nil(),
        scope: app::pauses::Scope {
            tenant: Some("acme".into()),
            kind: Some("triage".into()),
            lane: Some("batch".into()),
            schedule_id: Some(Uuid::nil()),
            op_id: None,
        },
        reason: "provider degraded".into(),
        paused_by: "token:agq_1234abcd".into(),
        paused_at: Utc::now(),
    };
    let counts = app::pauses::Counts {
        queued: 3,
        sleeping: 1,
        waiting: 0,
        running: 2,
    };
    for (pause, created, dry_run) in [(Some(pause.clone()), true, false), (None, false, true)] {
        c.answer(&app::pauses::Paused {
            pause,
            created,
            dry_run,
            operations: counts,
        });
    }
    c.answer(&app::pauses::Resumed {
        pause: pause.clone(),
        freed: counts,
        redispatched: 3,
    });
    c.answer(&pauses::PauseList {
        items: vec![pause],
        next_cursor: Some(
            "2026-12-09T10:00:00.000000Z/00000000-0000-0000-0000-000000000000".into(),
        ),
    });
    let budget = budget_view();
    let mut of_batch = budget.clone();
    of_batch.scope = "batch".into();
    of_batch.batch_id = Some(Uuid::nil());
    of_batch.exceeded_at = None;
    c.answer(&app::budgets::BudgetSet {
        budget: budget.clone(),
        resumed: true,
        batch_paused: false,
    });
    let mut of_tenant = budget_view();
    of_tenant.scope = "tenant".into();
    (of_tenant.period_secs, of_tenant.period_ends) = (Some(86_400), Some(Utc::now()));
    c.answer(&of_tenant);
    c.answer(&app::budgets::BudgetSet {
        budget: of_tenant,
        resumed: false,
        batch_paused: false,
    });
    c.answer(&budgets::AllowedOnce { resumed: false });
    c.answer(&budgets::BudgetList {
        items: vec![budget, of_batch],
    });
    let limit = app::rate_limits::LimitView {
        id: Uuid::nil(),
        scope: "key".into(),
        name: "org-1".into(),
        tenant: "t1".into(),
        window_secs: 60,
        max_tokens: Some(90_000),
        max_requests: None,
        window_tokens: 1_200,
        window_requests: 3,
        usage_ratio: 1.25,
        updated_at: Utc::now(),
    };
    c.answer(&limit);
    c.answer(&crate::rate_limits::LimitList { items: vec![limit] });
    c.answer(&crate::rate_limits::LimitRemoved {
        scope: app::rate_limits::LimitScope::Model,
        name: "gpt-4o-mini".into(),
    });
    let service = app::services::ServiceView {
        name: "billing".into(),
        url: "http://127.0.0.1:8000".into(),
        timeout_secs: 300,
        allow_link_local: false,
        kinds: vec![app::services::ServedKind {
            name: "refund".into(),
            version: "2".into(),
        }],
        tools: vec![agentq_core::services::ManifestTool {
            name: "pay".into(),
            description: "Pays".into(),
            replay: agentq_core::state::Replay::Unsafe,
            reconcile: true,
        }],
        registered_at: Utc::now(),
        updated_at: Utc::now(),
        drift: vec!["kind \"refund\" version \"2\" takes another input than registered".into()],
        checked_at: Some(Utc::now()),
    };
    c.answer(&app::services::Registered {
        service: service.clone(),
        replaced: false,
        secret: Some("whsec_c2VjcmV0c2VjcmV0c2VjcmV0".into()),
    });
    c.answer(&crate::services::ServiceList {
        items: vec![service],
    });
    c.answer(&crate::services::ServiceRemoved {
        name: "billing".into(),
    });
    c.answer(&crate::services::ServiceChecks {
        items: vec![
            app::services::Checked {
                name: "billing".into(),
                drift: vec!["no longer serves kind \"refund\" version \"1\"".into()],
                unreachable: None,
            },
            app::services::Checked {
                name: "search".into(),
                drift: vec![],
                unreachable: Some("fetching http://10.0.0.9/agentq/manifest failed".into()),
            },
        ],
    });
    let mut bad = serde_json::to_value(operation(true)).unwrap();
    bad["surprise"] = json!(1);
    assert!(!c.errors("Operation", &bad).is_empty(), "strict checks");

    // Every answer type was checked.
    let unchecked: Vec<_> = names(ANSWERS)
        .into_iter()
        .filter(|n| !c.checked.contains(n))
        .collect();
    assert!(unchecked.is_empty(), "no sample of {unchecked:?}");
}

#[test]
fn request_schemas_accept_what_the_handlers_read() {
    use batches::ReasonRequest;
    use dlq::{DiscardRequest, ResolveRequest, RetryRequest};
    use operations::{CancelRequest, CreateOperation};
    let mut c = Checker::new();
    let at = "2026-12-01T10:00:00Z";
    for body in [
        json!({ "kind": "echo", "input": { "text": "hi" } }),
        json!({ "kind": "echo", "input": null, "tenant": "acme", "ordering_key": "o",
                "lane": "batch", "concurrency_key": "account-7", "concurrency_limit": 3,
                "max_attempts": 7, "run_at": at, "deadline": at }),
        json!({ "kind": "echo", "input": 1, "lane": null, "run_at": null }),
        json!({ "kind": "echo" }),
        json!({ "input": {} }),
        json!({ "kind": "echo", "input": 1, "zzz": 1 }),
        json!({ "kind": "echo", "input": 1, "lane": "fast" }),
        json!({ "kind": "echo", "input": 1, "run_at": "tomorrow" }),
        json!({ "kind": "echo", "input": 1, "priority": 1 }),
        json!({ "kind": "echo", "input": 1, "concurrency_limit": "3" }),
        json!({ "kind": 1, "input": 1 }),
        json!({ "kind": "echo", "input": 1, "debounce_key": "doc-7", "debounce": "2s",
                "max_delay": "30s", "on_running": "cancel_running" }),
        json!({ "kind": "echo", "input": 1, "debounce_key": "doc-7", "debounce": 2 }),
        json!({ "kind": "echo", "input": 1, "debounce_key": null, "on_running": null }),
    ] {
        c.request::<CreateOperation>(body);
    }
    for body in [
        json!({}),
        json!({ "reason": "done" }),
        json!({ "reason": null }),
        json!({ "reason": 1 }),
        json!({ "why": "x" }),
        json!([]),
    ] {
        c.request::<CancelRequest>(body.clone());
        c.request::<ReasonRequest>(body);
    }
    for body in [
        json!({}),
        json!({ "patch_input": { "a": null }, "reason": "fixed" }),
        json!({ "patch": {} }),
    ] {
        c.request::<RetryRequest>(body);
    }
    for body in [
        json!({ "happened": true, "output": { "id": 1 }, "reason": "checked" }),
        json!({ "happened": false }),
        json!({}),
        json!({ "happened": "yes" }),
    ] {
        c.request::<ResolveRequest>(body);
    }
    for body in [
        json!({ "name": "n", "kind": "echo", "input": { "text": "hi" }, "interval_secs": 60 }),
        json!({ "name": "n", "kind": "echo", "input": null, "cron": "0 9 * * *",
                "time_zone": "Europe/Berlin", "overlap": "buffer_one",
                "catchup_window_secs": 600, "lane": "batch",
                "max_attempts": 3, "paused": true, "tenant": "acme" }),
        json!({ "name": "n", "kind": "echo", "input": 1, "overlap": null, "cron": null }),
        json!({ "name": "n", "kind": "echo" }),
        json!({ "kind": "echo", "input": 1 }),
        json!({ "name": "n", "kind": "echo", "input": 1, "overlap": "sometimes" }),
        json!({ "name": "n", "kind": "echo", "input": 1, "interval_secs": "60" }),
        json!({ "name": "n", "kind": "echo", "input": 1, "paused": "yes" }),
        json!({ "name": "n", "kind": "echo", "input": 1, "zzz": 1 }),
    ] {
        c.request::<app::schedules::NewSchedule>(body);
    }
    for body in [
        json!({ "reason": "duplicate" }),
        json!({}),
        json!({ "reason": "x", "force": true }),
    ] {
        c.request::<DiscardRequest>(body);
    }
    for body in [
        json!({ "source": "docs", "target": "out", "instructions": "do it" }),
        json!({ "tenant": "acme", "kind": "doc_migration", "source": "docs", "target": "out",
                "instructions": "do it", "canary": 5, "pause_window": 10, "pause_ratio": 0.3,
                "require": ["Title:"], "chunk_chars": 2000 }),
        json!({ "source": "docs", "target": "out" }),
        json!({ "source": "docs", "target": "out", "instructions": "x", "canary": -1 }),
        json!({ "source": "docs", "target": "out", "instructions": "x", "require": "Title:" }),
        json!({ "source": "docs", "target": "out", "instructions": "x", "bogus": 1 }),
    ] {
        c.request::<batches::StartBatch>(body);
    }
    for body in [
        json!({ "allow": ["echo", "agent"] }),
        json!({ "allow": [] }),
        json!({ "production": true }),
        json!({ "unset": true, "allow": null }),
        json!({ "allow": "echo" }),
        json!({ "production": "yes" }),
        json!({ "kinds": ["echo"] }),
    ] {
        c.request::<tenants::SetTenantKinds>(body);
    }
    for body in [
        json!({ "scope": { "kind": "triage", "tenant": "acme" }, "reason": "degraded" }),
        json!({ "scope": { "everything": true }, "reason": "drain", "dry_run": true }),
        json!({ "scope": { "lane": "batch", "schedule": Uuid::nil() }, "reason": "x" }),
        json!({ "scope": { "op_id": Uuid::nil() }, "reason": "x" }),
        json!({ "scope": { "lane": "sideways" }, "reason": "x" }),
        json!({ "scope": {}, "reason": 1 }),
        json!({ "scope": { "kind": "triage" } }),
        json!({ "scope": { "kinds": ["triage"] }, "reason": "x" }),
    ] {
        c.request::<app::pauses::PauseRequest>(body);
    }
    for body in [
        json!({}),
        json!({ "reason": "back" }),
        json!({ "reason": "hold", "dry_run": true }),
        json!({ "reason": 5 }),
        json!({ "why": "x" }),
    ] {
        c.request::<pauses::PauseReason>(body);
    }
    for body in [
        json!({ "tokens": 3000 }),
        json!({ "tokens": 3000, "measure": "output", "timeout_secs": 60, "reason": "more" }),
        json!({ "tokens": "many" }),
        json!({ "tokens": 1, "measure": "money" }),
        json!({ "measure": "total" }),
        json!({ "tokens": 1, "limit": 2 }),
    ] {
        c.request::<budgets::SetBudget>(body);
    }
    for body in [
        json!({ "tokens": 1_000_000, "period_secs": 86_400 }),
        json!({ "tokens": 5, "measure": "input", "period_secs": 3600, "reason": "cap" }),
        json!({ "tokens": 5 }),
        json!({ "tokens": 5, "period_secs": "daily" }),
        json!({ "tokens": 5, "period_secs": 60, "timeout_secs": 1 }),
    ] {
        c.request::<budgets::SetTenantBudget>(body);
    }
    for body in [
        json!({}),
        json!({ "reason": "one more" }),
        json!({ "why": 1 }),
    ] {
        c.request::<budgets::AllowOnceRequest>(body);
    }
    for body in [
        json!({ "scope": "model", "name": "gpt-4o-mini", "max_tokens": 90_000 }),
        json!({ "scope": "key", "name": "org-1", "tenant": "t1", "window_secs": 10,
                "max_tokens": 5_000, "max_requests": 20, "reason": "provider quota" }),
        json!({ "scope": "tenant", "name": "t1", "max_requests": 600 }),
        json!({ "scope": "planet", "name": "x", "max_tokens": 1 }),
        json!({ "scope": "model", "max_tokens": 1 }),
        json!({ "scope": "model", "name": "m", "max_tokens": "lots" }),
        json!({ "scope": "model", "name": "m", "max_tokens": 1, "burst": 2 }),
    ] {
        c.request::<app::rate_limits::LimitRequest>(body);
    }
    for body in [
        json!({ "url": "http://127.0.0.1:8000" }),
        json!({ "url": "https://svc.internal", "secret": "whsec_x", "timeout_secs": 30 }),
        json!({ "url": 7 }),
        json!({ "url": "http://x", "tls": false }),
    ] {
        c.request::<app::services::ServiceRequest>(body);
    }
    let unchecked: Vec<_> = names(REQUESTS)
        .into_iter()
        .filter(|n| !c.checked.contains(n))
        .collect();
    assert!(unchecked.is_empty(), "no sample of {unchecked:?}");
}

/// A deployment of one kind whose input schema has definitions of its own.
struct OneKind;

impl Catalog for OneKind {
    fn kinds(&self) -> Vec<agentq_core::kinds::KindInfo> {
        vec![agentq_core::kinds::KindInfo {
            name: "order".into(),
            versions: vec!["1".into()],
            webhook_only: false,
            for_tests: false,
            description: String::new(),
            input_schema: json!({
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "type": "object",
                "properties": { "items": { "type": "array", "items": { "$ref": "#/$defs/Item" } } },
                "required": ["items"],
                "$defs": { "Item": { "type": "object", "properties": { "qty": { "type": "integer" } },
                                     "required": ["qty"] } }
            }),
            service: None,
        }]
    }

    fn has_kind(&self, kind: &str) -> bool {
        kind == "order"
    }

    fn tools(&self) -> Vec<agentq_core::kinds::ToolInfo> {
        Vec::new()
    }

    fn requires(
        &self,
        _kind: &str,
        _input: &Value,
    ) -> Result<agentq_core::operation::Requires, agentq_core::kinds::InputError> {
        Ok(Default::default())
    }
}

#[test]
fn the_served_document_links_each_kinds_input_to_the_enqueue_body() {
    let doc = spec_for(&OneKind);
    let schemas = &doc["components"]["schemas"];
    assert!(schemas["KindInput.order"].is_object());
    assert_eq!(
        schemas["KindInput.order"]["properties"]["items"]["items"]["$ref"],
        "#/components/schemas/KindInput.order.Item"
    );
    assert!(schemas["KindInput.order.Item"].is_object());
    let root = json!({
        "$ref": "#/components/schemas/CreateOperation",
        "components": { "schemas": schemas },
    });
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .build(&root)
        .unwrap();
    let fits = json!({ "kind": "order", "input": { "items": [{ "qty": 2 }] } });
    assert!(validator.is_valid(&fits));
    let misfit = json!({ "kind": "order", "input": { "items": [{ "qty": "two" }] } });
    assert!(!validator.is_valid(&misfit));
    // Another kind's input is not checked against this one's schema.
    assert!(validator.is_valid(&json!({ "kind": "echo", "input": { "items": 1 } })));
}

/// A budget as the API shows it: an operation's, which refused a call.
fn budget_view() -> app::budgets::BudgetView {
    app::budgets::BudgetView {
        id: Uuid::nil(),
        scope: "operation".into(),
        op_id: Some(Uuid::nil()),
        batch_id: None,
        measure: "total".into(),
        limit_tokens: 3000,
        spent_tokens: 2000,
        held_tokens: 0,
        estimated_calls: 1,
        timeout_secs: 86_400,
        exceeded_at: Some(Utc::now()),
        allow_once: false,
        period_secs: None,
        period_ends: None,
    }
}
