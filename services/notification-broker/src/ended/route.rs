//! Routing a recorded end: one completion per target session (owner, then watchers; R8), then
//! a delivery armed for each. Per target, what is known is gathered (the completion stored, the
//! marker created or not, the item out or not, the session read), [`plan`] decides, and
//! [`execute`] does it. Both halves are idempotent, so a redelivered end repeats them
//! harmlessly.
//!
//! An end routed ahead ([`Early`]) has its completion stored and its item out already (the
//! item is this delivery's if the marker's create succeeded, an extra one otherwise).
//! Otherwise the completion's store goes out now; beside it, the target's marker create is
//! awaited (made ahead, beside the end's write, when the reporter's record named the targets)
//! and, when this end created the marker and wrote the end, the lane item is published naming
//! the execution ([`plan::publishes_first`]). The item may so reach the lane before the
//! completion is stored: the delivery waits for the completion it names
//! ([`arming::FIRST_WAIT`]), and a store slower than half that wait arms again in case the
//! delivery gave up on it first. A repeat of an end already recorded publishes its item only
//! once the completion is stored, naming nothing: its completion may be handed over already,
//! and a delivery waiting for it would hold the lane for nothing. The target session's read is
//! waited for last: a stopped target's item is taken back.

use serde_json::json;
use turnstile_shared::arming;
use turnstile_shared::delivery::{Completion, DeliveryMarker};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{session_event, EventKind};
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::SessionId;

use super::early::{self, Early};
use super::plan::{self, Known, TargetPlan};
use super::sent::{send, Ack, EndError};
use crate::ctx::Ctx;

/// What routing learnt of one target before deciding.
struct Gathered {
    /// The marker this end created, with its revision.
    created: Option<(DeliveryMarker, u64)>,
    /// The item out naming the execution for that marker.
    published: Option<u64>,
    /// An item that went out ahead beside a create that found a delivery armed.
    extra: Option<u64>,
    active: bool,
}

pub(super) async fn route(
    ctx: &Ctx,
    record: &ExecutionRecord,
    wrote: bool,
    acks: &mut Vec<Ack>,
    early: &mut Early,
    step_event: &mut Option<Envelope>,
) -> Result<(), EndError> {
    let completion = Completion::of(record);
    for target in record.targets() {
        let began = std::time::Instant::now();
        let sent = early.sent(&target);
        let stored_ahead = sent
            .as_ref()
            .filter(|s| s.stored.is_ok())
            .map(|s| s.store_took);
        let sent_ahead = sent.as_ref().is_some_and(|s| matches!(s.item, Some(Ok(_))));
        let store = async {
            if stored_ahead.is_some() {
                return Ok(());
            }
            early::store_completion(ctx, &target, &completion).await
        };
        let gather = async {
            let a = early.take(&target).await;
            let created = a.created?.map(|rev| (a.marker, rev));
            let mut published = None;
            let mut extra = None;
            match sent.and_then(|s| s.item) {
                Some(Ok(seq)) if created.is_some() => published = Some(seq),
                Some(Ok(seq)) => extra = Some(seq),
                Some(Err(e)) => {
                    tracing::debug!(execution = %record.id, session = %target, error = %e, "lane item sent ahead failed; publishing it now");
                }
                None => {}
            }
            if let (true, Some((marker, rev))) = (
                plan::publishes_first(wrote, created.is_some(), published.is_some()),
                &created,
            ) {
                let seq =
                    arming::publish_item(&ctx.js, &target, marker, *rev, Some(&record.id)).await?;
                published = Some(seq);
            }
            if published.is_some() {
                // Its item is out: the marker is in use.
                early.paid(&target);
            }
            let active = a.active.await??.is_some_and(|(s, _)| s.is_active());
            Ok::<_, EndError>(Gathered {
                created,
                published,
                extra,
                active,
            })
        };
        let (stored, gathered) = tokio::join!(store, gather);
        let gathered = gathered?;
        stored?;
        // How long the delivery may have waited for what it names: for an item sent ahead,
        // since the end's write and the sends beside it went out (its completion, or its end
        // in the registry, may have come late); otherwise since the store here.
        let store_took = match (sent_ahead, stored_ahead) {
            (true, _) => early.since_sent(),
            (false, Some(took)) => took,
            (false, None) => began.elapsed(),
        };
        let decided = plan::plan(Known {
            wrote,
            created: gathered.created.is_some(),
            published: gathered.published.is_some(),
            active: gathered.active,
            stored_late: store_took >= arming::FIRST_WAIT / 2,
        });
        if matches!(decided, TargetPlan::Stopped { .. }) {
            // Nothing will be handed over: no item is owed to its marker.
            early.paid(&target);
        }
        let executed = execute(ctx, record, &target, decided, gathered, acks).await?;
        // Its item is out (or a delivery armed already carries it). Not before: a plan that
        // failed on the way leaves the marker owed, and `release` publishes its item.
        early.paid(&target);
        let Some(claimed) = executed else {
            continue;
        };
        if let Some(ev) = step_event.take() {
            acks.push(send(ctx, &ev).await?);
        }
        routed(ctx, record, &target, claimed, acks).await?;
    }
    Ok(())
}

