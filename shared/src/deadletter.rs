//! R15 in one place: a message a service cannot take is kept on a dead-letter subject with the
//! reason in a header, an event says so, and the original is terminated so the service moves
//! on. If the dead letter cannot be stored, the original is retried rather than lost.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;

use crate::envelope::Envelope;
use crate::events;
use crate::subjects;

/// How a refusal ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Dead-lettered, and the original's termination confirmed by the server: the caller may
    /// remove it from its stream.
    Terminated,
    /// Dead-lettered and terminated, the termination not confirmed: the original may come
    /// back once (and be refused again).
    Unconfirmed,
    /// The dead letter could not be stored: the original is given back to be tried again.
    Retried,
}

/// Dead-letters `msg` on `dlq` with `reason`, publishes `event`, then terminates `msg`.
pub async fn refuse(
    js: &jetstream::Context,
    msg: &jetstream::Message,
    dlq: String,
    reason: &str,
    event: &Envelope,
) -> Refused {
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
    if let Err(e) = stored {
        tracing::warn!(subject = %msg.subject, error = %e, "dead-letter failed; will retry");
        if let Err(e) = msg
            .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
            .await
        {
            tracing::warn!(subject = %msg.subject, error = %e, "give back a message to refuse again");
        }
        return Refused::Retried;
    }
    match msg.double_ack_with(AckKind::Term).await {
        Ok(()) => Refused::Terminated,
        Err(e) => {
            tracing::warn!(subject = %msg.subject, error = %e, "terminate refused message; unconfirmed");
            Refused::Unconfirmed
        }
    }
}
