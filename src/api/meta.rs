//! Liveness, readiness and Prometheus metrics.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::ApiState;

/// Upper bounds (seconds) of the request-duration histogram.
const BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];

#[derive(Default)]
struct Series {
    count: u64,
    sum: f64,
    buckets: [u64; BUCKETS.len()],
}

/// Request counts and durations by method, route and status.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, String, u16), Series>>,
}

impl Metrics {
    pub fn observe(&self, method: &str, route: &str, status: u16, took: Duration) {
        let secs = took.as_secs_f64();
        let mut map = self.requests.lock().expect("metrics lock");
        let s = map
            .entry((method.to_string(), route.to_string(), status))
            .or_default();
        s.count += 1;
        s.sum += secs;
        for (i, le) in BUCKETS.iter().enumerate() {
            if secs <= *le {
                s.buckets[i] += 1;
            }
        }
    }

    fn render(&self, out: &mut String) {
        let map = self.requests.lock().expect("metrics lock");
        out.push_str("# HELP agentq_http_requests_total HTTP requests answered, by method, route and status.\n");
        out.push_str("# TYPE agentq_http_requests_total counter\n");
        for ((m, r, s), v) in map.iter() {
            let _ = writeln!(
                out,
                "agentq_http_requests_total{{method=\"{m}\",route=\"{r}\",status=\"{s}\"}} {}",
                v.count
            );
        }
        out.push_str(
            "# HELP agentq_http_request_duration_seconds Time to answer an HTTP request.\n",
        );
        out.push_str("# TYPE agentq_http_request_duration_seconds histogram\n");
        let mut by_route: BTreeMap<(&str, &str), Series> = BTreeMap::new();
        for ((m, r, _), v) in map.iter() {
            let s = by_route.entry((m, r)).or_default();
            s.count += v.count;
            s.sum += v.sum;
            for i in 0..BUCKETS.len() {
                s.buckets[i] += v.buckets[i];
            }
        }
        for ((m, r), s) in by_route {
            let labels = format!("method=\"{m}\",route=\"{r}\"");
            for (i, le) in BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "agentq_http_request_duration_seconds_bucket{{{labels},le=\"{le}\"}} {}",
                    s.buckets[i]
                );
            }
            let _ = writeln!(
                out,
                "agentq_http_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                s.count
            );
            let _ = writeln!(
                out,
                "agentq_http_request_duration_seconds_sum{{{labels}}} {}",
                s.sum
            );
            let _ = writeln!(
                out,
                "agentq_http_request_duration_seconds_count{{{labels}}} {}",
                s.count
            );
        }
    }
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// `GET /readyz`: PostgreSQL and RabbitMQ are reachable (503 naming the one that is not).
pub async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    let pg = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&state.pool),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    let mq = state.broker_up().await;
    let word = |up: bool| if up { "ok" } else { "down" };
    let code = if pg && mq {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut response = (
        code,
        Json(json!({ "postgres": word(pg), "rabbitmq": word(mq) })),
    )
        .into_response();
    if code != StatusCode::OK {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, axum::http::HeaderValue::from(5));
    }
    response
}

/// `GET /metrics`: Prometheus text.
pub async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    let mut out = String::new();
    state.metrics.render(&mut out);
    match agentq_core::db::count_by_status(&state.pool).await {
        Ok(rows) => {
            out.push_str("# HELP agentq_operations Operations by status.\n");
            out.push_str("# TYPE agentq_operations gauge\n");
            for (status, n) in rows {
                let _ = writeln!(out, "agentq_operations{{status=\"{status}\"}} {n}");
            }
        }
        Err(e) => tracing::warn!(error = %e, "metrics: counting operations failed"),
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
