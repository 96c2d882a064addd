//! Liveness, readiness and Prometheus metrics: `GET /metrics` of `agentq serve`, and the
//! `GET /metrics` and `GET /healthz` endpoint every long-running role serves on
//! `AGENTQ_METRICS_ADDR`. Both `/metrics` render the process's registry (`agentq_core::metrics`);
//! that `/healthz` answers from the role's loops (`agentq_core::health`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentq_core::health::Progress;
use agentq_core::metrics;
use axum::Json;
use axum::extract::State;
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::ApiState;
use super::auth::{Caller, Role};
use super::problem::ApiResult;

/// The API's request metrics, recorded in the process's registry.
#[derive(Default)]
pub struct Metrics;

impl Metrics {
    /// Counts one answered request; `route` is the matched route template (or `unmatched`),
    /// never the path, and the method is [`method_label`]'s.
    pub fn observe(&self, method: &Method, route: &str, status: u16, took: Duration) {
        let method = method_label(method);
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

/// A request's method as a metric label and in its span: one of the standard methods a client
/// may reasonably send, else `other`. The server accepts any token as a method, so the raw
/// method would let a client create series at will (until the registry's cap folds every new
/// series, legitimate ones too, into `_other`).
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> Json<Health> {
    Json(Health { status: Up::Ok })
}

/// `GET /readyz`: PostgreSQL and RabbitMQ are reachable (503 naming the one that is not).
pub async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    let pg = tokio::time::timeout(Duration::from_secs(2), agentq_app::health::ping(&state.app))
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

/// A bound `GET /metrics` endpoint (`AGENTQ_METRICS_ADDR`) of a process without the API, also
/// answering `GET /healthz` from its loops' progress marks.
pub struct MetricsEndpoint {
    listener: tokio::net::TcpListener,
    pool: Option<PgPool>,
    progress: Vec<Arc<Progress>>,
}

impl MetricsEndpoint {
    /// Binds `addr` and prints `metrics on http://ADDR` (the bound port when `addr` asks for 0).
    /// With a pool, each scrape also reads the database gauges; `progress` are the loops
    /// `GET /healthz` checks (none: it answers 200 while the process serves).
    pub async fn bind(
        addr: &str,
        pool: Option<PgPool>,
        progress: Vec<Arc<Progress>>,
    ) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on AGENTQ_METRICS_ADDR {addr}: {e}; pick another address"
            )
        })?;
        let bound: SocketAddr = listener.local_addr()?;
        println!("metrics on http://{bound}");
        tracing::info!(addr = %bound, "serving GET /metrics and GET /healthz");
        Ok(Self {
            listener,
            pool,
            progress,
        })
    }

    /// Serves until `shutdown`.
    pub async fn serve(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let progress = Arc::new(self.progress);
        let app =
            axum::Router::new()
                .route(
                    "/metrics",
                    get(|State(pool): State<Option<PgPool>>| async move {
                        prometheus(pool.as_ref()).await
                    }),
                )
                .with_state(self.pool)
                .route("/healthz", get(move || async move { health(&progress) }));
        axum::serve(self.listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await?;
        Ok(())
    }
}

/// `GET /healthz` of a metrics endpoint: 200 while every loop completed a round within its
/// limit, else 503 naming the stalled ones; each check shows its seconds since the last round.
fn health(progress: &[Arc<Progress>]) -> Response {
    let mut checks = serde_json::Map::new();
    let mut stalled = false;
    for p in progress {
        let stale = p.is_stale();
        stalled |= stale;
        checks.insert(
            p.what().to_string(),
            json!({
                "status": if stale { "stalled" } else { "ok" },
                "seconds_since": (p.since().as_secs_f64() * 10.0).round() / 10.0,
                "limit_seconds": p.stale_after().as_secs_f64(),
            }),
        );
    }
    let (code, status) = if stalled {
        (StatusCode::SERVICE_UNAVAILABLE, "stalled")
    } else {
        (StatusCode::OK, "ok")
    };
    (code, Json(json!({ "status": status, "checks": checks }))).into_response()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn method_labels_are_the_standard_methods_or_other() {
        for m in ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"] {
            assert_eq!(method_label(&Method::from_bytes(m.as_bytes()).unwrap()), m);
        }
        for m in [
            "TRACE",
            "CONNECT",
            "PROPFIND",
            "get",
            "X-CANARY-1",
            "AAAAAAAAAAAAAAAA",
        ] {
            assert_eq!(
                method_label(&Method::from_bytes(m.as_bytes()).unwrap()),
                "other",
                "{m}"
            );
        }
        // However many made-up methods a client sends, the requests fall into one series.
        for i in 0..100 {
            let m = Method::from_bytes(format!("M{i}").as_bytes()).unwrap();
            Metrics.observe(&m, "/label-test", 405, Duration::from_millis(1));
        }
        let count =
            metrics::global().value(&metrics::HTTP_REQUESTS, &["other", "/label-test", "405"]);
        assert_eq!(count, Some(100.0));
        let text = metrics::global().render();
        assert!(
            !text.contains("M42"),
            "a raw method became a label:\n{text}"
        );
    }

    #[tokio::test]
    async fn healthz_answers_503_naming_a_stalled_loop() {
        let fresh = Progress::new("lease_renewal", Duration::from_secs(60));
        let stalled = Progress::new("scheduler_pass", Duration::from_millis(500));
        tokio::time::sleep(Duration::from_millis(600)).await;
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0", None, vec![fresh, stalled.clone()])
            .await
            .unwrap();
        let addr = endpoint.listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(endpoint.serve(stop.clone()));
        let get = |path: &'static str| async move {
            let r = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        };
        let (status, body) = get("/healthz").await;
        assert_eq!(status, 503, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "stalled");
        assert_eq!(v["checks"]["scheduler_pass"]["status"], "stalled");
        assert_eq!(v["checks"]["lease_renewal"]["status"], "ok");
        assert_eq!(
            v["checks"]["lease_renewal"]["limit_seconds"].as_f64(),
            Some(60.0)
        );
        stalled.mark();
        let (status, body) = get("/healthz").await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = get("/metrics").await;
        assert_eq!(status, 200);
        assert!(
            body.contains("# TYPE agentq_leases_expired_total counter"),
            "{body}"
        );
        stop.cancel();
        server.await.unwrap().unwrap();
    }
}
