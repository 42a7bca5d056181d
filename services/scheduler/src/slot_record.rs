//! A slot's one record (R11): created by whoever decides the slot first (the claim), with
//! its `slot.<outcome>` event and metrics; and the error of every step of a pass. Used by the
//! ticker's passes and by the slot audit.

use chrono::{DateTime, Utc};
use turnstile_shared::api::ApiError;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events;
use turnstile_shared::schedules::{slot_key, SlotOutcome, SlotRecord};
use turnstile_shared::subjects;

use crate::ctx::Ctx;

#[derive(Debug, thiserror::Error)]
pub(crate) enum TickError {
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Publish(#[from] events::PublishError),
    #[error(transparent)]
    Envelope(#[from] turnstile_shared::EnvelopeError),
    #[error("start run: {0}")]
    Api(#[from] ApiError),
}

/// `turnstile_slots` and `turnstile_fire_drift_seconds`, by the claim that decided the slot.
fn observe_slot(outcome: &SlotOutcome) {
    use turnstile_shared::metrics::{metrics, SlotLabel};
    let m = metrics();
    let count = |outcome| {
        m.slots.get_or_create(&SlotLabel { outcome }).inc();
    };
    match outcome {
        SlotOutcome::Fired { drift_ms, late, .. } => {
            count("fired");
            if *late {
                count("late");
            }
            m.fire_drift.observe((*drift_ms as f64 / 1000.0).max(0.0));
        }
        SlotOutcome::Skipped { .. } => count("skipped"),
        SlotOutcome::Missed { .. } => count("missed"),
    }
}

/// Creates the slot's record (the claim) and emits `slot.<outcome>`; returns the record that
/// stands, which is an earlier one if the slot was decided before.
pub(crate) async fn record(
    ctx: &Ctx,
    schedule: &str,
    slot: DateTime<Utc>,
    outcome: SlotOutcome,
) -> Result<SlotRecord, TickError> {
    let key = slot_key(schedule, slot);
    let rec = SlotRecord {
        schedule: schedule.to_string(),
        slot,
        recorded_at: Utc::now(),
        outcome,
    };
    if ctx.buckets.slots.create(&key, &rec).await?.is_none() {
        if let Some((existing, _)) = ctx.buckets.slots.get::<SlotRecord>(&key).await? {
            return Ok(existing);
        }
    }
    observe_slot(&rec.outcome);
    let k = rec.outcome.event_kind().as_str();
    let env = Envelope::new(k, &rec)?.with_id(format!("{key}:{k}"));
    events::publish_durable(&ctx.js, subjects::schedule_event(schedule, k), &env, None).await?;
    Ok(rec)
}
