//! Tools: side effects a job performs through [`JobContext::tool`](crate::JobContext::tool),
//! and that the agent loop offers to the model. Each tool declares whether a call may be
//! repeated after a crash left its outcome unknown ([`Replay`]), and may implement
//! [`Tool::reconcile`] to ask the outside system whether it happened.
//!
//! Write a tool as a [`TypedTool`] (its arguments a Rust type, their JSON Schema derived from
//! it) or as a [`Tool`] over JSON values. A deployment registers its tools once
//! (`Registry::register_tool` in the worker); the `agent` kind names them
//! in its input, and any kind finds them with
//! [`JobContext::registered_tool`](crate::JobContext::registered_tool). A call receives a
//! [`ToolContext`]: the operation it runs for (scope every read and write to its tenant), the
//! step's idempotency key, the deployment's own state and the allowed origins.
//!
//! Invariant kept here: a tool is called only inside a journaled step: a [`ToolContext`] is
//! made by a [`Backend`](crate::context::Backend) running the step and by nothing else.

use std::sync::Arc;

use agentq_core::origins::Origins;
use async_trait::async_trait;
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::JobError;
use crate::info::OperationInfo;

/// Whether a step may run again after a crash left its outcome unknown (a typed state of
/// `agentq_core::state`, re-exported for kinds).
pub use agentq_core::state::Replay;

/// What the outside system says about an effect whose outcome was lost in a crash: of a
/// [`Tool`], its output as JSON; of a [`TypedTool`], its [`TypedTool::Output`].
#[derive(Clone, Debug, PartialEq)]
pub enum Reconciled<T = Value> {
    /// It happened; this is the output the call would have returned.
    Happened(T),
    /// It did not happen; the call may run now.
    NotHappened,
    /// This tool cannot tell: the operation goes to the DLQ as `unknown_side_effect`.
    Unsupported,
}

impl Reconciled {
    /// [`Reconciled::Happened`] with a typed output, as JSON.
    pub fn happened(output: impl Serialize) -> Result<Self, JobError> {
        serde_json::to_value(output)
            .map(Reconciled::Happened)
            .map_err(|e| JobError::NonRetryable(format!("a reconciled output is not JSON: {e}")))
    }
}

/// What a tool call knows about where it runs. Made only by a backend, for a call inside a
/// journaled step.
pub struct ToolContext<'a> {
    info: &'a OperationInfo,
    key: &'a str,
    http_allow: &'a Arc<Origins>,
    provided: &'a crate::provided::Provided,
}

impl<'a> ToolContext<'a> {
    /// The context of a call inside the step whose idempotency key is `key` (for a
    /// [`Backend`](crate::context::Backend): kinds and tools never make one).
    #[doc(hidden)]
    pub fn new(
        info: &'a OperationInfo,
        key: &'a str,
        http_allow: &'a Arc<Origins>,
        provided: &'a crate::provided::Provided,
    ) -> Self {
        Self {
            info,
            key,
            http_allow,
            provided,
        }
    }

    /// The step's idempotency key: the same on every attempt and after every crash. Pass it to
    /// the outside system (an `Idempotency-Key` header, a unique column) so the effect happens
    /// once, and look the effect up by it in [`Tool::reconcile`].
    pub fn idempotency_key(&self) -> &str {
        self.key
    }

    /// The operation the call runs for. Scope every read and write to its `tenant`.
    pub fn info(&self) -> &OperationInfo {
        self.info
    }

    /// The value of type `T` the deployment gave its registry, as
    /// [`JobContext::state`](crate::JobContext::state) hands it to kinds.
    pub fn state<T: Send + Sync + 'static>(&self) -> Result<&T, JobError> {
        self.provided.get::<T>()
    }

    /// The origins the operator allows outbound calls to (`AGENTQ_AGENT_HTTP_ALLOW`): check
    /// every URL before connecting.
    pub fn http_allow(&self) -> &Arc<Origins> {
        self.http_allow
    }
}

