//! `GET /openapi.json`: the OpenAPI 3.1 description of the routes, built from one table
//! ([`ROUTES`]); a test requests every entry against a running server. Its schemas are
//! generated (schemars) from the Rust types the handlers read (`REQUESTS`) and answer
//! (`ANSWERS`), so the document describes what is sent; tests here check every route names
//! one of them and that real answers validate against their schemas.

use std::sync::Arc;

use axum::Json;
use axum::routing::{MethodRouter, delete, get, post, put};

use agentq_app as app;
use agentq_core::kinds::Catalog;
use agentq_core::operation::OperationView;
use schemars::Schema;
use schemars::generate::{SchemaGenerator, SchemaSettings};
use serde_json::{Map, Value, json};

use crate::problem::Problem;
use crate::{
    ApiState, batches, dlq, events, kinds, meta, operations, schedules, tenants, webhooks,
};

/// Who may call a route.
#[derive(Clone, Copy)]
pub enum Access {
    Public,
    /// Standard Webhooks signature instead of a token.
    Signed,
    Producer,
    Operator,
    Admin,
}

/// One route: method, path (axum syntax `{param}`), its handler, summary, access, request
/// schema, success. The router ([`crate::router`]), the OpenAPI document ([`spec`]) and the
/// route tests all read [`ROUTES`], so a route exists in all three or in none.
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub handler: fn() -> MethodRouter<Arc<ApiState>>,
    pub summary: &'static str,
    pub access: Access,
    pub body: Option<&'static str>,
    pub ok: (u16, &'static str),
}

