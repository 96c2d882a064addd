//! Publishing pointers: persistent, `mandatory`, each publish awaiting its own confirm so many
//! tasks publishing at once pipeline their confirms on one channel.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use super::{CALL_TIMEOUT, Error, Names, Result};
use crate::operation::{Lane, Pointer};
use crate::telemetry::TRACEPARENT;

/// A confirm-mode channel for publishing pointers of one namespace.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    names: Names,
}

impl Publisher {
    /// Opens a confirm-mode channel on `conn`.
    pub async fn open(conn: &Connection, names: Names) -> Result<Self> {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self { channel, names })
    }

    /// Whether the channel can still publish; a closed one must be replaced by a new `open`.
    pub fn is_usable(&self) -> bool {
        self.channel.status().connected()
    }

    /// Publishes a pointer to `lane` and waits for the broker's confirm.
    pub async fn publish(&self, pointer: &Pointer, lane: Lane) -> Result<()> {
        self.publish_traced(pointer, lane, None).await
    }

    /// Publishes a pointer with the W3C `traceparent` of the operation (if it has one) as an
    /// AMQP header, and waits for the broker's confirm.
    pub async fn publish_traced(
        &self,
        pointer: &Pointer,
        lane: Lane,
        traceparent: Option<&str>,
    ) -> Result<()> {
        let mut props = BasicProperties::default();
        if let Some(tp) = traceparent {
            let mut headers = FieldTable::default();
            headers.insert(TRACEPARENT.into(), AMQPValue::LongString(tp.into()));
            props = props.with_headers(headers);
        }
        self.send(&pointer.encode(), lane, &pointer.op_id.to_string(), props)
            .await
    }

    /// Publishes arbitrary bytes to `lane` (tests use it to send poison messages).
    pub async fn publish_raw(&self, body: &[u8], lane: Lane, message_id: &str) -> Result<()> {
        self.send(body, lane, message_id, BasicProperties::default())
            .await
    }

    async fn send(
        &self,
        body: &[u8],
        lane: Lane,
        message_id: &str,
        props: BasicProperties,
    ) -> Result<()> {
        let props = props
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(message_id.into());
        let send = async {
            let confirm = self
                .channel
                .basic_publish(
                    self.names.jobs_exchange().into(),
                    lane.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    body,
                    props,
                )
                .await?
                .await?;
            match confirm {
                Confirmation::Ack(None) => Ok(()),
                Confirmation::Ack(Some(returned)) => Err(Error::NotConfirmed(format!(
                    "unroutable ({}): is the topology of this namespace declared?",
                    returned.reply_text
                ))),
                Confirmation::Nack(_) => Err(Error::NotConfirmed(
                    "nacked (queue full or broker out of resources)".into(),
                )),
                Confirmation::NotRequested => Err(Error::NotConfirmed(
                    "publisher confirms are not enabled on this channel".into(),
                )),
            }
        };
        tokio::time::timeout(CALL_TIMEOUT, send)
            .await
            .map_err(|_| Error::Timeout(CALL_TIMEOUT))?
    }
}
