//! The support agent's tools: `lookup_order` reads the deployment's own table, `refund` calls
//! the payments API once per step, whatever crashes in between.

use std::time::Duration;

use agentq::builtin::outbound;
use agentq::sqlx;
use agentq::{JobError, Reconciled, Replay, ToolContext, TypedTool, async_trait};
use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};

/// Arguments of `lookup_order`.
#[derive(Serialize, Deserialize, schemars::JsonSchema)]
pub struct LookupArgs {
    /// The order's id, e.g. `A-1001`.
    pub order_id: String,
}

/// An order, as `lookup_order` answers.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Order {
    pub order_id: String,
    pub found: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_cents: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// The deployment's own database, holding `support_orders`: its URL, and a pool opened on first
/// use (given to the registry with `Registry::provide`, read back with `cx.state`).
pub struct Orders {
    url: String,
    pool: tokio::sync::OnceCell<sqlx::PgPool>,
}

impl Orders {
    /// The database at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            pool: tokio::sync::OnceCell::new(),
        }
    }

    /// Its pool: opened the first time a tool needs it (a database that cannot be reached is a
    /// retryable failure of the step, which read nothing).
    async fn pool(&self) -> Result<&sqlx::PgPool, JobError> {
        self.pool
            .get_or_try_init(|| {
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(4)
                    .connect(&self.url)
            })
            .await
            .map_err(|e| JobError::no_effect(format!("connecting to the orders database: {e}")))
    }
}

/// `lookup_order`: reads an order from `support_orders`, in the deployment's own database
/// ([`Orders`]). Safe: a read may run again.
pub struct LookupOrder;

#[async_trait]
impl TypedTool for LookupOrder {
    const NAME: &str = "lookup_order";
    const DESCRIPTION: &str = "Look an order up by its id: whether it exists, the customer, its total in cents and its status.";
    const REPLAY: Replay = Replay::Safe;
    type Args = LookupArgs;
    type Output = Order;

    async fn call(&self, cx: &ToolContext<'_>, args: LookupArgs) -> Result<Order, JobError> {
        // Scoped to the operation's tenant: one tenant's agent never reads another's orders.
        let row: Option<(String, i64, String)> = sqlx::query_as(
            "SELECT customer, total_cents, status FROM support_orders
              WHERE tenant = $1 AND order_id = $2",
        )
        .bind(&cx.info().tenant)
        .bind(&args.order_id)
        .fetch_optional(cx.state::<Orders>()?.pool().await?)
        .await
        .map_err(|e| JobError::retryable(format!("reading support_orders: {e}")))?;
        Ok(match row {
            Some((customer, total_cents, status)) => Order {
                order_id: args.order_id,
                found: true,
                customer: Some(customer),
                total_cents: Some(total_cents),
                status: Some(status),
            },
            None => Order {
                order_id: args.order_id,
                found: false,
                customer: None,
                total_cents: None,
                status: None,
            },
        })
    }
}

/// Arguments of `refund`.
#[derive(Deserialize, Serialize, schemars::JsonSchema)]
pub struct RefundArgs {
    /// The order to refund.
    pub order_id: String,
    /// How much, in cents (at most the order's total).
    pub cents: u64,
    /// Why, in a few words.
    pub reason: String,
}

/// What the payments API answers for a refund (and what `refund` returns).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Refunded {
    pub refund_id: String,
    pub order_id: String,
    pub cents: u64,
}

/// `refund`: `POST {payments}/refunds` with the step's idempotency key. Unsafe: money moves,
/// so a call a crash interrupted is never made blindly again: [`Refund::reconcile`] asks the
/// API whether it happened.
pub struct Refund {
    refunds: Url,
}

impl Refund {
    /// Against the payments API at `payments_url`.
    pub fn new(payments_url: Url) -> Self {
        let mut refunds = payments_url;
        refunds.set_path(&format!("{}/refunds", refunds.path().trim_end_matches('/')));
        Self { refunds }
    }

