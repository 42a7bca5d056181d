//! After the turn that carried completions: a completed one has its hand-over recorded in the
//! registry and what it carried acked (R3, R14); a failed one leaves them pending. Then the
//! delivery marker is cleared and the next delivery armed if results remain, and a standby
//! pull is kept out for the session's next completions.

use async_nats::jetstream::{self, AckKind};
use serde_json::json;
use turnstile_shared::delivery::{self, DeliveryItem};
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::execution::{ExecutionRecord, HandedOver};
use turnstile_shared::kv::{Change, KvError};
use turnstile_shared::records::{Carried, SessionRecord, TurnRecord, TurnState};
use turnstile_shared::{subjects, ExecutionId, SessionId};

use super::error::DeliveryError;
use crate::ctx::Ctx;
use crate::handoff::rearm::arm;

/// Clears the session's marker, then arms the next delivery if completions are pending that
/// this one did not take (beyond the cap, or stored between its fetch and the clearing: their
/// routers saw the marker and left them to this delivery). Any completion stored after the
/// clearing arms a delivery itself, except the one that armed this delivery when this one
/// left it out at the cap before it was stored (`unseen`): its router counts on a delivery
/// waiting for it, so the next one is armed naming it, whatever is pending now.
pub(crate) async fn disarm_and_recheck(
    ctx: &Ctx,
    session: &SessionId,
    item: &DeliveryItem,
    unseen: Option<&ExecutionId>,
) -> Result<(), DeliveryError> {
    delivery::disarm(&ctx.buckets.deliveries, session, item).await?;
    if unseen.is_some() {
        arm(ctx, session, unseen).await;
        return Ok(());
    }
    let mut consumer = ctx.completion_consumer(session).await?;
    let info = consumer.info().await.map_err(|e| DeliveryError::Fetch {
        session: session.clone(),
        source: e.into(),
    })?;
    // What a standby of this lane holds, or was sent, is pending too: its router may have
    // seen the marker still set.
    if info.num_pending > 0 || ctx.standbys.owes(session, info.delivered.consumer_sequence) {
        arm(ctx, session, None).await;
    }
    Ok(())
}

/// Keeps a pull for the session's next completions out for a while (`standby`): opened by a
/// delivery that carried some, once its marker is cleared.
pub(crate) async fn keep_standby(ctx: &Ctx, session: &SessionId) {
    match ctx.completion_consumer(session).await {
        Ok(consumer) => ctx.standbys.open(consumer, session),
        Err(e) => tracing::debug!(%session, error = %e, "completion standby not opened"),
    }
}

