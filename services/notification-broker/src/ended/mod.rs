//! The one writer of terminal execution states. Ends (worker reports, cancellations) arrive on
//! the durable `ts.step.ended.*` queue; each is recorded by compare-and-set (the first end
//! wins), its workers and owned children are told, and one completion per target session is
//! left on `TS_COMPLETION` and a delivery armed (R3, R7, R8). Only then is it acked, so a
//! crash at any point redoes the idempotent rest (R14). A worker's report is recorded at once
//! by the replica that took it ([`Inline`]); its queued message is then the backstop.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::arming;
use turnstile_shared::delivery;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::EventKind;
use turnstile_shared::execution::{exec_reason, ExecKind, ExecStatus, ExecutionRecord};
use turnstile_shared::kv::Change;
use turnstile_shared::step_api::{step_kind, Ended};
use turnstile_shared::{consume, subjects, topology};

use crate::registry::{self, Reach};

mod armed;
mod attempts;
mod early;
mod inline;
mod plan;
mod route;
mod sent;
use crate::ctx::Ctx;
use crate::step_events::step_envelope;
pub(crate) use armed::ArmedSessions;
pub(crate) use attempts::Inline;
use early::{Early, Ending, Owed};
use sent::{send, EndError};

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    consume::until_shutdown("ended queue", &shutdown, || consume(&ctx, &shutdown)).await
}

async fn consume(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
    let consumer = topology::ensure_ended_consumer(&ctx.js, &ctx.topology).await?;
    consume::each_message_showing_progress(consumer, shutdown, |msg| {
        let ctx = ctx.clone();
        async move { handle(&ctx, msg).await }
    })
    .await
}

