//! One session's lane worker: pulls the session's next lane item (at most one is ever in
//! flight), dispatches it to the session's host, waits for its outcome, then acks. Occupancy is
//! exactly "this consumer has an unacked item" (R1); nothing else records it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use futures::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::lane::{LaneItem, TurnItem};
use turnstile_shared::records::{
    transport_kind, SessionRecord, TurnCommand, TurnRecord, TurnState,
};
use turnstile_shared::{deadletter, subjects, topology};

use crate::turn_watch::{sleep_or_cancel, TurnWaiter};
use crate::Ctx;

type ItemFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

#[derive(Debug, thiserror::Error)]
enum LaneError {
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
    #[error("open pull stream on {consumer}: {source}")]
    Pull {
        consumer: String,
        source: async_nats::Error,
    },
    #[error("pull stream of {0} ended")]
    Ended(String),
}

/// Serves the lane until cancelled; errors (NATS restarts, a deleted consumer) are retried.
pub(crate) async fn run_lane(ctx: Arc<Ctx>, session: SessionRecord, cancel: CancellationToken) {
    let mut delay = Duration::from_millis(100);
    while !cancel.is_cancelled() {
        match serve(&ctx, &session, &cancel).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(session = %session.id, error = %e, "lane interrupted; resuming");
                sleep_or_cancel(&cancel, delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
    tracing::debug!(session = %session.id, "lane worker stopped");
}

async fn serve(
    ctx: &Arc<Ctx>,
    session: &SessionRecord,
    cancel: &CancellationToken,
) -> Result<(), LaneError> {
    let name = subjects::lane_consumer(&session.id);
    let consumer = topology::ensure_lane_consumer(&ctx.js, &ctx.topology, &session.id).await?;
    ctx.completion_consumer(&session.id).await?;
    crate::delivery::rearm_if_pending(ctx, &session.id);
    let expiry = ctx.topology.lane_pull_expiry();
    let mut messages = consumer
        .stream()
        .group(subjects::LANE_GROUP)
        .max_messages_per_batch(1)
        .expires(expiry)
        .heartbeat(expiry / 2)
        .messages()
        .await
        .map_err(|e| LaneError::Pull {
            consumer: name.clone(),
            source: e.into(),
        })?;
    let item_cancel = cancel.child_token();
    let mut in_flight: Option<(u64, ItemFuture)> = None;
    // The next item can arrive while the current handler finishes its tail (after its ack,
    // awaiting the outcome event's ack); it waits here rather than being dropped.
    let mut next_item: Option<jetstream::Message> = None;
    // Whether this replica ever held the lane's pin (it received an item).
    let mut pinned = false;
    let ended = loop {
        if in_flight.is_none() {
            if let Some(msg) = next_item.take() {
                let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
                let fut = handle_item(ctx.clone(), session.clone(), msg, item_cancel.clone());
                in_flight = Some((seq, Box::pin(fut)));
            }
        }
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break None,
            _ = async { if let Some((_, f)) = in_flight.as_mut() { f.await } }, if in_flight.is_some() => {
                in_flight = None;
            }
            next = messages.next() => match next {
                Some(Ok(msg)) => {
                    pinned = true;
                    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
                    match &in_flight {
                        // A redelivery of the item we still hold (its ack wait ran out).
                        Some((current, _)) if *current == seq => {
                            tracing::debug!(session = %session.id, seq, "redelivery of item in flight");
                        }
                        _ => next_item = Some(msg),
                    }
                }
                Some(Err(e)) => {
                    tracing::debug!(session = %session.id, error = %e, "lane pull");
                }
                None => break Some(LaneError::Ended(name.clone())),
            }
        }
    };
    if let Some(err) = ended {
        // Keep the item we hold: its handler is still waiting; a fresh pull stream redelivers
        // nothing new while it is unacked.
        if let Some((_, f)) = in_flight {
            f.await;
        }
        return Err(err);
    }
    // Stop pulling and let the item's handler give it back (see `release`); at process
    // shutdown the pin is released only after this replica's connection has closed (lib.rs).
    drop(messages);
    item_cancel.cancel();
    if let Some((_, f)) = in_flight {
        f.await;
    }
    if pinned && ctx.shutdown.is_cancelled() {
        ctx.hand_back_lane(name);
    }
    Ok(())
}

/// Gives a lane item back unacked. At process shutdown the nak waits until this replica's
/// connection is closed (so the item cannot come straight back to one of its pull requests);
/// otherwise (the session was stopped) it is sent at once.
pub(crate) async fn release(ctx: &Ctx, msg: &jetstream::Message) {
    if ctx.shutdown.is_cancelled() {
        if let Some(reply) = &msg.reply {
            ctx.hand_back_item(reply.to_string());
            return;
        }
    }
    let _ = msg.ack_with(AckKind::Nak(None)).await;
}

async fn handle_item(
    ctx: Arc<Ctx>,
    session: SessionRecord,
    msg: jetstream::Message,
    cancel: CancellationToken,
) {
    match LaneItem::decode(&msg.payload, &session.id) {
        Ok(LaneItem::Turn(item)) => run_turn(&ctx, &session, msg, item, &cancel).await,
        Ok(LaneItem::Delivery(item)) => {
            crate::delivery::run_delivery(&ctx, &session, msg, item, &cancel).await
        }
        Ok(LaneItem::Run(item)) => crate::run::run_run(&ctx, &session, msg, item, &cancel).await,
        Err(e) => reject(&ctx, &session, &msg, &e.to_string()).await,
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
    match event {
        Ok(event) => deadletter::refuse(&ctx.js, msg, dlq, reason, &event).await,
        Err(e) => tracing::error!(session = %session.id, error = %e, "build lane.rejected"),
    }
}

async fn run_turn(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: jetstream::Message,
    item: TurnItem,
    cancel: &CancellationToken,
) {
    let waiter = ctx.turns.wait(&item.turn);
    let nak = |delay: Option<Duration>| msg.ack_with(AckKind::Nak(delay));
    // A first delivery cannot have an outcome yet, so the hot path dispatches without reading
    // the record (the transport creates or checks it, idempotent by turn id). A redelivery
    // (after a crash or fail-over) looks first: the turn may have ended meanwhile.
    let first_delivery = msg.info().map(|i| i.delivered <= 1).unwrap_or(false);
    if !first_delivery {
        let record = match current_record(ctx, session, &item).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(session = %session.id, turn = %item.turn, error = %e, "read turn; retrying");
                let _ = nak(Some(Duration::from_millis(500))).await;
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
    }
    if let Err(e) = dispatch(ctx, session, &msg, &item.turn, &item.text).await {
        tracing::warn!(session = %session.id, turn = %item.turn, error = %e, "dispatch; retrying");
        let _ = nak(Some(Duration::from_millis(500))).await;
        return;
    }
    match wait_terminal(ctx, &msg, &session.host, &item.turn, waiter, cancel, &[]).await {
        Some(record) => {
            finish(ctx, session, &msg, &record).await;
            if ctx.left_pending(&session.id) {
                crate::delivery::rearm_if_pending(ctx, &session.id);
            }
        }
        // Cancelled: hand the item back so the replica that takes the lane continues it.
        None => release(ctx, &msg).await,
    }
}

/// The turn's record; created here for items published straight onto the lane subject.
async fn current_record(
    ctx: &Ctx,
    session: &SessionRecord,
    item: &TurnItem,
) -> Result<TurnRecord, turnstile_shared::kv::KvError> {
    let key = item.turn.as_str();
    if let Some((r, _)) = ctx.buckets.turns.get::<TurnRecord>(key).await? {
        return Ok(r);
    }
    let fresh = TurnRecord {
        id: item.turn.clone(),
        session: session.id.clone(),
        text: item.text.clone(),
        queued_at: Utc::now(),
        delivery: None,
        parent: None,
        state: TurnState::Queued,
    };
    ctx.buckets.turns.create(key, &fresh).await?;
    Ok(ctx
        .buckets
        .turns
        .get::<TurnRecord>(key)
        .await?
        .map(|(r, _)| r)
        .unwrap_or(fresh))
}

/// `turn.started` and the transport command, sent together and both acknowledged (R14). The
/// transport de-duplicates by turn id, so a repeat after a crash never types twice.
pub(crate) async fn dispatch(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    turn: &turnstile_shared::TurnId,
    text: &str,
) -> Result<(), async_nats::Error> {
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let started = session_event(
        EventKind::TurnStarted,
        &session.id,
        Some(turn),
        &json!({ "replica": ctx.replica, "host": session.host, "delivery": delivered }),
    )?;
    let event_ack = events::send(&ctx.js, &started).await?;
    let command = Envelope::new(
        transport_kind::TURN,
        &TurnCommand {
            session: session.id.clone(),
            turn: turn.clone(),
            text: text.to_string(),
        },
    )?
    .with_session(&session.id)
    .with_turn(turn)
    .with_id(turn.to_string());
    let command_ack = events::send_to(
        &ctx.js,
        subjects::transport(&session.host, "turn"),
        &command,
        None,
    )
    .await?;
    let (e, c) = tokio::join!(event_ack, command_ack);
    e?;
    c?;
    Ok(())
}

/// Waits for the transport to record the outcome, keeping the item (and `held`, messages the
/// turn carries) alive with progress acks.
pub(crate) async fn wait_terminal(
    ctx: &Ctx,
    msg: &jetstream::Message,
    host: &turnstile_shared::HostName,
    turn: &turnstile_shared::TurnId,
    mut waiter: TurnWaiter,
    cancel: &CancellationToken,
    held: &[jetstream::Message],
) -> Option<TurnRecord> {
    let period = ctx.topology.progress_interval();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let mut watching = true;
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            changed = waiter.rx.changed(), if watching => {
                if changed.is_err() {
                    watching = false;
                    continue;
                }
                let rec = waiter.rx.borrow_and_update().clone();
                if let Some(rec) = rec.filter(|r| r.state.is_terminal()) {
                    return Some(rec);
                }
            }
            _ = tick.tick() => {
                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                    tracing::debug!(%turn, error = %e, "progress ack");
                }
                for h in held {
                    let _ = h.ack_with(AckKind::Progress).await;
                }
                // Fallback for a watch that missed an update across a reconnect.
                if let Ok(Some((rec, _))) = ctx.buckets.turns.get::<TurnRecord>(turn.as_str()).await {
                    if rec.state.is_terminal() {
                        return Some(rec);
                    }
                }
                // A host that stopped heartbeating will not record the outcome: the turn
                // fails with the named error instead of waiting (R9), and only this host's
                // sessions are touched.
                if let Some(rec) = fail_if_host_lapsed(ctx, host, turn).await {
                    return Some(rec);
                }
            }
        }
    }
}

