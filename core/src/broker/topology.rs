//! Names and declaration of the exchanges and queues. Declaration is idempotent;
//! every queue argument is set explicitly so RabbitMQ 3.10 and 4.x behave the same.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ExchangeKind};

use super::{DELIVERY_LIMIT, Result};
use crate::operation::Lane;

/// The names of one namespace's exchanges and queues.
#[derive(Clone, Debug)]
pub struct Names {
    ns: String,
}

impl Names {
    /// Names under `namespace` (validated by the caller's config).
    pub fn new(namespace: &str) -> Self {
        Self {
            ns: namespace.to_string(),
        }
    }

    /// Direct exchange that routes pointers to a lane's queue by routing key = lane name.
    pub fn jobs_exchange(&self) -> String {
        format!("{}.jobs", self.ns)
    }

    /// The quorum queue of a lane.
    pub fn lane_queue(&self, lane: Lane) -> String {
        format!("{}.jobs.{}", self.ns, lane.as_str())
    }

    /// Fanout exchange that receives the broker's dead letters.
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.ns)
    }

    /// Queue of broker dead letters (poison messages, delivery limit), drained by the scheduler.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.ns)
    }
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Declares quorum queue `name` with `args` unless it exists with other arguments. RabbitMQ
/// refuses a declaration whose arguments differ from an existing queue's in any way, the
/// replica count included (given where the queue was created without one, or missing where it
/// was created with one): such a queue is left as it is, so setting `AGENTQ_QUORUM_SIZE` on a
/// running deployment, or processes that disagree about it, never stop a process. A new queue
/// gets the size this process declares with ([`super::set_quorum_size`]); `rabbitmq-queues
/// grow` changes an existing queue's members.
///
/// The declaration is an ordinary one, never a passive probe first: the broker answers a
/// passive declaration of a missing queue by closing the channel, which the client logs as an
/// error, and a first start would print one per queue although nothing is wrong. Only a queue
/// whose arguments differ from this process's (a deployment changing its quorum size) makes
/// the broker close the channel, logged with a warning saying so.
async fn declare_quorum_queue(conn: &Connection, name: &str, mut args: FieldTable) -> Result<()> {
    if let Some(size) = super::quorum_size() {
        args.insert(
            "x-quorum-initial-group-size".into(),
            AMQPValue::LongInt(size as i32),
        );
    }
    // A refused declaration closes its channel: a channel of its own.
    let ch = conn.create_channel().await?;
    match ch
        .queue_declare(name.into(), QueueDeclareOptions::durable(), args)
        .await
    {
        Ok(_) => {
            let _ = ch.close(200, "declared".into()).await;
            Ok(())
        }
        Err(e) if differs(&e) => {
            tracing::warn!(
                queue = name,
                "the queue exists with other arguments (another quorum size): left as it is"
            );
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether the broker refused a declaration because the queue exists with other arguments.
fn differs(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(p)
    if p.kind() == &lapin::protocol::AMQPErrorKind::Soft(
        lapin::protocol::AMQPSoftError::PRECONDITIONFAILED
    ))
}

/// Declares the exchanges, queues and bindings of a namespace. Safe to call at every start-up.
pub async fn declare_topology(conn: &Connection, names: &Names) -> Result<()> {
    let ch = conn.create_channel().await?;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    ch.exchange_declare(
        names.jobs_exchange().into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    )
    .await?;
    ch.exchange_declare(
        names.dead_letter_exchange().into(),
        ExchangeKind::Fanout,
        durable,
        FieldTable::default(),
    )
    .await?;

    let mut dlq_args = FieldTable::default();
    dlq_args.insert("x-queue-type".into(), text("quorum"));
    declare_quorum_queue(conn, &names.dead_letter_queue(), dlq_args).await?;
    ch.queue_bind(
        names.dead_letter_queue().into(),
        names.dead_letter_exchange().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;

    for lane in Lane::ALL {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert(
            "x-dead-letter-exchange".into(),
            text(&names.dead_letter_exchange()),
        );
        // At-least-once dead-lettering needs reject-publish overflow (RabbitMQ >= 3.10).
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongInt(DELIVERY_LIMIT),
        );
        declare_quorum_queue(conn, &names.lane_queue(lane), args).await?;
        ch.queue_bind(
            names.lane_queue(lane).into(),
            names.jobs_exchange().into(),
            lane.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    ch.close(200, "topology declared".into()).await?;
    Ok(())
}

/// Deletes a namespace's queues and exchanges (tests and `agentq bench` clean up with it).
pub async fn delete_topology(conn: &Connection, names: &Names) -> Result<()> {
    let ch = conn.create_channel().await?;
    for lane in Lane::ALL {
        ch.queue_delete(names.lane_queue(lane).into(), QueueDeleteOptions::default())
            .await?;
    }
    ch.queue_delete(
        names.dead_letter_queue().into(),
        QueueDeleteOptions::default(),
    )
    .await?;
    ch.exchange_delete(
        names.jobs_exchange().into(),
        ExchangeDeleteOptions::default(),
    )
    .await?;
    ch.exchange_delete(
        names.dead_letter_exchange().into(),
        ExchangeDeleteOptions::default(),
    )
    .await?;
    ch.close(200, "topology deleted".into()).await?;
    Ok(())
}

/// Messages ready (not delivered to a consumer) in a lane's queue.
pub async fn queue_depth(conn: &Connection, names: &Names, lane: Lane) -> Result<u32> {
    let ch = conn.create_channel().await?;
    let q = ch
        .queue_declare(
            names.lane_queue(lane).into(),
            QueueDeclareOptions::durable().passive(),
            FieldTable::default(),
        )
        .await?;
    let depth = q.message_count();
    ch.close(200, "depth read".into()).await?;
    Ok(depth)
}

/// Drops every ready message of a lane's queue (operators recovering a broker; tests simulating
/// a broker that lost its messages). Postgres still has every operation.
pub async fn purge_lane(conn: &Connection, names: &Names, lane: Lane) -> Result<u32> {
    let ch = conn.create_channel().await?;
    let n = ch
        .queue_purge(names.lane_queue(lane).into(), QueuePurgeOptions::default())
        .await?;
    ch.close(200, "purged".into()).await?;
    Ok(n)
}
