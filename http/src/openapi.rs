//! `GET /openapi.json`: the OpenAPI 3.1 description of the routes, built from one table
//! ([`ROUTES`]); a test requests every entry against a running server.

use std::sync::Arc;

use axum::Json;
use axum::routing::{MethodRouter, get, post};

use crate::{ApiState, batches, dlq, events, meta, operations, webhooks};
use serde_json::{Value, json};

/// Who may call a route.
#[derive(Clone, Copy)]
pub enum Access {
    Public,
    /// Standard Webhooks signature instead of a token.
    Signed,
    Producer,
    Operator,
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
    if route.path == "/v1/operations" || route.path.starts_with("/v1/webhooks/") {
        responses["200"] = json!({ "description": "Already accepted (same Idempotency-Key or webhook-id)",
            "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Accepted" } } } });
        responses["413"] = problem("Body larger than 1 MiB");
        responses["429"] = problem("Tenant over its queued limit; not started (Retry-After)");
        responses["503"] = problem("Database or broker unavailable; not started (Retry-After)");
    }
    match route.access {
        Access::Public => {}
        Access::Signed => {
            responses["401"] = problem("Missing, invalid or stale signature; nothing enqueued");
        }
        Access::Producer | Access::Operator => {
            responses["401"] = problem("Missing, malformed, unknown or revoked token");
            responses["403"] = problem("The token's role may not use this route");
        }
    }
    if route.path.contains('{') {
        responses["404"] = problem("No such id in the caller's tenant");
    }
    if route.body.is_some() || route.path.contains('{') {
        responses["400"] = problem("Malformed request");
        responses["422"] = problem("Well-formed but refused; `field` names what is wrong");
    }
    if route.method == "post" && route.path != "/v1/operations" {
        responses["409"] =
            problem("The operation or dead letter is not in a state that allows this");
    }
    let mut op = json!({
        "summary": route.summary,
        "operationId": format!("{}_{}", route.method, route.path.trim_start_matches('/')
            .replace(['/', '.'], "_").replace(['{', '}'], "")),
        "parameters": parameters(route.path, route.method),
        "responses": responses,
    });
    match route.access {
        Access::Producer | Access::Operator => {
            op["security"] = json!([{ "bearer": [] }]);
            op["x-agentq-role"] = json!(if matches!(route.access, Access::Operator) {
                "operator"
            } else {
                "producer"
            });
        }
        _ => op["security"] = json!([]),
    }
    if let Some(body) = route.body {
        op["requestBody"] = json!({ "required": route.path == "/v1/operations" || route.path.ends_with("/discard") || route.path.ends_with("/resolve"),
            "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{body}") } } } });
    }
    op
}

