//! The e2e suite's harness: the testkit's [`World`] running the `agentq` binary, plus what
//! only agentq's own tests use (a library producer over the built-in kinds).

use std::ops::{Deref, DerefMut};

use agentq_testkit::World;
use serde_json::Value;

pub use agentq_testkit::DEADLINE;

/// The `agentq` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_agentq");

/// A fresh test world with one scheduler and one worker running.
pub async fn running_app() -> TestApp {
    TestApp(agentq_testkit::running(BIN).await)
}

/// One test's world of the `agentq` binary (see [`World`]).
pub struct TestApp(pub World);

impl Deref for TestApp {
    type Target = World;

    fn deref(&self) -> &World {
        &self.0
    }
}

impl DerefMut for TestApp {
    fn deref_mut(&mut self) -> &mut World {
        &mut self.0
    }
}

impl TestApp {
    /// Creates and migrates a fresh database and declares a fresh namespace.
    pub async fn start() -> Self {
        TestApp(World::start(BIN).await)
    }

    /// Stops the processes and deletes the database and the namespace.
    pub async fn cleanup(self) {
        self.0.cleanup().await;
    }

    /// A dispatcher publishing into this test's namespace (close it when done).
    pub fn dispatcher(&self) -> std::sync::Arc<agentq_core::dispatch::Dispatcher> {
        std::sync::Arc::new(agentq_core::dispatch::Dispatcher::new(
            self.pool.clone(),
            &self.amqp_url,
            self.names(),
            "test",
        ))
    }

    /// A library producer accepting the built-in kinds, and its dispatcher (close it when
    /// done).
    pub fn producer(
        &self,
    ) -> (
        agentq_producer::Producer,
        std::sync::Arc<agentq_core::dispatch::Dispatcher>,
    ) {
        self.producer_with(agentq_kinds::registry())
    }

    /// A library producer accepting the kinds of `registry`, and its dispatcher.
    pub fn producer_with(
        &self,
        registry: agentq_worker::Registry,
    ) -> (
        agentq_producer::Producer,
        std::sync::Arc<agentq_core::dispatch::Dispatcher>,
    ) {
        let dispatcher = self.dispatcher();
        let producer = agentq_producer::Producer::new(
            self.pool.clone(),
            dispatcher.clone(),
            std::sync::Arc::new(registry),
            3,
        );
        (producer, dispatcher)
    }

    /// Enqueues one operation of `kind` on `lane` per input, through the library (hundreds of
    /// CLI processes would take longer than the test itself); returns their ids in order.
    pub async fn enqueue_many(
        &self,
        kind: &str,
        lane: agentq_core::Lane,
        inputs: impl IntoIterator<Item = Value>,
    ) -> Vec<uuid::Uuid> {
        let (producer, dispatcher) = self.producer();
        let mut ids = Vec::new();
        for input in inputs {
            let e = producer
                .enqueue(agentq_producer::EnqueueRequest {
                    tenant: "t1".into(),
                    kind: kind.into(),
                    input,
                    lane,
                    ..Default::default()
                })
                .await
                .unwrap();
            ids.push(e.op_id.0);
        }
        dispatcher.close().await;
        ids
    }
}
