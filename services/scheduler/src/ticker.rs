//! The scheduler's loop: wake at the next slot of any schedule (or when a schedule changes or a
//! run ends), then give every due slot its one record (R11). A slot is claimed by creating its
//! record, so with several replicas each slot is decided once; the run it fires has an id
//! derived from the slot, so starting it again after a crash is harmless (R14).
//!
//! The schedules are held in a [`Table`] kept by a watch on the bucket, and due schedules are
//! handled concurrently (at most [`CONCURRENCY`] at once), each with one compare-and-set write
//! of its record at the end: every step before it (claim, run start) is idempotent, so a crash
//! midway only repeats them.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::{Operation, Watch};
use chrono::{DateTime, Utc};
use futures::{FutureExt, StreamExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, ApiError};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, EventKind};
use turnstile_shared::runs::{RunRecord, StartRun};
use turnstile_shared::schedules::{slot_run, ScheduleRecord, SlotOutcome, SlotRecord};
use turnstile_shared::{subjects, RunId};

use crate::cron::CronSpec;
use crate::ctx::Ctx;
use crate::plan::{decide, Decision, Situation};
pub(crate) use crate::slot_record::{record, TickError};
use crate::table::Table;

/// Longest sleep without looking (a missed wake-up costs at most this).
const MAX_SLEEP: Duration = Duration::from_secs(30);
/// Most slots handled in one pass of one schedule.
const MAX_SLOTS: usize = 1000;
/// Schedules handled at once in a pass.
const CONCURRENCY: usize = 256;
const API: Duration = Duration::from_secs(10);

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    let mut table = Table::default();
    let mut watch: Option<Watch> = None;
    // Run ends wake a schedule holding a buffered slot.
    let mut run_ends = ctx.client.subscribe(subjects::ALL_RUN_EVENTS).await.ok();
    let mut check_buffered = true;
    // The slot audit (`audit`): at most one at a time, off this loop.
    let mut audit_at = tokio::time::Instant::now() + crate::audit::PERIOD;
    let mut auditing: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let Some(w) = watch.as_mut() else {
            match ctx.buckets.schedules.store().watch_with_history(">").await {
                Ok(w) => {
                    table = Table::default();
                    watch = Some(w);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "watch schedules; retrying");
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
            continue;
        };
        // Everything the watch has ready, so the pass sees current records.
        while let Some(change) = w.next().now_or_never() {
            if !apply(&mut table, change) {
                watch = None;
                break;
            }
        }
        if watch.is_none() {
            continue;
        }
        if audit_at <= tokio::time::Instant::now()
            && auditing.as_ref().is_none_or(|a| a.is_finished())
        {
            audit_at = tokio::time::Instant::now() + crate::audit::PERIOD;
            auditing = Some(tokio::spawn(crate::audit::audit(
                ctx.clone(),
                table.snapshot(),
            )));
        }
        let now = Utc::now();
        let due = table.due(now, check_buffered);
        check_buffered = false;
        if !due.is_empty() {
            pass(&ctx, &mut table, due).await;
            continue;
        }
        let sleep = table
            .wake_at()
            .map(|n| (n - now).to_std().unwrap_or_default())
            .unwrap_or(MAX_SLEEP)
            .min(MAX_SLEEP);
        let Some(w) = watch.as_mut() else { continue };
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            change = w.next() => if !apply(&mut table, change) { watch = None },
            Some(_) = async { match run_ends.as_mut() { Some(s) => s.next().await, None => std::future::pending().await } } => {
                check_buffered = table.has_buffered();
            }
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

type Change =
    Option<Result<async_nats::jetstream::kv::Entry, async_nats::jetstream::kv::WatcherError>>;

/// Applies one watch message to the table; `false` when the watch has ended or failed (it is
/// then opened again, which re-reads every schedule).
fn apply(table: &mut Table, change: Change) -> bool {
    let entry = match change {
        Some(Ok(entry)) => entry,
        Some(Err(e)) => {
            tracing::warn!(error = %e, "schedules watch failed; re-reading");
            return false;
        }
        None => return false,
    };
    match entry.operation {
        Operation::Put => match serde_json::from_slice::<ScheduleRecord>(&entry.value) {
            Ok(record) => table.upsert(record, entry.revision),
            Err(e) => tracing::error!(key = %entry.key, error = %e, "unreadable schedule; skipped"),
        },
        Operation::Delete | Operation::Purge => table.remove(&entry.key, entry.revision),
    }
    true
}

/// Handles the due schedules in two rounds, [`CONCURRENCY`] schedules at once in each: first
/// every due slot gets its record (the claim, stamped with its fire time), then the fired runs
/// start and each schedule's record is written. Claims first keeps a thousand slots due in the
/// same second from waiting on each other's run starts; a crash between the rounds leaves the
/// cursor behind, so the next pass finds the claims standing and starts their runs (R14).
async fn pass(ctx: &Ctx, table: &mut Table, due: Vec<(ScheduleRecord, u64)>) {
    let work: Vec<_> = due
        .into_iter()
        .filter_map(|(s, rev)| table.cron(&s.spec.name).cloned().map(|c| (s, rev, c)))
        .collect();
    let now = Utc::now();
    let claimed: Vec<_> = futures::stream::iter(work)
        .map(|(s, rev, cron)| async move {
            let name = s.spec.name.clone();
            (name, claim(ctx, s, rev, &cron).await)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut plans = Vec::with_capacity(claimed.len());
    for (name, result) in claimed {
        match result {
            Ok(plan) => plans.push(plan),
            Err(e) => {
                tracing::warn!(schedule = %name, error = %e, "schedule pass; retrying");
                table.retry_later(&name, now);
            }
        }
    }
    let done: Vec<_> = futures::stream::iter(plans)
        .map(|plan| async move {
            let name = plan.before.spec.name.clone();
            (name, act(ctx, plan).await)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    for (name, result) in done {
        match result {
            Ok(Some((record, revision))) => table.upsert(record, revision),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(schedule = %name, error = %e, "schedule pass; retrying");
                table.retry_later(&name, now);
            }
        }
    }
}

/// What a schedule's pass decided: the record as it will be written, and the runs to cancel
/// and start, in order.
struct Plan {
    before: ScheduleRecord,
    revision: u64,
    after: ScheduleRecord,
    actions: Vec<Action>,
}

enum Action {
    Cancel(RunId),
    Start(RunId),
}

/// The first round for one schedule: a buffered slot whose blocker ended is claimed as fired;
/// then each due slot gets its record.
async fn claim(
    ctx: &Ctx,
    s: ScheduleRecord,
    revision: u64,
    cron: &CronSpec,
) -> Result<Plan, TickError> {
    let name = s.spec.name.clone();
    let mut running = running_run(ctx, &s).await?;
    let mut after = s.clone();
    let mut actions = Vec::new();
    if let (Some(slot), None) = (s.buffered, &running) {
        after.buffered = None;
        if let Some(run) = claim_fire(ctx, &s, slot).await? {
            after.last_run = Some(run.clone());
            running = Some(run.clone());
            actions.push(Action::Start(run));
        }
    }
    let now = Utc::now();
    let due = cron.slots_between(s.cursor, now, MAX_SLOTS);
    if !due.is_empty() {
        let situation = Situation {
            now,
            paused: s.paused.is_some(),
            running: running.as_ref(),
            buffered: after.buffered.is_some(),
        };
        let decisions = decide(&s.spec, &due, &situation, |slot| slot_run(&name, slot));
        for (slot, decision) in due.iter().zip(decisions) {
            match decision {
                Decision::Fire => {
                    if let Some(run) = claim_fire(ctx, &s, *slot).await? {
                        after.last_run = Some(run.clone());
                        actions.push(Action::Start(run));
                    }
                }
                Decision::CancelAndFire { cancel } => {
                    if let Some(run) = claim_fire(ctx, &s, *slot).await? {
                        after.last_run = Some(run.clone());
                        actions.push(Action::Cancel(cancel));
                        actions.push(Action::Start(run));
                    }
                }
                Decision::Buffer => {
                    after.buffered.get_or_insert(*slot);
                }
                Decision::Skip { reason, yielded_to } => {
                    let outcome = SlotOutcome::Skipped {
                        reason: reason.to_string(),
                        yielded_to,
                    };
                    let standing = record(ctx, &name, *slot, outcome).await?;
                    start_if_fired(standing, &mut after, &mut actions);
                }
                Decision::Miss { reason } => {
                    let outcome = SlotOutcome::Missed {
                        reason: reason.to_string(),
                    };
                    let standing = record(ctx, &name, *slot, outcome).await?;
                    start_if_fired(standing, &mut after, &mut actions);
                }
            }
            after.cursor = after.cursor.max(*slot);
        }
    }
    Ok(Plan {
        before: s,
        revision,
        after,
        actions,
    })
}

/// A slot an earlier pass claimed as fired keeps that record (R11), whatever this pass would
/// decide for it now (a catch-up that only fires the latest slot, a skip): its run is started
/// again (idempotent by run id), since that pass may have failed before its start landed (R12:
/// a slot recorded fired has its run).
fn start_if_fired(standing: SlotRecord, after: &mut ScheduleRecord, actions: &mut Vec<Action>) {
    if let SlotOutcome::Fired { run, .. } = standing.outcome {
        after.last_run = Some(run.clone());
        actions.push(Action::Start(run));
    }
}

/// The second round: cancels and starts the plan's runs (idempotent by run id), then writes
/// the schedule's record once. Returns the record written and its revision (`None` if
/// nothing changed).
async fn act(ctx: &Ctx, plan: Plan) -> Result<Option<(ScheduleRecord, u64)>, TickError> {
    for action in &plan.actions {
        match action {
            Action::Cancel(run) => cancel_run(ctx, run).await?,
            Action::Start(run) => {
                start_run(ctx, &plan.before, run.clone()).await?;
            }
        }
    }
    if plan.after == plan.before {
        return Ok(None);
    }
    write_back(ctx, &plan.before, plan.revision, plan.after).await
}

/// Writes the pass's result at the revision it started from; if the record changed meanwhile
/// (an API call), the same changes are applied to the current record.
async fn write_back(
    ctx: &Ctx,
    before: &ScheduleRecord,
    revision: u64,
    after: ScheduleRecord,
) -> Result<Option<(ScheduleRecord, u64)>, TickError> {
    let name = &before.spec.name;
    let bucket = &ctx.buckets.schedules;
    if let Some(rev) = bucket.update(name, &after, revision).await? {
        return Ok(Some((after, rev)));
    }
    let edited = bucket
        .edit::<ScheduleRecord, _>(name, |r| crate::plan::merge_pass(r, before, &after))
        .await?;
    if edited.is_none() {
        tracing::info!(schedule = %name, "schedule deleted during its pass");
        return Ok(None);
    }
    Ok(bucket.get::<ScheduleRecord>(name).await?)
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
) -> Result<Option<RunId>, TickError> {
    let run = claim_fire(ctx, s, slot).await?;
    if let Some(run) = &run {
        start_run(ctx, s, run.clone()).await?;
    }
    Ok(run)
}

/// Claims the slot as fired: the run to start, or `None` when the slot's standing record
/// (decided earlier) is not a fire.
async fn claim_fire(
    ctx: &Ctx,
    s: &ScheduleRecord,
    slot: DateTime<Utc>,
) -> Result<Option<RunId>, TickError> {
    let name = &s.spec.name;
    let run = slot_run(name, slot)
        .ok_or_else(|| ApiError::bad_request(format!("schedule {name} gives no valid run id")))?;
    // Fired when claimed: the claim is what decides the slot.
    let now = Utc::now();
    let drift_ms = (now - slot).num_milliseconds();
    let outcome = SlotOutcome::Fired {
        fired_at: now,
        drift_ms,
        late: drift_ms > s.spec.late_threshold.as_millis() as i64,
        run: run.clone(),
    };
    let claimed = record(ctx, name, slot, outcome).await?;
    Ok(match claimed.outcome {
        SlotOutcome::Fired { run, .. } => Some(run),
        _ => None,
    })
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