/// A tool over JSON values. Most tools are easier to write as a [`TypedTool`], which is a
/// `Tool` too; write a `Tool` when its arguments have no fixed shape, or when a kind builds the
/// tool per operation with a configuration of its own (and calls it with
/// [`JobContext::tool`](crate::JobContext::tool) instead of registering it).
///
/// ```
/// use agentq_sdk::{JobError, Reconciled, Replay, Tool, ToolContext};
/// use async_trait::async_trait;
/// use serde_json::{Value, json};
///
/// /// Posts to a webhook the kind's input names, once per step.
/// struct Notify {
///     url: String,
/// }
///
/// #[async_trait]
/// impl Tool for Notify {
///     fn name(&self) -> &str {
///         "notify"
///     }
///     fn replay(&self) -> Replay {
///         Replay::Unsafe // a second notification would be wrong
///     }
///     async fn call(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
///         // Send `args` to self.url with `Idempotency-Key: cx.idempotency_key()` here.
///         Ok(json!({ "sent_to": self.url, "key": cx.idempotency_key() }))
///     }
///     async fn reconcile(&self, cx: &ToolContext<'_>, _args: &Value) -> Result<Reconciled, JobError> {
///         // Ask the receiver whether it got `cx.idempotency_key()`; it did here.
///         Ok(Reconciled::Happened(json!({ "sent_to": self.url, "key": cx.idempotency_key() })))
///     }
/// }
///
/// let tool = Notify { url: "https://hooks.example/x".into() };
/// assert_eq!(tool.replay(), Replay::Unsafe);
/// ```
#[async_trait]
pub trait Tool: Send + Sync {
    /// The name the model calls it by and its steps are journaled under: 1–64 letters, digits,
    /// `_` or `-`.
    fn name(&self) -> &str;

    /// `Safe` if repeating a call with the same idempotency key is harmless.
    fn replay(&self) -> Replay;

    /// What the tool does, for a model choosing tools in the agent loop.
    fn description(&self) -> &str {
        ""
    }

    /// JSON Schema of the arguments, for the model.
    fn parameters(&self) -> Value {
        serde_json::json!({ "type": "object" })
    }

    /// Whether the agent loop must get a human's approval (signal `approval`) before each call.
    fn requires_approval(&self) -> bool {
        false
    }

