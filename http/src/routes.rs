//! The API's routes: one table ([`ROUTES`]) of method, path, handler and the [`Access`] each
//! needs, which the router mounts, the OpenAPI document describes and the route tests walk.
//! The access is enforced, not only documented: [`mount`] puts every route behind [`enforce`],
//! which authenticates the caller and checks its role before the handler runs (401/403 as
//! problem+json, nothing read or written). Handlers keep their finer checks (a tenant's own
//! ids, a producer naming another tenant), which the application layer makes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post, put};

use crate::auth::{Caller, Role};
use crate::problem::ApiError;
use crate::{
    ApiState, batches, budgets, dlq, events, kinds, meta, operations, pauses, rate_limits,
    schedules, tenants, webhooks,
};

/// Who may call a route: [`enforce`] checks it before the handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone, without a token.
    Public,
    /// A Standard Webhooks signature instead of a token (the handler verifies it).
    Signed,
    /// A token of any role.
    Producer,
    /// An operator's token, or a producer's when the deployment lets producers approve
    /// (`AGENTQ_PRODUCER_MAY_APPROVE`): the approval routes. Documented as `operator`.
    Approver,
    /// An operator's or an admin's token.
    Operator,
    /// An admin's token.
    Admin,
}

/// One route: method, path (axum syntax `{param}`), its handler, summary, access, request
/// schema, success. The router ([`crate::router`]), the OpenAPI document
/// ([`crate::openapi::spec`]) and the route tests all read [`ROUTES`], so a route exists in all
/// three or in none.
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
        "Read an operation: what it waits for (`waiting`: the signal, its timeout, what the job needs, an agent's pending tool call) and, with `include=input`, its input (operator or admin; audited)",
        Access::Producer,
        None,
        (200, "OperationDetail"),
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
        "/v1/operations/{id}/why",
        || get(operations::why),
        "Why the operation is not running (or what it is doing): the one gate that holds it now, with its evidence",
        Access::Producer,
        None,
        (200, "Why"),
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
        Access::Approver,
        Some("CancelRequest"),
        (202, "SignalResult"),
    ),
    r(
        "post",
        "/v1/operations/{id}/reject",
        || post(operations::reject),
        "Reject: the signal approval with {\"approved\": false, \"by\", \"reason\"}, audited as reject",
        Access::Approver,
        Some("CancelRequest"),
        (202, "SignalResult"),
    ),
    r(
        "post",
        "/v1/operations/{id}/pause",
        || post(pauses::pause_operation),
        "Pause one operation: not claimed while paused; if running, it stops at its next step boundary with its journal and attempt kept (a reason is required; audited; dry_run counts)",
        Access::Operator,
        Some("PauseReason"),
        (200, "Paused"),
    ),
    r(
        "post",
        "/v1/operations/{id}/resume",
        || post(pauses::resume_operation),
        "Lift one operation's own pause and re-dispatch it (audited)",
        Access::Operator,
        Some("PauseReason"),
        (200, "Resumed"),
    ),
    r(
        "put",
        "/v1/operations/{id}/budget",
        || put(budgets::set_operation),
        "Set or raise an operation's token budget (audited); an operation waiting for its budget is queued again",
        Access::Operator,
        Some("SetBudget"),
        (200, "BudgetSet"),
    ),
    r(
        "post",
        "/v1/operations/{id}/budget/allow-once",
        || post(budgets::allow_once),
        "Let the next model call an operation's own budget refuses through, once (audited); queued again if it waits for its budget",
        Access::Operator,
        Some("AllowOnceRequest"),
        (200, "AllowedOnce"),
    ),
    r(
        "get",
        "/v1/operations/{id}/budgets",
        || get(budgets::list),
        "The token budgets over an operation: its own, then its batch's (limit, measure, spent, held, calls charged by estimate)",
        Access::Producer,
        None,
        (200, "BudgetList"),
    ),
    r(
        "put",
        "/v1/batches/{id}/budget",
        || put(budgets::set_batch),
        "Set or raise a batch's token budget ({id}: its id or name; audited); a batch its budget paused needs a resume",
        Access::Operator,
        Some("SetBudget"),
        (200, "BudgetSet"),
    ),
    r(
        "put",
        "/v1/tenants/{tenant}/budget",
        || put(budgets::set_tenant),
        "Set or raise a tenant's token budget per period (an admin's act, audited); the tenant's operations waiting for a budget are queued again",
        Access::Admin,
        Some("SetTenantBudget"),
        (200, "BudgetSet"),
    ),
    r(
        "get",
        "/v1/pauses",
        || get(pauses::list),
        "The pauses in force (an admin may pass ?tenant=)",
        Access::Operator,
        None,
        (200, "PauseList"),
    ),
    r(
        "post",
        "/v1/pauses",
        || post(pauses::create),
        "Pause every operation of a scope (a kind, a tenant, a lane, a schedule, any combination; or everything: drain mode); running ones stop at their next step boundary (a reason is required; audited; dry_run counts and changes nothing)",
        Access::Operator,
        Some("PauseRequest"),
        (200, "Paused"),
    ),
    r(
        "get",
        "/v1/rate-limits",
        || get(rate_limits::list),
        "The rate limits the caller may see (an admin's every one, or ?tenant='s; anyone else's its tenant's), each with what its current window holds",
        Access::Producer,
        None,
        (200, "LimitList"),
    ),
    r(
        "post",
        "/v1/rate-limits",
        || post(rate_limits::set),
        "Set (create or replace) a rate limit on model calls per window: of a model or provider or of a tenant (an admin's), or of a key the tenant's operations name (an operator's, for its own tenant); shared by every worker; audited",
        Access::Operator,
        Some("LimitRequest"),
        (200, "LimitView"),
    ),
    r(
        "delete",
        "/v1/rate-limits/{scope}/{name}",
        || delete(rate_limits::delete),
        "Remove a rate limit (a key limit's tenant is ?tenant=, an operator's own by default); audited",
        Access::Operator,
        None,
        (200, "LimitRemoved"),
    ),
    r(
        "post",
        "/v1/pauses/{id}/resume",
        || post(pauses::resume),
        "Lift a pause and re-dispatch what it held that no other pause holds (audited)",
        Access::Operator,
        Some("PauseReason"),
        (200, "Resumed"),
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
        "/v1/batches",
        || get(batches::list),
        "List batches, newest first, with their progress and times (one keyset page; ?status=, and ?tenant= for an admin)",
        Access::Operator,
        None,
        (200, "BatchPage"),
    ),
    r(
        "post",
        "/v1/batches",
        || post(batches::start),
        "Start a batch: one operation per document of a source store, optionally named (idempotent: a re-run enqueues only what is missing; 201 created, 200 found again; 409 for a name the tenant uses)",
        Access::Operator,
        Some("StartBatch"),
        (201, "BatchStarted"),
    ),
    r(
        "get",
        "/v1/batches/{id}",
        || get(batches::show),
        "A batch's progress (by id or name): totals by status, start and finish times, rate over running time, ETA while running, token usage, top failures",
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
        "Cancel every unfinished operation of a batch (audited; a completed batch is refused)",
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
        "A schedule (by id or name) with its next firings and counts",
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
        || get(crate::openapi_document),
        "This document",
        Access::Public,
        None,
        (200, "OpenApi"),
    ),
];