const fn r(
    method: &'static str,
    path: &'static str,
    handler: fn() -> MethodRouter<Arc<ApiState>>,
    summary: &'static str,
    access: Access,
    body: Option<&'static str>,
    ok: (u16, &'static str),
) -> Route {
    Route {
        method,
        path,
        handler,
        summary,
        access,
        body,
        ok,
    }
}

/// Every route of the API.
pub const ROUTES: &[Route] = &[
    r(
        "post",
        "/v1/operations",
        || post(operations::create),
        "Enqueue an operation (Idempotency-Key: same key + same body → the same operation; a different body → 422)",
        Access::Producer,
        Some("CreateOperation"),
        (202, "Accepted"),
    ),
    r(
        "get",
        "/v1/operations",
        || get(operations::list),
        "List and search the caller's operations (keyset pages, newest first; no inputs or results)",
        Access::Producer,
        None,
        (200, "OperationPage"),
    ),
    r(
        "get",
        "/v1/operations/{id}",
        || get(operations::show),
        "Read an operation",
        Access::Producer,
        None,
        (200, "Operation"),
    ),
    r(
        "get",
        "/v1/operations/{id}/steps",
        || get(operations::steps),
        "Read an operation's journal",
        Access::Producer,
        None,
        (200, "Steps"),
    ),
    r(
        "get",
        "/v1/operations/{id}/events",
        || get(events::stream),
        "Server-Sent Events of the operation's life, resumable with Last-Event-ID; ends at a terminal status",
        Access::Producer,
        None,
        (200, "EventStream"),
    ),
    r(
        "post",
        "/v1/operations/{id}/signals/{name}",
        || post(operations::signal),
        "Send a signal (the body is its JSON payload, or empty)",
        Access::Producer,
        Some("AnyJson"),
        (202, "SignalResult"),
    ),
    r(
        "get",
        "/v1/kinds",
        || get(kinds::list),
        "The deployment's kinds (versions, whether only webhook deliveries create them, the JSON Schema of their input, the versions live workers run) and the tools an agent may name",
        Access::Producer,
        None,
        (200, "Kinds"),
    ),
    r(
        "get",
        "/v1/tenants/{tenant}/kinds",
        || get(tenants::show),
        "The kinds a tenant may create operations of (its own list, else the default list of tenant *, else every kind); a tenant's own tokens and admins",
        Access::Producer,
        None,
        (200, "TenantKinds"),
    ),
    r(
        "put",
        "/v1/tenants/{tenant}/kinds",
        || put(tenants::set),
        "Set the kinds a tenant (or *, the default) may create operations of, pausing its schedules of kinds no longer allowed (an admin's act, audited)",
        Access::Admin,
        Some("SetTenantKinds"),
        (200, "TenantKinds"),
    ),
    r(
        "post",
        "/v1/operations/{id}/cancel",
        || post(operations::cancel),
        "Cancel an operation (at once, or at the next step boundary if running)",
        Access::Producer,
        Some("CancelRequest"),
        (202, "CancelResult"),
    ),
    r(
        "post",
        "/v1/operations/{id}/approve",
        || post(operations::approve),
        "Approve: the signal approval with {\"approved\": true, \"by\", \"reason\"}, audited as approve (an operator's act unless AGENTQ_PRODUCER_MAY_APPROVE)",
        Access::Operator,
        Some("CancelRequest"),
        (202, "SignalResult"),
    ),
    r(
        "post",
        "/v1/operations/{id}/reject",
        || post(operations::reject),
        "Reject: the signal approval with {\"approved\": false, \"by\", \"reason\"}, audited as reject",
        Access::Operator,
        Some("CancelRequest"),
        (202, "SignalResult"),
    ),
    r(
        "post",
        "/v1/webhooks/{source}",
        || post(webhooks::deliver),
        "Deliver a Standard Webhooks event; webhook-id deduplicates retries",
        Access::Signed,
        Some("AnyJson"),
        (202, "Accepted"),
    ),
    r(
        "get",
        "/v1/dlq",
        || get(dlq::list),
        "List dead letters (keyset pages, newest first)",
        Access::Operator,
        None,
        (200, "DeadLetterPage"),
    ),
    r(
        "get",
        "/v1/dlq/stats",
        || get(dlq::stats),
        "Open dead letters grouped by class, kind and reason fingerprint",
        Access::Operator,
        None,
        (200, "DeadLetterStats"),
    ),
    r(
        "get",
        "/v1/dlq/{id}",
        || get(dlq::show),
        "A dead letter with its operation, journal and audit history",
        Access::Operator,
        None,
        (200, "DeadLetterDetails"),
    ),
    r(
        "post",
        "/v1/dlq/{id}/retry",
        || post(dlq::retry),
        "Re-queue a dead operation from its failed step, optionally patching its input",
        Access::Operator,
        Some("RetryRequest"),
        (200, "ActionResult"),
    ),
    r(
        "post",
        "/v1/dlq/{id}/resolve",
        || post(dlq::resolve),
        "Say whether an unknown side effect happened, then re-queue",
        Access::Operator,
        Some("ResolveRequest"),
        (200, "ActionResult"),
    ),
    r(
        "post",
        "/v1/dlq/{id}/discard",
        || post(dlq::discard),
        "Discard a dead letter for good, with a reason",
        Access::Operator,
        Some("DiscardRequest"),
        (200, "ActionResult"),
    ),
    r(
        "post",
        "/v1/batches",
        || post(batches::start),
        "Start a batch: one operation per document of a source store (idempotent: a re-run enqueues only what is missing; 201 created, 200 found again)",
        Access::Operator,
        Some("StartBatch"),
        (201, "BatchStarted"),
    ),
    r(
        "get",
        "/v1/batches/{id}",
        || get(batches::show),
        "A batch's progress: totals by status, rate, ETA, token usage, top failures",
        Access::Operator,
        None,
        (200, "BatchStatus"),
    ),
    r(
        "post",
        "/v1/batches/{id}/pause",
        || post(batches::pause),
        "Pause a running or canary batch (nothing new starts; audited)",
        Access::Operator,
        Some("ReasonRequest"),
        (200, "BatchResult"),
    ),
    r(
        "post",
        "/v1/batches/{id}/resume",
        || post(batches::resume),
        "Resume a paused batch, or run the rest of a canary (enqueues missing documents, re-dispatches its queue)",
        Access::Operator,
        Some("ReasonRequest"),
        (200, "BatchResult"),
    ),
    r(
        "post",
        "/v1/batches/{id}/cancel",
        || post(batches::cancel),
        "Cancel every unfinished operation of a batch (audited)",
        Access::Operator,
        Some("ReasonRequest"),
        (200, "BatchResult"),
    ),
    r(
        "get",
        "/v1/batches/{id}/report",
        || get(batches::report),
        "A batch's per-document outcomes: its operation, status, error and written hash, or not_enqueued",
        Access::Operator,
        None,
        (200, "BatchReport"),
    ),
    r(
        "get",
        "/v1/schedules",
        || get(schedules::list),
        "List schedules with their next firings (an admin may pass ?tenant=)",
        Access::Operator,
        None,
        (200, "ScheduleList"),
    ),
    r(
        "post",
        "/v1/schedules",
        || post(schedules::create),
        "Add a schedule: a kind and input fired as an operation on a cron expression (with an IANA time zone) or an interval; the input is checked against the kind first (audited)",
        Access::Operator,
        Some("CreateSchedule"),
        (201, "Schedule"),
    ),
    r(
        "get",
        "/v1/schedules/{id}",
        || get(schedules::show),
        "A schedule with its next firings and counts",
        Access::Operator,
        None,
        (200, "Schedule"),
    ),
    r(
        "delete",
        "/v1/schedules/{id}",
        || delete(schedules::delete),
        "Delete a schedule (its operations stay; audited)",
        Access::Operator,
        None,
        (200, "Schedule"),
    ),
    r(
        "post",
        "/v1/schedules/{id}/pause",
        || post(schedules::pause),
        "Pause a schedule: nothing fires until it is resumed (audited)",
        Access::Operator,
        None,
        (200, "Schedule"),
    ),
    r(
        "post",
        "/v1/schedules/{id}/resume",
        || post(schedules::resume),
        "Resume a paused schedule from its first tick after now (audited)",
        Access::Operator,
        None,
        (200, "Schedule"),
    ),
    r(
        "get",
        "/healthz",
        || get(meta::healthz),
        "Liveness",
        Access::Public,
        None,
        (200, "Health"),
    ),
    r(
        "get",
        "/readyz",
        || get(meta::readyz),
        "Readiness: PostgreSQL and RabbitMQ reachable",
        Access::Public,
        None,
        (200, "Ready"),
    ),
    r(
        "get",
        "/metrics",
        || get(meta::metrics),
        "Prometheus metrics (every tenant's counts; AGENTQ_METRICS_ADDR serves them without a token)",
        Access::Operator,
        None,
        (200, "Metrics"),
    ),
    r(
        "get",
        "/openapi.json",
        || get(document),
        "This document",
        Access::Public,
        None,
        (200, "OpenApi"),
    ),
];

fn parameters(path: &str, method: &str) -> Vec<Value> {
    let mut out: Vec<Value> = path
        .split('/')
        .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            let schema = if name == "id" {
                json!({ "type": "string", "format": "uuid" })
            } else {
                json!({ "type": "string", "pattern": "^[A-Za-z0-9_.:-]{1,128}$" })
            };
            json!({ "name": name, "in": "path", "required": true, "schema": schema })
        })
        .collect();
    if path == "/v1/operations" && method == "post" {
        out.push(
            json!({ "name": "Idempotency-Key", "in": "header", "required": false,
            "schema": { "type": "string", "minLength": 1, "maxLength": 256 } }),
        );
    }
    if path.ends_with("/events") {
        out.push(
            json!({ "name": "Last-Event-ID", "in": "header", "required": false,
            "schema": { "type": "string" } }),
        );
    }
    if path.starts_with("/v1/webhooks/") {
        for h in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            out.push(json!({ "name": h, "in": "header", "required": true, "schema": { "type": "string" } }));
        }
    }
    if path == "/v1/operations" && method == "get" {
        for q in operations::LIST_PARAMETERS {
            let (schema, description) = match q {
                "status" => (
                    json!({ "type": "string" }),
                    "One status or a comma-separated list; may repeat: any of them matches",
                ),
                "batch" => (json!({ "type": "string", "format": "uuid" }), "A batch id"),
                "schedule" => (
                    json!({ "type": "string", "format": "uuid" }),
                    "A schedule id: the operations it fired",
                ),
                "limit" => (
                    json!({ "type": "integer", "minimum": 1, "maximum": app::page::MAX_PAGE }),
                    "Page size (default 100)",
                ),
                "after" => (
                    json!({ "type": "string" }),
                    "The next_cursor of the previous page (opaque)",
                ),
                "tenant" => (json!({ "type": "string" }), "Admins only: one tenant"),
                "kind" => (json!({ "type": "string" }), "A job kind"),
                _ => (
                    json!({ "type": "string" }),
                    "RFC 3339, or an age such as 2h or 7d; after is inclusive, before exclusive",
                ),
            };
            out.push(json!({ "name": q, "in": "query", "required": false,
                "description": description, "schema": schema }));
        }
    }
    if path == "/v1/schedules" && method == "get" {
        out.push(json!({ "name": "tenant", "in": "query", "required": false, "schema": { "type": "string" } }));
    }
    if path == "/v1/dlq" || path == "/v1/dlq/stats" {
        for q in ["tenant", "kind", "class", "since", "batch", "status"] {
            out.push(json!({ "name": q, "in": "query", "required": false, "schema": { "type": "string" } }));
        }
        if path == "/v1/dlq" {
            out.push(json!({ "name": "limit", "in": "query", "required": false,
                "schema": { "type": "integer", "minimum": 1, "maximum": 1000 } }));
            out.push(json!({ "name": "after", "in": "query", "required": false, "schema": { "type": "string" } }));
        }
    }
    out
}

