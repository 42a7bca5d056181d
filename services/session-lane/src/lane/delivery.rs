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
    acked, collect_expecting, disarm_and_recheck, dispatch, finish, keep_standby, release, settle,
    wait_terminal, DeliveryError, Expected, Watch,
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
    // The command this attempt sent, sent again if it is lost (`lost_command`).
    let mut sent = None;
    let (record, held) = match existing {
        Some(record) => {
            if !record.state.is_terminal() {
                match dispatch(
                    ctx,
                    session,
                    &msg,
                    command_for(session, &record, false),
                    item_kind::DELIVERY,
                )
                .await
                {
                    Ok(command) => sent = Some(command),
                    Err(e) => return retry(DeliveryError::Nats(e)).await,
                }
            }
            (record, Vec::new())
        }
        None => {
            let taken = match collect_expecting(ctx, session, Expected::of(&item)).await {
                Ok(c) => c,
                Err(e) => return retry(e).await,
            };
            let (carried, held) = (taken.carried, taken.held);
            unseen = taken.unseen;
            if carried.is_empty() {
                // Nothing (left) to hand over: an earlier delivery took it all. Or, redelivered
                // with no record, what this item's earlier attempt took is still held by its
                // dead replica, and that attempt's command may still be typed: see `supersede`.
                if !first_delivery {
                    if let Err(e) = supersede(ctx, session, &turn_id).await {
                        return retry(e).await;
                    }
                }
                if let Err(e) = disarm_and_recheck(ctx, &session.id, &item, unseen.as_ref()).await {
                    return retry(e).await;
                }
                return acked(ctx, session, &msg).await;
            }
            let record = carrying(session, &turn_id, &item, &carried);
            let command = command_for(session, &record, true);
            match dispatch(ctx, session, &msg, command, item_kind::DELIVERY).await {
                Ok(command) => sent = Some(command),
                Err(e) => {
                    for h in &held {
                        let _ = h.ack_with(AckKind::Nak(None)).await;
                    }
                    return retry(DeliveryError::Nats(e)).await;
                }
            }
            backstop_record(ctx, &record, waiter.rx.clone());
            unwritten = Some(record.clone());
            (record, held)
        }
    };
    let record = if record.state.is_terminal() {
        // Redelivered after its turn ended: the marker may not have been cleared.
        if let Err(e) = disarm_and_recheck(ctx, &session.id, &item, None).await {
            tracing::warn!(session = %session.id, delivery = %item.delivery, error = %e, "clear delivery marker; a stale marker is cleared by the next completion");
        }
        record
    } else {
        // Off the hand-off path, while the turn runs.
        if let Err(e) = disarm_and_recheck(ctx, &session.id, &item, unseen.as_ref()).await {
            tracing::warn!(session = %session.id, delivery = %item.delivery, error = %e, "clear delivery marker; a stale marker is re-armed by the next completion");
        }
        // More are likely on their way: they are pushed to this replica as they are stored.
        keep_standby(ctx, &session.id).await;
        let watch = Watch {
            host: &session.host,
            turn: &turn_id,
            unwritten: unwritten.as_ref(),
            command: sent.as_ref(),
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
    if let Err(e) = settle(ctx, session, &record, &held).await {
        // The hand-over is not recorded, so nothing was acked: the item comes back, finds
        // its turn ended, and settles it again.
        return retry(e).await;
    }
    finish(ctx, session, &msg, &record).await;
}

/// The delivery turn's record: the batch as one message, and what it carries.
fn carrying(
    session: &SessionRecord,
    turn_id: &TurnId,
    item: &DeliveryItem,
    carried: &[(Completion, u64)],
) -> TurnRecord {
    let text = delivery::render_batch(&carried.iter().map(|(c, _)| c.clone()).collect::<Vec<_>>());
    TurnRecord::queued(turn_id.clone(), session.id.clone(), text)
        .carrying(Some(delivery::carried(item.delivery.clone(), carried)))
}

/// A redelivered item found no record of its turn and nothing to carry: its earlier attempt
/// may have dispatched a command whose batch its dead replica still holds. The turn is
/// recorded failed first, so that command is never typed (only what a record names is, R14;
/// and nothing is typed past a lane that moved on, R1). What the dead replica held comes back
/// pending when its hold lapses, unarmed: the session's next turn end arms a delivery for it
/// (R3). A record written meanwhile (the transport took the command) is left as it is, and
/// the item is retried to go on with that turn.
async fn supersede(ctx: &Ctx, session: &SessionRecord, turn: &TurnId) -> Result<(), DeliveryError> {
    let now = Utc::now();
    let failed = TurnRecord {
        id: turn.clone(),
        session: session.id.clone(),
        text: String::new(),
        queued_at: now,
        delivery: None,
        parent: None,
        state: TurnState::Failed {
            ended_at: now,
            reason: turnstile_shared::records::reason::DELIVERY_SUPERSEDED.to_string(),
            detail: "its lane replica died before it was recorded, and nothing was left to carry"
                .to_string(),
            output: Vec::new(),
        },
    };
    ctx.mark_left_pending(&session.id, true);
    match ctx.buckets.turns.create(turn.as_str(), &failed).await? {
        Some(_) => Ok(()),
        None => Err(DeliveryError::Recorded(turn.clone())),
    }
}

/// How long after dispatching a delivery turn the lane writes its record itself, `queued`,
/// in case its transport has not recorded it `running` by then (it takes well under a
/// millisecond to, when its agent is ready). Past this, a redelivered item finds the record
/// and goes on with that turn rather than collecting again, however long the transport takes
/// (an agent launching, a host down).
const BACKSTOP_AFTER: Duration = Duration::from_millis(100);

/// Writes the delivery turn's record `queued` [`BACKSTOP_AFTER`] its dispatch, unless the
/// transport wrote it first. The common case costs nothing: this replica's watch of the turns
/// has seen the transport's write (`seen`). Otherwise this create loses if it is there all
/// the same, and changes nothing. A transport whose create of it `running` loses to this one
/// reads it and goes on from it.
fn backstop_record(
    ctx: &Ctx,
    record: &TurnRecord,
    seen: tokio::sync::watch::Receiver<Option<TurnRecord>>,
) {
    let turns = ctx.buckets.turns.clone();
    let record = record.clone();
    tokio::spawn(async move {
        tokio::time::sleep(BACKSTOP_AFTER).await;
        if seen.borrow().is_some() {
            return;
        }
        if let Err(e) = turns.create(record.id.as_str(), &record).await {
            tracing::warn!(session = %record.session, turn = %record.id, error = %e, "back-stop record of a delivery turn; its transport records it");
        }
    });
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
