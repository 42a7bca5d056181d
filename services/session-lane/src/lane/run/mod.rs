//! A `run` lane item (R5): while it holds the lane it drives its messages to completion. Each
//! message is a turn; then, round after round, it waits until everything that turn started is
//! terminal, hands the completions to the agent as one next turn (R3; the run is the session's
//! only deliverer meanwhile, R4), and stops when a turn starts nothing new. Then the next
//! message, then the finalizer. Bounded by `max_rounds`, `max_duration` and `idle_timeout`
//! (R10); `completed` only if every message completed (R12). Progress lives in the run record,
//! so a replica that takes the lane over continues where the run was (R14).
//!
//! - `driver`: the rounds of each message, the bounds, the end (R5, R10, R12);
//! - `wait`: waiting for a turn's whole subtree and taking what came back;
//! - `events`: the run's lifecycle events.

mod driver;
mod events;

pub(crate) use events::event as run_event;
mod wait;

use std::time::Duration;

use async_nats::jetstream;
use chrono::Utc;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::delivery::{DeliveryItem, DeliveryMarker};
use turnstile_shared::events::EventKind;
use turnstile_shared::kv::Change;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::runs::{DriverClaim, RunItem, RunRecord, RunState};
use turnstile_shared::{DeliveryId, SessionId};

use crate::ctx::Ctx;
use crate::handoff::{acked, disarm_and_recheck, rearm_if_pending, reject, release, retry_later};
use driver::{DriveError, Driver};
use events::event;

pub(super) async fn run_run(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: jetstream::Message,
    item: RunItem,
    cancel: &CancellationToken,
) {
    let (record, revision) = match ctx.buckets.runs.get::<RunRecord>(item.run.as_str()).await {
        Ok(Some(found)) => found,
        Ok(None) => {
            let reason = format!("no run record {}", item.run);
            return reject(ctx, session, &msg, &reason).await;
        }
        Err(e) => return retry(ctx, &msg, &item, &e.to_string()).await,
    };
    if record.session != session.id {
        let reason = format!("run {} belongs to session {}", record.id, record.session);
        return reject(ctx, session, &msg, &reason).await;
    }
    if record.state.is_terminal() {
        return acked(ctx, session, &msg).await;
    }
    let claim = claim_of(&msg);
    let record = match start(ctx, record, revision, &claim).await {
        Ok(r) => r,
        Err(DriveError::Ended) => return acked(ctx, session, &msg).await,
        Err(DriveError::Superseded) => return superseded(&item, &claim),
        Err(e) => return retry(ctx, &msg, &item, &e.to_string()).await,
    };
    // R4: while the run holds the lane, its marker tells the broker a deliverer exists.
    let marker = hold_deliveries(ctx, &session.id).await;
    let mut driver = Driver {
        ctx,
        session,
        msg: &msg,
        cancel,
        run: record,
        claim: claim.clone(),
        settled: None,
        gave_back: false,
    };
    match driver.drive().await {
        Ok(Some(end)) => {
            match driver.end(end).await {
                Ok(()) => {}
                Err(DriveError::Superseded) => return superseded(&item, &claim),
                Err(e) => return retry(ctx, &msg, &item, &e.to_string()).await,
            }
            finish(ctx, session, &msg, &item, marker, driver.gave_back).await;
        }
        // Cancelled (replica stopping): the lane moves, the run continues elsewhere.
        Ok(None) => release(ctx, &msg).await,
        // Another driver of this run ended it meanwhile: nothing more is written for it.
        Err(DriveError::Ended) => {
            tracing::info!(run = %item.run, "the run was ended by another driver; this one stops");
            finish(ctx, session, &msg, &item, marker, driver.gave_back).await;
        }
        // A later delivery of the item drives the run now: this one touches nothing more,
        // not the item (that delivery's to ack), nor the marker (it may rely on it).
        Err(DriveError::Superseded) => superseded(&item, &claim),
        Err(e) => retry(ctx, &msg, &item, &e.to_string()).await,
    }
}

