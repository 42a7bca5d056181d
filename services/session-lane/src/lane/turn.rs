//! A `turn` lane item: one message typed into the agent once it holds the lane (R2), its
//! outcome waited for, then the lane freed. A redelivered item (after a crash or fail-over)
//! first reads the turn's record, so an ended turn is only finished, never typed again (R14).

use std::time::Duration;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use turnstile_shared::lane::TurnItem;
use turnstile_shared::records::{KnownTurn, SessionRecord, TurnCommand, TurnRecord, TurnState};

use crate::ctx::Ctx;
use crate::handoff::{
    dispatch, finish, rearm_if_pending, reject, release, retry_later, wait_terminal, Watch,
};
use turnstile_shared::metrics::item_kind;

/// Serves one `turn` item to its end (or gives it back when the replica stops).
pub(super) async fn run_turn(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: jetstream::Message,
    item: TurnItem,
    cancel: &CancellationToken,
) {
    let waiter = ctx.turns.wait(&item.turn);
    // A first delivery cannot have an outcome yet, so the hot path dispatches without reading
    // the record (the transport creates or checks it, idempotent by turn id). A redelivery
    // (after a crash or fail-over) looks first: the turn may have ended meanwhile.
    let first_delivery = msg.info().map(|i| i.delivered <= 1).unwrap_or(false);
    // The record's revision goes to the transport when known to stand queued, so it records
    // the turn running without reading it: the item's word on a first delivery, the read on
    // a redelivery.
    let mut known = item.known(&session.id).filter(|_| first_delivery);
    if !first_delivery {
        let (record, revision) = match current_record(ctx, session, &item).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(session = %session.id, turn = %item.turn, error = %e, "read turn; retrying");
                retry_later(ctx, &msg, Duration::from_millis(500)).await;
                return;
            }
        };
        if record.session != session.id {
            let reason = format!("turn {} belongs to session {}", record.id, record.session);
            return reject(ctx, session, &msg, &reason).await;
        }
        if record.state.is_terminal() {
            return finish(ctx, session, &msg, &record).await;
        }
        known = (record.state == TurnState::Queued).then_some(KnownTurn { revision, record });
    }
    let command = TurnCommand {
        session: session.id.clone(),
        turn: item.turn.clone(),
        text: item.text.clone(),
        delivery: None,
        known,
        unrecorded: false,
    };
    let sent = match dispatch(ctx, session, &msg, command, item_kind::TURN).await {
        Ok(sent) => sent,
        Err(e) => {
            tracing::warn!(session = %session.id, turn = %item.turn, error = %e, "dispatch; retrying");
            retry_later(ctx, &msg, Duration::from_millis(500)).await;
            return;
        }
    };
    let watch = Watch::recorded(&session.host, &item.turn, &sent);
    match wait_terminal(ctx, &msg, watch, waiter, cancel, &[]).await {
        Some(record) => {
            finish(ctx, session, &msg, &record).await;
            if ctx.left_pending(&session.id) {
                rearm_if_pending(ctx, &session.id);
            }
        }
        // Cancelled: hand the item back so the replica that takes the lane continues it.
        None => release(ctx, &msg).await,
    }
}

/// The turn's record and its revision; created here for items published straight onto the
/// lane subject.
async fn current_record(
    ctx: &Ctx,
    session: &SessionRecord,
    item: &TurnItem,
) -> Result<(TurnRecord, u64), turnstile_shared::kv::KvError> {
    let key = item.turn.as_str();
    if let Some(found) = ctx.buckets.turns.get::<TurnRecord>(key).await? {
        return Ok(found);
    }
    let fresh = TurnRecord::queued(item.turn.clone(), session.id.clone(), item.text.clone());
    if let Some(revision) = ctx.buckets.turns.create(key, &fresh).await? {
        return Ok((fresh, revision));
    }
    ctx.buckets
        .turns
        .get::<TurnRecord>(key)
        .await?
        .ok_or_else(|| turnstile_shared::kv::KvError::Contended {
            bucket: turnstile_shared::subjects::TURNS_BUCKET.to_string(),
            key: key.to_string(),
            attempts: 1,
        })
}
