//! The audit that keeps every slot accounted for when the store loses a write (R11).
//!
//! A pass creates the record of every slot it decides before it moves the schedule's cursor
//! past it, except a `buffer_one` slot held back, which the schedule's record names
//! (`buffered`) until it fires. So every slot at or before the cursor has a record, or is the
//! one held. The fault campaign found slots with neither: a buffered slot that never fired and
//! was never named again, twice, each just before a NATS node of the three-node cluster was
//! filled up or killed (the schedule's write that held it acknowledged, then lost). Such a slot
//! cannot be told apart from one that never existed, and is the user's to know about.
//!
//! So every [`PERIOD`] the ticker hands its schedules here: for each, the slots of the last
//! [`WINDOW`] up to its cursor (older than [`GRACE`], and not the one held) are matched against
//! the slot records written in that time, and a slot with none is recorded `missed`, reason
//! `record_lost`, with a warning. Another replica doing the same creates the same record once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use futures::StreamExt;
use turnstile_shared::schedules::{slot_key, ScheduleRecord, SlotOutcome, SlotRecord};

use crate::cron::CronSpec;
use crate::ctx::Ctx;
use crate::plan::slot_reason;
use crate::slot_record::{record, TickError};

/// How often the ticker audits.
pub(crate) const PERIOD: Duration = Duration::from_secs(30);
/// How far back slots are audited.
const WINDOW: TimeDelta = TimeDelta::minutes(10);
/// A slot younger than this is left to the pass deciding it.
const GRACE: TimeDelta = TimeDelta::seconds(10);
/// Most slots looked at per schedule.
const MAX_SLOTS: usize = 1000;
/// Schedules audited at once.
const CONCURRENCY: usize = 16;

/// Audits every schedule given (its record and parsed cron), off the ticker's loop.
pub(crate) async fn audit(ctx: Arc<Ctx>, schedules: Vec<(ScheduleRecord, CronSpec)>) {
    let ctx = &ctx;
    futures::stream::iter(schedules)
        .for_each_concurrent(CONCURRENCY, |(s, cron)| async move {
            if let Err(e) = audit_one(ctx, &s, &cron).await {
                tracing::debug!(schedule = %s.spec.name, error = %e, "audit slots; again later");
            }
        })
        .await;
}

async fn audit_one(ctx: &Ctx, s: &ScheduleRecord, cron: &CronSpec) -> Result<(), TickError> {
    let now = Utc::now();
    let upto = s.cursor.min(now - GRACE);
    // Slots before the schedule existed are not its slots (its cursor starts at its creation).
    let from = (now - WINDOW).max(s.created_at);
    let slots: Vec<_> = cron
        .slots_between(from, upto, MAX_SLOTS)
        .into_iter()
        .filter(|slot| s.buffered != Some(*slot))
        .collect();
    if slots.is_empty() {
        return Ok(());
    }
    let name = &s.spec.name;
    // The records written since the window began (a slot is recorded at or after its time).
    let written: HashSet<String> = ctx
        .buckets
        .slots
        .entries_written_since::<SlotRecord>(&format!("{name}.>"), Some(from))
        .await?
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    for slot in slots {
        if written.contains(&slot_key(name, slot)) {
            continue;
        }
        let outcome = SlotOutcome::Missed {
            reason: slot_reason::RECORD_LOST.to_string(),
        };
        let standing = record(ctx, name, slot, outcome).await?;
        if matches!(&standing.outcome, SlotOutcome::Missed { reason } if reason == slot_reason::RECORD_LOST)
        {
            tracing::warn!(schedule = %name, %slot,
                "a slot before the cursor had no record (a store fault lost what decided it): recorded missed, record_lost");
        }
    }
    Ok(())
}
