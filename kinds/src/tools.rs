//! The built-in tools of the `script` and `agent` kinds: `ledger` (a side effect, safe or
//! unsafe, with reconcile), `kv_put` / `kv_get` (a key-value table per tenant) and `http_get`
//! (a GET of an allowed origin). Their tables are reached through `agentq_core::db` with the
//! worker's pool ([`JobContext::pool`](agentq_worker::JobContext::pool)), scoped to the
//! operation (ledger) or its tenant (kv).

mod http_get;
mod kv;
mod ledger;

pub(crate) use http_get::HttpGet;
pub(crate) use kv::Kv;
pub(crate) use ledger::Ledger;
