//! Debounce on a key, the one implementation the CLI (`agentq enqueue --debounce-key`), the API
//! (`POST /v1/operations` with `debounce_key`) and webhook sources (`--debounce-pointer`) call.
//!
//! An enqueue naming a key whose operation is pending (queued, never started) in its tenant
//! replaces that operation's input (last wins) and pushes its start back to now + window, never
//! later than its first arrival + max_delay; it is answered with that operation
//! (`created: false`, `debounce.outcome: joined`) and audited (`operator_actions`, action
//! `debounce`). When the key's operation has already started, the policy decides: `queue` (a
//! new pending operation), `skip` (the started one is the answer, nothing new) or
//! `cancel_running` (the started one is cancelled through the cancel flow, and a new pending
//! one made). The SQL is `agentq_core::db::debounce`; what is durable when is in docs/debounce.md.

use agentq_core::db::debounce::{self as db, Outcome, Spec};
use agentq_core::metrics;
use agentq_core::operation::{OperationId, Status};
use agentq_producer::EnqueueRequest;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{App, AppError, Caller, Result};

pub use agentq_core::db::debounce::OnRunning;

/// Longest debounce key.
pub const MAX_KEY: usize = 256;
/// Longest window and longest max_delay: a day.
pub const MAX_MS: i64 = 86_400_000;
/// Without a max_delay, a key's stream of arrivals starts its operation at most this many
/// windows after the first.
pub const DEFAULT_MAX_DELAY_WINDOWS: i64 = 10;

/// The names of a debounce's four fields where they were given: the API's fields
/// ([`Fields::API`]), a command's flags ([`Fields::CLI`]).
#[derive(Clone, Copy, Debug)]
pub struct Fields {
    pub key: &'static str,
    pub window: &'static str,
    pub max_delay: &'static str,
    pub on_running: &'static str,
}

impl Fields {
    /// `POST /v1/operations`'s fields.
    pub const API: Fields = Fields {
        key: "/debounce_key",
        window: "/debounce",
        max_delay: "/max_delay",
        on_running: "/on_running",
    };
    /// `agentq enqueue`'s flags.
    pub const CLI: Fields = Fields {
        key: "--debounce-key",
        window: "--debounce",
        max_delay: "--max-delay",
        on_running: "--on-running",
    };
    /// `agentq webhooks add`'s flags (the key is read at `--debounce-pointer`).
    pub const SOURCE: Fields = Fields {
        key: "--debounce-pointer",
        window: "--debounce",
        max_delay: "--max-delay",
        on_running: "--on-running",
    };
}

/// A debounce as typed: durations such as `500ms`, `2s`, `5m`, `1h`; a policy `queue`,
/// `skip` or `cancel_running`. All absent: no debounce.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Request {
    pub key: Option<String>,
    pub window: Option<String>,
    pub max_delay: Option<String>,
    pub on_running: Option<String>,
}

/// Reads a duration as typed (`500ms`, `2s`, `5m`, `1h`) in milliseconds, naming `field`.
pub fn parse_ms(s: &str, field: &'static str) -> Result<i64> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(AppError::invalid(
            field,
            format!("{field} {s:?} is negative; give a duration such as 2s"),
        ));
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let factor = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => 0,
    };
    let ms = n
        .parse::<i64>()
        .ok()
        .filter(|_| factor > 0)
        .and_then(|n| n.checked_mul(factor));
    match ms {
        None => Err(AppError::invalid(
            field,
            format!("{field} {s:?}: use a duration such as 500ms, 2s, 5m or 1h"),
        )),
        Some(ms) if ms > MAX_MS => Err(AppError::invalid(
            field,
            format!("{field} {s:?} is longer than a day"),
        )),
        Some(ms) => Ok(ms),
    }
}

