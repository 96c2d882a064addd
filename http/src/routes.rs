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
use axum::routing::MethodRouter;

use crate::ApiState;
use crate::auth::{Caller, Role};
use crate::problem::ApiError;

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

mod table;
pub use table::ROUTES;

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
    // The token's rate first, by the token presented: a request past it costs no lookup.
    if let Ok(token) = crate::auth::bearer(req.headers()) {
        let hash = agentq_app::access::token_hash(token);
        if let Err(wait) = state.throttle.take(&hash, crate::throttle::cost(req.uri())) {
            return ApiError::from(agentq_app::AppError::Busy {
                message: format!(
                    "this token has used its request rate ({} units a second, \
                     AGENTQ_API_TOKEN_RATE; a list page costs one more per 20 rows of its \
                     limit); nothing was done: retry after the Retry-After seconds",
                    state.throttle.rate()
                ),
                retry_after_secs: wait.as_secs().max(1) + u64::from(wait.subsec_nanos() > 0),
            })
            .into_response();
        }
    }
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

    use crate::meta;
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
            throttle: crate::throttle::Throttle::new(0),
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
