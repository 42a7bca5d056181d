//! One session's lane worker: pulls the session's next lane item (at most one is ever in
//! flight), hands it to its kind, and moves on when the kind has acked it. Occupancy is exactly
//! "this consumer has an unacked item" (R1); nothing else records it. A kind done with its item
//! removes it from the lane stream (limits retention keeps it otherwise) right behind its ack.
//!
//! A handler still running well after the server handed out an item again is dropped
//! (`overdue`).
//!
//! The kinds, one file each, call down into `crate::handoff` and never into each other:
//! - `turn`: one message (`lane.turn`);
//! - `delivery`: every pending completion handed over in one turn (`lane.delivery`, R3);
//! - `run`: a message sequence driven to completion (`lane.run`, R5).

mod delivery;
mod overdue;
mod pull;
mod run;
mod turn;

pub(crate) use pull::PullHub;
pub(crate) use run::run_event;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use turnstile_shared::lane::LaneItem;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::{subjects, topology};

use crate::ctx::Ctx;
use crate::handoff::{rearm_if_pending, reject};

type ItemFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

#[derive(Debug, thiserror::Error)]
enum LaneError {
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
    #[error(transparent)]
    Pull(#[from] pull::PullError),
}

/// Serves the lane until cancelled; errors (NATS restarts, a deleted consumer) are retried.
pub(crate) async fn run_lane(ctx: Arc<Ctx>, session: SessionRecord, cancel: CancellationToken) {
    let mut delays = turnstile_shared::consume::RESUME.delays();
    while !cancel.is_cancelled() {
        match serve(&ctx, &session, &cancel).await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(session = %session.id, error = %e, "lane interrupted; resuming");
                delays.wait_or_cancel(&cancel).await;
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
    // Bound in a boxed future of its own: the consumer handle (about 2 KB with its info) and
    // the setup futures never become part of this task's state, which an idle lane keeps for
    // its whole life (7 KB a lane when they were).
    Box::pin(bind(ctx, session)).await?;
    let mut messages = pull::LanePull::new(
        ctx.pulls.clone(),
        &session.id,
        ctx.topology.lane_pull_expiry(),
    );
    let item_cancel = cancel.child_token();
    let mut in_flight: Option<(u64, ItemFuture)> = None;
    // The next item can arrive while the current handler finishes its tail (after its ack,
    // awaiting the outcome event's ack); it waits here rather than being dropped.
    let mut next_item: Option<jetstream::Message> = None;
    // Whether this replica ever held the lane's pin (it received an item), and the pin the
    // server gave it (recorded, so a survivor can take the lane over if this replica dies).
    let mut pinned = false;
    let mut pin: Option<String> = None;
    // A handler still running after the server handed out another item (`overdue`).
    let grace = overdue::grace(ctx.topology.lane_ack_wait);
    let mut overdue = overdue::Overdue::default();
    let ended = loop {
        if in_flight.is_none() {
            overdue.clear();
            if let Some(msg) = next_item.take() {
                let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
                let fut = handle_item(ctx.clone(), session.clone(), msg, item_cancel.clone());
                in_flight = Some((seq, Box::pin(fut)));
            }
        }
        let due = overdue.due(grace);
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break None,
            _ = async { if let Some((_, f)) = in_flight.as_mut() { f.await } }, if in_flight.is_some() => {
                in_flight = None;
            }
            _ = async { if let Some((_, at)) = due { tokio::time::sleep_until(at).await } }, if due.is_some() && in_flight.is_some() => {
                if let (Some((held, _)), Some((next, _))) = (in_flight.take(), due) {
                    tracing::warn!(session = %session.id, held, next, grace_s = grace.as_secs(),
                        "a lane item's handler still ran this long after the server handed out an item again; dropped, the delivery kept is served");
                }
            }
            next = messages.next() => match next {
                Ok(msg) => {
                    pinned = true;
                    let (seq, behind) = msg
                        .info()
                        .map_or((0, 0), |i| (i.stream_sequence, i.pending));
                    turnstile_shared::metrics::metrics()
                        .lane_queue_depth
                        .observe(behind as f64);
                    note_pin(ctx, &session.id, &msg, &mut pin);
                    match &in_flight {
                        // A redelivery of the item we still hold: its ack wait ran out, or a
                        // restarted server lost its ack. Kept for when the handler ends: it
                        // then finds the item's end and finishes it through this delivery,
                        // whose ack the server answers (not the earlier one's, after a
                        // restart): the latest one kept. An item the handler did free is
                        // only acked again.
                        Some((current, _)) if *current == seq => {
                            tracing::debug!(session = %session.id, seq, "redelivery of item in flight; kept for after it");
                            overdue.arrived(seq, tokio::time::Instant::now());
                            let held_seq = next_item
                                .as_ref()
                                .and_then(|m| m.info().ok().map(|i| i.stream_sequence));
                            if held_seq.is_none_or(|s| s == seq) {
                                next_item = Some(msg);
                            }
                        }
                        _ => {
                            if in_flight.is_some() {
                                overdue.arrived(seq, tokio::time::Instant::now());
                            }
                            next_item = Some(msg);
                        }
                    }
                }
                Err(e @ pull::PullError::Deleted(_)) => break Some(e.into()),
                Err(e) => {
                    tracing::debug!(session = %session.id, error = %e, "lane pull");
                }
            }
        }
    };
    if let Some(err) = ended {
        // Keep the item we hold: its handler is still waiting; a fresh pull stream redelivers
        // nothing new while it is unacked.
        if let Some((held, f)) = in_flight {
            let_end_within(session, held, f, grace, "its consumer was deleted").await;
        }
        return Err(err);
    }
    // Stop pulling and let the item's handler give it back (see `release`); at process
    // shutdown the pin is released only after this replica's connection has closed (lib.rs).
    drop(messages);
    item_cancel.cancel();
    if let Some((held, f)) = in_flight {
        let_end_within(session, held, f, grace, "the lane is stopping").await;
    }
    if ctx.fenced.is_cancelled() {
        return Ok(());
    }
    if pinned && ctx.shutdown.is_cancelled() {
        ctx.hand_back_lane(name);
    } else if pin.is_some() {
        // The session stopped: this replica holds its lane no more.
        Box::pin(crate::liveness::forget_pin(ctx, &session.id)).await;
    }
    Ok(())
}

/// Lets the handler in flight end, for at most `grace` (a handler that never returns would
/// keep the lane from starting again, or from stopping); past it the handler is dropped, as
/// a take-over drops one on another replica (R14 resumes from the records).
async fn let_end_within(
    session: &SessionRecord,
    held: u64,
    handler: ItemFuture,
    grace: std::time::Duration,
    why: &'static str,
) {
    if tokio::time::timeout(grace, handler).await.is_err() {
        tracing::warn!(session = %session.id, held, grace_s = grace.as_secs(), why,
            "a lane item's handler did not end within its grace; dropped");
    }
}

/// Binds the lane's consumer. A replica starting with thousands of lanes sets them up a
/// bounded number at a time: all at once, their consumer requests timed out (10,000 lanes) and
/// were retried for minutes.
async fn bind(ctx: &Arc<Ctx>, session: &SessionRecord) -> Result<(), LaneError> {
    let _setup = ctx.lane_setup.acquire().await;
    topology::ensure_lane_consumer(&ctx.js, &ctx.topology, &session.id).await?;
    // The completion consumer is bound on first need (a delivery or a run collecting): an idle
    // session that never had work finish for it holds one server-side consumer, its lane's.
    rearm_if_pending(ctx, &session.id);
    Ok(())
}

/// Records the lane's pin when the server gives this replica a new one (the first item after
/// it became the holder), off the hand-off path.
fn note_pin(
    ctx: &Arc<Ctx>,
    session: &turnstile_shared::SessionId,
    msg: &jetstream::Message,
    pin: &mut Option<String>,
) {
    let Some(id) = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(subjects::PIN_ID_HEADER))
        .map(|v| v.as_str())
    else {
        return;
    };
    if pin.as_deref() != Some(id) {
        *pin = Some(id.to_string());
        crate::liveness::record_pin(ctx, session, id.to_string());
    }
}

/// The one match on the item kind: each kind serves its item to its end and acks, gives back
/// or refuses it itself.
async fn handle_item(
    ctx: Arc<Ctx>,
    session: SessionRecord,
    msg: jetstream::Message,
    cancel: CancellationToken,
) {
    if ctx.lease.hold().await.is_err() {
        // Taken over while this item came: the survivor was given it back already.
        return;
    }
    match LaneItem::decode(&msg.payload, &session.id) {
        Ok(LaneItem::Turn(item)) => turn::run_turn(&ctx, &session, msg, item, &cancel).await,
        Ok(LaneItem::Delivery(item)) => {
            delivery::run_delivery(&ctx, &session, msg, item, &cancel).await
        }
        Ok(LaneItem::Run(item)) => run::run_run(&ctx, &session, msg, item, &cancel).await,
        Err(e) => reject(&ctx, &session, &msg, &e.to_string()).await,
    }
}