fn problem(desc: &str) -> Value {
    json!({ "description": desc, "content": { "application/problem+json": {
        "schema": { "$ref": "#/components/schemas/Problem" } } } })
}

fn operation(route: &Route) -> Value {
    let (code, schema) = route.ok;
    let content = match schema {
        "Metrics" => json!({ "text/plain": { "schema": { "type": "string" } } }),
        "EventStream" => json!({ "text/event-stream": { "schema": { "type": "string" } } }),
        s => {
            json!({ "application/json": { "schema": { "$ref": format!("#/components/schemas/{s}") } } })
        }
    };
    let mut responses =
        json!({ code.to_string(): { "description": "Success", "content": content } });
    let enqueues = route.method == "post"
        && (route.path == "/v1/operations" || route.path.starts_with("/v1/webhooks/"));
    if route.method == "post" && route.path == "/v1/batches" {
        responses["200"] = json!({ "description": "The same batch, found again (only missing documents were enqueued)",
            "content": { "application/json": { "schema": { "$ref": "#/components/schemas/BatchStarted" } } } });
        responses["429"] = problem("Tenant over its queued limit; not started (Retry-After)");
        responses["503"] = problem("Database or broker unavailable; not started (Retry-After)");
    }
    if enqueues {
        responses["200"] = json!({ "description": "Already accepted (same Idempotency-Key or webhook-id)",
            "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Accepted" } } } });
        responses["413"] = problem("Body larger than 1 MiB");
        responses["429"] = problem("Tenant over its queued limit; not started (Retry-After)");
        responses["503"] = problem("Database or broker unavailable; not started (Retry-After)");
    }
    if schema == "EventStream" {
        responses["429"] = problem(
            "The token's, or the server's, cap of open event streams is full (Retry-After)",
        );
    }
    match route.access {
        Access::Public => {}
        Access::Signed => {
            responses["401"] = problem("Missing, invalid or stale signature; nothing enqueued");
        }
        Access::Producer | Access::Operator | Access::Admin => {
            responses["401"] = problem("Missing, malformed, unknown or revoked token");
            responses["403"] = problem("The token's role may not use this route");
        }
    }
    if route.path.contains('{') {
        responses["404"] = problem("No such id in the caller's tenant");
    }
    let parameters = parameters(route.path, route.method);
    let queried = parameters.iter().any(|p| p["in"] == "query");
    if queried {
        responses["400"] = problem("A query parameter is unknown, repeated or malformed");
    }
    if route.body.is_some() || route.path.contains('{') {
        responses["400"] = problem("Malformed request");
        responses["422"] = problem("Well-formed but refused; `field` names what is wrong");
    }
    if route.method == "post" && route.path != "/v1/operations" && route.path != "/v1/batches" {
        responses["409"] = problem(
            "The operation, dead letter, batch or schedule is not in a state that allows this (or the name is taken)",
        );
    }
    let mut op = json!({
        "summary": route.summary,
        "operationId": format!("{}_{}", route.method, route.path.trim_start_matches('/')
            .replace(['/', '.'], "_").replace(['{', '}'], "")),
        "parameters": parameters,
        "responses": responses,
    });
    match route.access {
        Access::Producer | Access::Operator | Access::Admin => {
            op["security"] = json!([{ "bearer": [] }]);
            op["x-agentq-role"] = json!(match route.access {
                Access::Operator => "operator",
                Access::Admin => "admin",
                _ => "producer",
            });
        }
        _ => op["security"] = json!([]),
    }
    if let Some(body) = route.body {
        op["requestBody"] = json!({ "required": route.path == "/v1/operations" || route.path == "/v1/batches" || route.path == "/v1/schedules" || route.path.ends_with("/discard") || route.path.ends_with("/resolve"),
            "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{body}") } } } });
    }
    op
}