/// Fails the turn `transport_unavailable` if its host's heartbeat key has lapsed.
async fn fail_if_host_lapsed(
    ctx: &Ctx,
    host: &turnstile_shared::HostName,
    turn: &turnstile_shared::TurnId,
) -> Option<TurnRecord> {
    match ctx
        .buckets
        .hosts
        .get::<turnstile_shared::records::HostRecord>(host.as_str())
        .await
    {
        Ok(Some(_)) | Err(_) => return None,
        Ok(None) => {}
    }
    let ended_at = Utc::now();
    let ttl = ctx.topology.host_ttl;
    ctx.buckets
        .turns
        .modify::<TurnRecord, _>(turn.as_str(), |cur| match cur {
            Some(r) if !r.state.is_terminal() => turnstile_shared::kv::Change::Write(TurnRecord {
                state: TurnState::Failed {
                    ended_at,
                    reason: turnstile_shared::records::reason::TRANSPORT_UNAVAILABLE.to_string(),
                    detail: format!(
                        "host {host} has not heartbeaten for {ttl:?}; its transport agent is gone"
                    ),
                    output: Vec::new(),
                },
                ..r.clone()
            }),
            _ => turnstile_shared::kv::Change::Keep,
        })
        .await
        .ok()
        .flatten()
        .filter(|r| r.state.is_terminal())
}

