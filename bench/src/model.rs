//! The benchmark's model provider: an in-process OpenAI-compatible server that answers every
//! call after a fixed latency (echoing the last user message) and counts peak concurrency, so
//! `agentq bench --model-latency-ms N` measures how many model calls a worker keeps in flight.
//! With [`LatencyModel::agent`], a request that offers the `kv_put` tool is an agent's turn:
//! turns before the last call `kv_put`, and every request is counted per (user text, turn) so
//! `durable-steps` can tell how many calls a crash made it send again. With a capacity
//! ([`LatencyModel::with_capacity`]) it answers that many calls at once and refuses a call past
//! them at once with a 503, as a provider's concurrency limit does. It is served by the test
//! kit's small HTTP server ([`agentq_testkit::http_server`]), one connection per call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentq_testkit::http_server::{self, Request, Server};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::net::TcpStream;

/// What the provider has seen.
#[derive(Default)]
pub struct Counters {
    /// Calls answered or being answered.
    pub requests: AtomicUsize,
    in_flight: AtomicUsize,
    /// Most calls in flight at once (answered ones: a refusal is not in flight).
    pub peak: AtomicUsize,
    /// Calls refused with a 503 for being past the capacity.
    pub refused: AtomicUsize,
    /// Agent turns: requests per (user text, turn).
    pub turns: Mutex<HashMap<(String, usize), usize>>,
    /// Agent turns sent again although their model step was already committed (must be 0).
    pub resent_journaled: AtomicUsize,
}

/// A running latency server.
pub struct LatencyModel {
    /// Its base URL (`AGENTQ_MODEL_BASE_URL`).
    pub url: String,
    pub counters: Arc<Counters>,
    /// Accepts until the provider is dropped.
    _server: Server,
}

impl LatencyModel {
    /// Answers after `latency`; an agent's turns (requests offering `kv_put`) call the tool
    /// until the request carries `agent_turns - 1` answers, then answer.
    /// A turn sent again is checked against the journal in `pool` as it arrives.
    pub async fn agent(
        latency: Duration,
        agent_turns: usize,
        pool: PgPool,
    ) -> std::io::Result<Self> {
        Self::serve(latency, agent_turns, Some(pool), None).await
    }

    /// Answers every call after `latency`, echoing its last user message; with a `capacity`,
    /// at most that many calls at once: one past them is refused at once with a 503.
    pub async fn with_capacity(
        latency: Duration,
        capacity: Option<usize>,
    ) -> std::io::Result<Self> {
        Self::serve(latency, 1, None, capacity).await
    }

    async fn serve(
        latency: Duration,
        agent_turns: usize,
        pool: Option<PgPool>,
        capacity: Option<usize>,
    ) -> std::io::Result<Self> {
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        let server = Server::start(move |socket, request| {
            answer(
                socket,
                request,
                latency,
                agent_turns,
                pool.clone(),
                capacity,
                c.clone(),
            )
        })
        .await?;
        Ok(Self {
            url: server.url.clone(),
            counters,
            _server: server,
        })
    }
}

async fn answer(
    mut socket: TcpStream,
    Request { method, body }: Request,
    latency: Duration,
    agent_turns: usize,
    pool: Option<PgPool>,
    capacity: Option<usize>,
    c: Arc<Counters>,
) -> std::io::Result<()> {
    if method.is_empty() {
        // Closed before sending a request: no call.
        return Ok(());
    }
    c.requests.fetch_add(1, Ordering::Relaxed);
    let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    if capacity.is_some_and(|cap| now > cap) {
        c.in_flight.fetch_sub(1, Ordering::SeqCst);
        c.refused.fetch_add(1, Ordering::Relaxed);
        let body =
            json!({ "error": { "message": "too many requests at once", "type": "overloaded" } });
        return http_server::answer(&mut socket, 503, "application/json", &[], &body.to_string())
            .await;
    }
    c.peak.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(latency).await;
    c.in_flight.fetch_sub(1, Ordering::SeqCst);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = request["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let offers_kv_put = request["tools"]
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t["function"]["name"] == "kv_put"));
    let turn = request["messages"]
        .as_array()
        .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count());
    let message = if offers_kv_put {
        let sent_before = {
            let mut turns = c.turns.lock().expect("bench model lock");
            let n = turns.entry((text.to_string(), turn)).or_default();
            *n += 1;
            *n > 1
        };
        // Turn t is the model step at seq 2t (each earlier turn added one kv_put step).
        if sent_before
            && let Some(pool) = &pool
            && crate::fixtures::agent_step_completed(pool, text, 2 * turn as i32)
                .await
                .unwrap_or(false)
        {
            c.resent_journaled.fetch_add(1, Ordering::SeqCst);
        }
        if turn + 1 < agent_turns {
            let args = json!({ "key": format!("t{turn}"), "value": turn }).to_string();
            json!({ "role": "assistant", "content": null, "tool_calls": [{
                "id": format!("call_{turn}"), "type": "function",
                "function": { "name": "kv_put", "arguments": args } }] })
        } else {
            json!({ "role": "assistant", "content": "done" })
        }
    } else {
        json!({ "role": "assistant", "content": text })
    };
    let reply = json!({
        "model": "bench-latency",
        "choices": [{ "index": 0, "message": message, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 1, "completion_tokens": 1 }
    })
    .to_string();
    http_server::answer(&mut socket, 200, "application/json", &[], &reply).await
}
