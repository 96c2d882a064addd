//! The benchmark's model provider: an in-process OpenAI-compatible server that answers every
//! call after a fixed latency (echoing the last user message) and counts peak concurrency, so
//! `agentq bench --model-latency-ms N` measures how many model calls a worker keeps in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicUsize,
    in_flight: AtomicUsize,
    pub peak: AtomicUsize,
}

/// A running latency server.
pub struct LatencyModel {
    pub url: String,
    pub counters: Arc<Counters>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LatencyModel {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LatencyModel {
    pub async fn start(latency: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let c = c.clone();
                tokio::spawn(async move {
                    let _ = answer(socket, latency, c).await;
                });
            }
        });
        Ok(Self {
            url,
            counters,
            task,
        })
    }
}

async fn answer(mut socket: TcpStream, latency: Duration, c: Arc<Counters>) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let body = loop {
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = socket.read(&mut chunk).await?;
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            break buf[end + 4..].to_vec();
        }
    };
    c.requests.fetch_add(1, Ordering::Relaxed);
    let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    c.peak.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(latency).await;
    c.in_flight.fetch_sub(1, Ordering::SeqCst);
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = request["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let reply = json!({
        "model": "bench-latency",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 1, "completion_tokens": 1 }
    })
    .to_string();
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{reply}",
        reply.len()
    );
    socket.write_all(response.as_bytes()).await?;
    socket.shutdown().await
}
