//! The broker dead-letter recorder: drains `<ns>.dlq` (messages workers rejected as undecodable
//! or pointing at no operation, and messages that hit the delivery limit), records each as a
//! `poison_message` dead letter with its raw bytes (capped) and the broker's reason, then acks
//! it. Recording comes before the ack, so a crash in between records it twice, never zero times.

use std::time::Duration;

use agentq_core::broker::{Consumer, Delivery, Names};
use agentq_core::db;
use agentq_core::dispatch::Dispatcher;
use agentq_core::operation::Pointer;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// Records broker dead letters until `shutdown`, reconnecting after broker failures.
pub(crate) async fn run(
    pool: PgPool,
    dispatcher: &Dispatcher,
    names: Names,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(200);
    while !shutdown.is_cancelled() {
        let opened = dispatcher
            .with_connection(async |conn| {
                Consumer::open_dead_letters(conn, &names, 64, "agentq-scheduler-dlq").await
            })
            .await;
        let mut consumer = match opened {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot consume the broker dead-letter queue; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => break,
                d = consumer.next() => d,
            };
            match next {
                Some(Ok(delivery)) => {
                    if let Err(e) = record(&pool, &delivery).await {
                        tracing::warn!(error = %e, "recording a broker dead letter failed; it stays queued");
                        let _ = delivery.requeue().await;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    } else if let Err(e) = delivery.ack().await {
                        tracing::warn!(error = %e, "acking a recorded broker dead letter failed");
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "broker dead-letter consumer failed; reconnecting");
                    break;
                }
                None => break,
            }
        }
        let _ = consumer.close().await;
    }
}

async fn record(pool: &PgPool, delivery: &Delivery) -> db::Result<()> {
    let (why, queue) = delivery.death();
    let body = delivery.body();
    let (what, pointer_to) = match Pointer::decode(body) {
        Ok(p) => (
            format!("a pointer to operation {}", p.op_id),
            Some(p.op_id.0),
        ),
        Err(e) => (format!("{} bytes that are {e}", body.len()), None),
    };
    let reason = format!("{why} from {queue}: {what}");
    let id = db::within(db::dead_letters::record_poison(
        pool, body, &reason, pointer_to,
    ))
    .await?;
    tracing::warn!(dead_letter = %id, %why, %queue, "recorded a poison message");
    Ok(())
}
