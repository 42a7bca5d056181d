//! The `ts.api.schedules.*` service: add, list, show, pause, resume, trigger, backfill,
//! delete. Any replica answers; changes are compare-and-set writes, and a bad request gets a
//! clear error while the service keeps serving (R15).

use std::sync::Arc;

use async_nats::service::ServiceExt;
use chrono::{DateTime, TimeDelta, Utc};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{ApiError, ErrorCode};
use turnstile_shared::events::EventKind;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::runs::RunRecord;
use turnstile_shared::schedules::{
    valid_name, Backfill, ListSchedules, PauseSchedule, Paused, ScheduleRecord, ScheduleRef,
    ScheduleSpec, ScheduleView, SlotRecord,
};
use turnstile_shared::{subjects, RunId};

use crate::cron::CronSpec;
use crate::ctx::{Ctx, Error};
use crate::ticker::{fire, schedule_event, start_run, update, TickError};

/// Slots a backfill may fire at once.
const MAX_BACKFILL: usize = 500;
/// Slot records `show` returns, newest first.
const SHOW_SLOTS: usize = 20;
/// How far back `show` looks for slot records (their default retention).
const LOOK_BACK: TimeDelta = TimeDelta::days(30);

pub(crate) async fn serve(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    let service = ctx
        .client
        .service_builder()
        .description(
            "Turnstile schedules: add, list, show, pause, resume, trigger, backfill, delete",
        )
        .start(subjects::api::SCHEDULER_SERVICE, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(Error::Api)?;
    let group = service.group(subjects::api::SCHEDULES_GROUP);
    let mut tasks = Vec::new();
    macro_rules! endpoint {
        ($verb:literal, $handler:path) => {{
            tasks.push(
                turnstile_shared::service_info::add(
                    &group,
                    $verb,
                    ctx.clone(),
                    shutdown.clone(),
                    $handler,
                )
                .await
                .map_err(Error::Api)?,
            );
        }};
    }
    endpoint!("add", add);
    endpoint!("list", list);
    endpoint!("show", show);
    endpoint!("pause", pause);
    endpoint!("resume", resume);
    endpoint!("trigger", trigger);
    endpoint!("backfill", backfill);
    endpoint!("delete", delete);
    futures::future::join_all(tasks).await;
    let _ = service.stop().await;
    Ok(())
}

/// A fire's failure as the answer: a store or server failure by its kind (`unavailable` when
/// another try may succeed), the run API's own answer as it came.
fn tick(e: TickError) -> ApiError {
    match e {
        TickError::Api(e) => e,
        TickError::Kv(e) => e.into(),
        TickError::Publish(e) => e.into(),
        TickError::Envelope(e) => ApiError::internal(e),
    }
}

async fn get(ctx: &Ctx, name: &str) -> Result<ScheduleRecord, ApiError> {
    ctx.buckets
        .schedules
        .get::<ScheduleRecord>(name)
        .await
        .map_err(ApiError::from)?
        .map(|(r, _)| r)
        .ok_or_else(|| ApiError::not_found(format!("no schedule {name:?}")))
}

fn cron_of(s: &ScheduleSpec) -> Result<CronSpec, ApiError> {
    CronSpec::parse(&s.cron, &s.tz).map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn add(ctx: Arc<Ctx>, spec: ScheduleSpec) -> Result<ScheduleRecord, ApiError> {
    if !valid_name(&spec.name) {
        return Err(ApiError::bad_request(format!(
            "schedule name {:?} must be 1-40 letters, digits, '-' or '_'",
            spec.name
        )));
    }
    cron_of(&spec)?;
    if spec.messages.is_empty() || spec.messages.iter().any(|m| m.trim().is_empty()) {
        return Err(ApiError::bad_request(
            "a schedule needs at least one non-blank message",
        ));
    }
    if spec.limits.max_rounds == 0 {
        return Err(ApiError::bad_request("max_rounds must be at least 1"));
    }
    let session = ctx
        .buckets
        .sessions
        .get::<SessionRecord>(spec.session.as_str())
        .await
        .map_err(ApiError::from)?
        .map(|(r, _)| r)
        .ok_or_else(|| ApiError::not_found(format!("no session {}", spec.session)))?;
    if !session.is_active() {
        return Err(ApiError::new(
            ErrorCode::Stopped,
            format!("session {} is stopped", session.id),
        ));
    }
    let now = Utc::now();
    let record = ScheduleRecord {
        spec: spec.clone(),
        created_at: now,
        // Slots before the schedule existed are not its slots.
        cursor: now,
        paused: None,
        last_run: None,
        buffered: None,
    };
    if ctx
        .buckets
        .schedules
        .create(&spec.name, &record)
        .await
        .map_err(ApiError::from)?
        .is_none()
    {
        return Err(ApiError::new(
            ErrorCode::Exists,
            format!("schedule {:?} exists", spec.name),
        ));
    }
    schedule_event(&ctx, &spec.name, EventKind::ScheduleAdded, json!(record)).await;
    Ok(record)
}

/// One page of schedules, most recently written first.
async fn list(
    ctx: Arc<Ctx>,
    req: ListSchedules,
) -> Result<turnstile_shared::page::Page<ScheduleRecord>, ApiError> {
    turnstile_shared::page::newest(&ctx.buckets.schedules, ">", &req.page, |_, s| {
        Some::<ScheduleRecord>(s)
    })
    .await
}

async fn show(ctx: Arc<Ctx>, req: ScheduleRef) -> Result<ScheduleView, ApiError> {
    let schedule = get(&ctx, &req.name).await?;
    let cron = cron_of(&schedule.spec)?;
    let zone = cron.zone();
    let next = cron
        .upcoming(Utc::now(), 5)
        .into_iter()
        .map(|t| t.with_timezone(&zone).to_rfc3339())
        .collect();
    let slots = slots_of(&ctx, &schedule, &cron).await?;
    Ok(ScheduleView {
        schedule,
        next,
        slots,
    })
}

/// The schedule's latest slot records: those written since its [`SHOW_SLOTS`]th latest slot
/// (found from the cron, the records by the stream's time index), so the cost follows the
/// slots shown, not the schedule's history nor the other schedules'.
async fn slots_of(
    ctx: &Ctx,
    s: &ScheduleRecord,
    cron: &CronSpec,
) -> Result<Vec<SlotRecord>, ApiError> {
    let since = latest_slots_from(cron, s.cursor, SHOW_SLOTS);
    let mut out: Vec<SlotRecord> = ctx
        .buckets
        .slots
        .entries_written_since(&format!("{}.>", s.spec.name), Some(since))
        .await
        .map_err(ApiError::from)?
        .into_iter()
        .map(|(_, r)| r)
        .collect();
    out.sort_by_key(|r| std::cmp::Reverse(r.slot));
    out.truncate(SHOW_SLOTS);
    Ok(out)
}

/// The `n`th latest slot at or before `until` (looking back at most a retention's worth,
/// [`LOOK_BACK`]); slot records are written at or after their slot.
fn latest_slots_from(cron: &CronSpec, until: DateTime<Utc>, n: usize) -> DateTime<Utc> {
    let mut span = TimeDelta::minutes(1);
    loop {
        let from = until - span;
        let slots = cron.slots_between(from, until, 100_000);
        if slots.len() >= n {
            return slots[slots.len() - n];
        }
        if span >= LOOK_BACK {
            return from;
        }
        span = (span * 4).min(LOOK_BACK);
    }
}

async fn pause(ctx: Arc<Ctx>, req: PauseSchedule) -> Result<ScheduleRecord, ApiError> {
    get(&ctx, &req.name).await?;
    let at = Utc::now();
    let rec = update(&ctx, &req.name, |r| {
        if r.paused.is_none() {
            r.paused = Some(Paused {
                at,
                note: req.note.clone(),
            });
        }
    })
    .await
    .map_err(tick)?;
    schedule_event(
        &ctx,
        &req.name,
        EventKind::SchedulePaused,
        json!({ "note": req.note }),
    )
    .await;
    Ok(rec)
}

async fn resume(ctx: Arc<Ctx>, req: ScheduleRef) -> Result<ScheduleRecord, ApiError> {
    get(&ctx, &req.name).await?;
    let rec = update(&ctx, &req.name, |r| r.paused = None)
        .await
        .map_err(tick)?;
    schedule_event(&ctx, &req.name, EventKind::ScheduleResumed, json!({})).await;
    Ok(rec)
}

/// Fires the schedule now, outside its slots: a run is queued on the session's lane (where it
/// waits behind anything running). It becomes the run later slots are judged against.
async fn trigger(ctx: Arc<Ctx>, req: ScheduleRef) -> Result<RunRecord, ApiError> {
    let s = get(&ctx, &req.name).await?;
    let run = RunId::new();
    let rec = start_run(&ctx, &s, run.clone()).await.map_err(tick)?;
    update(&ctx, &req.name, |r| r.last_run = Some(run.clone()))
        .await
        .map_err(tick)?;
    schedule_event(
        &ctx,
        &req.name,
        EventKind::ScheduleTriggered,
        json!({ "run": run }),
    )
    .await;
    Ok(rec)
}

/// Fires every slot in (from, to] that has no record yet (each queued on the lane in order).
async fn backfill(ctx: Arc<Ctx>, req: Backfill) -> Result<Vec<SlotRecord>, ApiError> {
    if req.to <= req.from {
        return Err(ApiError::bad_request("backfill needs --from before --to"));
    }
    let s = get(&ctx, &req.name).await?;
    let cron = cron_of(&s.spec)?;
    let slots = cron.slots_between(req.from, req.to, MAX_BACKFILL + 1);
    if slots.len() > MAX_BACKFILL {
        return Err(ApiError::bad_request(format!(
            "more than {MAX_BACKFILL} slots in that range; backfill a shorter one"
        )));
    }
    let mut out = Vec::new();
    for slot in slots {
        let key = turnstile_shared::schedules::slot_key(&s.spec.name, slot);
        let existing = ctx
            .buckets
            .slots
            .get::<SlotRecord>(&key)
            .await
            .map_err(ApiError::from)?;
        if existing.is_none() {
            fire(&ctx, &s, slot).await.map_err(tick)?;
        }
        if let Some((r, _)) = ctx
            .buckets
            .slots
            .get::<SlotRecord>(&key)
            .await
            .map_err(ApiError::from)?
        {
            out.push(r);
        }
    }
    Ok(out)
}

async fn delete(ctx: Arc<Ctx>, req: ScheduleRef) -> Result<ScheduleRecord, ApiError> {
    let s = get(&ctx, &req.name).await?;
    ctx.buckets
        .schedules
        .store()
        .delete(&req.name)
        .await
        .map_err(ApiError::failure)?;
    schedule_event(&ctx, &req.name, EventKind::ScheduleDeleted, json!({})).await;
    Ok(s)
}
