//! `GET /v1/operations/{id}/events`: the operation's life as Server-Sent Events, read from its
//! event log. Each event's id is its id in that log (increasing within the operation in commit
//! order, not consecutive), so a client that reconnects with `Last-Event-ID: n` gets exactly
//! the events after n: nothing missed, nothing twice. The
//! stream ends after a terminal status (the terminal event carries the result or the error).
//!
//! One poller per server serves every open stream, so the database cost does not grow with
//! the number of streams. Every [`POLL`] it reads, in one statement, the status, the highest
//! event number and the new events (up to [`PAGE`] each) of every operation that has a stream
//! open, and publishes what it found in that operation's [`Feed`] (a `watch` channel): the
//! streams of an operation with news wake and take the events from there, the others sleep.
//! A stream reads the log itself only to catch up (when it opens, resuming after
//! `Last-Event-ID`, or when it fell behind the feed, which keeps only the latest read), so
//! idle streams cost nothing, many streams on one operation cost one read, and N operations
//! cost one query per tick. A stream ends once it has sent everything the poller read up to a
//! status that was terminal at that read, or when its operation is gone or a read fails.
//!
//! Streams are capped per token and in all ([`Streams`]: 429 with `Retry-After` beyond). The
//! poller also re-checks, every [`RECHECK`] and in one query, the tokens of all open streams:
//! a revoked token's streams end within seconds.

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use agentq_app::events::{self as log, News};
use agentq_core::operation::{OperationId, Status};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::auth::{Caller, Role};
use super::problem::{ApiError, ApiResult};
use super::{ApiState, Params, QueryParams, parse_id};

/// How often the poller looks for new events of the operations with an open stream.
const POLL: Duration = Duration::from_millis(200);
/// Events read per query (per operation for the poller).
const PAGE: i64 = 200;
/// How often the poller checks that the tokens of the open streams are still valid.
const RECHECK: Duration = Duration::from_secs(2);

/// The event streams open on this server, per token and in all, and the poller they share.
pub struct Streams {
    per_token: usize,
    max: usize,
    /// Per token hash: its open streams and its revocation signal.
    open: Mutex<HashMap<String, TokenStreams>>,
    /// The operations with a stream following the poller's reads.
    feeds: Mutex<HashMap<OperationId, Feed>>,
    /// Set once the first stream has started the poller (a server that never had a stream
    /// runs none).
    polling: AtomicBool,
}

/// The open streams of one token.
struct TokenStreams {
    open: usize,
    /// Cancelled by the poller when the token is found revoked (or cannot be re-checked):
    /// every stream of the token ends.
    revoked: CancellationToken,
}

/// One operation's share of the poller.
struct Feed {
    /// The last event the poller has read; `None` until its first read, which starts at the
    /// head (a stream catches up by itself before it follows a feed).
    loaded: Option<i64>,
    /// The poller's latest read, to every stream of the operation. Its receivers are the
    /// streams: the poller drops a feed nobody follows.
    tx: watch::Sender<Arc<Tick>>,
}

/// What one read of the poller found for one operation.
#[derive(Default)]
struct Tick {
    /// `events` are all the ones after this, in order: a stream that is behind this reads the
    /// log itself up to here.
    after: i64,
    events: Vec<(log::Event, Option<log::Outcome>)>,
    /// The operation's status at the read was terminal, and every event up to that read is
    /// in `events` or before them: a stream that has sent them is over.
    over: bool,
    /// The operation no longer exists: its streams end.
    gone: bool,
}

impl Tick {
    /// The last event this read reached.
    fn upto(&self) -> i64 {
        self.events.last().map_or(self.after, |(e, _)| e.seq)
    }
}

impl Streams {
    pub fn new(per_token: usize, max: usize) -> Self {
        Self {
            per_token,
            max,
            open: Mutex::new(HashMap::new()),
            feeds: Mutex::new(HashMap::new()),
            polling: AtomicBool::new(false),
        }
    }

    /// A slot for one more stream of the token `hash`, or the 429 that says which cap is full.
    fn take(state: &Arc<ApiState>, hash: &str) -> ApiResult<Slot> {
        let s = &state.streams;
        let mut open = s.open.lock().expect("streams lock");
        let total: usize = open.values().map(|t| t.open).sum();
        let mine = open.get(hash).map_or(0, |t| t.open);
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
        if !s.polling.swap(true, Ordering::AcqRel) {
            tokio::spawn(poll(Arc::downgrade(state)));
        }
        let mine = open
            .entry(hash.to_string())
            .or_insert_with(|| TokenStreams {
                open: 0,
                revoked: CancellationToken::new(),
            });
        if mine.revoked.is_cancelled() {
            // The caller has just authenticated with this token: a failed re-check of the
            // streams still ending does not end this one (the next re-check covers it).
            mine.revoked = CancellationToken::new();
        }
        mine.open += 1;
        Ok(Slot {
            state: state.clone(),
            hash: hash.to_string(),
            revoked: mine.revoked.clone(),
        })
    }

