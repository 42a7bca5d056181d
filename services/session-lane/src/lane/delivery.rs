//! A `delivery` lane item (R3): once it holds the lane it takes every pending completion of
//! the session (up to [`DELIVERY_CAP`]), checks each is addressed to a session that owns or
//! watches it (R8), has what it carries recorded in its turn record, types them as ONE
//! message, and acks them only after that turn completed. A failed turn leaves them pending.

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
    DeliveryError, Watch,
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
    // A redelivered item finds the turn its earlier attempt's command had recorded (by the
    // transport, or by this lane failing a lapsed host) and finishes that one. A first
    // delivery cannot have one yet: only this attempt's command creates it (hot path: no
    // read).
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
    // The record this attempt's command asks the transport to write, if nobody wrote one.
    let mut unwritten = None;
    let (record, held) = match existing {
        Some(record) => {
            if !record.state.is_terminal() {
                if let Err(e) = dispatch(
                    ctx,
                    session,
                    &msg,
                    command_for(session, &record, false),
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
            let command = command_for(session, &record, true);
            if let Err(e) = dispatch(ctx, session, &msg, command, item_kind::DELIVERY).await {
                for h in &held {
                    let _ = h.ack_with(AckKind::Nak(None)).await;
                }
                return retry(DeliveryError::Nats(e)).await;
            }
            unwritten = Some(record.clone());
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
        let watch = Watch {
            host: &session.host,
            turn: &turn_id,
            unwritten: unwritten.as_ref(),
        };
        match wait_terminal(ctx, &msg, watch, waiter, cancel, &held).await {
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

/// A delivery turn's command: its record's text and carried list. On the item's first
/// attempt (`unrecorded`) the lane writes no record: the transport records the turn running,
/// carried list included, before it types anything (R14), and until then the stored command
/// holds the list durably. The turn is under way once the command is out; only a failed
/// dispatch retries the item. A redelivered item re-sends the record it found, without a
/// revision to spare: the transport reads it.
fn command_for(session: &SessionRecord, record: &TurnRecord, unrecorded: bool) -> TurnCommand {
    TurnCommand {
        session: session.id.clone(),
        turn: record.id.clone(),
        text: record.text.clone(),
        delivery: record.delivery.clone(),
        known: None,
        unrecorded,
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