/// Carries out a target's plan. Returns the delivery the completion went to (`Some(None)`: a
/// delivery already armed took it, none claimed), or `None` for a stopped session.
async fn execute(
    ctx: &Ctx,
    record: &ExecutionRecord,
    target: &SessionId,
    decided: TargetPlan,
    gathered: Gathered,
    acks: &mut Vec<Ack>,
) -> Result<Option<Option<DeliveryMarker>>, EndError> {
    let Gathered {
        created,
        published,
        extra,
        ..
    } = gathered;
    match decided {
        TargetPlan::Stopped { claim } => {
            // Kept on TS_COMPLETION for operators; nothing will hand it over.
            for seq in published.into_iter().chain(extra) {
                arming::take_back_item(&ctx.js, target, seq).await?;
            }
            let claimed = match (claim, created) {
                (Some(trust), _) => {
                    arming::claim(&ctx.js, &ctx.buckets.deliveries, target, trust).await?
                }
                (None, created) => created,
            };
            if let Some((m, rev)) = claimed {
                ctx.buckets
                    .deliveries
                    .remove_revision(target.as_str(), rev)
                    .await?;
                tracing::info!(execution = %record.id, session = %target, delivery = %m.delivery, "target session stopped; completion kept, not delivered");
            }
            Ok(None)
        }
        TargetPlan::First { arm_again } => {
            if arm_again {
                // Stored late: its delivery may have stopped waiting for it and cleared the
                // marker; if so a new one is armed (else the marker stands).
                tracing::info!(execution = %record.id, session = %target, "completion stored late; arming again in case its delivery went without it");
                if let Some(d) = arming::arm(&ctx.js, &ctx.buckets.deliveries, target).await? {
                    acks.push(send(ctx, &queued_event(target, &d)?).await?);
                }
            }
            Ok(Some(created.map(|(m, _)| m)))
        }
        TargetPlan::Repeat => {
            let Some((marker, rev)) = created else {
                return Ok(Some(None));
            };
            arming::publish_item(&ctx.js, target, &marker, rev, None).await?;
            Ok(Some(Some(marker)))
        }
        TargetPlan::Claim(trust) => {
            // Decided again now that the completion is stored, so a delivery taken by the lane
            // meanwhile cannot have missed it; the item names nothing to wait for.
            let claimed = arming::claim(&ctx.js, &ctx.buckets.deliveries, target, trust).await?;
            if let Some((marker, rev)) = &claimed {
                arming::publish_item(&ctx.js, target, marker, *rev, None).await?;
            }
            Ok(Some(claimed.map(|(m, _)| m)))
        }
    }
}

/// The routed completion's metric and events: `completion.routed`, and `delivery.queued` for a
/// delivery this end armed or claimed.
async fn routed(
    ctx: &Ctx,
    record: &ExecutionRecord,
    target: &SessionId,
    claimed: Option<DeliveryMarker>,
    acks: &mut Vec<Ack>,
) -> Result<(), EndError> {
    let role = if record.owner.as_ref() == Some(target) {
        "owner"
    } else {
        "watcher"
    };
    turnstile_shared::metrics::metrics()
        .completions_routed
        .get_or_create(&turnstile_shared::metrics::RoleLabel { role })
        .inc();
    let ev = session_event(
        EventKind::CompletionRouted,
        target,
        None,
        &json!({ "execution": record.id, "name": record.name, "status": record.status.name(), "role": role }),
    )?
    .with_id(format!("{}:{target}:routed", record.id));
    acks.push(send(ctx, &ev).await?);
    if let Some(marker) = claimed {
        acks.push(send(ctx, &queued_event(target, &marker.delivery)?).await?);
    }
    Ok(())
}

/// `delivery.queued` for a delivery armed on `target`'s lane.
fn queued_event(
    target: &SessionId,
    delivery: &turnstile_shared::DeliveryId,
) -> Result<Envelope, EndError> {
    Ok(session_event(
        EventKind::DeliveryQueued,
        target,
        None,
        &json!({ "delivery": delivery }),
    )?
    .with_id(format!("{delivery}:queued")))
}
