//! Webhook delivery (Standard Webhooks): a delivery is verified against the valid secrets of
//! the sources of that name (HMAC-SHA256 over `id.timestamp.body`, constant-time, ±5 minutes)
//! before anything is parsed or written, then enqueued as one operation of the source's kind
//! and tenant, its `webhook-id` the dedupe key so a sender's retries map to one operation. An
//! unknown source is refused exactly like a delivery its secret did not sign. A source with a
//! config gets the input `{"event": body, "source", "webhook_id", "config"}`; one without
//! gets the body.

use agentq_core::db::access;
use agentq_core::operation::Origin;
use agentq_core::webhook::{self, Secret};
use agentq_producer::{EnqueueRequest, Enqueued};
use serde_json::{Value, json};

use crate::{App, AppError, Result};

/// Longest accepted `webhook-id`.
pub const MAX_WEBHOOK_ID: usize = 256;

/// A delivery as received: its Standard Webhooks headers (absent when not sent) and body.
pub struct Delivery<'a> {
    pub id: Option<&'a str>,
    pub timestamp: Option<&'a str>,
    pub signature: Option<&'a str>,
    pub body: &'a [u8],
}

/// A delivery a source's secret signed: where it goes.
pub struct Verified {
    /// The source's name, as the delivery addressed it.
    pub source: String,
    /// The delivery's `webhook-id`.
    pub id: String,
    pub tenant: String,
    pub kind: String,
    /// The source's config: the operation's input wraps the event with it.
    pub config: Option<Value>,
    /// The source's debounce: deliveries holding a key at its pointer are debounced on it.
    pub debounce: Option<crate::debounce::SourceDebounce>,
    /// The token budget each of its operations is born with.
    pub budget: Option<agentq_core::db::budgets::Spec>,
}

/// What [`verify`] decided.
pub enum Verdict {
    Verified(Verified),
    /// No source of that name signed it (or none exists): why, as the sender may be told
    /// (HTTP 401; nothing was enqueued).
    Refused(String),
}

/// Verifies `delivery` against every source named `source` (the one whose secret signed it
/// wins). A `webhook-id` longer than [`MAX_WEBHOOK_ID`] is refused as malformed (after the
/// signature, so a stranger learns nothing).
pub async fn verify(app: &App, source: &str, delivery: &Delivery<'_>) -> Result<Verdict> {
    let targets = if (1..=128).contains(&source.len()) {
        access::sources_named(&app.pool, source).await?
    } else {
        Vec::new()
    };
    let Delivery {
        id,
        timestamp,
        signature,
        body,
    } = *delivery;
    let now = chrono::Utc::now();
    // No target: the same checks against no secret, so the reason is the one a known source
    // would give.
    let mut refusal = targets
        .is_empty()
        .then(|| webhook::verify(&[], id, timestamp, signature, body, now).err())
        .flatten();
    let mut verified = None;
    for target in targets {
        let secrets: Vec<Secret> = target
            .secrets
            .iter()
            .filter_map(|s| Secret::parse(s).ok())
            .collect();
        match webhook::verify(&secrets, id, timestamp, signature, body, now) {
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
        return Ok(Verdict::Refused(why));
    };
    let id = id.expect("verified deliveries have an id");
    if id.len() > MAX_WEBHOOK_ID {
        return Err(AppError::malformed(
            "webhook-id",
            format!("webhook-id is longer than {MAX_WEBHOOK_ID} characters"),
        ));
    }
    Ok(Verdict::Verified(Verified {
        source: source.to_string(),
        id: id.to_string(),
        tenant: target.tenant,
        kind: target.kind,
        config: target.config,
        debounce: target.debounce.and_then(|d| serde_json::from_value(d).ok()),
        budget: target.budget,
    }))
}

/// Enqueues a verified delivery's `event` through the tenant's caps: a retry with the same
/// `webhook-id` and body gets the same operation back; with another body it is a conflict
/// (nothing enqueued). `request_id` and `traceparent` are the receiving request's. A source
/// with a debounce folds a delivery whose body holds a key at its pointer into the key's
/// pending operation (`crate::debounce`, audited as the source, `webhook:<source>`), and
/// answers its debounce too; a delivery without a key there is enqueued as it is.
pub async fn enqueue(
    app: &App,
    delivery: &Verified,
    event: Value,
    request_id: Option<String>,
    traceparent: Option<String>,
) -> Result<(Enqueued, Option<crate::debounce::Answer>)> {
    let Verified {
        source,
        id,
        tenant,
        kind,
        config,
        debounce,
        budget,
    } = delivery;
    let spec = debounce.as_ref().and_then(|d| d.for_event(&event));
    // A configured source hands its kind the delivery with its context; otherwise the body is
    // the input as is.
    let input = match config {
        Some(config) => json!({
            "event": event,
            "source": source,
            "webhook_id": id,
            "config": config,
        }),
        None => event,
    };
    let req = EnqueueRequest {
        tenant: tenant.clone(),
        kind: kind.clone(),
        input,
        dedupe_key: Some(format!("webhook:{source}:{id}")),
        origin: Origin::Webhook,
        request_id,
        traceparent,
        budget: *budget,
        ..EnqueueRequest::default()
    };
    // The one conflict of a delivery: its webhook-id came before with another body.
    let redelivered = |op_id: uuid::Uuid| {
        AppError::Conflict(format!(
            "webhook-id {id:?} was already delivered with a different body (operation \
             {op_id}); a retry must resend the same body"
        ))
    };
    if let Some(spec) = spec {
        let actor = format!("webhook:{source}");
        let d = crate::debounce::fold(app, req, &spec, &actor)
            .await
            .map_err(|e| match e {
                AppError::KeyReused { op_id, .. } => redelivered(op_id),
                other => other,
            })?;
        let enqueued = Enqueued {
            op_id: d.op_id,
            created: d.created,
            status: d.status,
        };
        return Ok((enqueued, Some(d.debounce)));
    }
    crate::capacity::admit(app, tenant, kind, 1).await?;
    let enqueued = app.producer.enqueue(req).await.map_err(|e| match e {
        agentq_producer::Error::KeyConflict { op_id, .. } => redelivered(op_id.0),
        other => crate::operations::refused_enqueue(other),
    })?;
    Ok((enqueued, None))
}
