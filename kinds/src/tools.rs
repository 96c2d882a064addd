//! The built-in tools of the `script` and `agent` kinds: `ledger` (a side effect, safe or
//! unsafe, with reconcile), `kv_put` / `kv_get` (a key-value table per tenant) and `http_get`
//! (a GET of an allowed origin), registered like a deployment's own tools. Their tables are
//! reached through [`crate::tables`] with the worker's pool
//! ([`EnginePool`](agentq_worker::EnginePool), as state), scoped to the operation (ledger)
//! or its tenant (kv).

mod http_get;
mod kv;
mod ledger;

pub(crate) use http_get::HttpGet;
pub(crate) use kv::{KvGet, KvPut};
pub(crate) use ledger::Ledger;

/// Registers the built-in tools the `agent` kind may name: `kv_put`, `kv_get`, `ledger` (unsafe,
/// reconciled) and `http_get`.
pub(crate) fn register(r: &mut agentq_worker::Registry) {
    r.register_tool(KvPut)
        .register_tool(KvGet)
        .register_tool(Ledger::for_agents())
        .register_tool(HttpGet);
}
