//! What one collect took from a session's pending completions, before the registry's check:
//! what the lane's standby held and a fetch, then whatever the wait for the completion that
//! armed a delivery adds. One message per execution (a redelivery replaces its earlier copy,
//! another stored message of the same end is terminated, R14); a copy of a completion this
//! replica handed over is terminated; anything not a completion for this session is refused
//! to the dead-letter subject (R8).

use async_nats::jetstream::{self, AckKind};
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use turnstile_shared::delivery::{Completion, COMPLETION_KIND, DELIVERY_CAP};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{session_event, EventKind};
use turnstile_shared::records::SessionRecord;
use turnstile_shared::{deadletter, subjects, ExecutionId, SessionId};

use super::error::DeliveryError;
use crate::ctx::Ctx;

/// A pending completion pulled for a turn: its message, its stream sequence and what it
/// says.
pub(super) struct Fetched {
    pub(super) msg: jetstream::Message,
    pub(super) seq: u64,
    pub(super) completion: Completion,
}

/// The completions one collect took, in the order taken.
#[derive(Default)]
pub(super) struct Batch {
    items: Vec<Fetched>,
}

impl Batch {
    /// Pulls up to the cap of pending completions: what this lane's standby holds, and, unless
    /// it is still out, a fetch. Those that are not completions for this session (undecodable,
    /// another kind, another session's) are refused here (R8); the rest still need their
    /// registry check (`admit`).
    pub(super) async fn fetch(ctx: &Ctx, session: &SessionRecord) -> Result<Self, DeliveryError> {
        let mut fetched = Self::default();
        if let Some(held) = ctx.standbys.take(&session.id).await {
            for msg in held.messages {
                fetched.take_in(ctx, &session.id, msg).await;
            }
            if held.open {
                return Ok(fetched);
            }
        }
        let consumer = ctx.completion_consumer(&session.id).await?;
        let fetch_err = |e: async_nats::Error| DeliveryError::Fetch {
            session: session.id.clone(),
            source: e,
        };
        let batch = consumer
            .fetch()
            .max_messages(DELIVERY_CAP.saturating_sub(fetched.items.len()).max(1))
            .messages()
            .await
            .map_err(|e| fetch_err(e.into()))?;
        let mut taken = Vec::new();
        let drained = drain(batch, FETCH_BOUND, &mut taken).await;
        for msg in taken {
            fetched.take_in(ctx, &session.id, msg).await;
        }
        match drained {
            Drained::Ended => {}
            Drained::Failed(e) => return Err(fetch_err(e)),
            Drained::Unanswered => {
                tracing::warn!(session = %session.id, taken = fetched.items.len(), "a completion fetch got no end from the server within {FETCH_BOUND:?}; going on with what came, and arming a delivery for the rest once their ack wait has run out");
                rearm_after(ctx, &session.id);
            }
        }
        Ok(fetched)
    }

    /// Adds a pulled message to what a delivery took, or refuses it (R8). A redelivery of one
    /// taken already replaces it (its earlier delivery's ack would be void).
    pub(super) async fn take_in(
        &mut self,
        ctx: &Ctx,
        session: &SessionId,
        msg: jetstream::Message,
    ) {
        let fetched = &mut self.items;
        let (seq, delivered) = msg
            .info()
            .map(|i| (i.stream_sequence, i.consumer_sequence))
            .unwrap_or_default();
        ctx.standbys.seen(session, delivered);
        match decode(session, &msg) {
            Ok(completion)
                if ctx
                    .handed_over
                    .knows(&(session.clone(), completion.execution.clone())) =>
            {
                // A copy of a completion a completed turn carried: its ack or removal had not
                // landed when this copy was handed out (or a standby held it). Never typed again.
                tracing::info!(%session, execution = %completion.execution, "a completion handed over already came back; dropped");
                let _ = msg.ack_with(AckKind::Term).await;
            }
            Ok(completion)
                if fetched
                    .iter()
                    .any(|f| f.seq != seq && f.completion.execution == completion.execution) =>
            {
                // Another stored message of the same end (its report stored twice, e.g. across a
                // store restart): this delivery carries the one it took first (R14).
                tracing::info!(%session, execution = %completion.execution, seq, "a second message of a completion this delivery holds; dropped");
                let _ = msg.ack_with(AckKind::Term).await;
            }
            Ok(completion) => {
                fetched.retain(|f| f.seq != seq);
                fetched.push(Fetched {
                    msg,
                    seq,
                    completion,
                });
            }
            Err(reason) => reject(ctx, session, &msg, &reason).await,
        }
    }

    /// Whether it holds `execution`'s completion.
    pub(super) fn holds(&self, execution: &ExecutionId) -> bool {
        self.items
            .iter()
            .any(|f| f.completion.execution == *execution)
    }