/// Emits the outcome event (derived from the durable record) and frees the lane.
pub(crate) async fn finish(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    record: &TurnRecord,
) {
    let event = match outcome_event(record) {
        Ok(ev) => Some(ev),
        Err(e) => {
            tracing::error!(turn = %record.id, error = %e, "build outcome event");
            None
        }
    };
    // The event is sent before the ack (so readers see it before the next turn starts) and its
    // acknowledgement awaited after, keeping the hand-off to one round trip.
    let sent = match &event {
        Some(ev) => Some(events::send(&ctx.js, ev).await),
        None => None,
    };
    if let Err(e) = msg.double_ack().await {
        tracing::warn!(session = %session.id, turn = %record.id, error = %e, "ack lane item");
    }
    let acked = match sent {
        Some(Ok(ack)) => ack.await,
        Some(Err(e)) => Err(e),
        None => Ok(()),
    };
    if let (Err(e), Some(ev)) = (acked, event) {
        tracing::warn!(turn = %record.id, error = %e, "outcome event; retrying");
        tokio::spawn(republish(ctx.js.clone(), ev));
    }
}

/// Retries an event whose publish failed after its lane item was acked (bounded; the event's
/// stable id makes a repeat harmless).
async fn republish(js: jetstream::Context, event: Envelope) {
    let mut delay = Duration::from_millis(200);
    for _ in 0..10 {
        tokio::time::sleep(delay).await;
        match events::publish(&js, &event).await {
            Ok(()) => return,
            Err(e) => tracing::warn!(event = %event.id, error = %e, "outcome event retry"),
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
    tracing::error!(event = %event.id, "outcome event lost after 10 attempts");
}

/// `turn.completed` or `turn.failed` for a terminal record; shared with the stop path.
pub(crate) fn outcome_event(
    record: &TurnRecord,
) -> Result<Envelope, turnstile_shared::EnvelopeError> {
    let (k, data) = match &record.state {
        TurnState::Completed {
            host,
            typed_at,
            ended_at,
            output,
        } => (
            EventKind::TurnCompleted,
            json!({ "host": host, "typed_at": typed_at, "ended_at": ended_at, "output": output }),
        ),
        TurnState::Failed {
            reason,
            detail,
            ended_at,
            output,
        } => (
            EventKind::TurnFailed,
            json!({ "reason": reason, "detail": detail, "ended_at": ended_at, "output": output }),
        ),
        other => (
            EventKind::TurnFailed,
            json!({ "reason": "not_terminal", "detail": other.name() }),
        ),
    };
    session_event(k, &record.session, Some(&record.id), &data)
}
