//! `POST /v1/webhooks/{source}`: Standard Webhooks ingress. A delivery is verified against the
//! source's valid secrets (HMAC-SHA256 over `id.timestamp.body`, constant-time, ±5 minutes)
//! before anything is parsed or written; its `webhook-id` is the dedupe key, so a sender's
//! retries map to one operation. An unknown source answers the same 401 as a bad signature. A source with a config gets the input
//! `{"event": body, "source", "webhook_id", "config"}`; one without gets the body.

use std::sync::Arc;

use agentq_core::db;
use agentq_core::operation::Origin;
use agentq_core::webhook::{self, Secret};
use agentq_producer::EnqueueRequest;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;

use super::operations::accepted;
use super::problem::{ApiError, ApiResult, request_id};
use super::{ApiState, Params, body};

/// Longest accepted `webhook-id`.
const MAX_WEBHOOK_ID: usize = 256;

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// `POST /v1/webhooks/{source}`.
pub async fn deliver(
    State(state): State<Arc<ApiState>>,
    Params(source): Params<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let bytes = body::bytes(body).await?;
    // An unknown source is refused exactly like a delivery its secret did not sign, so the
    // answer never tells a caller which sources exist.
    let targets = if (1..=128).contains(&source.len()) {
        db::access::sources_named(&state.app.pool, &source).await?
    } else {
        Vec::new()
    };
    let (id, ts, sig) = (
        header(&headers, "webhook-id"),
        header(&headers, "webhook-timestamp"),
        header(&headers, "webhook-signature"),
    );
    let now = chrono::Utc::now();
    // No target: the same checks against no secret, so the reason is the one a known source
    // would give.
    let mut refusal = targets
        .is_empty()
        .then(|| webhook::verify(&[], id, ts, sig, &bytes, now).err())
        .flatten();
    let mut verified = None;
    for target in &targets {
        let secrets: Vec<Secret> = target
            .secrets
            .iter()
            .filter_map(|s| Secret::parse(s).ok())
            .collect();
        match webhook::verify(&secrets, id, ts, sig, &bytes, now) {
            Ok(()) => {
                verified = Some(target);
                break;
            }
            Err(e) => refusal = Some(e),
        }
    }
    let Some(target) = verified else {
        let why = refusal.map(|e| e.to_string()).unwrap_or_default();
        tracing::info!(source = %source, reason = %why, "webhook delivery refused");
        return Err(ApiError::unauthorized(format!(
            "the delivery is not signed by this source ({why}); nothing was enqueued"
        )));
    };
    let id = id.expect("verified deliveries have an id");
    if id.len() > MAX_WEBHOOK_ID {
        return Err(ApiError::bad_request(format!(
            "webhook-id is longer than {MAX_WEBHOOK_ID} characters"
        ))
        .field("webhook-id"));
    }
    let event = body::parse_value(&bytes)?;
    // A configured source hands its kind the delivery with its context; otherwise the body is
    // the input as is.
    let input = match &target.config {
        Some(config) => serde_json::json!({
            "event": event,
            "source": source,
            "webhook_id": id,
            "config": config,
        }),
        None => event,
    };
    state.admit().await?;
    agentq_app::capacity::admit(&state.app, &target.tenant, &target.kind, 1).await?;
    let enqueued = state
        .app
        .producer
        .enqueue(EnqueueRequest {
            tenant: target.tenant.clone(),
            kind: target.kind.clone(),
            input,
            dedupe_key: Some(format!("webhook:{source}:{id}")),
            origin: Origin::Webhook,
            request_id: request_id(),
            traceparent: super::traceparent(),
            ..EnqueueRequest::default()
        })
        .await
        .map_err(|e| match e {
            agentq_producer::Error::KeyConflict { op_id, .. } => ApiError::conflict(format!(
                "webhook-id {id:?} was already delivered with a different body (operation \
                 {op_id}); a retry must resend the same body"
            ))
            .field("webhook-id"),
            other => agentq_app::operations::refused_enqueue(other).into(),
        })?;
    Ok(accepted(enqueued.op_id, enqueued.created, enqueued.status))
}
