//! A fake OpenAI-compatible provider for tests: an in-process HTTP/1.1 server on `127.0.0.1:0`
//! (a [`crate::http_server::Server`]) that answers (echoing the last user message, like the built-in model), streams, stalls,
//! cuts a stream, or returns any error on demand, and counts requests and peak concurrency.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::http_server::{self, Request, Server};

/// What the fake does with the next requests.
#[derive(Clone, Debug)]
pub enum Mode {
    /// 200 with a JSON completion echoing the last user message.
    Echo,
    /// Like `Echo`, with this text appended (e.g. a `confidence: 0.1` line).
    EchoSuffix(String),
    /// Echo, but obey one (bad) instruction: when the system message says "drop titles from
    /// memos" and the text mentions "memo", drop its `Title:` lines.
    Obey,
    /// 200 with an SSE stream echoing it word by word, ending with `[DONE]`.
    EchoStream,
    /// This status, JSON body and extra headers.
    Error {
        status: u16,
        body: Value,
        headers: Vec<(String, String)>,
    },
    /// Never send response headers.
    StallHeaders,
    /// A `kv_put` call streamed as llama.cpp's server streams it (found against the real one):
    /// the function name repeated in every chunk, the arguments in pieces, and no usage even
    /// though the request asked for it.
    LlamaToolStream,
    /// Stream two chunks, then close without `[DONE]`.
    StreamCut,
    /// Stream one chunk, then go silent.
    StreamStall,
    /// Stream a chunk every 200 ms forever: never idle, never done.
    StreamTrickle,
    /// Echo after this delay (many calls in flight).
    Slow(Duration),
    /// A provider that answers `calls` at once (echoing after `latency`) and refuses a request
    /// past them at once with a 503 (counted in [`Counters::refused`]).
    Capacity { calls: usize, latency: Duration },
    /// An agent script keyed on how many tool results the request carries: call `kv_put`, then
    /// `ledger`, then answer.
    Agent,
    /// An agent that fetches each URL with `http_get` in turn, then answers with what it got.
    AgentHttp(Vec<String>),
    /// An agent of `turns` model turns, each answered after `latency`: turn t < turns - 1 calls
    /// `kv_put` with key `t{t}`, the last answers.
    AgentTurns { turns: usize, latency: Duration },
    /// 200 with the completion a test's function makes of the request body (build it with
    /// [`completion`] or [`tool_call`]; [`tool_results_in`] says how far the agent got).
    Script(Script),
}

/// A test's function from a completion request to its answer.
#[derive(Clone)]
pub struct Script(pub Arc<dyn Fn(&Value) -> Value + Send + Sync>);

impl std::fmt::Debug for Script {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Script")
    }
}

/// Called with every completion request's body as it arrives, before the answer.
pub type Hook = Arc<dyn Fn(Value) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub peak: AtomicUsize,
    /// Requests a [`Mode::Capacity`] refused.
    pub refused: AtomicUsize,
    /// The `model` field of every completion request, in order.
    pub models: Mutex<Vec<String>>,
}

pub struct FakeModel {
    pub addr: SocketAddr,
    pub url: String,
    mode: Arc<Mutex<Mode>>,
    hook: Arc<Mutex<Option<Hook>>>,
    pub counters: Arc<Counters>,
    /// Accepts until the fake is dropped.
    _server: Server,
}

impl FakeModel {
    pub async fn start(mode: Mode) -> Self {
        let mode = Arc::new(Mutex::new(mode));
        let hook: Arc<Mutex<Option<Hook>>> = Arc::new(Mutex::new(None));
        let counters = Arc::new(Counters::default());
        let (m, h, c) = (mode.clone(), hook.clone(), counters.clone());
        let server = Server::start(move |socket, request| {
            serve(socket, request, m.clone(), h.clone(), c.clone())
        })
        .await
        .expect("starting the fake model on 127.0.0.1");
        Self {
            addr: server.addr,
            url: server.url.clone(),
            mode,
            hook,
            counters,
            _server: server,
        }
    }

    pub fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// Calls `hook` with every completion request's body before answering it.
    pub fn set_hook(&self, hook: Hook) {
        *self.hook.lock().unwrap() = Some(hook);
    }

    /// Holds every completion request until the returned gate has a permit for it (one permit
    /// lets one request through): a test decides when a model call in flight ends.
    pub fn hold_requests(&self) -> Arc<tokio::sync::Semaphore> {
        self.hold_where(|_| true)
    }

