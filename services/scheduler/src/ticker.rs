//! The scheduler's loop: wake at the next slot of any schedule (or when a schedule changes or a
//! run ends), then give every due slot its one record (R11). A slot is claimed by creating its
//! record, so with several replicas each slot is decided once; the run it fires has an id
//! derived from the slot, so starting it again after a crash is harmless (R14).

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, ApiError};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, EventKind};
use turnstile_shared::runs::{RunRecord, StartRun};
use turnstile_shared::schedules::{slot_key, slot_run, ScheduleRecord, SlotOutcome, SlotRecord};
use turnstile_shared::{subjects, RunId};

use crate::cron::CronSpec;
use crate::plan::{decide, Decision, Situation};
use crate::Ctx;

/// Longest sleep without looking (a missed wake-up costs at most this).
const MAX_SLEEP: Duration = Duration::from_secs(30);
/// Most slots handled in one pass of one schedule.
const MAX_SLOTS: usize = 1000;
const API: Duration = Duration::from_secs(10);

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

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    // Wake-ups besides the timer: schedule changes and run ends (a buffered slot waits on one).
    let mut changes = match ctx.buckets.schedules.store().watch_all().await {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "watch schedules; relying on the timer");
            None
        }
    };
    let mut run_ends = ctx.client.subscribe(subjects::ALL_RUN_EVENTS).await.ok();
    loop {
        let next = match pass(&ctx).await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "scheduler pass; retrying");
                Some(Utc::now() + chrono::TimeDelta::seconds(1))
            }
        };
        let sleep = next
            .map(|n| (n - Utc::now()).to_std().unwrap_or_default())
            .unwrap_or(MAX_SLEEP)
            .min(MAX_SLEEP);
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            Some(_) = async { match changes.as_mut() { Some(w) => w.next().await, None => std::future::pending().await } } => {}
            Some(_) = async { match run_ends.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {}
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

/// Handles every schedule's due slots; returns the earliest next slot.
async fn pass(ctx: &Ctx) -> Result<Option<DateTime<Utc>>, TickError> {
    let schedules = ctx.buckets.schedules.values::<ScheduleRecord>().await?;
    let mut earliest: Option<DateTime<Utc>> = None;
    for s in schedules {
        let name = s.spec.name.clone();
        let cron = match CronSpec::parse(&s.spec.cron, &s.spec.tz) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(schedule = %name, error = %e, "unreadable schedule; skipped");
                continue;
            }
        };
        let cursor = match process(ctx, s, &cron).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(schedule = %name, error = %e, "schedule pass");
                continue;
            }
        };
        if let Some(n) = cron.next_after(cursor.max(Utc::now())) {
            earliest = Some(earliest.map_or(n, |e| e.min(n)));
        }
    }
    Ok(earliest)
}

/// One schedule: a buffered slot whose blocker ended fires; then each due slot gets its
/// record. Returns the cursor after the pass.
async fn process(
    ctx: &Ctx,
    mut s: ScheduleRecord,
    cron: &CronSpec,
) -> Result<DateTime<Utc>, TickError> {
    let name = s.spec.name.clone();
    let running = running_run(ctx, &s).await?;
    if let (Some(slot), None) = (s.buffered, &running) {
        let now = Utc::now();
        fire(ctx, &s, slot, now).await?;
        s = update(ctx, &name, |r| {
            r.buffered = None;
            r.last_run = slot_run(&name, slot);
        })
        .await?;
    }
    let now = Utc::now();
    let due = cron.slots_between(s.cursor, now, MAX_SLOTS);
    if due.is_empty() {
        return Ok(s.cursor);
    }
    let running = running_run(ctx, &s).await?;
    let situation = Situation {
        now,
        paused: s.paused.is_some(),
        running: running.as_ref(),
        buffered: s.buffered.is_some(),
    };
    let decisions = decide(&s.spec, &due, &situation, |slot| slot_run(&name, slot));
    for (slot, decision) in due.iter().zip(decisions) {
        let mut buffer = None;
        let mut fired = None;
        match decision {
            Decision::Fire => fired = Some(fire(ctx, &s, *slot, now).await?),
            Decision::CancelAndFire { cancel } => {
                cancel_run(ctx, &cancel).await?;
                fired = Some(fire(ctx, &s, *slot, now).await?);
            }
            Decision::Buffer => buffer = Some(*slot),
            Decision::Skip { reason, yielded_to } => {
                let outcome = SlotOutcome::Skipped {
                    reason: reason.to_string(),
                    yielded_to,
                };
                record(ctx, &name, *slot, outcome).await?;
            }
            Decision::Miss { reason } => {
                let outcome = SlotOutcome::Missed {
                    reason: reason.to_string(),
                };
                record(ctx, &name, *slot, outcome).await?;
            }
        }
        let slot = *slot;
        s = update(ctx, &name, |r| {
            if r.cursor < slot {
                r.cursor = slot;
            }
            if let Some(b) = buffer {
                r.buffered.get_or_insert(b);
            }
            if let Some(run) = &fired {
                r.last_run = Some(run.clone());
            }
        })
        .await?;
    }
    Ok(s.cursor)
}

