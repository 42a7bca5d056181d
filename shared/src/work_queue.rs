//! What a work-queue stream still holds for its consumer: the messages stored on a subject past
//! the consumer's ack floor. A work queue removes a message once it is acked, so these are
//! exactly the work not yet done or being done. The backstops for lost work look here before
//! they publish a message again (the broker's queued steps, the lanes' turn commands).

use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::stream::DirectGetErrorKind;
use async_nats::jetstream::{self, stream::Stream};

use crate::envelope::Envelope;

#[derive(Debug, thiserror::Error)]
pub enum HoldsError {
    #[error("read stream {stream}: {source}")]
    Stream {
        stream: String,
        source: async_nats::Error,
    },
    #[error("read consumer {consumer} of {stream}: {source}")]
    Consumer {
        stream: String,
        consumer: String,
        source: async_nats::Error,
    },
    #[error("read {subject} on {stream}: {source}")]
    Read {
        stream: String,
        subject: String,
        source: async_nats::Error,
    },
}

/// Whether a message on `subject` that `is` picks out is stored on `stream` past `consumer`'s
/// ack floor (with no such consumer, everything stored counts). Reads at most `scan` messages;
/// past that the answer is yes (a queue that long is being served, or waits for its workers).
/// A message that is not an envelope is passed over.
pub async fn holds(
    js: &jetstream::Context,
    stream: &str,
    consumer: &str,
    subject: &str,
    scan: usize,
    is: impl Fn(&Envelope) -> bool,
) -> Result<bool, HoldsError> {
    let handle: Stream<()> =
        js.get_stream_no_info(stream)
            .await
            .map_err(|e| HoldsError::Stream {
                stream: stream.to_string(),
                source: e.into(),
            })?;
    let mut seq = match handle.consumer_info(consumer).await {
        Ok(info) => info.ack_floor.stream_sequence + 1,
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => 1,
        Err(e) => {
            return Err(HoldsError::Consumer {
                stream: stream.to_string(),
                consumer: consumer.to_string(),
                source: e.into(),
            })
        }
    };
    for _ in 0..scan {
        let msg = match handle.direct_get_next_for_subject(subject, Some(seq)).await {
            Ok(m) => m,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(false),
            Err(e) => {
                return Err(HoldsError::Read {
                    stream: stream.to_string(),
                    subject: subject.to_string(),
                    source: e.into(),
                })
            }
        };
        seq = msg.sequence + 1;
        if Envelope::decode(&msg.payload).is_ok_and(|env| is(&env)) {
            return Ok(true);
        }
    }
    Ok(true)
}