impl Request {
    /// The debounce these fields ask for (none when all are absent), each wrong field refused
    /// by its name in `fields`: a key of 1-256 characters, a window of more than 0 up to a
    /// day, a max_delay no shorter than the window (default 10 windows, at most a day), a
    /// known policy.
    pub fn spec(&self, fields: Fields) -> Result<Option<Spec>> {
        let Some(key) = &self.key else {
            if self.window.is_some() || self.max_delay.is_some() || self.on_running.is_some() {
                return Err(AppError::invalid(
                    fields.key,
                    format!(
                        "{}, {} and {} need {}: the key arrivals are debounced on",
                        fields.window, fields.max_delay, fields.on_running, fields.key
                    ),
                ));
            }
            return Ok(None);
        };
        if key.is_empty() || key.len() > MAX_KEY {
            return Err(AppError::invalid(
                fields.key,
                format!(
                    "{} must be 1-{MAX_KEY} characters (got {})",
                    fields.key,
                    key.len()
                ),
            ));
        }
        let Some(window) = &self.window else {
            return Err(AppError::invalid(
                fields.window,
                format!(
                    "{} needs {}: how long to wait for a newer arrival (e.g. 2s)",
                    fields.key, fields.window
                ),
            ));
        };
        let window_ms = parse_ms(window, fields.window)?;
        if window_ms == 0 {
            return Err(AppError::invalid(
                fields.window,
                format!("{} must be longer than 0 (e.g. 2s)", fields.window),
            ));
        }
        let max_delay_ms = match &self.max_delay {
            Some(m) => parse_ms(m, fields.max_delay)?,
            None => (window_ms * DEFAULT_MAX_DELAY_WINDOWS).min(MAX_MS),
        };
        if max_delay_ms < window_ms {
            return Err(AppError::invalid(
                fields.max_delay,
                format!(
                    "{} ({max_delay_ms} ms) is shorter than {} ({window_ms} ms): the start is \
                     never later than the first arrival + {}, so it must be at least the window",
                    fields.max_delay, fields.window, fields.max_delay
                ),
            ));
        }
        let on_running = match &self.on_running {
            None => OnRunning::Queue,
            Some(p) => OnRunning::parse(p).ok_or_else(|| {
                AppError::invalid(
                    fields.on_running,
                    format!(
                        "{} {p:?}: use {}",
                        fields.on_running,
                        OnRunning::NAMES.join(", ")
                    ),
                )
            })?,
        };
        Ok(Some(Spec {
            key: key.clone(),
            window_ms,
            max_delay_ms,
            on_running,
        }))
    }
}

/// What happened to a debounced enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Folded {
    /// A new pending operation of the key.
    Pending,
    /// Folded into the key's pending operation: its input is this one's now.
    Joined,
    /// Policy `skip`: the key's operation has started; it is the answer, nothing was made.
    Skipped,
    /// The same delivery (its Idempotency-Key or webhook-id) was debounced before.
    Repeated,
}

/// The debounce part of an enqueue's answer.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct Answer {
    pub outcome: Folded,
    pub debounce_key: String,
    /// When the operation starts at the earliest (pending and joined).
    pub run_at: Option<DateTime<Utc>>,
    /// The key's started operations cancelled for this one (policy `cancel_running`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cancelled: Vec<OperationId>,
    /// Joined: the options (by their fields' names: `deadline`, `budget`, `rate_key`, `lane`,
    /// `max_attempts`, `ordering_key`, `concurrency_key`, `concurrency_limit`) this arrival
    /// asked otherwise than the pending operation, which kept its own (a join replaces only
    /// the input).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kept: Vec<String>,
}

/// A debounced enqueue's answer: the operation the caller's input is (or is not, when
/// skipped) part of.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Debounced {
    pub op_id: OperationId,
    /// True for a new pending operation.
    pub created: bool,
    pub status: Status,
    pub debounce: Answer,
}

/// Enqueues `req` debounced on `spec` for `caller`, through every rule of an ordinary enqueue
/// (`crate::operations::enqueue`'s); `run_at` is refused (the window decides the start).
pub async fn enqueue(
    app: &App,
    caller: &Caller,
    req: EnqueueRequest,
    spec: &Spec,
) -> Result<Debounced> {
    crate::operations::check_enqueue(caller, &req)?;
    if req.run_at.is_some() {
        return Err(AppError::invalid(
            "/run_at",
            "run_at and a debounce exclude each other: a debounced operation starts once its \
             window has passed with no newer arrival",
        ));
    }
    fold(app, req, spec, &caller.actor).await
}