/// This delivery's claim on the run: the item's lane sequence and delivery count, and as its
/// token the delivery's ack subject, which no other delivery shares (it carries the consumer's
/// delivery sequence and the server's delivery time).
fn claim_of(msg: &jetstream::Message) -> DriverClaim {
    let (item, delivery) = msg
        .info()
        .map_or((0, 0), |i| (i.stream_sequence, i.delivered as u64));
    DriverClaim {
        item,
        delivery,
        token: msg.reply.as_deref().unwrap_or_default().to_string(),
    }
}

fn superseded(item: &RunItem, claim: &DriverClaim) {
    tracing::warn!(
        run = %item.run,
        delivery = claim.delivery,
        "a later delivery of the run's lane item drives it now (this one was handed out again after its ack wait ran out); this driver stops"
    );
}

/// An ended run's item: its delivery marker released, the item acked. Completions the run
/// gave back (`gave_back`) wait for redelivery, counted as held, not pending: the recheck of
/// the marker's release does not see them, so a delivery is armed for them here.
async fn finish(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    item: &RunItem,
    marker: Option<DeliveryItem>,
    gave_back: bool,
) {
    if let Some(m) = &marker {
        if let Err(e) = disarm_and_recheck(ctx, &session.id, m, None).await {
            tracing::warn!(run = %item.run, error = %e, "release delivery marker");
        }
    }
    // A run that found a marker set (an earlier driver's, left when a later delivery took
    // the run over from it) rechecks too: that marker is nobody's now.
    if gave_back || marker.is_none() {
        rearm_if_pending(ctx, &session.id);
    }
    acked(ctx, session, msg).await;
}

async fn retry(ctx: &Ctx, msg: &jetstream::Message, item: &RunItem, e: &str) {
    tracing::warn!(run = %item.run, error = %e, "run interrupted; retrying");
    retry_later(ctx, msg, Duration::from_millis(500)).await;
}

/// Claims the run for this delivery of its item (R1) and starts it if it is queued, in one
/// write, from the record as the item's handler read it at `revision` (read again only on a
/// conflict). `Superseded` when a later delivery claimed it already; `Ended` when it ended.
async fn start(
    ctx: &Ctx,
    record: RunRecord,
    revision: u64,
    claim: &DriverClaim,
) -> Result<RunRecord, DriveError> {
    ctx.lease.hold().await?;
    let started_at = Utc::now();
    let next = ctx
        .buckets
        .runs
        .modify_from::<RunRecord, _>(
            record.id.as_str(),
            Some((record.clone(), revision)),
            |cur| match cur {
                Some(r) if r.state.is_terminal() => Change::Keep,
                Some(r) if r.driver.as_ref().is_some_and(|d| !claim.supersedes(d)) => Change::Keep,
                Some(r) => Change::Write(RunRecord {
                    driver: Some(claim.clone()),
                    state: match r.state {
                        RunState::Queued => RunState::Running { started_at },
                        ref s => s.clone(),
                    },
                    ..r.clone()
                }),
                None => Change::Keep,
            },
        )
        .await?
        .ok_or(DriveError::Gone)?;
    if next.state.is_terminal() {
        return Err(DriveError::Ended);
    }
    if next.driver.as_ref() != Some(claim) {
        return Err(DriveError::Superseded);
    }
    if matches!(record.state, RunState::Queued) {
        event(
            ctx,
            &next,
            EventKind::RunStarted,
            json!({ "messages": next.messages.len() }),
        )
        .await;
    }
    Ok(next)
}

/// Creates the session's delivery marker for the run (unless a delivery is armed already);
/// returns it as an item to clear when the run ends.
async fn hold_deliveries(ctx: &Ctx, session: &SessionId) -> Option<DeliveryItem> {
    let marker = DeliveryMarker {
        delivery: DeliveryId::new(),
        armed_at: Utc::now(),
    };
    match ctx
        .buckets
        .deliveries
        .create(session.as_str(), &marker)
        .await
    {
        Ok(Some(rev)) => Some(DeliveryItem {
            delivery: marker.delivery,
            marker_rev: Some(rev),
            first: None,
            first_ended_at: None,
        }),
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(%session, error = %e, "hold deliveries for the run");
            None
        }
    }
}