/// Adds a type's schema to a generator's definitions, under the type's schema name (the name
/// routes give in [`Route::body`] and [`Route::ok`]).
type Describe = fn(&mut SchemaGenerator) -> Schema;

/// Every JSON request body of the API, described as it is read.
const REQUESTS: &[Describe] = &[
    SchemaGenerator::subschema_for::<operations::CreateOperation>,
    SchemaGenerator::subschema_for::<operations::CancelRequest>,
    SchemaGenerator::subschema_for::<dlq::RetryRequest>,
    SchemaGenerator::subschema_for::<dlq::ResolveRequest>,
    SchemaGenerator::subschema_for::<dlq::DiscardRequest>,
    SchemaGenerator::subschema_for::<batches::ReasonRequest>,
    SchemaGenerator::subschema_for::<batches::StartBatch>,
    SchemaGenerator::subschema_for::<app::schedules::NewSchedule>,
    SchemaGenerator::subschema_for::<tenants::SetTenantKinds>,
];

/// Every JSON answer of the API, described as it is written.
const ANSWERS: &[Describe] = &[
    SchemaGenerator::subschema_for::<Problem>,
    SchemaGenerator::subschema_for::<operations::Accepted>,
    SchemaGenerator::subschema_for::<OperationView>,
    SchemaGenerator::subschema_for::<operations::OperationPage>,
    SchemaGenerator::subschema_for::<operations::Steps>,
    SchemaGenerator::subschema_for::<operations::SignalResult>,
    SchemaGenerator::subschema_for::<operations::CancelResult>,
    SchemaGenerator::subschema_for::<dlq::DeadLetterPage>,
    SchemaGenerator::subschema_for::<dlq::DeadLetterStats>,
    SchemaGenerator::subschema_for::<app::dlq::Details>,
    SchemaGenerator::subschema_for::<app::dlq::Acted>,
    SchemaGenerator::subschema_for::<app::batches::Overview>,
    SchemaGenerator::subschema_for::<batches::BatchResult>,
    SchemaGenerator::subschema_for::<app::batches::StartedSummary>,
    SchemaGenerator::subschema_for::<app::batches::Report>,
    SchemaGenerator::subschema_for::<app::schedules::ScheduleView>,
    SchemaGenerator::subschema_for::<schedules::ScheduleList>,
    SchemaGenerator::subschema_for::<meta::Health>,
    SchemaGenerator::subschema_for::<meta::Ready>,
    SchemaGenerator::subschema_for::<app::kinds::Kinds>,
    SchemaGenerator::subschema_for::<app::tenants::TenantKinds>,
];