    /// Holds, like [`FakeModel::hold_requests`], only the requests with a message whose content
    /// is `prompt` (a `script` operation's `{"model": prompt}` step); the rest are answered.
    pub fn hold_prompt(&self, prompt: &str) -> Arc<tokio::sync::Semaphore> {
        let prompt = prompt.to_string();
        self.hold_where(move |body| {
            body["messages"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["content"] == prompt.as_str()))
        })
    }

    fn hold_where(
        &self,
        pick: impl Fn(&Value) -> bool + Send + Sync + 'static,
    ) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = gate.clone();
        self.set_hook(Arc::new(move |body| {
            let held = pick(&body).then(|| held.clone());
            Box::pin(async move {
                if let Some(held) = held {
                    held.acquire().await.expect("gate open").forget();
                }
            })
        }));
        gate
    }

    pub fn requests(&self) -> usize {
        self.counters.requests.load(Ordering::SeqCst)
    }

    pub fn peak(&self) -> usize {
        self.counters.peak.load(Ordering::SeqCst)
    }

    pub fn refused(&self) -> usize {
        self.counters.refused.load(Ordering::SeqCst)
    }

    /// An error mode in OpenAI's shape.
    pub fn error(status: u16, etype: &str, code: &str) -> Mode {
        Mode::Error {
            status,
            body: json!({ "error": { "message": "fake", "type": etype, "code": code } }),
            headers: Vec::new(),
        }
    }
}

pub fn last_user(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    v["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn tool_results(body: &[u8]) -> usize {
    tool_results_in(&serde_json::from_slice(body).unwrap_or(Value::Null))
}

/// How many tool results a completion request carries: how many tool calls the agent made.
pub fn tool_results_in(request: &Value) -> usize {
    request["messages"]
        .as_array()
        .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count())
}

/// A 200 answer with this JSON body.
fn ok(body: Value) -> Mode {
    Mode::Error {
        status: 200,
        body,
        headers: Vec::new(),
    }
}

/// The turn a request is for: how many assistant messages it carries.
pub fn assistant_turns(body: &[u8]) -> usize {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    v["messages"]
        .as_array()
        .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count())
}

/// A completion that calls the tool `name` with `args`, in OpenAI's shape.
pub fn tool_call(id: &str, name: &str, args: Value) -> Value {
    json!({
        "id": "chatcmpl-fake", "model": "fake-model",
        "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": null,
            "tool_calls": [{ "id": id, "type": "function", "function": { "name": name, "arguments": args.to_string() } }]
        }}],
        "usage": { "prompt_tokens": 5, "completion_tokens": 5 }
    })
}

/// A completion answering `text`, in OpenAI's shape.
pub fn completion(text: &str) -> Value {
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion", "model": "fake-model",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 3, "completion_tokens": text.split_whitespace().count() }
    })
}

async fn serve(
    mut socket: TcpStream,
    Request { method, body }: Request,
    mode: Arc<Mutex<Mode>>,
    hook: Arc<Mutex<Option<Hook>>>,
    c: Arc<Counters>,
) -> std::io::Result<()> {
    if method == "GET" {
        // A web page, for the agent's http_get tool.
        let page = "hello from the fake web";
        return http_server::answer(&mut socket, 200, "text/plain", &[], page).await;
    }
    c.requests.fetch_add(1, Ordering::SeqCst);
    if let Some(m) = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["model"].as_str().map(str::to_string))
    {
        c.models.lock().unwrap().push(m);
    }
    let hook = hook.lock().unwrap().clone();
    // A body cut short (the client was killed while sending it) is no request to check.
    if let (Some(hook), Ok(request)) = (hook, serde_json::from_slice::<Value>(&body)) {
        hook(request).await;
    }
    let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    c.peak.fetch_max(now, Ordering::SeqCst);
    let mode = mode.lock().unwrap().clone();
    let text = last_user(&body);
    let result = match mode {
        Mode::Agent => {
            let reply = match tool_results(&body) {
                0 => tool_call("call_a", "kv_put", json!({ "key": "a", "value": 1 })),
                1 => {
                    // A slow second turn, so a test can kill the worker between tool A and B.
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    tool_call("call_b", "ledger", json!({ "label": "b" }))
                }
                _ => completion("done: stored a, recorded b"),
            };
            respond(&mut socket, ok(reply), &text).await
        }
        Mode::AgentTurns { turns, latency } => {
            tokio::time::sleep(latency).await;
            let turn = assistant_turns(&body);
            let reply = if turn + 1 < turns {
                tool_call(
                    &format!("call_{turn}"),
                    "kv_put",
                    json!({ "key": format!("t{turn}"), "value": turn }),
                )
            } else {
                completion("done")
            };
            respond(&mut socket, ok(reply), &text).await
        }
        Mode::AgentHttp(urls) => {
            let done = tool_results(&body);
            let reply = match urls.get(done) {
                Some(url) => tool_call(&format!("call_{done}"), "http_get", json!({ "url": url })),
                None => {
                    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    let results: Vec<String> = v["messages"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|m| m["role"] == "tool")
                        .map(|m| m["content"].as_str().unwrap_or_default().to_string())
                        .collect();
                    completion(&results.join(" | "))
                }
            };
            respond(&mut socket, ok(reply), &text).await
        }
        Mode::Capacity { calls, .. } if now > calls => {
            c.refused.fetch_add(1, Ordering::SeqCst);
            respond(&mut socket, FakeModel::error(503, "overloaded", ""), &text).await
        }
        Mode::Capacity { latency, .. } => respond(&mut socket, Mode::Slow(latency), &text).await,
        Mode::Script(Script(f)) => {
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            respond(&mut socket, ok(f(&request)), &text).await
        }
        Mode::Obey => {
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let system: String = v["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|m| m["role"] == "system")
                .filter_map(|m| m["content"].as_str())
                .collect();
            let answer = if system.contains("drop titles from memos") && text.contains("memo") {
                text.lines()
                    .filter(|l| !l.starts_with("Title:"))
                    .collect::<Vec<_>>()
                    .join("\n")
            } else {
                text.clone()
            };
            respond(&mut socket, ok(completion(&answer)), &text).await
        }
        mode => respond(&mut socket, mode, &text).await,
    };
    c.in_flight.fetch_sub(1, Ordering::SeqCst);
    result
}

