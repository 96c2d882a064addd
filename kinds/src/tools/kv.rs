//! The `kv_put` / `kv_get` tools: a key-value table per tenant.

use agentq_worker::{EnginePool, JobError, Replay, ToolContext, TypedTool};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Arguments of `kv_put`.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
pub(crate) struct PutArgs {
    /// The key to store the value under.
    key: String,
    /// Any JSON value.
    value: Value,
}

/// Arguments of `kv_get`.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
pub(crate) struct GetArgs {
    /// The key to read.
    key: String,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct Stored {
    ok: bool,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct Read {
    value: Option<Value>,
}

fn unavailable(e: agentq_core::db::Error) -> JobError {
    JobError::retryable(format!("kv unavailable: {e}"))
}

/// `kv_put`: stores a JSON value under a key in the operation's tenant's table. Replay-safe
/// (an upsert).
pub(crate) struct KvPut;

#[async_trait]
impl TypedTool for KvPut {
    const NAME: &str = "kv_put";
    const DESCRIPTION: &str = "Store a JSON value under a key.";
    const REPLAY: Replay = Replay::Safe;
    type Args = PutArgs;
    type Output = Stored;

    async fn call(&self, cx: &ToolContext<'_>, args: PutArgs) -> Result<Stored, JobError> {
        agentq_core::db::within(crate::tables::kv::put(
            &cx.state::<EnginePool>()?.0,
            &cx.info().tenant,
            &args.key,
            &args.value,
        ))
        .await
        .map_err(unavailable)?;
        Ok(Stored { ok: true })
    }
}

/// `kv_get`: reads the value stored under a key in the operation's tenant's table (null if
/// none). Replay-safe (a read).
pub(crate) struct KvGet;

#[async_trait]
impl TypedTool for KvGet {
    const NAME: &str = "kv_get";
    const DESCRIPTION: &str = "Read the JSON value stored under a key (null if none).";
    const REPLAY: Replay = Replay::Safe;
    type Args = GetArgs;
    type Output = Read;

    async fn call(&self, cx: &ToolContext<'_>, args: GetArgs) -> Result<Read, JobError> {
        let value = agentq_core::db::within(crate::tables::kv::get(
            &cx.state::<EnginePool>()?.0,
            &cx.info().tenant,
            &args.key,
        ))
        .await
        .map_err(unavailable)?;
        Ok(Read { value })
    }
}