    /// The feed of the poller's reads of `op`.
    fn follow(state: &Arc<ApiState>, op: OperationId) -> watch::Receiver<Arc<Tick>> {
        let s = &state.streams;
        let mut feeds = s.feeds.lock().expect("feeds lock");
        feeds
            .entry(op)
            .or_insert_with(|| Feed {
                loaded: None,
                tx: watch::Sender::new(Arc::default()),
            })
            .tx
            .subscribe()
    }
}

/// The poller: every [`POLL`] one read for all the operations with a stream open, every
/// [`RECHECK`] one re-check of all their tokens; until the server shuts down.
async fn poll(state: Weak<ApiState>) {
    let Some(shutdown) = state.upgrade().map(|s| s.shutdown.clone()) else {
        return;
    };
    let mut ticks = tokio::time::interval(POLL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rechecked = Instant::now();
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        let Some(state) = state.upgrade() else {
            return;
        };
        read_feeds(&state).await;
        if rechecked.elapsed() >= RECHECK {
            rechecked = Instant::now();
            recheck_tokens(&state).await;
        }
    }
    if let Some(state) = state.upgrade() {
        state.streams.feeds.lock().expect("feeds lock").clear();
    }
}

/// One read for every followed feed, published to the feeds with news.
async fn read_feeds(state: &ApiState) {
    let watched: Vec<(uuid::Uuid, Option<i64>)> = {
        let mut feeds = state.streams.feeds.lock().expect("feeds lock");
        feeds.retain(|_, f| f.tx.receiver_count() > 0);
        feeds.iter().map(|(op, f)| (op.0, f.loaded)).collect()
    };
    if watched.is_empty() {
        return;
    }
    let read: agentq_app::Result<Vec<News>> = log::of_many(&state.app, &watched, PAGE).await;
    // Only this task removes feeds or moves `loaded`, so the feeds read are still there with
    // the cursors the read used; feeds added meanwhile are read next tick.
    let mut feeds = state.streams.feeds.lock().expect("feeds lock");
    let news = match read {
        Ok(news) => news,
        Err(e) => {
            tracing::warn!(operations = watched.len(), error = %e,
                "reading events failed; ending the streams waiting for them");
            let failed: HashSet<uuid::Uuid> = watched.iter().map(|(op, _)| *op).collect();
            feeds.retain(|op, _| !failed.contains(&op.0));
            return;
        }
    };
    for n in news {
        let Some(feed) = feeds.get_mut(&OperationId(n.op)) else {
            continue;
        };
        let after = feed.loaded.unwrap_or(n.head);
        let upto = n.events.last().map_or(after, |(e, _)| e.seq);
        feed.loaded = Some(upto);
        let gone = n.status.is_none();
        let over = upto >= n.head
            && n.status
                .as_deref()
                .and_then(|s| s.parse::<Status>().ok())
                .is_some_and(Status::is_terminal);
        let events = n.events;
        feed.tx.send_if_modified(|tick| {
            if events.is_empty() && tick.upto() == after && tick.over == over && tick.gone == gone {
                return false;
            }
            *tick = Arc::new(Tick {
                after,
                events,
                over,
                gone,
            });
            true
        });
    }
}

/// Ends the streams of every token that is no longer valid (or of all, if the check fails).
async fn recheck_tokens(state: &ApiState) {
    let hashes: Vec<String> = {
        let open = state.streams.open.lock().expect("streams lock");
        open.keys().cloned().collect()
    };
    if hashes.is_empty() {
        return;
    }
    let valid = agentq_app::access::still_valid(&state.app, &hashes).await;
    let open = state.streams.open.lock().expect("streams lock");
    let valid: HashSet<String> = match valid {
        Ok(valid) => valid.into_iter().collect(),
        Err(e) => {
            tracing::warn!(tokens = hashes.len(), error = %e,
                "re-checking the tokens of open event streams failed; ending their streams");
            HashSet::new()
        }
    };
    for hash in hashes.iter().filter(|h| !valid.contains(*h)) {
        if let Some(t) = open.get(hash)
            && !t.revoked.is_cancelled()
        {
            tracing::info!(
                streams = t.open,
                "an event stream token is no longer valid; ending its streams"
            );
            t.revoked.cancel();
        }
    }
}