    /// The outbound client: only origins the operator allowed (`AGENTQ_AGENT_HTTP_ALLOW`),
    /// checked here and again on the connection's address.
    fn client(&self, cx: &ToolContext<'_>) -> Result<outbound::Client, JobError> {
        cx.http_allow().check(&self.refunds).map_err(|why| {
            JobError::NonRetryable(format!(
                "the payments API {} is not allowed: {why}; add its origin to \
                 AGENTQ_AGENT_HTTP_ALLOW, then `agentq dlq retry` this operation",
                self.refunds
            ))
        })?;
        outbound::Client::new(Duration::from_secs(10), None)
            .map_err(|e| JobError::no_effect(format!("http client: {e}")))
    }
}

/// How a failed request fails the step: no connection means nothing was sent; a refusal that
/// cannot change is for good; anything else may have reached the API (unknown: reconciled).
fn request_error(what: &str, e: outbound::Error) -> JobError {
    match e {
        outbound::Error::Refused(why) | outbound::Error::UnapprovedPeer(why) => {
            JobError::NonRetryable(format!("{what} refused: {why}"))
        }
        outbound::Error::Http(e) if e.is_connect() => {
            JobError::no_effect(format!("{what}: the payments API could not be reached"))
        }
        outbound::Error::Http(_) => JobError::retryable(format!("{what}: no answer")),
    }
}

#[async_trait]
impl TypedTool for Refund {
    const NAME: &str = "refund";
    const DESCRIPTION: &str =
        "Refund an order, in cents. Only for an order lookup_order found, at most its total.";
    const REPLAY: Replay = Replay::Unsafe;
    type Args = RefundArgs;
    type Output = Refunded;

    async fn call(&self, cx: &ToolContext<'_>, args: RefundArgs) -> Result<Refunded, JobError> {
        let client = self.client(cx)?;
        let request = client
            .post(self.refunds.clone())
            .header("Idempotency-Key", cx.idempotency_key())
            .json(&serde_json::json!({
                "tenant": cx.info().tenant,
                "order_id": args.order_id,
                "cents": args.cents,
                "reason": args.reason,
            }));
        let answer = client
            .send(request)
            .await
            .map_err(|e| request_error("refund", e))?;
        match answer.status() {
            s if s.is_success() => answer
                .json::<Refunded>()
                .await
                .map_err(|e| JobError::retryable(format!("refund: unreadable answer: {e}"))),
            // Refused before acting: the next attempt may send it again.
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                Err(JobError::no_effect(format!(
                    "refund: the payments API answered {}",
                    answer.status()
                )))
            }
            s if s.is_client_error() => Err(JobError::NonRetryable(format!(
                "refund: the payments API refused it ({s})"
            ))),
            s => Err(JobError::retryable(format!(
                "refund: the payments API answered {s}"
            ))),
        }
    }

    async fn reconcile(
        &self,
        cx: &ToolContext<'_>,
        _args: RefundArgs,
    ) -> Result<Reconciled<Refunded>, JobError> {
        let client = self.client(cx)?;
        let mut url = self.refunds.clone();
        url.query_pairs_mut()
            .append_pair("idempotency_key", cx.idempotency_key());
        let answer = client
            .send(client.get(url))
            .await
            .map_err(|e| request_error("asking whether the refund happened", e))?;
        match answer.status() {
            StatusCode::NOT_FOUND => Ok(Reconciled::NotHappened),
            s if s.is_success() => {
                let refunded: Refunded = answer.json().await.map_err(|e| {
                    JobError::retryable(format!("reconcile: unreadable answer: {e}"))
                })?;
                Ok(Reconciled::Happened(refunded))
            }
            s => Err(JobError::retryable(format!(
                "asking whether the refund happened: the payments API answered {s}"
            ))),
        }
    }
}