/// JSON Schema 2020-12 (OpenAPI 3.1's dialect), shared schemas under `#/components/schemas/`.
fn settings() -> SchemaSettings {
    SchemaSettings::draft2020_12().with(|s| {
        s.definitions_path = "/components/schemas".into();
        s.meta_schema = None;
    })
}

/// The schemas of `types` and of every named type they use, by name.
fn generated(settings: SchemaSettings, types: &[Describe]) -> Map<String, Value> {
    let mut generator = settings.into_generator();
    for describe in types {
        describe(&mut generator);
    }
    generator.take_definitions(true)
}

/// `components.schemas`: the request bodies as they are read and the answers as they are
/// written (a type both use has one schema: a test checks), and what is no Rust type.
fn schemas() -> Map<String, Value> {
    let mut out = generated(settings().for_deserialize(), REQUESTS);
    out.extend(generated(settings().for_serialize(), ANSWERS));
    out.insert("AnyJson".into(), json!({ "description": "Any JSON value" }));
    out.insert("OpenApi".into(), json!({ "type": "object" }));
    out
}

/// The whole document.
pub fn spec() -> Value {
    let mut paths = serde_json::Map::new();
    for route in ROUTES {
        let entry = paths
            .entry(route.path.to_string())
            .or_insert_with(|| json!({}));
        entry[route.method] = operation(route);
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "agentq",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Durable, crash-safe runner for long-running AI-agent jobs. Errors are application/problem+json; every response carries x-request-id."
        },
        "paths": paths,
        "components": {
            "schemas": schemas(),
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer",
                "description": "An agentq token (agq_…) from `agentq tokens create`" } }
        }
    })
}

