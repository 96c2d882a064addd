//! support-agent: a worked example of a deployment's own kind on agentq.
//!
//! The `support` kind answers a customer about an order with the agent loop and two tools of
//! its own:
//! - `lookup_order` (safe): reads the order from the deployment's own table
//!   (`support_orders`, see `schema.sql`) in its own database (`SUPPORT_DATABASE_URL`, a pool
//!   given to the registry with `Registry::provide`), scoped to the operation's tenant;
//! - `refund` (unsafe): refunds through the payments API (`SUPPORT_PAYMENTS_URL`) with the
//!   step's idempotency key, and after a crash asks the API whether that refund happened
//!   (reconcile) instead of refunding again.
//!
//! The `handoff` kind hands a customer's message to a person: it looks the order up, then
//! waits for the signal `reply`, saying with `ctx.wait_for_signal_about` what it needs (the
//! order and the message), which `support-agent status OP`, the API and the console show.
//!
//! Both tools are registered for the deployment, so the built-in `agent` kind may name them
//! too (`"tools": ["lookup_order", "refund"]`). `src/main.rs` hands the registry to
//! `agentq::main`, which gives the binary every agentq subcommand.

mod tools;

use std::time::Duration;

use agentq::model::{Message, Role};
use agentq::{AgentSpec, JobContext, JobError, Registry, SignalOutcome};
use serde::{Deserialize, Serialize};
use serde_json::json;

pub use tools::{LookupArgs, LookupOrder, Orders, Refund, Refunded};

/// What the deployment is configured with.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The payments API the `refund` tool calls: `POST {url}/refunds`, and
    /// `GET {url}/refunds?idempotency_key=K` to reconcile. Its origin must also be in
    /// `AGENTQ_AGENT_HTTP_ALLOW`.
    pub payments_url: reqwest::Url,
    /// The shop's own database, with the `support_orders` table `lookup_order` reads.
    pub orders_url: String,
}

impl Settings {
    /// From the environment: `SUPPORT_PAYMENTS_URL` (default `http://127.0.0.1:9090`) and
    /// `SUPPORT_DATABASE_URL` (default: `DATABASE_URL`, agentq's own, for a demo on one server).
    pub fn from_env() -> Result<Self, String> {
        let raw = std::env::var("SUPPORT_PAYMENTS_URL")
            .unwrap_or_else(|_| "http://127.0.0.1:9090".into());
        let payments_url = reqwest::Url::parse(&raw)
            .map_err(|e| format!("SUPPORT_PAYMENTS_URL {raw:?} is not a URL: {e}"))?;
        let orders_url = std::env::var("SUPPORT_DATABASE_URL")
            .or_else(|_| std::env::var("DATABASE_URL"))
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/agentq".into());
        Ok(Self {
            payments_url,
            orders_url,
        })
    }
}

/// Registers the `support` kind and its tools.
pub fn register(registry: &mut Registry, settings: Settings) {
    registry
        .provide(Orders::new(settings.orders_url))
        .register_tool(LookupOrder)
        .register_tool(Refund::new(settings.payments_url));
    registry.register("support", support).describe(
        "Answers a customer about an order: looks the order up, refunds it when that is \
         what the customer needs (with a human's approval if asked), and replies.",
    );
    registry.register("handoff", handoff).describe(
        "Hands a customer's message to a person: looks the order up and waits up to three \
         days for the signal \"reply\" with {\"text\": …}, the reply to send.",
    );
}

/// Input of `handoff`.
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HandoffInput {
    /// The order the customer writes about.
    pub order_id: String,
    /// What the customer wrote.
    pub message: String,
}

/// The `handoff` kind: the order looked up, then a person's reply waited for, with what the
/// person needs to write it.
pub async fn handoff(ctx: JobContext, input: HandoffInput) -> Result<SupportReply, JobError> {
    let order_id = input.order_id.clone();
    let order = ctx.call(&LookupOrder, LookupArgs { order_id }).await?;
    let about = json!({
        "needs": "a reply to the customer: send signal \"reply\" with {\"text\": …}",
        "order": order,
        "message": input.message,
    });
    match ctx
        .wait_for_signal_about("reply", Duration::from_secs(72 * 3600), about)
        .await?
    {
        SignalOutcome::Received { payload, .. } => Ok(SupportReply {
            reply: payload["text"].as_str().unwrap_or_default().to_string(),
            tool_calls: 1,
        }),
        SignalOutcome::TimedOut => Err(JobError::NonRetryable(
            "nobody replied within three days".into(),
        )),
    }
}

/// Input of `support`.
#[derive(Debug, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SupportInput {
    /// The order the customer writes about, e.g. `A-1001`.
    pub order_id: String,
    /// What the customer wrote.
    pub message: String,
    /// Every refund waits for a human's approval first (`agentq approve OP`).
    #[serde(default)]
    pub approve_refunds: bool,
}

/// What `support` returns.
#[derive(Debug, Deserialize, Serialize)]
pub struct SupportReply {
    /// The reply to send the customer.
    pub reply: String,
    /// Tool calls the agent made.
    pub tool_calls: u32,
}

const SYSTEM: &str = "You are a support agent for an online shop. Look the order up before \
anything else. Refund only an order that exists, at most its total, and only when the \
customer asks for their money back. Then answer the customer in two sentences.";

/// The `support` kind: the agent loop over `lookup_order` and `refund`.
pub async fn support(ctx: JobContext, input: SupportInput) -> Result<SupportReply, JobError> {
    let tool = |name: &str| {
        ctx.registered_tool(name).ok_or_else(|| {
            JobError::NonRetryable(format!("this worker registers no tool {name:?}"))
        })
    };
    let mut refund = tool("refund")?;
    if input.approve_refunds {
        refund = agentq::tool::with_approval(refund);
    }
    let outcome = ctx
        .agent(AgentSpec {
            system: SYSTEM.into(),
            messages: vec![Message::text(
                Role::User,
                format!("Order {}: {}", input.order_id, input.message),
            )],
            tools: vec![tool("lookup_order")?, refund],
            max_turns: 6,
            approval_timeout: Duration::from_secs(72 * 3600),
            model: None,
            tool_choice: None,
        })
        .await?;
    Ok(SupportReply {
        reply: outcome.answer,
        tool_calls: outcome.tool_calls,
    })
}