    /// Performs the call. [`ToolContext::idempotency_key`] is stable across retries and
    /// crashes: pass it to the outside system so it can deduplicate.
    ///
    /// How an error is classed matters for an `Unsafe` tool. [`JobError::NoEffect`] says the
    /// call certainly did nothing (never sent; refused before acting), so the next attempt
    /// runs it again. A `Retryable` or `Overloaded` error (a timeout, a dropped connection)
    /// leaves the outcome unknown: the step is journaled `unknown` and the next attempt
    /// reconciles it, or fails closed. `NonRetryable` means it failed for good (the agent
    /// loop reports it to the model as the call's result).
    async fn call(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError>;

    /// Asks the outside system whether the call with [`ToolContext::idempotency_key`] already
    /// happened. Called only for an `Unsafe` tool whose call a crash or an unknown error
    /// interrupted; without it such a call stops the operation as `unknown_side_effect`.
    async fn reconcile(
        &self,
        _cx: &ToolContext<'_>,
        _args: &Value,
    ) -> Result<Reconciled, JobError> {
        Ok(Reconciled::Unsupported)
    }
}

/// A tool whose arguments and output are Rust types: the JSON Schema the model receives is
/// derived from [`TypedTool::Args`], and arguments that do not fit it are refused before
/// [`TypedTool::call`] runs, naming the field (the agent loop hands that refusal to the model
/// as the call's result, so it can correct itself). A kind calls it with
/// [`JobContext::call`](crate::JobContext::call); registered
/// (`Registry::register_tool` in the worker), the model can call it too.
///
/// ```
/// use agentq_sdk::{JobError, Replay, ToolContext, TypedTool};
///
/// #[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
/// struct LookupArgs {
///     /// The order's number, as the customer gives it.
///     order: String,
/// }
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Order {
///     order: String,
///     status: String,
/// }
///
/// struct Lookup;
///
/// #[agentq_sdk::async_trait]
/// impl TypedTool for Lookup {
///     const NAME: &str = "lookup_order";
///     const DESCRIPTION: &str = "Look an order up by its number.";
///     const REPLAY: Replay = Replay::Safe; // a read: repeating it is harmless
///     type Args = LookupArgs;
///     type Output = Order;
///
///     async fn call(&self, cx: &ToolContext<'_>, args: LookupArgs) -> Result<Order, JobError> {
///         // A real tool reads its table here, scoped to cx.info().tenant.
///         Ok(Order { order: args.order, status: "shipped".into() })
///     }
/// }
///
/// use agentq_sdk::Tool;
/// assert_eq!(Lookup.name(), "lookup_order");
/// assert!(Lookup.parameters()["properties"]["order"].is_object());
/// ```
#[async_trait]
pub trait TypedTool: Send + Sync + 'static {
    /// See [`Tool::name`].
    const NAME: &'static str;
    /// See [`Tool::description`].
    const DESCRIPTION: &'static str = "";
    /// See [`Tool::replay`].
    const REPLAY: Replay;
    /// See [`Tool::requires_approval`].
    const REQUIRES_APPROVAL: bool = false;

    /// The arguments, as the model must send them.
    type Args: Serialize + DeserializeOwned + JsonSchema + Send + Sync;
    /// What a call returns (journaled, and handed to the model as JSON).
    type Output: Serialize + DeserializeOwned + Send;

    /// Performs the call: see [`Tool::call`] for how to class its errors.
    async fn call(&self, cx: &ToolContext<'_>, args: Self::Args) -> Result<Self::Output, JobError>;

    /// See [`Tool::reconcile`]: [`Reconciled::Happened`] with the call's output,
    /// [`Reconciled::NotHappened`], or (the default) [`Reconciled::Unsupported`].
    async fn reconcile(
        &self,
        _cx: &ToolContext<'_>,
        _args: Self::Args,
    ) -> Result<Reconciled<Self::Output>, JobError> {
        Ok(Reconciled::Unsupported)
    }
}

#[async_trait]
impl<T: TypedTool> Tool for T {
    fn name(&self) -> &str {
        T::NAME
    }

    fn replay(&self) -> Replay {
        T::REPLAY
    }

    fn description(&self) -> &str {
        T::DESCRIPTION
    }

    fn parameters(&self) -> Value {
        parameters_of::<T::Args>()
    }

    fn requires_approval(&self) -> bool {
        T::REQUIRES_APPROVAL
    }

    async fn call(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
        let args = decode_args::<T::Args>(T::NAME, args)?;
        let output = TypedTool::call(self, cx, args).await?;
        serde_json::to_value(output).map_err(|e| {
            JobError::NonRetryable(format!(
                "tool {:?} returned an output that is not JSON: {e}",
                T::NAME
            ))
        })
    }

    async fn reconcile(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Reconciled, JobError> {
        let args = decode_args::<T::Args>(T::NAME, args)?;
        Ok(match TypedTool::reconcile(self, cx, args).await? {
            Reconciled::Happened(output) => Reconciled::happened(output)?,
            Reconciled::NotHappened => Reconciled::NotHappened,
            Reconciled::Unsupported => Reconciled::Unsupported,
        })
    }
}

/// The JSON Schema of `A` as a tool's parameters: every subschema inlined (models and their
/// servers' grammar builders read plain schemas best), without the `$schema` and `title`
/// keys.
pub fn parameters_of<A: JsonSchema>() -> Value {
    let generator = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    let mut schema = generator.into_root_schema_for::<A>().to_value();
    if let Some(map) = schema.as_object_mut() {
        map.remove("$schema");
        map.remove("title");
    }
    schema
}

/// Decodes a tool's arguments into `A`; a misfit is a non-retryable error naming the field.
fn decode_args<A: DeserializeOwned>(tool: &str, args: &Value) -> Result<A, JobError> {
    crate::info::decode::<A>(args)
        .map_err(|e| JobError::NonRetryable(format!("the arguments do not fit tool {tool:?}: {e}")))
}

/// Whether `name` may name a tool: 1–64 letters, digits, `_` or `-` (what model providers
/// accept as a function name).
pub fn check_name(name: &str) -> Result<(), String> {
    let fits = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if fits {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a tool name: use 1-64 letters, digits, `_` or `-`"
        ))
    }
}

/// `tool` with every call waiting for a human's approval first (the agent loop's signal
/// `approval`), whatever the tool itself asks.
pub fn with_approval(tool: Arc<dyn Tool>) -> Arc<dyn Tool> {
    Arc::new(Approved(tool))
}

struct Approved(Arc<dyn Tool>);

#[async_trait]
impl Tool for Approved {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn replay(&self) -> Replay {
        self.0.replay()
    }

    fn description(&self) -> &str {
        self.0.description()
    }

    fn parameters(&self) -> Value {
        self.0.parameters()
    }

    fn requires_approval(&self) -> bool {
        true
    }

    async fn call(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Value, JobError> {
        self.0.call(cx, args).await
    }

    async fn reconcile(&self, cx: &ToolContext<'_>, args: &Value) -> Result<Reconciled, JobError> {
        self.0.reconcile(cx, args).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_names_are_what_providers_accept() {
        assert!(check_name("lookup_order").is_ok());
        assert!(check_name("refund-v2").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("rm -rf").is_err());
        assert!(check_name(&"x".repeat(65)).is_err());
    }

    #[derive(serde::Deserialize, JsonSchema)]
    #[allow(dead_code)]
    struct Args {
        /// Cents.
        amount: u32,
        note: Option<String>,
    }

    #[test]
    fn parameters_are_derived_from_the_args_type() {
        let p = parameters_of::<Args>();
        assert_eq!(p["type"], "object");
        assert_eq!(p["properties"]["amount"]["description"], "Cents.");
        assert_eq!(p["required"], serde_json::json!(["amount"]));
        assert!(p.get("$schema").is_none() && p.get("title").is_none());
    }
}