/// One open stream's place in [`Streams`], given back when the stream is dropped (the client
/// went away, or the stream ended).
struct Slot {
    state: Arc<ApiState>,
    hash: String,
    /// Its token's revocation signal.
    revoked: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.state.streams.open.lock().expect("streams lock");
        if let Some(t) = open.get_mut(&self.hash) {
            t.open -= 1;
            if t.open == 0 {
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

fn parse_last(s: &str) -> ApiResult<i64> {
    s.trim()
        .parse::<i64>()
        .ok()
        .filter(|n| *n >= 0)
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "Last-Event-ID {s:?} is not an event id from this stream (a number ≥ 0)"
            ))
            .field("Last-Event-ID")
        })
}

/// What a terminal event to send carries: the outcome the poller read with it, or to be read.
enum Outcome {
    Known(Option<log::Outcome>),
    Unread,
}

struct Cursor {
    state: Arc<ApiState>,
    op: OperationId,
    last: i64,
    buffered: VecDeque<(log::Event, Outcome)>,
    slot: Slot,
    /// The poller's reads of this operation, once the stream has caught up.
    feed: Option<watch::Receiver<Arc<Tick>>>,
    /// The stream reads the log itself next: it has just opened, read a full page, or fell
    /// behind its feed.
    own: bool,
}

fn is_terminal(data: &Value) -> bool {
    data["status"]
        .as_str()
        .and_then(|s| s.parse::<Status>().ok())
        .is_some_and(Status::is_terminal)
}

impl Cursor {
    /// The next event, waiting for one; `None` when the stream is over: it has sent every
    /// event up to a read that found the operation terminal (or gone), its token was
    /// revoked, a read failed, or the server is shutting down.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if self.state.shutdown.is_cancelled() {
                return None;
            }
            if self.slot.revoked.is_cancelled() {
                tracing::info!(op_id = %self.op, "the stream's token was revoked (or could not be re-checked); ending it");
                return None;
            }
            if let Some((e, outcome)) = self.buffered.pop_front() {
                self.last = e.seq;
                return Some(self.render(e, outcome).await);
            }
            if self.own {
                let page = match log::after(&self.state.app, self.op, self.last, PAGE).await {
                    Ok(page) => page,
                    Err(e) => {
                        tracing::warn!(op_id = %self.op, error = %e, "reading events failed; ending the stream");
                        return None;
                    }
                };
                // Behind a feed that has read further, yet nothing to read: the operation's
                // log is gone with it.
                if page.is_empty()
                    && self
                        .feed
                        .as_ref()
                        .is_some_and(|f| f.borrow().after > self.last)
                {
                    return None;
                }
                self.own = page.len() as i64 == PAGE;
                self.buffered
                    .extend(page.into_iter().map(|e| (e, Outcome::Unread)));
                if !self.own && self.feed.is_none() {
                    self.feed = Some(Streams::follow(&self.state, self.op));
                }
                continue;
            }
            let feed = self.feed.as_mut()?;
            let tick = feed.borrow_and_update().clone();
            if tick.gone {
                return None;
            }
            if self.last < tick.after {
                self.own = true;
                continue;
            }
            let last = self.last;
            self.buffered.extend(
                tick.events
                    .iter()
                    .filter(|(e, _)| e.seq > last)
                    .map(|(e, o)| (e.clone(), Outcome::Known(o.clone()))),
            );
            if !self.buffered.is_empty() {
                continue;
            }
            if tick.over {
                return None;
            }
            tokio::select! {
                changed = feed.changed() => {
                    if changed.is_err() {
                        // The poller dropped the feed: its read failed, or the server stops.
                        return None;
                    }
                }
                _ = self.state.shutdown.cancelled() => return None,
                _ = self.slot.revoked.cancelled() => {}
            }
        }
    }

    async fn render(&self, e: log::Event, outcome: Outcome) -> Event {
        let mut data = e.data;
        agentq_app::redact::redact_event(&self.state.app, &mut data);
        data["at"] = json!(e.at);
        if e.kind == "status" && is_terminal(&data) {
            // The terminal event carries the outcome, read from the operation itself (the log
            // keeps no results): by the poller with the event, or here.
            let outcome = match outcome {
                Outcome::Known(o) => o,
                Outcome::Unread => {
                    let status = data["status"].as_str().unwrap_or_default();
                    log::outcome_if(&self.state.app, self.op, status)
                        .await
                        .ok()
                        .flatten()
                }
            };
            if let Some(o) = outcome {
                data["result"] = json!(o.result);
                data["finished_at"] = json!(o.finished_at);
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
    // Only an operation in the caller's scope is followed (another tenant's: 404).
    agentq_app::operations::find(&state.app, &caller.app(), op).await?;
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
        buffered: VecDeque::new(),
        slot,
        feed: None,
        own: true,
    };
    let events =
        futures_util::stream::unfold(
            cursor,
            |mut c| async move { c.next().await.map(|e| (Ok(e), c)) },
        );
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
