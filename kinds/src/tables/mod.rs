//! The built-in kinds' own tables, and the only SQL of `agentq-kinds`: `agent_kv` of the
//! `kv_put` / `kv_get` tools ([`kv`]), `ledger_effects` of the `ledger` tool ([`ledger`]), and
//! the source and target tables of `doc_migration` ([`docs`]). The tables themselves are
//! created by agentq's migrations (`migrations/`), except a `doc_migration` target table,
//! created on first write. Each function takes the worker's pool, which a run has as the
//! state [`EnginePool`](agentq_worker::EnginePool) (`ctx.state::<EnginePool>()`,
//! `cx.state::<EnginePool>()`).
//!
//! An invariant test (`tests/invariants.rs`) allows SQL only here and in `core/src/db/`.

pub mod docs;
pub mod kv;
pub mod ledger;
