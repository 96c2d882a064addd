//! `GET /v1/operations/{id}/events`: the operation's life as Server-Sent Events, read from its
//! event log. Each event's id is its number in that log, so a client that reconnects with
//! `Last-Event-ID: n` gets exactly the events after n: nothing missed, nothing twice. The
//! stream ends after a terminal status (the terminal event carries the result or the error).
//!
//! Streams are capped per token and in all ([`Streams`]: 429 with `Retry-After` beyond), and
//! each re-checks its token every [`RECHECK`]: a revoked token's stream ends within seconds.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentq_core::db;
use agentq_core::operation::{OperationId, Status};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth::{Caller, Role};
use super::problem::{ApiError, ApiResult};
use super::{ApiState, Params, QueryParams, parse_id};

/// How often an open stream looks for new events.
const POLL: Duration = Duration::from_millis(200);
/// Events read per query.
const PAGE: i64 = 200;
/// How often an open stream checks that its token is still valid.
const RECHECK: Duration = Duration::from_secs(2);

/// The event streams open on this server, per token and in all.
pub struct Streams {
    per_token: usize,
    max: usize,
    open: Mutex<HashMap<String, usize>>,
}

impl Streams {
    pub fn new(per_token: usize, max: usize) -> Self {
        Self {
            per_token,
            max,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// A slot for one more stream of the token `hash`, or the 429 that says which cap is full.
    fn take(state: &Arc<ApiState>, hash: &str) -> ApiResult<Slot> {
        let s = &state.streams;
        let mut open = s.open.lock().expect("streams lock");
        let total: usize = open.values().sum();
        let mine = open.get(hash).copied().unwrap_or(0);
        let full = if mine >= s.per_token {
            Some(format!(
                "this token has {mine} event streams open, the most one token may \
                 (AGENTQ_STREAMS_PER_TOKEN); close one, or poll GET /v1/operations/{{id}}"
            ))
        } else if total >= s.max {
            Some(format!(
                "the server has {total} event streams open, its most (AGENTQ_STREAMS_MAX); retry later"
            ))
        } else {
            None
        };
        if let Some(detail) = full {
            return Err(ApiError::busy(detail, 5));
        }
        *open.entry(hash.to_string()).or_default() += 1;
        Ok(Slot {
            state: state.clone(),
            hash: hash.to_string(),
        })
    }
}

/// One open stream's place in [`Streams`], given back when the stream is dropped (the client
/// went away, or the stream ended).
struct Slot {
    state: Arc<ApiState>,
    hash: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.state.streams.open.lock().expect("streams lock");
        if let Some(n) = open.get_mut(&self.hash) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.hash);
            }
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    last_event_id: Option<String>,
}

fn parse_last(s: &str) -> ApiResult<i32> {
    s.trim()
        .parse::<i32>()
        .ok()
        .filter(|n| *n >= 0)
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "Last-Event-ID {s:?} is not an event id from this stream (a number ≥ 0)"
            ))
            .field("Last-Event-ID")
        })
}

struct Cursor {
    state: Arc<ApiState>,
    op: OperationId,
    last: i32,
    buffered: std::collections::VecDeque<db::events::Event>,
    slot: Slot,
    /// When the token was last found valid.
    checked: Instant,
}

fn is_terminal(data: &Value) -> bool {
    data["status"]
        .as_str()
        .and_then(|s| s.parse::<Status>().ok())
        .is_some_and(Status::is_terminal)
}

impl Cursor {
    /// The next event, waiting for one; `None` when the stream is over: the operation was
    /// already terminal before a read that found nothing after the last event sent.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if self.state.shutdown.is_cancelled() || !self.token_still_valid().await {
                return None;
            }
            if let Some(e) = self.buffered.pop_front() {
                self.last = e.seq;
                return Some(self.render(e).await);
            }
            let read = async {
                let before = db::find_operation(&self.state.pool, self.op, None).await?;
                let page =
                    db::events::events_after(&self.state.pool, self.op.0, self.last, PAGE).await?;
                Ok::<_, db::Error>((before, page))
            };
            match read.await {
                Ok((_, page)) if !page.is_empty() => self.buffered.extend(page),
                Ok((None, _)) => return None,
                Ok((Some(v), _)) if v.status.is_terminal() => return None,
                Ok(_) => {
                    tokio::select! {
                        _ = tokio::time::sleep(POLL) => {}
                        _ = self.state.shutdown.cancelled() => return None,
                    }
                }
                Err(e) => {
                    tracing::warn!(op_id = %self.op, error = %e, "reading events failed; ending the stream");
                    return None;
                }
            }
        }
    }

    /// False once the stream's token is revoked (checked every [`RECHECK`]).
    async fn token_still_valid(&mut self) -> bool {
        if self.checked.elapsed() < RECHECK {
            return true;
        }
        match db::access::authenticate_hash(&self.state.pool, &self.slot.hash).await {
            Ok(Some(_)) => {
                self.checked = Instant::now();
                true
            }
            Ok(None) => {
                tracing::info!(op_id = %self.op, "the stream's token was revoked; ending it");
                false
            }
            Err(e) => {
                tracing::warn!(op_id = %self.op, error = %e, "re-checking the stream's token failed; ending it");
                false
            }
        }
    }

    async fn render(&self, e: db::events::Event) -> Event {
        let mut data = e.data;
        data["at"] = json!(e.at);
        if e.kind == "status" && is_terminal(&data) {
            // The terminal event carries the outcome, read from the operation itself (the log
            // keeps no results).
            if let Ok(Some(v)) = db::find_operation(&self.state.pool, self.op, None).await
                && v.status.as_str() == data["status"].as_str().unwrap_or_default()
            {
                data["result"] = json!(v.result);
                data["finished_at"] = json!(v.finished_at);
            }
        }
        Event::default()
            .id(e.seq.to_string())
            .event(e.kind)
            .data(data.to_string())
    }
}

/// `GET /v1/operations/{id}/events`.
pub async fn stream(
    State(state): State<Arc<ApiState>>,
    caller: Caller,
    Params(id): Params<String>,
    QueryParams(query): QueryParams<EventsQuery>,
    headers: HeaderMap,
) -> ApiResult<Sse<impl Stream<Item = Result<Event, Infallible>>>> {
    caller.require(Role::Producer)?;
    let op = OperationId(parse_id(&id, "id")?);
    if db::find_operation(&state.pool, op, caller.scope())
        .await?
        .is_none()
    {
        return Err(ApiError::not_found(format!("no operation {op}")).field("id"));
    }
    let header = headers
        .get("last-event-id")
        .map(|v| {
            v.to_str().map_err(|_| {
                ApiError::bad_request("Last-Event-ID is not ASCII").field("Last-Event-ID")
            })
        })
        .transpose()?;
    let last = match header.or(query.last_event_id.as_deref()) {
        Some(s) => parse_last(s)?,
        None => 0,
    };
    let slot = Streams::take(&state, &caller.token_hash)?;
    let cursor = Cursor {
        state,
        op,
        last,
        buffered: Default::default(),
        slot,
        checked: Instant::now(),
    };
    let events =
        futures_util::stream::unfold(
            cursor,
            |mut c| async move { c.next().await.map(|e| (Ok(e), c)) },
        );
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
