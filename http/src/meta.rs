//! Liveness, readiness and Prometheus metrics: `GET /metrics` of `agentq serve`, and the
//! `GET /metrics` endpoint `agentq worker` and `agentq scheduler` serve on `AGENTQ_METRICS_ADDR`.
//! Both render the process's registry (`agentq_core::metrics`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentq_core::metrics;
use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use schemars::JsonSchema;
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::ApiState;
use super::auth::{Caller, Role};
use super::problem::ApiResult;

/// The API's request metrics, recorded in the process's registry.
#[derive(Default)]
pub struct Metrics;

impl Metrics {
    /// Counts one answered request; `route` is the matched route template, never the path.
    pub fn observe(&self, method: &str, route: &str, status: u16, took: Duration) {
        metrics::HTTP_REQUESTS.inc(&[method, route, &status.to_string()]);
        metrics::HTTP_REQUEST_DURATION.observe(&[method, route], took.as_secs_f64());
    }
}

/// The answer of `GET /healthz`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Health {
    /// Always `ok`: the process answers.
    pub status: Up,
}

/// The answer of `GET /readyz`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Ready {
    pub postgres: Reachable,
    pub rabbitmq: Reachable,
}

/// The one state a live process reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Up {
    Ok,
}

/// Whether a service agentq needs answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reachable {
    Ok,
    Down,
}

impl From<bool> for Reachable {
    fn from(up: bool) -> Self {
        if up { Reachable::Ok } else { Reachable::Down }
    }
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> Json<Health> {
    Json(Health { status: Up::Ok })
}

/// `GET /readyz`: PostgreSQL and RabbitMQ are reachable (503 naming the one that is not).
pub async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    let pg = tokio::time::timeout(
        Duration::from_secs(2),
        agentq_core::db::ping(&state.app.pool),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    let mq = state.broker_up().await;
    let code = if pg && mq {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut response = (
        code,
        Json(Ready {
            postgres: pg.into(),
            rabbitmq: mq.into(),
        }),
    )
        .into_response();
    if code != StatusCode::OK {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, axum::http::HeaderValue::from(5));
    }
    response
}

/// `GET /metrics` on the API address: Prometheus text with every tenant's counts, so it needs
/// an operator token (Prometheus sends it with `authorization`); `AGENTQ_METRICS_ADDR` serves
/// the same without a token on an address an operator keeps private.
pub async fn metrics(State(state): State<Arc<ApiState>>, caller: Caller) -> ApiResult<Response> {
    caller.require(Role::Operator)?;
    Ok(prometheus(Some(&state.app.pool)).await)
}

async fn prometheus(pool: Option<&PgPool>) -> Response {
    let text = metrics::scrape(pool).await;
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response()
}

/// A bound `GET /metrics` endpoint (`AGENTQ_METRICS_ADDR`) of a process without the API.
pub struct MetricsEndpoint {
    listener: tokio::net::TcpListener,
    pool: Option<PgPool>,
}

impl MetricsEndpoint {
    /// Binds `addr` and prints `metrics on http://ADDR` (the bound port when `addr` asks for 0).
    /// With a pool, each scrape also reads the database gauges.
    pub async fn bind(addr: &str, pool: Option<PgPool>) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on AGENTQ_METRICS_ADDR {addr}: {e}; pick another address"
            )
        })?;
        let bound: SocketAddr = listener.local_addr()?;
        println!("metrics on http://{bound}");
        tracing::info!(addr = %bound, "serving GET /metrics");
        Ok(Self { listener, pool })
    }

    /// Serves until `shutdown`.
    pub async fn serve(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let app =
            axum::Router::new()
                .route(
                    "/metrics",
                    get(|State(pool): State<Option<PgPool>>| async move {
                        prometheus(pool.as_ref()).await
                    }),
                )
                .with_state(self.pool);
        axum::serve(self.listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await?;
        Ok(())
    }
}