impl Access {
    /// The least role a token must have, `None` for a route without a token; `approvers` is
    /// the deployment's `AGENTQ_PRODUCER_MAY_APPROVE`.
    pub fn least_role(self, approvers: bool) -> Option<Role> {
        match self {
            Access::Public | Access::Signed => None,
            Access::Producer => Some(Role::Producer),
            Access::Approver if approvers => Some(Role::Producer),
            Access::Approver | Access::Operator => Some(Role::Operator),
            Access::Admin => Some(Role::Admin),
        }
    }
}

/// The route's handler behind [`enforce`] of its access.
pub fn mount(route: &Route, state: &Arc<ApiState>) -> MethodRouter<Arc<ApiState>> {
    guarded(route.access, (route.handler)(), state)
}

/// `handler` behind [`enforce`] of `access` (only for the methods it has: another method is
/// still answered 405 without a token).
fn guarded(
    access: Access,
    handler: MethodRouter<Arc<ApiState>>,
    state: &Arc<ApiState>,
) -> MethodRouter<Arc<ApiState>> {
    handler.route_layer(middleware::from_fn_with_state(
        (state.clone(), access),
        enforce,
    ))
}

/// Checks the caller against the route's access before its handler runs: no token or a bad
/// one is 401, a role below the route's is 403. The caller found is handed to the handler
/// (its `Caller` extractor takes it from the request instead of looking the token up again).
pub async fn enforce(
    State((state, access)): State<(Arc<ApiState>, Access)>,
    mut req: Request,
    next: Next,
) -> Response {
    let Some(least) = access.least_role(state.app.settings.producer_may_approve) else {
        return next.run(req).await;
    };
    let caller = match Caller::of_request(&state, req.extensions(), req.headers()).await {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if access == Access::Approver && caller.role < least {
        return ApiError::forbidden(format!(
            "approving or rejecting needs an operator token (or AGENTQ_PRODUCER_MAY_APPROVE=true \
             on the server); this token is a {} token; nothing was sent",
            caller.role.as_str()
        ))
        .into_response();
    }
    if let Err(refused) = caller.require(least) {
        return refused.into_response();
    }
    req.extensions_mut().insert(caller);
    next.run(req).await
}

#[cfg(test)]
mod tests {
    //! The access of every route, as declared, is what the router enforces: a role below it
    //! is refused before the handler runs, the role it names is let through (no stronger check
    //! hides behind a weaker declaration), and a bearer route without a token is 401.

    use std::sync::Mutex;
    use std::time::Duration;

    use agentq_core::broker::Names;
    use agentq_core::dispatch::Dispatcher;
    use agentq_core::kinds::{Catalog, InputError, KindInfo, ToolInfo};
    use agentq_core::operation::Requires;
    use agentq_producer::Producer;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::{MethodFilter, on};
    use serde_json::Value;
    use tokio_util::sync::CancellationToken;

    use super::*;

    /// A deployment without kinds: no route reached here needs one.
    struct NoKinds;

    impl Catalog for NoKinds {
        fn kinds(&self) -> Vec<KindInfo> {
            Vec::new()
        }
        fn has_kind(&self, _kind: &str) -> bool {
            false
        }
        fn tools(&self) -> Vec<ToolInfo> {
            Vec::new()
        }
        fn requires(&self, _kind: &str, _input: &Value) -> Result<Requires, InputError> {
            Ok(Requires::default())
        }
    }

    /// A server state whose database and broker are never reached (nothing is there): a
    /// request the access check lets through to a real handler would fail, not pass.
    fn state(producer_may_approve: bool) -> Arc<ApiState> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(100))
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let dispatcher = Arc::new(Dispatcher::new(
            pool.clone(),
            "amqp://127.0.0.1:1",
            Names::new("routes-test"),
            "test",
        ));
        let producer = Producer::new(pool.clone(), dispatcher.clone(), Arc::new(NoKinds), 5);
        let settings = agentq_app::Settings {
            producer_may_approve,
            ..Default::default()
        };
        Arc::new(ApiState {
            app: agentq_app::App::new(pool, producer, dispatcher, settings),
            streams: crate::events::Streams::new(1, 1),
            broker: Mutex::new(None),
            metrics: meta::Metrics,
            shutdown: CancellationToken::new(),
        })
    }

    fn caller(role: Role) -> Caller {
        Caller {
            tenant: "acme".into(),
            role,
            prefix: "agq_test0000".into(),
            token_hash: "0".repeat(64),
        }
    }

    /// `router` as authenticated by `caller` (none: no Authorization header), on a local port.
    async fn serve(
        router: Router,
        caller: Option<Caller>,
    ) -> (String, tokio::task::JoinHandle<()>) {
        let router = router.layer(middleware::from_fn(move |mut req: Request, next: Next| {
            if let Some(c) = caller.clone() {
                req.extensions_mut().insert(c);
            }
            next.run(req)
        }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        (base, server)
    }

    /// Calls `route` with made-up path parameters (an id that is no UUID) and a body that is
    /// not JSON: a handler that ran would refuse them (400) rather than answer 403.
    async fn call(client: &reqwest::Client, base: &str, route: &Route) -> (u16, String) {
        let path = route
            .path
            .replace("{id}", "not-an-id")
            .replace("{name}", "go")
            .replace("{tenant}", "acme")
            .replace("{source}", "github");
        let method =
            axum::http::Method::from_bytes(route.method.to_uppercase().as_bytes()).unwrap();
        let r = client
            .request(method, format!("{base}{path}"))
            .header("content-type", "application/json")
            .body("{")
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.text().await.unwrap())
    }

    const ROLES: [Role; 3] = [Role::Producer, Role::Operator, Role::Admin];

    #[tokio::test]
    async fn every_route_lets_through_exactly_the_roles_its_access_declares() {
        let client = reqwest::Client::new();
        for approvers in [false, true] {
            let state = state(approvers);
            // Every route of the table behind its access check, its handler a stub.
            let mut stubs = Router::new();
            for route in ROUTES {
                let method =
                    axum::http::Method::from_bytes(route.method.to_uppercase().as_bytes()).unwrap();
                let stub = on(MethodFilter::try_from(method).unwrap(), || async {
                    StatusCode::NO_CONTENT
                });
                stubs = stubs.route(route.path, guarded(route.access, stub, &state));
            }
            let stubs = stubs.with_state(state.clone());
            let mut callers: Vec<Option<Role>> = ROLES.into_iter().map(Some).collect();
            callers.push(None);
            for role in callers {
                let (base, server) = serve(stubs.clone(), role.map(caller)).await;
                for route in ROUTES {
                    let (status, body) = call(&client, &base, route).await;
                    let expected = match (route.access.least_role(approvers), role) {
                        (None, _) => 204,
                        (Some(_), None) => 401,
                        (Some(least), Some(role)) if role >= least => 204,
                        (Some(_), Some(_)) => 403,
                    };
                    assert_eq!(
                        status, expected,
                        "{} {} declared {:?} (approvers: {approvers}) called as {role:?}: {body}",
                        route.method, route.path, route.access
                    );
                }
                server.abort();
            }
        }
    }

    #[tokio::test]
    async fn the_servers_router_refuses_a_role_below_every_routes_access_before_its_handler() {
        let state = state(false);
        let client = reqwest::Client::new();
        let mut refused = 0;
        for role in ROLES {
            let (base, server) = serve(crate::router(state.clone()), Some(caller(role))).await;
            for route in ROUTES {
                let Some(least) = route.access.least_role(false) else {
                    continue;
                };
                if role >= least {
                    continue;
                }
                let (status, body) = call(&client, &base, route).await;
                assert_eq!(
                    status, 403,
                    "{} {} as {role:?}: {body}",
                    route.method, route.path
                );
                assert!(
                    body.contains("\"type\":\"https://agentq.dev/problems/forbidden\""),
                    "{body}"
                );
                refused += 1;
            }
            server.abort();
        }
        assert!(
            refused >= 20,
            "only {refused} refusals: the table lost its operator routes?"
        );
        // No token at all: 401 on every bearer route, with the challenge.
        let (base, server) = serve(crate::router(state.clone()), None).await;
        for route in ROUTES
            .iter()
            .filter(|r| r.access.least_role(false).is_some())
        {
            let (status, body) = call(&client, &base, route).await;
            assert_eq!(
                status, 401,
                "{} {} without a token: {body}",
                route.method, route.path
            );
        }
        server.abort();
    }
}