/// The flow behind every debounced enqueue (an API or CLI one, a webhook delivery), `req`
/// already through its front door's checks; `actor` is audited with each folded arrival.
pub(crate) async fn fold(
    app: &App,
    req: EnqueueRequest,
    spec: &Spec,
    actor: &str,
) -> Result<Debounced> {
    // An arrival that joins the key's pending operation makes none: the tenant's cap counts it
    // only when it may make one (the kinds a tenant may use are checked either way). Claimed
    // meanwhile, it makes one the cap did not count, as a burst within the count's second may.
    let joins = db::has_pending(&app.pool, &req.tenant, &spec.key).await?;
    crate::capacity::admit(app, &req.tenant, &req.kind, if joins { 0 } else { 1 }).await?;
    let op = {
        let mut conn = app
            .pool
            .acquire()
            .await
            .map_err(agentq_core::db::Error::from)?;
        app.producer
            .prepare(&mut conn, req)
            .await
            .map_err(crate::operations::refused_enqueue)?
    };
    let answer = |outcome, run_at| Answer {
        outcome,
        debounce_key: spec.key.clone(),
        run_at,
        cancelled: Vec::new(),
        kept: Vec::new(),
    };
    let outcome = db::enqueue(&app.pool, &op, spec, actor).await?;
    let debounced = match outcome {
        Outcome::Created { id, run_at, .. } => {
            metrics::OPERATIONS_ENQUEUED.inc(&[&op.kind]);
            let mut answer = answer(Folded::Pending, Some(run_at));
            if spec.on_running == OnRunning::CancelRunning {
                answer.cancelled = cancel_started(app, &op.tenant, spec, id, actor).await?;
            }
            Debounced {
                op_id: OperationId(id),
                created: true,
                status: Status::Queued,
                debounce: answer,
            }
        }
        Outcome::Joined { id, run_at, kept } => {
            metrics::DEBOUNCED.inc(&[&op.kind, "joined"]);
            let mut answer = answer(Folded::Joined, Some(run_at));
            answer.kept = kept.into_iter().map(String::from).collect();
            Debounced {
                op_id: OperationId(id),
                created: false,
                status: Status::Queued,
                debounce: answer,
            }
        }
        Outcome::Skipped { id, status } => {
            metrics::DEBOUNCED.inc(&[&op.kind, "skipped"]);
            Debounced {
                op_id: OperationId(id),
                created: false,
                status,
                debounce: answer(Folded::Skipped, None),
            }
        }
        Outcome::Existing {
            id,
            status,
            input_sha256,
        } => {
            if input_sha256 != op.input_sha256 {
                return Err(crate::operations::refused_enqueue(
                    agentq_producer::Error::KeyConflict {
                        key: op.dedupe_key.unwrap_or_default(),
                        op_id: OperationId(id),
                    },
                ));
            }
            Debounced {
                op_id: OperationId(id),
                created: false,
                status,
                debounce: answer(Folded::Repeated, None),
            }
        }
        Outcome::OtherKind { id, kind } => {
            return Err(AppError::Conflict(format!(
                "debounce key {:?} names the pending operation {id} of kind {kind:?}, not {:?}; \
                 use another key for this kind (nothing was enqueued)",
                spec.key, op.kind
            )));
        }
    };
    Ok(debounced)
}

/// Cancels the key's started operations other than `pending`, through the operator's cancel
/// flow (audited by `actor`); returns them.
async fn cancel_started(
    app: &App,
    tenant: &str,
    spec: &Spec,
    pending: uuid::Uuid,
    actor: &str,
) -> Result<Vec<OperationId>> {
    let mut cancelled = Vec::new();
    let reason = format!(
        "debounce key {:?}: a newer arrival (on_running cancel_running)",
        spec.key
    );
    for id in db::started_of_key(&app.pool, tenant, &spec.key, pending).await? {
        let done = agentq_core::db::cancel::cancel_operation(
            &app.pool,
            id,
            Some(tenant),
            actor,
            Some(&reason),
        )
        .await?;
        if matches!(
            done,
            agentq_core::db::cancel::Cancelled::Now | agentq_core::db::cancel::Cancelled::Requested
        ) {
            cancelled.push(OperationId(id));
        }
    }
    Ok(cancelled)
}

