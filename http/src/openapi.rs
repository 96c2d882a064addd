//! `GET /openapi.json`: the OpenAPI 3.1 description of the routes, built from the route table
//! ([`crate::routes::ROUTES`]); a test requests every entry against a running server. Its
//! schemas are generated (schemars) from the Rust types the handlers read (`REQUESTS`) and
//! answer (`ANSWERS`), so the document describes what is sent; the tests (`openapi/tests.rs`)
//! check every route names one of them and that real answers validate against their schemas.

use agentq_app as app;
use agentq_core::kinds::Catalog;
use schemars::Schema;
use schemars::generate::{SchemaGenerator, SchemaSettings};
use serde_json::{Map, Value, json};

use crate::problem::Problem;
use crate::routes::{Access, ROUTES, Route};
use crate::{
    batches, budgets, dlq, meta, operations, pauses, rate_limits, schedules, services, tenants,
};

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
    if path == "/v1/operations/{id}" && method == "get" {
        out.push(json!({ "name": "include", "in": "query", "required": false,
            "description": "`input` (comma-separated with `result`, which is always shown): the operation's input too; needs an operator or admin token (a producer's gets 403) and is audited as reveal_payloads",
            "schema": { "type": "string" } }));
    }
    if path == "/v1/schedules" && method == "get" {
        out.push(json!({ "name": "tenant", "in": "query", "required": false, "schema": { "type": "string" } }));
    }
    if path == "/v1/batches" && method == "get" {
        out.push(json!({ "name": "tenant", "in": "query", "required": false,
            "description": "Admins only: one tenant", "schema": { "type": "string" } }));
        out.push(json!({ "name": "status", "in": "query", "required": false,
            "description": "One batch status",
            "schema": { "type": "string", "enum": agentq_core::state::BatchStatus::NAMES } }));
        out.push(json!({ "name": "limit", "in": "query", "required": false,
            "description": "Page size (default 100)",
            "schema": { "type": "integer", "minimum": 1, "maximum": app::page::MAX_PAGE } }));
        out.push(json!({ "name": "after", "in": "query", "required": false,
            "description": "The next_cursor of the previous page (opaque)",
            "schema": { "type": "string" } }));
    }
    if (path.starts_with("/v1/batches/{id}") || path.starts_with("/v1/schedules/{id}"))
        && let Some(id) = out
            .iter_mut()
            .find(|p| p["name"] == "id" && p["in"] == "path")
    {
        id["description"] = json!("Its id, or its name (unique in its tenant)");
        id["schema"] = json!({ "type": "string" });
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
        responses["409"] = problem(
            "The tenant has another batch of that name, or this batch was cancelled; nothing started",
        );
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
        Access::Producer | Access::Approver | Access::Operator | Access::Admin => {
            responses["401"] = problem("Missing, malformed, unknown or revoked token");
            responses["403"] = problem("The token's role may not use this route");
        }
    }
    if route.path.contains('{') {
        responses["404"] =
            problem("No such id (or, for a batch or schedule, name) in the caller's tenant");
    }
    if route.method == "get" && route.path == "/v1/operations/{id}" {
        responses["403"] = problem(
            "`include=input` with a producer's token: reading an input needs an operator or admin token; nothing was read",
        );
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
        Access::Producer | Access::Approver | Access::Operator | Access::Admin => {
            op["security"] = json!([{ "bearer": [] }]);
            op["x-agentq-role"] = json!(match route.access {
                Access::Approver | Access::Operator => "operator",
                Access::Admin => "admin",
                _ => "producer",
            });
        }
        _ => op["security"] = json!([]),
    }
    if let Some(body) = route.body {
        op["requestBody"] = json!({ "required": route.path == "/v1/operations" || route.path == "/v1/batches" || route.path == "/v1/schedules" || route.path == "/v1/pauses" || route.path.ends_with("/budget") || route.path.ends_with("/discard") || route.path.ends_with("/resolve"),
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
    SchemaGenerator::subschema_for::<app::pauses::PauseRequest>,
    SchemaGenerator::subschema_for::<pauses::PauseReason>,
    SchemaGenerator::subschema_for::<budgets::SetBudget>,
    SchemaGenerator::subschema_for::<budgets::SetTenantBudget>,
    SchemaGenerator::subschema_for::<budgets::AllowOnceRequest>,
    SchemaGenerator::subschema_for::<app::rate_limits::LimitRequest>,
    SchemaGenerator::subschema_for::<app::services::ServiceRequest>,
];

/// Every JSON answer of the API, described as it is written.
const ANSWERS: &[Describe] = &[
    SchemaGenerator::subschema_for::<Problem>,
    SchemaGenerator::subschema_for::<operations::Accepted>,
    SchemaGenerator::subschema_for::<app::decision::Shown>,
    SchemaGenerator::subschema_for::<operations::OperationPage>,
    SchemaGenerator::subschema_for::<operations::Steps>,
    SchemaGenerator::subschema_for::<app::why::Why>,
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
    SchemaGenerator::subschema_for::<batches::BatchPage>,
    SchemaGenerator::subschema_for::<app::schedules::ScheduleView>,
    SchemaGenerator::subschema_for::<schedules::ScheduleList>,
    SchemaGenerator::subschema_for::<meta::Health>,
    SchemaGenerator::subschema_for::<meta::Ready>,
    SchemaGenerator::subschema_for::<app::kinds::Kinds>,
    SchemaGenerator::subschema_for::<app::tenants::TenantKinds>,
    SchemaGenerator::subschema_for::<app::pauses::Paused>,
    SchemaGenerator::subschema_for::<app::pauses::Resumed>,
    SchemaGenerator::subschema_for::<pauses::PauseList>,
    SchemaGenerator::subschema_for::<app::budgets::BudgetSet>,
    SchemaGenerator::subschema_for::<budgets::AllowedOnce>,
    SchemaGenerator::subschema_for::<budgets::BudgetList>,
    SchemaGenerator::subschema_for::<app::budgets::BudgetView>,
    SchemaGenerator::subschema_for::<app::rate_limits::LimitView>,
    SchemaGenerator::subschema_for::<rate_limits::LimitList>,
    SchemaGenerator::subschema_for::<rate_limits::LimitRemoved>,
    SchemaGenerator::subschema_for::<app::services::Registered>,
    SchemaGenerator::subschema_for::<services::ServiceList>,
    SchemaGenerator::subschema_for::<services::ServiceRemoved>,
    SchemaGenerator::subschema_for::<services::ServiceChecks>,
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

#[cfg(test)]
mod tests;