/// The schedule's last run, if it has not ended.
async fn running_run(ctx: &Ctx, s: &ScheduleRecord) -> Result<Option<RunId>, TickError> {
    let Some(run) = &s.last_run else {
        return Ok(None);
    };
    let rec = ctx.buckets.runs.get::<RunRecord>(run.as_str()).await?;
    Ok(match rec {
        Some((r, _)) if !r.state.is_terminal() => Some(run.clone()),
        // Fired but not created yet (a crash between): treat as going; the claim re-starts it.
        None => Some(run.clone()),
        Some(_) => None,
    })
}

/// Claims the slot as fired and starts its run. If the slot was claimed already (another
/// replica, or this one before a crash), the existing record stands and its run is started
/// again if it was fired (idempotent by run id).
pub(crate) async fn fire(
    ctx: &Ctx,
    s: &ScheduleRecord,
    slot: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<RunId, TickError> {
    let name = &s.spec.name;
    let run = slot_run(name, slot)
        .ok_or_else(|| ApiError::bad_request(format!("schedule {name} gives no valid run id")))?;
    let drift_ms = (now - slot).num_milliseconds();
    let outcome = SlotOutcome::Fired {
        fired_at: now,
        drift_ms,
        late: drift_ms > s.spec.late_threshold.as_millis() as i64,
        run: run.clone(),
    };
    let claimed = record(ctx, name, slot, outcome).await?;
    match &claimed.outcome {
        SlotOutcome::Fired { run, .. } => {
            start_run(ctx, s, run.clone()).await?;
            Ok(run.clone())
        }
        _ => Ok(run),
    }
}

/// `cancel_other`: the running run stops at its next boundary, `failed: cancelled`.
async fn cancel_run(ctx: &Ctx, run: &RunId) -> Result<(), TickError> {
    let req = turnstile_shared::runs::RunRef { run: run.clone() };
    let _: RunRecord = api::call(&ctx.client, subjects::api::RUNS_CANCEL, &req, API).await?;
    Ok(())
}

pub(crate) async fn start_run(
    ctx: &Ctx,
    s: &ScheduleRecord,
    run: RunId,
) -> Result<RunRecord, TickError> {
    let req = StartRun {
        session: s.spec.session.clone(),
        messages: s.spec.messages.clone(),
        finalizer: s.spec.finalizer.clone(),
        limits: s.spec.limits,
        schedule: Some(s.spec.name.clone()),
        id: Some(run),
    };
    Ok(api::call(&ctx.client, subjects::api::RUNS_START, &req, API).await?)
}

/// Creates the slot's record (the claim) and emits `slot.<outcome>`; returns the record that
/// stands, which is an earlier one if the slot was decided before.
async fn record(
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
    let k = rec.outcome.event_kind().as_str();
    let env = Envelope::new(k, &rec)?.with_id(format!("{key}:{k}"));
    events::publish_durable(&ctx.js, subjects::schedule_event(schedule, k), &env, None).await?;
    Ok(rec)
}

pub(crate) async fn update(
    ctx: &Ctx,
    name: &str,
    f: impl Fn(&mut ScheduleRecord),
) -> Result<ScheduleRecord, TickError> {
    let next = ctx
        .buckets
        .schedules
        .edit::<ScheduleRecord, _>(name, f)
        .await?;
    next.ok_or_else(|| TickError::Api(ApiError::not_found(format!("no schedule {name}"))))
}

/// An event about a schedule itself (`schedule.added`, ...).
pub(crate) async fn schedule_event(ctx: &Ctx, name: &str, k: EventKind, data: serde_json::Value) {
    let k = k.as_str();
    let env = Envelope::new(k, &json!({ "schedule": name, "data": data }));
    match env {
        Ok(env) => {
            if let Err(e) =
                events::publish_durable(&ctx.js, subjects::schedule_event(name, k), &env, None)
                    .await
            {
                tracing::warn!(schedule = name, error = %e, "schedule event");
            }
        }
        Err(e) => tracing::warn!(error = %e, "build schedule event"),
    }
}
