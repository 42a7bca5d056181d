//! R15 in one place: a message a service cannot take is kept on a dead-letter subject with the
//! reason in a header, an event says so, and the original is terminated so the service moves
//! on. If the dead letter cannot be stored, the original is retried rather than lost.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;

use crate::envelope::Envelope;
use crate::events;
use crate::subjects;

/// Dead-letters `msg` on `dlq` with `reason`, publishes `event`, then terminates `msg`.
pub async fn refuse(
    js: &jetstream::Context,
    msg: &jetstream::Message,
    dlq: String,
    reason: &str,
    event: &Envelope,
) {
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
    tracing::warn!(subject = %msg.subject, seq, reason, "refusing message");
    let mut headers = HeaderMap::new();
    headers.insert(
        subjects::REASON_HEADER,
        reason.replace(['\r', '\n'], " ").as_str(),
    );
    headers.insert("Nats-Msg-Id", format!("{}:{seq}", msg.subject).as_str());
    let stored = async {
        js.publish_with_headers(dlq, headers, msg.payload.clone())
            .await?
            .await?;
        events::publish(js, event).await?;
        Ok::<(), async_nats::Error>(())
    }
    .await;
    let ack = match stored {
        Ok(()) => AckKind::Term,
        Err(e) => {
            tracing::warn!(subject = %msg.subject, error = %e, "dead-letter failed; will retry");
            AckKind::Nak(Some(Duration::from_secs(1)))
        }
    };
    if let Err(e) = msg.ack_with(ack).await {
        tracing::warn!(subject = %msg.subject, error = %e, "ack refused message");
    }
}
