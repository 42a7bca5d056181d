//! A `delivery` lane item (R3): once it holds the lane it takes every pending completion of
//! the session (up to [`DELIVERY_CAP`]), checks each is addressed to a session that owns or
//! watches it (R8), records what it carries in its turn record, types them as ONE message,
//! and acks them only after that turn completed. A failed turn leaves them pending.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use tokio_util::sync::CancellationToken;
use turnstile_shared::delivery::{self, Completion, DeliveryItem};
use turnstile_shared::records::{SessionRecord, TurnCommand, TurnRecord, TurnState};
use turnstile_shared::TurnId;

use crate::ctx::Ctx;
use crate::handoff::{
    collect_expecting, disarm_and_recheck, dispatch, finish, release, settle, wait_terminal,
    DeliveryError,
};
use turnstile_shared::metrics::item_kind;

pub(super) async fn run_delivery(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: jetstream::Message,
    item: DeliveryItem,
    cancel: &CancellationToken,
) {
    let turn_id = item.delivery.turn();
    let waiter = ctx.turns.wait(&turn_id);
    let retry = |e: DeliveryError| retry_later(&msg, session, &item, e);
    // A redelivered item finds the turn its earlier attempt recorded (it, or the transport
    // from its command) and finishes that one. A first delivery cannot have one yet: only
    // this attempt's write or its command creates it (hot path: no read).
    let first_delivery = msg.info().map(|i| i.delivered <= 1).unwrap_or(false);
    let existing = if first_delivery {
        None
    } else {
        match ctx.buckets.turns.get::<TurnRecord>(turn_id.as_str()).await {
            Ok(r) => r.map(|(r, _)| r),
            Err(e) => return retry(e.into()).await,
        }
    };
    // The completion that armed this delivery, left out at the cap before it was stored.
    let mut unseen = None;
    let (record, held) = match existing {
        Some(record) => {
            if !record.state.is_terminal() {
                if let Err(e) = dispatch(
                    ctx,
                    session,
                    &msg,
                    command_for(session, &record),
                    item_kind::DELIVERY,
                )
                .await
                {
                    return retry(DeliveryError::Nats(e)).await;
                }
            }
            (record, Vec::new())
        }
        None => {
            let taken = match collect_expecting(ctx, session, item.first.as_ref()).await {
                Ok(c) => c,
                Err(e) => return retry(e).await,
            };
            let (carried, held) = (taken.carried, taken.held);
            unseen = taken.unseen;
            if carried.is_empty() {
                // Nothing (left) to hand over: an earlier delivery took it all.
                if let Err(e) = disarm_and_recheck(ctx, &session.id, &item, unseen.as_ref()).await {
                    return retry(e).await;
                }
                let _ = msg.double_ack().await;
                return;
            }
            let record = carrying(session, &turn_id, &item, &carried);
            if let Err(e) = record_and_dispatch(ctx, session, &msg, &record).await {
                for h in &held {
                    let _ = h.ack_with(AckKind::Nak(None)).await;
                }
                return retry(e).await;
            }
            (record, held)
        }
    };
    let record = if record.state.is_terminal() {
        record
    } else {
        // Off the hand-off path, while the turn runs.
        if let Err(e) = disarm_and_recheck(ctx, &session.id, &item, unseen.as_ref()).await {
            tracing::warn!(session = %session.id, delivery = %item.delivery, error = %e, "clear delivery marker; a stale marker is re-armed by the next completion");
        }
        match wait_terminal(ctx, &msg, &session.host, &turn_id, waiter, cancel, &held).await {
            Some(r) => r,
            None => {
                for h in &held {
                    let _ = h.ack_with(AckKind::Nak(None)).await;
                }
                return release(ctx, &msg).await;
            }
        }
    };
    settle(ctx, session, &record, &held).await;
    finish(ctx, session, &msg, &record).await;
}

/// The delivery turn's record: the batch as one message, and what it carries.
fn carrying(
    session: &SessionRecord,
    turn_id: &TurnId,
    item: &DeliveryItem,
    carried: &[(Completion, u64)],
) -> TurnRecord {
    TurnRecord {
        id: turn_id.clone(),
        session: session.id.clone(),
        text: delivery::render_batch(&carried.iter().map(|(c, _)| c.clone()).collect::<Vec<_>>()),
        queued_at: Utc::now(),
        delivery: Some(delivery::carried(item.delivery.clone(), carried)),
        parent: None,
        state: TurnState::Queued,
    }
}

/// Writes the turn's record and dispatches it at once (one round trip, not two). What it
/// carries is durable before anything is typed either way (R14): the command carries the
/// list, and a transport that finds no record creates this same one before typing. So the
/// turn is under way once the command is out, whether or not this write succeeded (the
/// transport writes it then); only a failed dispatch retries the item, and its redelivery
/// finds the record if this write landed.
async fn record_and_dispatch(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    record: &TurnRecord,
) -> Result<(), DeliveryError> {
    // The dispatch is polled first, so its event and command are on the wire ahead of the
    // record's write.
    let (sent, created) = tokio::join!(
        dispatch(
            ctx,
            session,
            msg,
            command_for(session, record),
            item_kind::DELIVERY,
        ),
        ctx.buckets.turns.create(record.id.as_str(), record),
    );
    sent.map_err(DeliveryError::Nats)?;
    // Already there means the transport created it from the command: the same record.
    if let Err(e) = created {
        tracing::warn!(session = %session.id, turn = %record.id, error = %e, "record delivery turn; its transport records it from the command");
    }
    Ok(())
}

/// A delivery turn's command: its record's text and carried list. No revision: the record is
/// written beside the command (or, redelivered, read without one to spare), so the transport
/// reads or creates it.
fn command_for(session: &SessionRecord, record: &TurnRecord) -> TurnCommand {
    TurnCommand {
        session: session.id.clone(),
        turn: record.id.clone(),
        text: record.text.clone(),
        delivery: record.delivery.clone(),
        known: None,
    }
}

async fn retry_later(
    msg: &jetstream::Message,
    session: &SessionRecord,
    item: &DeliveryItem,
    e: DeliveryError,
) {
    tracing::warn!(session = %session.id, delivery = %item.delivery, error = %e, "delivery; retrying");
    let _ = msg
        .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
        .await;
}