/// A webhook source's debounce, as stored with it: the JSON pointer of the key in a
/// delivery's body, and the debounce's window, cap and policy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceDebounce {
    pub pointer: String,
    pub window_ms: i64,
    pub max_delay_ms: i64,
    pub on_running: String,
}

impl SourceDebounce {
    /// The debounce `--debounce-pointer`, `--debounce`, `--max-delay`, `--on-running` ask for
    /// (none without a pointer), each wrong flag refused by its name.
    pub fn from_flags(req: &Request) -> Result<Option<Self>> {
        let Some(spec) = req.spec(Fields::SOURCE)? else {
            return Ok(None);
        };
        if !spec.key.starts_with('/') {
            return Err(AppError::invalid(
                Fields::SOURCE.key,
                format!(
                    "--debounce-pointer {:?} is not a JSON pointer: it starts with '/', e.g. \
                     /document/id",
                    spec.key
                ),
            ));
        }
        Ok(Some(SourceDebounce {
            pointer: spec.key,
            window_ms: spec.window_ms,
            max_delay_ms: spec.max_delay_ms,
            on_running: spec.on_running.as_str().to_string(),
        }))
    }

    /// The debounce of a delivery whose body is `event`: its key is the value at the pointer
    /// (a string, or a number or boolean as written); none when the body has no such value.
    pub fn for_event(&self, event: &serde_json::Value) -> Option<Spec> {
        let key = match event.pointer(&self.pointer)? {
            serde_json::Value::String(s) => s.clone(),
            v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => v.to_string(),
            _ => return None,
        };
        (!key.is_empty() && key.len() <= MAX_KEY).then(|| Spec {
            key,
            window_ms: self.window_ms,
            max_delay_ms: self.max_delay_ms,
            on_running: OnRunning::parse(&self.on_running).unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: Option<&str>, w: Option<&str>, m: Option<&str>, p: Option<&str>) -> Request {
        Request {
            key: key.map(Into::into),
            window: w.map(Into::into),
            max_delay: m.map(Into::into),
            on_running: p.map(Into::into),
        }
    }

    #[test]
    fn a_debounce_is_checked_field_by_field() {
        let ok = req(Some("doc-1"), Some("2s"), None, None)
            .spec(Fields::API)
            .unwrap()
            .unwrap();
        assert_eq!((ok.window_ms, ok.max_delay_ms), (2000, 20_000));
        assert_eq!(ok.on_running, OnRunning::Queue);
        assert_eq!(req(None, None, None, None).spec(Fields::API).unwrap(), None);
        let long = "k".repeat(MAX_KEY + 1);
        for (r, field) in [
            (req(Some("k"), Some("-2s"), None, None), "/debounce"),
            (req(Some("k"), Some("0s"), None, None), "/debounce"),
            (req(Some("k"), Some("2 weeks"), None, None), "/debounce"),
            (req(Some("k"), Some("2d"), None, None), "/debounce"),
            (req(Some("k"), Some("5s"), Some("2s"), None), "/max_delay"),
            (
                req(Some("k"), Some("5s"), None, Some("later")),
                "/on_running",
            ),
            (req(Some(&long), Some("5s"), None, None), "/debounce_key"),
            (req(Some(""), Some("5s"), None, None), "/debounce_key"),
            (req(None, Some("5s"), None, None), "/debounce_key"),
            (req(Some("k"), None, None, None), "/debounce"),
        ] {
            match r.spec(Fields::API) {
                Err(AppError::Invalid { field: f, message }) => {
                    assert_eq!(f, field, "{message}");
                    assert!(message.contains(field), "{message}");
                }
                other => panic!("{r:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_sources_key_is_read_at_its_pointer() {
        let d = SourceDebounce {
            pointer: "/doc/id".into(),
            window_ms: 2000,
            max_delay_ms: 30_000,
            on_running: "skip".into(),
        };
        let spec = d.for_event(&serde_json::json!({"doc": {"id": 7}})).unwrap();
        assert_eq!((spec.key.as_str(), spec.on_running), ("7", OnRunning::Skip));
        assert!(d.for_event(&serde_json::json!({"doc": {}})).is_none());
        assert!(
            d.for_event(&serde_json::json!({"doc": {"id": {}}}))
                .is_none()
        );
    }
}
