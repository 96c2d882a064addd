//! Consuming pointers: manual acks, explicit `basic_qos` per lane. A delivery is acked right
//! after its claim commits (or once it is known to be a duplicate), never held for a job.

use futures_util::StreamExt;
use lapin::Connection;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};

use super::{Names, Result};
use crate::operation::Lane;

/// A stream of deliveries from one lane's queue, on a channel of its own.
pub struct Consumer {
    inner: lapin::Consumer,
    channel: lapin::Channel,
}

impl Consumer {
    /// Starts consuming `lane` with at most `prefetch` unacknowledged deliveries.
    pub async fn open(
        conn: &Connection,
        names: &Names,
        lane: Lane,
        prefetch: u16,
        tag: &str,
    ) -> Result<Self> {
        Self::open_queue(conn, &names.lane_queue(lane), prefetch, tag).await
    }

    /// Starts consuming the namespace's broker dead-letter queue (`<ns>.dlq`).
    pub async fn open_dead_letters(
        conn: &Connection,
        names: &Names,
        prefetch: u16,
        tag: &str,
    ) -> Result<Self> {
        Self::open_queue(conn, &names.dead_letter_queue(), prefetch, tag).await
    }

    async fn open_queue(conn: &Connection, queue: &str, prefetch: u16, tag: &str) -> Result<Self> {
        let channel = conn.create_channel().await?;
        channel
            .basic_qos(prefetch, BasicQosOptions { global: false })
            .await?;
        let inner = channel
            .basic_consume(
                queue.into(),
                tag.into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Self { inner, channel })
    }

    /// The next delivery; `None` when the consumer was cancelled or the channel closed.
    pub async fn next(&mut self) -> Option<Result<Delivery>> {
        self.inner
            .next()
            .await
            .map(|r| r.map(Delivery).map_err(Into::into))
    }

    /// The next delivery if one is already buffered, without waiting.
    pub fn try_next(&mut self) -> Option<Result<Delivery>> {
        use futures_util::FutureExt;
        self.next().now_or_never().flatten()
    }

    /// Closes the channel; the broker requeues whatever was not acknowledged.
    pub async fn close(self) -> Result<()> {
        if self.channel.status().connected() {
            self.channel.close(200, "consumer closed".into()).await?;
        }
        Ok(())
    }
}

/// One message from a lane's queue.
pub struct Delivery(lapin::message::Delivery);

impl Delivery {
    /// The message body.
    pub fn body(&self) -> &[u8] {
        &self.0.data
    }

    /// Whether the broker delivered this message before (to this or another consumer).
    pub fn redelivered(&self) -> bool {
        self.0.redelivered
    }

    /// Deliveries of this message so far, as counted by a quorum queue (`x-delivery-count`).
    pub fn delivery_count(&self) -> i64 {
        let Some(headers) = self.0.properties.headers() else {
            return 0;
        };
        match headers.inner().get("x-delivery-count") {
            Some(AMQPValue::LongLongInt(n)) => *n,
            Some(AMQPValue::LongInt(n)) => i64::from(*n),
            Some(AMQPValue::ShortInt(n)) => i64::from(*n),
            _ => 0,
        }
    }

    /// Why and where the broker dead-lettered this message (`x-first-death-reason` such as
    /// `rejected` or `delivery_limit`, and `x-first-death-queue`), for messages from the DLQ.
    pub fn death(&self) -> (String, String) {
        let text = |key: &str| -> String {
            let Some(headers) = self.0.properties.headers() else {
                return "unknown".into();
            };
            match headers.inner().get(key) {
                Some(AMQPValue::LongString(s)) => {
                    String::from_utf8_lossy(s.as_bytes()).into_owned()
                }
                Some(AMQPValue::ShortString(s)) => s.as_str().to_string(),
                _ => "unknown".into(),
            }
        };
        (text("x-first-death-reason"), text("x-first-death-queue"))
    }

    /// Done with it: claimed, or known to change nothing.
    pub async fn ack(&self) -> Result<()> {
        self.0.acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }

    /// Acks this delivery and every earlier unsettled one on its channel (`multiple`): one
    /// frame for a whole claimed batch.
    pub async fn ack_through(&self) -> Result<()> {
        self.0.acker.ack(BasicAckOptions { multiple: true }).await?;
        Ok(())
    }

    /// Poison: dead-letter it through the DLX, never requeue.
    pub async fn reject(&self) -> Result<()> {
        self.0
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await?;
        Ok(())
    }

    /// Not processed (shutting down): put it back for another worker.
    pub async fn requeue(&self) -> Result<()> {
        self.0
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                multiple: false,
            })
            .await?;
        Ok(())
    }
}