fn schemas() -> Value {
    let s = |v: &str| json!({ "type": "string", "description": v });
    json!({
        "Problem": { "type": "object", "required": ["type", "title", "status", "detail"], "properties": {
            "type": { "type": "string" }, "title": { "type": "string" }, "status": { "type": "integer" },
            "detail": s("What was wrong and what to do"), "field": s("The field, header or parameter at fault"),
            "request_id": s("Quote it when reporting a problem") } },
        "CreateOperation": { "type": "object", "additionalProperties": false, "required": ["kind", "input"], "properties": {
            "kind": s("A job kind this deployment runs"), "input": { "description": "The job's input (≤ 1 MiB)" },
            "tenant": s("Only for admin tokens; others enqueue in their own tenant"),
            "ordering_key": s("Operations sharing it run one at a time, in order"),
            "lane": { "type": "string", "enum": ["interactive", "batch"] },
            "priority": { "type": "integer" }, "max_attempts": { "type": "integer", "minimum": 1, "maximum": 1000 },
            "run_at": { "type": "string", "format": "date-time" }, "deadline": { "type": "string", "format": "date-time" } } },
        "Accepted": { "type": "object", "properties": { "op_id": { "type": "string", "format": "uuid" },
            "status": { "type": "string" }, "created": { "type": "boolean" },
            "status_url": { "type": "string" }, "events_url": { "type": "string" } } },
        "Operation": { "type": "object", "properties": {
            "op_id": { "type": "string", "format": "uuid" }, "tenant": { "type": "string" }, "kind": { "type": "string" },
            "lane": { "type": "string" },
            "status": { "type": "string", "enum": ["queued", "running", "sleeping", "waiting", "succeeded", "dead", "cancelled", "discarded"] },
            "attempt": { "type": "integer" }, "max_attempts": { "type": "integer" }, "restarts": { "type": "integer" },
            "run_at": { "type": "string", "format": "date-time" }, "created_at": { "type": "string", "format": "date-time" },
            "updated_at": { "type": "string", "format": "date-time" }, "finished_at": { "type": ["string", "null"], "format": "date-time" },
            "result": {}, "error_class": { "type": ["string", "null"] }, "error_message": { "type": ["string", "null"] },
            "waiting_for": { "type": ["string", "null"] }, "batch_id": { "type": ["string", "null"] },
            "dedupe_key": { "type": ["string", "null"] }, "ordering_key": { "type": ["string", "null"] },
            "request_id": { "type": ["string", "null"] } } },
        "Steps": { "type": "object", "properties": { "op_id": { "type": "string" }, "steps": { "type": "array", "items": { "type": "object" } } } },
        "AnyJson": { "description": "Any JSON value" },
        "SignalResult": { "type": "object", "properties": { "op_id": { "type": "string" }, "signal": { "type": "string" },
            "result": { "type": "string", "enum": ["delivered", "kept"] } } },
        "CancelRequest": { "type": "object", "additionalProperties": false, "properties": { "reason": { "type": "string" } } },
        "CancelResult": { "type": "object", "properties": { "op_id": { "type": "string" },
            "result": { "type": "string", "enum": ["cancelled", "requested"] } } },
        "DeadLetterPage": { "type": "object", "properties": { "items": { "type": "array", "items": { "type": "object" } },
            "next_cursor": { "type": ["string", "null"] } } },
        "DeadLetterStats": { "type": "object", "properties": { "groups": { "type": "array", "items": { "type": "object" } } } },
        "DeadLetterDetails": { "type": "object", "properties": { "dead_letter": { "type": "object" }, "operation": {},
            "steps": { "type": "array" }, "history": { "type": "array" }, "raw_message_preview": { "type": ["string", "null"] } } },
        "RetryRequest": { "type": "object", "additionalProperties": false, "properties": {
            "patch_input": { "description": "RFC 7386 merge patch applied to the input" }, "reason": { "type": "string" } } },
        "ResolveRequest": { "type": "object", "additionalProperties": false, "required": ["happened"], "properties": {
            "happened": { "type": "boolean" }, "output": { "description": "What the step returned, if it happened" },
            "reason": { "type": "string" } } },
        "DiscardRequest": { "type": "object", "additionalProperties": false, "required": ["reason"], "properties": {
            "reason": { "type": "string", "minLength": 1 } } },
        "ActionResult": { "type": "object", "properties": { "id": { "type": "string" }, "result": { "type": "string" },
            "op_id": { "type": ["string", "null"] } } },
        "ReasonRequest": { "type": "object", "additionalProperties": false, "properties": { "reason": { "type": "string" } } },
        "BatchStatus": { "type": "object", "properties": { "batch_id": { "type": "string", "format": "uuid" },
            "status": { "type": "string", "enum": ["canary", "running", "paused", "cancelled"] },
            "documents": { "type": "integer" }, "enqueued": { "type": "integer" }, "unfinished": { "type": "integer" },
            "by_status": { "type": "object" }, "succeeded_per_s": { "type": "number" }, "eta_secs": { "type": ["integer", "null"] },
            "usage": { "type": "object" }, "top_failures": { "type": "array" } } },
        "BatchResult": { "type": "object", "properties": { "batch_id": { "type": "string", "format": "uuid" },
            "result": { "type": "string", "enum": ["paused", "resumed", "cancelled"] } } },
        "Health": { "type": "object", "properties": { "status": { "type": "string" } } },
        "Ready": { "type": "object", "properties": { "postgres": { "type": "string", "enum": ["ok", "down"] },
            "rabbitmq": { "type": "string", "enum": ["ok", "down"] } } },
        "OpenApi": { "type": "object" }
    })
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

/// `GET /openapi.json`.
pub async fn document() -> Json<Value> {
    Json(spec())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