async fn respond(socket: &mut TcpStream, mode: Mode, text: &str) -> std::io::Result<()> {
    let json_response = |status: u16, body: &Value, extra: &[(String, String)]| {
        http_server::response(status, "application/json", extra, &body.to_string())
    };
    let sse_head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let chunk = |piece: &str| {
        format!(
            "data: {}\n\n",
            json!({ "model": "fake-model", "choices": [{ "index": 0, "delta": { "content": piece } }] })
        )
    };
    match mode {
        Mode::Echo => {
            socket
                .write_all(json_response(200, &completion(text), &[]).as_bytes())
                .await?
        }
        Mode::EchoSuffix(suffix) => {
            let answer = format!("{text}{suffix}");
            socket
                .write_all(json_response(200, &completion(&answer), &[]).as_bytes())
                .await?
        }
        Mode::Slow(d) => {
            tokio::time::sleep(d).await;
            socket
                .write_all(json_response(200, &completion(text), &[]).as_bytes())
                .await?
        }
        Mode::Error {
            status,
            body,
            headers,
        } => {
            socket
                .write_all(json_response(status, &body, &headers).as_bytes())
                .await?
        }
        Mode::StallHeaders => tokio::time::sleep(Duration::from_secs(3600)).await,
        Mode::EchoStream => {
            socket.write_all(sse_head.as_bytes()).await?;
            for (i, word) in text.split(' ').enumerate() {
                let piece = if i == 0 {
                    word.to_string()
                } else {
                    format!(" {word}")
                };
                socket.write_all(chunk(&piece).as_bytes()).await?;
                socket.flush().await?;
            }
            let tail = json!({ "model": "fake-model", "choices": [{ "index": 0, "delta": {}, "finish_reason": "stop" }],
                               "usage": { "prompt_tokens": 3, "completion_tokens": 2 } });
            socket
                .write_all(format!("data: {tail}\n\ndata: [DONE]\n\n").as_bytes())
                .await?;
        }
        Mode::LlamaToolStream => {
            socket.write_all(sse_head.as_bytes()).await?;
            for piece in ["{\"key\": ", "\"colour\", ", "\"value\": \"blue\"}"] {
                let delta = json!({ "model": "fake-model", "choices": [{ "index": 0, "finish_reason": null,
                    "delta": { "role": "assistant", "content": null, "tool_calls": [{ "index": 0, "id": "call_0",
                        "type": "function", "function": { "name": "kv_put", "arguments": piece } }] } }] });
                socket
                    .write_all(format!("data: {delta}\n\n").as_bytes())
                    .await?;
                socket.flush().await?;
            }
            let tail = json!({ "model": "fake-model", "choices": [{ "index": 0, "delta": {}, "finish_reason": "tool_calls" }] });
            socket
                .write_all(format!("data: {tail}\n\ndata: [DONE]\n\n").as_bytes())
                .await?;
        }
        Mode::StreamCut => {
            socket.write_all(sse_head.as_bytes()).await?;
            socket.write_all(chunk("half ").as_bytes()).await?;
            socket.write_all(chunk("an answer").as_bytes()).await?;
            socket.flush().await?;
        }
        Mode::Agent
        | Mode::AgentHttp(_)
        | Mode::AgentTurns { .. }
        | Mode::Obey
        | Mode::Script(_)
        | Mode::Capacity { .. } => {
            unreachable!("answered in serve")
        }
        Mode::StreamTrickle => {
            socket.write_all(sse_head.as_bytes()).await?;
            loop {
                socket.write_all(chunk("more ").as_bytes()).await?;
                socket.flush().await?;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        Mode::StreamStall => {
            socket.write_all(sse_head.as_bytes()).await?;
            socket.write_all(chunk("and then").as_bytes()).await?;
            socket.flush().await?;
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    }
    socket.shutdown().await
}
