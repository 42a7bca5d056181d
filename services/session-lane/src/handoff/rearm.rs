//! Arming a delivery from the lane's side: after a delivery left completions pending (beyond
//! its cap, stored while its marker was set, or waiting for their end), and after a turn ends
//! on a lane whose last delivery failed. The broker arms the rest, as it routes each end.

use async_nats::jetstream;
use serde_json::json;
use turnstile_shared::arming::ArmError;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::kv::Bucket;
use turnstile_shared::{subjects, DeliveryId, ExecutionId, SessionId};

use crate::ctx::Ctx;

pub(super) async fn arm(ctx: &Ctx, session: &SessionId, first: Option<&ExecutionId>) {
    logged(
        session,
        arm_with(&ctx.js, &ctx.buckets.deliveries, session, first).await,
    );
}

/// Arms a delivery for completions the sweep found waiting on an idle lane with none on its
/// way (`crate::sweep`). `Ok(Some)`: the delivery armed; `Ok(None)`: one is on its way
/// already (a young marker, or its item on the lane).
pub(crate) async fn arm_for_waiting(
    ctx: &Ctx,
    session: &SessionId,
) -> Result<Option<DeliveryId>, ArmError> {
    arm_with(&ctx.js, &ctx.buckets.deliveries, session, None).await
}

/// A failed arm is logged; the next turn end or sweep arms again.
fn logged(session: &SessionId, armed: Result<Option<DeliveryId>, ArmError>) {
    if let Err(e) = armed {
        tracing::warn!(%session, error = %e, "arm delivery");
    }
}

async fn arm_with(
    js: &jetstream::Context,
    deliveries: &Bucket,
    session: &SessionId,
    first: Option<&ExecutionId>,
) -> Result<Option<DeliveryId>, ArmError> {
    let armed = turnstile_shared::arming::arm_naming(js, deliveries, session, first).await?;
    if let Some(d) = &armed {
        // The event is for readers of the session's history; the delivery does not need it.
        let announced = match session_event(
            EventKind::DeliveryQueued,
            session,
            None,
            &json!({ "delivery": d }),
        ) {
            Ok(ev) => events::publish(js, &ev.with_id(format!("{d}:queued")))
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = announced {
            tracing::debug!(%session, delivery = %d, error = %e, "announce a delivery armed");
        }
    }
    Ok(armed)
}

/// Arms a delivery if completions wait without one: after a turn ends on a lane whose last
/// delivery failed, and once when a lane worker starts (a failure seen by another replica).
/// Off the hand-off path: spawned.
pub(crate) fn rearm_if_pending(ctx: &Ctx, session: &SessionId) {
    let js = ctx.js.clone();
    let deliveries = ctx.buckets.deliveries.clone();
    let session = session.clone();
    tokio::spawn(async move {
        let Ok(stream) = js.get_stream_no_info(subjects::COMPLETION_STREAM).await else {
            return;
        };
        if pending_completions(&stream, &session).await.unwrap_or(0) > 0 {
            logged(&session, arm_with(&js, &deliveries, &session, None).await);
        }
    });
}

/// A session's completions not handed over yet, as its completion consumer counts them: still
/// to deliver plus held unacked (an acked copy the store failed to remove is neither). `None`
/// when the consumer cannot be read (not made yet, or the store unreachable). The one
/// definition `session show` and the re-arm both use.
pub(crate) async fn pending_completions(
    stream: &jetstream::stream::Stream<()>,
    session: &SessionId,
) -> Option<u64> {
    let info = stream
        .consumer_info(subjects::completion_consumer(session))
        .await
        .ok()?;
    Some(info.num_pending + info.num_ack_pending as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::consumer::{pull, AckPolicy};
    use futures::StreamExt;
    use std::time::Duration;
    use turnstile_shared::StepId;

    /// A hand-over's completion acked but left on the stream (its removal refused by a full
    /// disk, found by the fault campaign as `pending 1` for ever) is not pending: the count is
    /// the consumer's (still to deliver plus held unacked), not what is stored.
    #[tokio::test]
    async fn an_acked_completion_left_stored_is_not_pending() -> anyhow::Result<()> {
        let server = turnstile_tests::NatsServer::start().await?;
        let js = jetstream::new(server.client().await?);
        let stream = js
            .create_stream(jetstream::stream::Config {
                name: subjects::COMPLETION_STREAM.into(),
                subjects: vec![subjects::COMPLETION_ALL.into()],
                ..Default::default()
            })
            .await?;
        let session = SessionId::new();
        for _ in 0..3 {
            let step = ExecutionId::from(&StepId::new());
            js.publish(subjects::completion(&session, &step), "done".into())
                .await?
                .await?;
        }
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(subjects::completion_consumer(&session)),
                filter_subject: subjects::completion_session_all(&session),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            })
            .await?;
        let stream = js.get_stream_no_info(subjects::COMPLETION_STREAM).await?;
        assert_eq!(pending_completions(&stream, &session).await, Some(3));
        // One handed over and acked, its removal lost; one held unacked; one not fetched.
        let mut batch = consumer
            .fetch()
            .max_messages(2)
            .expires(Duration::from_secs(5))
            .messages()
            .await?;
        let acked = batch
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("no completion handed out"))?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        acked
            .double_ack()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let _held = batch
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("a second completion"))?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(
            pending_completions(&stream, &session).await,
            Some(2),
            "three stored, one of them acked: two pending (one held, one to deliver)"
        );
        Ok(())
    }
}