/// After the delivery turn: completed → record the hand-over in each execution's registry
/// record, then ack what it carried (messages held now, or by sequence for a delivery resumed
/// after a crash); failed → leave them pending (R3). A hand-over that could not be recorded
/// acks nothing: the caller retries its item, which settles the recorded turn again.
pub(crate) async fn settle(
    ctx: &Ctx,
    session: &SessionRecord,
    record: &TurnRecord,
    held: &[jetstream::Message],
) -> Result<(), DeliveryError> {
    let Some(carried) = &record.delivery else {
        return Ok(());
    };
    let completed = matches!(record.state, TurnState::Completed { .. });
    if completed {
        ctx.handed_over.note(
            &carried
                .completions
                .iter()
                .map(|c| (session.id.clone(), c.execution.clone()))
                .collect::<Vec<_>>(),
        );
        record_handed_over(ctx, &session.id, record, carried).await?;
    }
    let m = turnstile_shared::metrics::metrics();
    let count = carried.completions.len() as u64;
    m.delivery_batch.observe(count as f64);
    if completed {
        m.completions_handed_over.inc_by(count);
    } else {
        m.completions_left_pending.inc_by(count);
    }
    // A failed hand-over leaves its completions pending (R3); the session's next turn end
    // arms a delivery for them again.
    ctx.mark_left_pending(&session.id, !completed);
    // The recorded list is what was typed. A held message it does not name (the record was
    // written from an earlier attempt's command, with another batch) stays pending.
    let (held, extra): (Vec<_>, Vec<_>) = held.iter().partition(|h| {
        h.info().is_ok_and(|i| {
            carried
                .completions
                .iter()
                .any(|c| c.seq == i.stream_sequence)
        })
    });
    for h in extra {
        let _ = h.ack_with(AckKind::Nak(None)).await;
    }
    if completed {
        // Acked through the messages held; by sequence for what is not held (a delivery
        // resumed after a crash, or a failed ack). Removal is idempotent.
        let mut all = held.len() == carried.completions.len();
        for h in &held {
            if let Err(e) = crate::handoff::reconnect::double_ack(ctx, h).await {
                tracing::warn!(session = %session.id, error = %e, "ack completion; removing by sequence");
                all = false;
                break;
            }
        }
        if !all {
            remove_by_seq(ctx, carried).await;
        }
    } else {
        for h in held {
            let _ = h.ack_with(AckKind::Nak(None)).await;
        }
    }
    let k = if completed {
        EventKind::DeliveryCompleted
    } else {
        EventKind::DeliveryFailed
    };
    let data = json!({
        "delivery": carried.delivery,
        "turn": record.id,
        "executions": carried.completions.iter().map(|c| &c.execution).collect::<Vec<_>>(),
        "count": carried.completions.len(),
    });
    match session_event(k, &session.id, Some(&record.id), &data) {
        Ok(ev) => {
            if let Err(e) = events::publish(&ctx.js, &ev).await {
                tracing::warn!(error = %e, "delivery event");
            }
        }
        Err(e) => tracing::warn!(error = %e, "build delivery event"),
    }
    Ok(())
}

/// Writes into each carried execution's registry record that this completed turn handed it to
/// the session, before its completion is acked: the store may lose an ack's removal (a full
/// disk), or the end may be routed again, and the copy that comes back then finds this
/// (`admit`), on whichever replica meets it (R3, R14). Idempotent: a hand-over recorded
/// already is kept as it is.
async fn record_handed_over(
    ctx: &Ctx,
    session: &SessionId,
    record: &TurnRecord,
    carried: &Carried,
) -> Result<(), DeliveryError> {
    let at = match &record.state {
        TurnState::Completed { ended_at, .. } => *ended_at,
        _ => chrono::Utc::now(),
    };
    let writes = carried.completions.iter().map(|c| {
        ctx.buckets
            .executions
            .modify::<ExecutionRecord, _>(c.execution.as_str(), |cur| match cur {
                Some(r) if r.handed_to(session).is_none() => {
                    let mut next = r.clone();
                    next.handed_over.push(HandedOver {
                        session: session.clone(),
                        turn: record.id.clone(),
                        at,
                    });
                    Change::Write(next)
                }
                _ => Change::Keep,
            })
    });
    for w in futures::future::join_all(writes).await {
        match w {
            Ok(_) => {}
            // The store did not take it (down, full, contended): tried again with the item.
            Err(e @ (KvError::Nats { .. } | KvError::Contended { .. })) => return Err(e.into()),
            // A record this build cannot read or write will not become writable by waiting:
            // the lane goes on (this replica's memory still drops a copy that comes back).
            Err(e) => {
                tracing::error!(%session, turn = %record.id, error = %e, "record a hand-over in the registry; going on without it")
            }
        }
    }
    Ok(())
}

/// Removes carried completions from the work-queue stream by sequence: the ack of a delivery
/// resumed by another replica, which no longer holds the messages. Idempotent.
async fn remove_by_seq(ctx: &Ctx, carried: &Carried) {
    for c in &carried.completions {
        match turnstile_shared::removal::remove(&ctx.js, subjects::COMPLETION_STREAM, c.seq).await {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(execution = %c.execution, seq = c.seq, error = %e, "remove carried completion; it stays pending")
            }
        }
    }
}