/// The document with the deployment's kinds linked in: each kind's input schema under
/// `components.schemas` as `KindInput.<kind>` (its own definitions beside it as
/// `KindInput.<kind>.<Type>`), and `CreateOperation` requiring, for each `kind`, an `input`
/// that fits that kind's schema.
pub fn spec_for(catalog: &dyn Catalog) -> Value {
    let mut doc = spec();
    let mut conditions = Vec::new();
    let schemas = doc["components"]["schemas"]
        .as_object_mut()
        .expect("components.schemas is an object");
    for kind in catalog.kinds() {
        let name = format!("KindInput.{}", kind.name);
        let (schema, defs) = lift_definitions(kind.input_schema, &name);
        schemas.extend(defs);
        schemas.insert(name.clone(), schema);
        conditions.push(json!({
            "if": { "properties": { "kind": { "const": kind.name } }, "required": ["kind"] },
            "then": { "properties": { "input": { "$ref": format!("#/components/schemas/{name}") } } }
        }));
    }
    if let Some(create) = schemas.get_mut("CreateOperation") {
        let mut linked = std::mem::take(create);
        linked["properties"]["input"]["description"] = json!(
            "The job's input (≤ 1 MiB), fitting its kind's schema: components.schemas.KindInput.<kind>, also served by GET /v1/kinds"
        );
        let mut all_of = vec![linked];
        all_of.extend(conditions);
        *create = json!({ "allOf": all_of });
    }
    doc
}

/// A kind's input schema as a component: its `$defs` moved out beside it under
/// `<name>.<Type>`, and its references to them rewritten to point there.
fn lift_definitions(mut schema: Value, name: &str) -> (Value, Map<String, Value>) {
    let defs = schema
        .as_object_mut()
        .and_then(|o| {
            o.remove("$schema");
            o.remove("$defs")
        })
        .and_then(|d| match d {
            Value::Object(m) => Some(m),
            _ => None,
        })
        .unwrap_or_default();
    let rewrite = |mut v: Value| {
        point_refs_at(&mut v, name);
        v
    };
    let lifted = defs
        .into_iter()
        .map(|(def, v)| (format!("{name}.{def}"), rewrite(v)))
        .collect();
    (rewrite(schema), lifted)
}

/// Rewrites every `"$ref": "#/$defs/X"` inside `v` to `"#/components/schemas/<name>.X"`.
fn point_refs_at(v: &mut Value, name: &str) {
    match v {
        Value::Object(map) => {
            for (key, child) in map.iter_mut() {
                if key == "$ref"
                    && let Some(def) = child.as_str().and_then(|r| r.strip_prefix("#/$defs/"))
                {
                    *child = json!(format!("#/components/schemas/{name}.{def}"));
                } else {
                    point_refs_at(child, name);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| point_refs_at(i, name)),
        _ => {}
    }
}

/// `GET /openapi.json`: the document, with this deployment's kinds linked in.
pub async fn document(
    axum::extract::State(state): axum::extract::State<Arc<ApiState>>,
) -> Json<Value> {
    Json(spec_for(state.app.producer.catalog().as_ref()))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use agentq_core::db::batches::Failure;
    use agentq_core::db::dead_letters::{ActionView, DeadLetterView, StatRow};
    use agentq_core::db::listing::Summary;
    use agentq_core::operation::{Lane, OperationId, Status, StepView};
    use agentq_core::state::{
        BatchStatus, DeadLetterStatus, Overlap, Replay, StepKind, StepStatus,
    };
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
            schedule: agentq_core::db::schedules::Schedule {
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
            &body_of(operations::accepted(op, true, Status::Queued)).await,
        );
        c.wire(
            "Accepted",
            &body_of(operations::accepted(op, false, Status::Succeeded)).await,
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
            c.answer(&operation(done));
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
        c.answer(&app::batches::Overview {
            batch_id: Uuid::new_v4(),
            tenant: "acme".into(),
            kind: "doc_migration".into(),
            status: BatchStatus::Paused,
            paused_reason: Some("auto-paused".into()),
            canary: Some(10),
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
            top_failures: vec![Failure {
                error_class: "non_retryable".into(),
                reason: "bad input <n>".into(),
                count: 10,
            }],
        });
        let batch_id = Uuid::new_v4();
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
}