async fn handle(ctx: &Arc<Ctx>, msg: jetstream::Message) {
    let ended = match Envelope::decode(&msg.payload)
        .and_then(|env| env.expect_kind(step_kind::ENDED).map(|()| env))
        .and_then(|env| env.data_as::<Ended>())
    {
        Ok(e) => e,
        Err(e) => {
            let reason = e.to_string();
            let data = json!({ "reason": reason, "subject": msg.subject.as_str() });
            match Envelope::new(EventKind::EndRejected.as_str(), &data) {
                Ok(ev) => {
                    let dlq = subjects::BROKER_DEADLETTER.to_string();
                    turnstile_shared::deadletter::refuse(&ctx.js, &msg, dlq, &reason, &ev).await;
                }
                Err(e) => tracing::error!(error = %e, "build end.rejected"),
            }
            return;
        }
    };
    // Recorded already by this replica's report handler (see `inline`): ack if that worked.
    // Acks here are not confirmed: one that is lost redelivers the end, and recording it again
    // changes nothing.
    match ctx.inline.outcome(&ended.execution).await {
        Some(true) => {
            if let Err(e) = msg.ack().await {
                tracing::debug!(execution = %ended.execution, error = %e, "ack end");
            }
            return;
        }
        Some(false) => {}
        // A report's end, first delivered here, on a replica that made no attempt: the
        // replica that took the report is recording it right now and removes the message
        // once it has. Given back for a moment; it comes back only if that did not happen.
        None if ended.known.is_some() && msg.info().is_ok_and(|i| i.delivered <= 1) => {
            let _ = msg.ack_with(AckKind::Nak(Some(attempts::GRACE))).await;
            return;
        }
        None => {}
    }
    match record_end(ctx, &ended, false).await {
        Ok(()) => {
            if let Err(e) = msg.ack().await {
                tracing::debug!(execution = %ended.execution, error = %e, "ack end");
            }
        }
        Err(e) => {
            tracing::warn!(execution = %ended.execution, error = %e, "record end; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                .await;
        }
    }
}

/// Records an end and routes it. `ahead`: the end is a worker's report this replica took,
/// recorded at once (`Inline`): its completion and lane item go out beside its write too
/// ([`Early`]). Otherwise (the ended queue, the backstop) they follow it.
async fn record_end(ctx: &Arc<Ctx>, ended: &Ended, ahead: bool) -> Result<(), EndError> {
    ctx.running.forget(&ended.execution);
    // From the record the reporter read, when it sent it: one write, no read (a conflict
    // re-reads).
    let known = ended
        .known
        .as_ref()
        .filter(|k| k.record.id == ended.execution)
        .map(|k| (k.record.clone(), k.revision));
    // The session reads and marker creates that do not depend on the end's outcome go out
    // beside its write (the targets as the reporter read them); for an end routed ahead, its
    // completion and item too, from the record as this end writes it.
    let running = known
        .as_ref()
        .map(|(r, _)| r)
        .filter(|r| r.kind == ExecKind::Step && !r.status.is_terminal());
    let ending = running.filter(|_| ahead).map(|r| ExecutionRecord {
        status: with_start(&ended.status, r.status.started_at()),
        ..r.clone()
    });
    let early_targets = match &ending {
        Some(record) => Ending::Routed(record),
        None => Ending::Targets(running.map(|r| r.targets()).unwrap_or_default()),
    };
    // Whether this call wrote the end (the last decision of the compare-and-set), rather than
    // finding it recorded: a repeat (a redelivered end, the other replica's copy, a resend)
    // may route a completion that is long handed over.
    let wrote = std::sync::atomic::AtomicBool::new(false);
    let write = ctx.buckets.executions.modify_from::<ExecutionRecord, _>(
        ended.execution.as_str(),
        known,
        |cur| match cur {
            Some(r) if !r.status.is_terminal() => {
                wrote.store(true, Ordering::Relaxed);
                Change::Write(ExecutionRecord {
                    status: with_start(&ended.status, r.status.started_at()),
                    ..r.clone()
                })
            }
            _ => {
                wrote.store(false, Ordering::Relaxed);
                Change::Keep
            }
        },
    );
    let (record, mut early) = tokio::join!(write, Early::run(ctx, early_targets));
    let wrote = wrote.load(Ordering::Relaxed);
    let result = finish_end(ctx, record, ended, wrote, &mut early).await;
    // Every marker this end created owes its item until routing publishes it; whatever is
    // still owed now (the end did not reach that target, or failed on the way) gets its item
    // here: no marker waits without one.
    release(ctx, early.owed()).await;
    result
}

async fn finish_end(
    ctx: &Ctx,
    record: Result<Option<ExecutionRecord>, turnstile_shared::kv::KvError>,
    ended: &Ended,
    wrote: bool,
    early: &mut Early,
) -> Result<(), EndError> {
    let record = record?;
    let Some(record) = record else {
        tracing::warn!(execution = %ended.execution, "end of an unknown execution; dropped");
        return Ok(());
    };
    let k = match &record.status {
        ExecStatus::Completed { .. } => EventKind::StepCompleted,
        ExecStatus::Failed { .. } => EventKind::StepFailed,
        _ => EventKind::StepCancelled,
    };
    observe_step_end(&record);
    let mut unrecorded = Vec::new();
    if let (ExecStatus::Cancelled { .. }, Some(step)) = (&record.status, record.step_id()) {
        // Tell the worker now (it also learns from its next heartbeat), then what it owns.
        if let Err(e) = ctx
            .client
            .publish(subjects::step_cancel(&step), "cancel".into())
            .await
        {
            tracing::debug!(%step, error = %e, "cancel notice");
        }
        let walked =
            registry::cancel_under(ctx, &record, Reach::Owned, exec_reason::PARENT_CANCELLED)
                .await?;
        unrecorded = walked.unrecorded;
    }
    // Events go out on the way and are confirmed before the end is acked. The step's own
    // goes out once the first lane item is (it would queue ahead of the completion's write
    // otherwise), still before the events routing emits.
    let mut acks = Vec::new();
    let mut step_event = Some(step_envelope(&record, k)?);
    if delivery::routes_completions(&record) {
        route::route(ctx, &record, wrote, &mut acks, early, &mut step_event).await?;
    }
    if let Some(ev) = step_event {
        acks.push(send(ctx, &ev).await?);
    }
    for ack in acks {
        ack.await?;
    }
    // Ended work is no longer its owner's to cancel on stop (in the background).
    crate::owned::forget(ctx, &record);
    // Last, once the end is routed (the end is acked after it: see `recheck_unrecorded`).
    registry::recheck_unrecorded(
        ctx,
        &record.id,
        unrecorded,
        Reach::Owned,
        exec_reason::PARENT_CANCELLED,
    )
    .await;
    Ok(())
}

/// `turnstile_steps_ended`, once per recorded end (a repeated end keeps the record as it was).
fn observe_step_end(record: &ExecutionRecord) {
    if record.kind != ExecKind::Step {
        return;
    }
    let kind = record.work.as_ref().map_or("unknown", |w| w.kind());
    let outcome = match &record.status {
        ExecStatus::Completed { .. } => "completed",
        ExecStatus::Failed { .. } => "failed",
        _ => "cancelled",
    };
    turnstile_shared::metrics::metrics()
        .steps_ended
        .get_or_create(&turnstile_shared::metrics::StepLabels { kind, outcome })
        .inc();
}

/// Keeps the start time the record knew (the end message may have been built without it).
fn with_start(status: &ExecStatus, known: Option<chrono::DateTime<chrono::Utc>>) -> ExecStatus {
    let mut s = status.clone();
    match &mut s {
        ExecStatus::Completed { started_at, .. }
        | ExecStatus::Failed { started_at, .. }
        | ExecStatus::Cancelled { started_at, .. }
            if started_at.is_none() =>
        {
            *started_at = known;
        }
        _ => {}
    }
    s
}

/// Publishes the items of markers that have none yet. Not a removal: another router may have
/// seen the marker meanwhile and left its completion to this delivery; a delivery that finds
/// nothing clears the marker and arms again for anything pending.
async fn release(ctx: &Ctx, owed: Vec<Owed>) {
    for (target, marker, rev) in owed {
        if let Err(e) = arming::publish_item(&ctx.js, &target, &marker, rev, None).await {
            tracing::warn!(session = %target, error = %e, "publish the item of an armed delivery; its marker is checked against the lane once it is older than the trust window");
        }
    }
}
