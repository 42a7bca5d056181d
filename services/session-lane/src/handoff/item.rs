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

/// Gives a lane item back unacked (never once this replica is fenced). At process shutdown the nak waits until this replica's
/// connection is closed (so the item cannot come straight back to one of its pull requests);
/// otherwise (the session was stopped) it is sent at once.
pub(crate) async fn release(ctx: &Ctx, msg: &jetstream::Message) {
    if ctx.fenced.is_cancelled() {
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
    match event {
        Ok(event) => deadletter::refuse(&ctx.js, msg, dlq, reason, &event).await,
        Err(e) => tracing::error!(session = %session.id, error = %e, "build lane.rejected"),
    }
}
