//! `POST /v1/webhooks/{source}`: Standard Webhooks ingress, over the application layer's
//! delivery ([`agentq_app::webhooks`]: verify against the source's secrets, then enqueue with
//! the `webhook-id` as dedupe key). An unknown source answers the same 401 as a bad signature;
//! the body is parsed only after the signature verified, and the broker checked before
//! anything is written.

use std::sync::Arc;

use agentq_app::AppError;
use agentq_app::webhooks::{self, Delivery, Verdict};
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;

use super::operations::accepted;
use super::problem::{ApiError, ApiResult, request_id};
use super::{ApiState, Params, body};

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
    let delivery = Delivery {
        id: header(&headers, "webhook-id"),
        timestamp: header(&headers, "webhook-timestamp"),
        signature: header(&headers, "webhook-signature"),
        body: &bytes,
    };
    let verified = match webhooks::verify(&state.app, &source, &delivery).await? {
        Verdict::Verified(v) => v,
        Verdict::Refused(why) => {
            return Err(ApiError::unauthorized(format!(
                "the delivery is not signed by this source ({why}); nothing was enqueued"
            )));
        }
    };
    let event = body::parse_value(&bytes)?;
    state.admit().await?;
    let (enqueued, debounce) = webhooks::enqueue(
        &state.app,
        &verified,
        event,
        request_id(),
        super::traceparent(),
    )
    .await
    .map_err(|e| match e {
        // The one conflict of a delivery: its webhook-id came with another body before.
        conflict @ AppError::Conflict(_) => ApiError::from(conflict).field("webhook-id"),
        other => other.into(),
    })?;
    Ok(accepted(
        enqueued.op_id,
        enqueued.created,
        enqueued.status,
        debounce,
    ))
}