    /// Whether it holds as many as one turn carries.
    pub(super) fn is_full(&self) -> bool {
        self.items.len() >= DELIVERY_CAP
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &Fetched> {
        self.items.iter()
    }

    pub(super) fn into_items(self) -> Vec<Fetched> {
        self.items
    }
}

/// A completion message addressed to this session, or why it is not one.
fn decode(session: &SessionId, m: &jetstream::Message) -> Result<Completion, String> {
    let env = Envelope::decode(&m.payload).map_err(|e| e.to_string())?;
    env.expect_kind(COMPLETION_KIND)
        .map_err(|e| e.to_string())?;
    if env.session.as_ref() != Some(session) {
        return Err(format!(
            "completion names session {:?}, not {session}",
            env.session.map(|s| s.to_string())
        ));
    }
    env.data_as().map_err(|e| e.to_string())
}

/// R8 refusal: dead-lettered with the reason and recorded as `completion.rejected`.
pub(super) async fn reject(ctx: &Ctx, session: &SessionId, m: &jetstream::Message, reason: &str) {
    let seq = m.info().map(|i| i.stream_sequence).unwrap_or_default();
    let dlq = subjects::completion_deadletter(session);
    let ev = session_event(
        EventKind::CompletionRejected,
        session,
        None,
        &json!({ "reason": reason, "subject": m.subject.as_str(), "seq": seq, "dead_letter": dlq }),
    )
    .map(|e| e.with_id(format!("{session}:completion.rejected:{seq}")));
    match ev {
        Ok(ev) => {
            deadletter::refuse(&ctx.js, m, dlq, reason, &ev).await;
        }
        Err(e) => tracing::error!(error = %e, "build completion.rejected"),
    }
}

/// A fetch cut off at its bound may still have been served, after the bound, to the inbox it
/// no longer reads (a paused leader resumed): those completions come back once their ack
/// wait runs out, and nothing counts them as pending now. So a delivery is armed for the
/// session then; one that finds nothing clears its marker.
fn rearm_after(ctx: &Ctx, session: &SessionId) {
    let (js, deliveries, session) = (
        ctx.js.clone(),
        ctx.buckets.deliveries.clone(),
        session.clone(),
    );
    let wait = ctx.topology.lane_ack_wait + Duration::from_secs(1);
    tokio::spawn(async move {
        tokio::time::sleep(wait).await;
        if let Err(e) = turnstile_shared::arming::arm(&js, &deliveries, &session).await {
            tracing::warn!(%session, error = %e, "arm a delivery for completions a cut-off fetch may have left");
        }
    });
}

/// How long a fetch's reply may take. The server answers a fetch at once (it does not wait
/// for messages), so this is only reached when the request or its end was lost: the consumer's
/// leader killed, paused or cut off mid-request. The client library sets no timer for a fetch
/// without an expiry, and without this bound the delivery (and its lane) waited for ever.
pub(crate) const FETCH_BOUND: Duration = Duration::from_secs(10);

/// How a fetch's stream ended.
#[derive(Debug)]
pub(crate) enum Drained {
    /// The server ended it (no more messages, or the batch is full).
    Ended,
    /// A message could not be received.
    Failed(async_nats::Error),
    /// No end within the bound: what came is kept.
    Unanswered,
}

/// Takes a fetch's messages into `taken` until the server ends it, bounded by `bound`.
pub(crate) async fn drain<S>(
    batch: S,
    bound: Duration,
    taken: &mut Vec<jetstream::Message>,
) -> Drained
where
    S: futures::Stream<Item = Result<jetstream::Message, async_nats::Error>>,
{
    let mut batch = std::pin::pin!(batch);
    let all = async {
        while let Some(m) = batch.next().await {
            match m {
                Ok(msg) => taken.push(msg),
                Err(e) => return Drained::Failed(e),
            }
        }
        Drained::Ended
    };
    tokio::time::timeout(bound, all)
        .await
        .unwrap_or(Drained::Unanswered)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use async_nats::jetstream::{consumer, stream};

    use super::*;

    /// A fetch whose server does not answer (paused as the request goes out) ends at the
    /// bound, keeping what came; the same fetch answered ends at once with the messages.
    #[tokio::test]
    async fn a_fetch_nobody_answers_ends_at_the_bound() -> anyhow::Result<()> {
        let server = turnstile_tests::NatsServer::start().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        let s = js
            .create_stream(stream::Config {
                name: "FETCH".into(),
                subjects: vec!["fetch.>".into()],
                ..Default::default()
            })
            .await?;
        let c: consumer::PullConsumer = s
            .create_consumer(consumer::pull::Config {
                durable_name: Some("f".into()),
                ..Default::default()
            })
            .await?;
        js.publish("fetch.x", "one".into()).await?.await?;
        // Answered: each fetch ends at once (a loaded server may answer the first before its
        // consumer counts the message: fetched again until it comes, bounded).
        turnstile_tests::wait_until("the message fetched", Duration::from_secs(10), || {
            let c = c.clone();
            async move {
                let mut taken = Vec::new();
                let answered = drain(
                    c.fetch().max_messages(5).messages().await?,
                    Duration::from_secs(5),
                    &mut taken,
                )
                .await;
                anyhow::ensure!(matches!(answered, Drained::Ended), "{answered:?}");
                Ok((taken.len() == 1).then_some(()))
            }
        })
        .await?;

        server.pause()?;
        let mut taken = Vec::new();
        let started = tokio::time::Instant::now();
        let fetch = async {
            match c.fetch().max_messages(5).messages().await {
                Ok(batch) => drain(batch, Duration::from_millis(500), &mut taken).await,
                Err(e) => Drained::Failed(e.into()),
            }
        };
        // The client library alone would wait here for ever (no timer on a fetch without an
        // expiry): the outer bound turns that into a failure.
        let unanswered = tokio::time::timeout(Duration::from_secs(5), fetch).await;
        server.resume()?;
        let unanswered =
            unanswered.map_err(|_| anyhow::anyhow!("the fetch waited past its bound"))?;
        assert!(matches!(unanswered, Drained::Unanswered), "{unanswered:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(taken.is_empty());
        Ok(())
    }
}
