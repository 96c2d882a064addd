//! A fake payments API for the support agent's tests, in-process on `127.0.0.1:0`: it records
//! every refund request it receives (never deduplicating them, so a second refund would show),
//! answers a repeated idempotency key with its first refund, answers reconcile lookups, and can
//! hold its answers at a gate so a test can kill a worker after the refund happened and before
//! its answer arrived.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

#[derive(Default)]
struct Ledger {
    /// Every refund request, in order: its idempotency key and body.
    posts: Mutex<Vec<(String, Value)>>,
    /// The refund made for each key.
    refunds: Mutex<HashMap<String, Value>>,
    lookups: AtomicUsize,
}

pub struct Payments {
    pub url: String,
    ledger: Arc<Ledger>,
    gate: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Payments {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Shared {
    ledger: Arc<Ledger>,
    gate: tokio::sync::watch::Receiver<bool>,
}

impl Payments {
    /// Starts the fake; with `open` false, refund answers wait for [`Payments::open`].
    pub async fn start(open: bool) -> Self {
        let ledger = Arc::new(Ledger::default());
        let (gate, rx) = tokio::sync::watch::channel(open);
        let app = axum::Router::new()
            .route("/refunds", post(refund).get(lookup))
            .with_state(Shared {
                ledger: ledger.clone(),
                gate: rx,
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            url,
            ledger,
            gate,
            task,
        }
    }

    /// Lets held and later refund answers go.
    pub fn open(&self) {
        let _ = self.gate.send(true);
    }

    /// Refund requests received (each one a refund a real API without deduplication made).
    pub fn posts(&self) -> Vec<(String, Value)> {
        self.ledger.posts.lock().unwrap().clone()
    }

    /// Reconcile lookups received.
    pub fn lookups(&self) -> usize {
        self.ledger.lookups.load(Ordering::SeqCst)
    }

    /// Polls until a refund request has arrived, for at most `deadline`.
    pub async fn wait_for_post(&self, deadline: Duration) {
        let end = tokio::time::Instant::now() + deadline;
        while self.posts().is_empty() {
            assert!(
                tokio::time::Instant::now() < end,
                "no refund request within {deadline:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn refund(State(s): State<Shared>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key is required").into_response();
    };
    let made = {
        s.ledger
            .posts
            .lock()
            .unwrap()
            .push((key.clone(), body.clone()));
        let mut refunds = s.ledger.refunds.lock().unwrap();
        let n = refunds.len() + 1;
        refunds
            .entry(key)
            .or_insert_with(|| {
                json!({ "refund_id": format!("rf_{n}"), "order_id": body["order_id"], "cents": body["cents"] })
            })
            .clone()
    };
    // The refund has happened; its answer waits at the gate.
    let mut gate = s.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    (StatusCode::CREATED, Json(made)).into_response()
}

async fn lookup(State(s): State<Shared>, Query(q): Query<HashMap<String, String>>) -> Response {
    s.ledger.lookups.fetch_add(1, Ordering::SeqCst);
    let key = q.get("idempotency_key").cloned().unwrap_or_default();
    match s.ledger.refunds.lock().unwrap().get(&key) {
        Some(r) => Json(r.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
