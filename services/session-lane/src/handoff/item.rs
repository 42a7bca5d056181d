//! Holding and refusing a lane item, shared by every item kind: give it back unacked when
//! this replica stops (so the next holder continues it), or dead-letter it with the reason
//! when it cannot be taken (R15).

use async_nats::jetstream::{self, AckKind};
use serde_json::json;
use turnstile_shared::deadletter;
use turnstile_shared::events::{session_event, EventKind};
use turnstile_shared::records::SessionRecord;
use turnstile_shared::subjects;

use crate::ctx::Ctx;

/// Removes an item its kind is done with from the lane stream, once the server has confirmed
/// its ack. Only then: the server handles the removal of an item its consumer still has
/// pending badly (nats-server 2.15: the lane's next item then waited up to the ack wait for
/// about half of such removals; an unconfirmed ack with the removal right behind it on the
/// same connection still lost that race under load). Right after: an ack lives in the
/// consumer's state, which the server writes to disk a while after taking it, so an ack taken
/// just before the server is killed can be lost, and the recovered consumer holds the item for
/// the ack wait; the removal is on disk with the stream, and a recovered consumer lets go of a
/// removed item. Together they do what a work-queue ack does in one step.
pub(crate) async fn remove_item(ctx: &Ctx, session: &SessionRecord, msg: &jetstream::Message) {
    let Ok(info) = msg.info() else {
        return;
    };
    let seq = info.stream_sequence;
    if let Err(e) = turnstile_shared::lane::send_removal(&ctx.client, seq).await {
        tracing::debug!(session = %session.id, seq, error = %e, "remove a done lane item; its session's stop takes it");
    }
}

/// Deliveries of an item after which an ack that is still not confirmed no longer holds its
/// removal back.
const REMOVE_UNCONFIRMED_FROM: i64 = 3;

/// The lane is done with this item: acked (the ack confirmed, so whoever reads the lane next
/// sees it free), then removed. An unconfirmed ack leaves the item for its redelivery to ack
/// again; from its third delivery on, the item is removed all the same (its work is done): a
/// consumer whose acks keep going unanswered would otherwise hand the item out for ever and
/// serve nothing behind it, and a removal ahead of the ack costs at most one ack wait.
pub(crate) async fn acked(ctx: &Ctx, session: &SessionRecord, msg: &jetstream::Message) {
    match super::reconnect::double_ack(ctx, msg).await {
        Ok(()) => remove_item(ctx, session, msg).await,
        Err(e) => {
            let (seq, delivered) = msg
                .info()
                .map_or((0, 0), |i| (i.stream_sequence, i.delivered));
            // Never for an item this replica may have lost (`liveness::lease`).
            if delivered >= REMOVE_UNCONFIRMED_FROM && ctx.lease.held() {
                tracing::warn!(session = %session.id, seq, delivered, error = %e,
                    "ack lane item unconfirmed again; removed, its work being done");
                remove_item(ctx, session, msg).await;
            } else {
                tracing::warn!(session = %session.id, seq, delivered, error = %e,
                    "ack lane item unconfirmed; its redelivery acks it again");
            }
        }
    }
}

/// Gives a lane item back unacked (never once this replica is fenced). At process shutdown the nak waits until this replica's
/// connection is closed (so the item cannot come straight back to one of its pull requests);
/// otherwise (the session was stopped) it is sent at once.
pub(crate) async fn release(ctx: &Ctx, msg: &jetstream::Message) {
    if ctx.fenced.is_cancelled() || ctx.lease.hold().await.is_err() {
        // A survivor gave it back already and may hold it now.
        return;
    }
    if ctx.shutdown.is_cancelled() {
        if let Some(reply) = &msg.reply {
            ctx.hand_back_item(reply.to_string());
            return;
        }
    }
    let _ = msg.ack_with(AckKind::Nak(None)).await;
}

/// Gives a lane item back for another try after `delay`, under this replica's lease (never
/// once it may have lost the lane: the survivor holds the item now).
pub(crate) async fn retry_later(ctx: &Ctx, msg: &jetstream::Message, delay: std::time::Duration) {
    if ctx.lease.hold().await.is_ok() {
        let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
    }
}

/// R15: a lane item this build cannot take goes to the dead-letter subject with the reason, an
/// event says so, and the lane moves on to the next item.
pub(crate) async fn reject(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    reason: &str,
) {
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
    let dlq = subjects::lane_deadletter(&session.id);
    let event = session_event(
        EventKind::LaneRejected,
        &session.id,
        None,
        &json!({ "reason": reason, "lane_seq": seq, "dead_letter": dlq }),
    )
    .map(|e| e.with_id(format!("{}:lane.rejected:{seq}", session.id)));
    // Removed once its termination is confirmed (a removal the server takes before the
    // termination holds the lane, see `remove_item`), as a done item is: an item left stored
    // past an idle lane's position is what the stranded sweep hands out again.
    match event {
        Ok(event) => {
            if deadletter::refuse(&ctx.js, msg, dlq, reason, &event).await
                == deadletter::Refused::Terminated
            {
                remove_item(ctx, session, msg).await;
            }
        }
        Err(e) => tracing::error!(session = %session.id, error = %e, "build lane.rejected"),
    }
}
