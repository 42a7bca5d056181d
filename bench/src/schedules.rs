//! `turnstile-bench schedules`: many schedules due in the same second. The services run in this
//! process (the instant agent) against the benchmark's nats-server; every schedule is added
//! through the scheduler's API with a cron firing every `PERIOD` seconds, and the two slots
//! after the last add are judged from their slot records: each must have fired (none skipped
//! or missed), with drift = the claim's `fired_at` minus the slot, and from the run records:
//! each fired run queued (`created_at` minus the slot) and done.
//!
//! Beside it, in the same run: the raw JetStream floor and the cost of one slot claim alone
//! (the `ts_slots` create the scheduler makes per slot, timed one at a time).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chrono::{DateTime, TimeDelta, Utc};
use futures::StreamExt;
use turnstile_shared::api;
use turnstile_shared::runs::{RunRecord, RunState};
use turnstile_shared::schedules::{
    slot_run, ScheduleRecord, ScheduleSpec, SlotOutcome, SlotRecord,
};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::topology::bind;

use crate::deployment::Deployment;
use crate::inproc::{create_sessions, start_broker, start_lane, start_scheduler, start_transport};

/// Seconds between a schedule's slots (`*/PERIOD * * * * *`).
const PERIOD: i64 = 10;
/// Schedules on each session (their runs queue on its lane).
const PER_SESSION: usize = 10;
/// Slot claims timed alone.
const CLAIMS: usize = 1000;

pub async fn measure(d: &Deployment, schedules: usize) -> Result<serde_json::Value> {
    let client = Deployment::connect(&d.operator).await?;
    let js = async_nats::jetstream::new(client.clone());
    let buckets = bind(&js).await?;
    let dir = tempfile::tempdir()?;
    let lane = start_lane(&d.lane);
    let transport = start_transport(&d.transport, dir.path())?;
    let broker = start_broker(&d.broker, d.callout.clone());
    eprintln!("schedules: floor, 2000 round trips");
    let floor = crate::floor::measure(d, 2000).await?;
    eprintln!("schedules: {CLAIMS} slot claims alone");
    let claim = claims(&buckets.slots).await?;
    let sessions = create_sessions(&client, schedules.div_ceil(PER_SESSION)).await?;
    let scheduler = start_scheduler(&d.admin);
    wait_for_scheduler(&client).await?;
    eprintln!(
        "schedules: adding {schedules} schedules on {} sessions",
        sessions.len()
    );
    let added = Instant::now();
    let names: Vec<String> = (0..schedules).map(|i| format!("bench-{i}")).collect();
    let adds = futures::stream::iter(names.iter().enumerate())
        .map(|(i, name)| {
            let spec = spec(name, &sessions[i / PER_SESSION]);
            let client = client.clone();
            async move {
                api::call::<_, ScheduleRecord>(
                    &client,
                    subj::SCHEDULES_ADD,
                    &spec,
                    Duration::from_secs(30),
                )
                .await
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    for a in adds {
        a.context("add schedule")?;
    }
    let add_seconds = added.elapsed().as_secs_f64();
    // The two slots after every schedule exists (a second of margin).
    let first = next_slot(Utc::now() + TimeDelta::seconds(1));
    let slots = [first, first + TimeDelta::seconds(PERIOD)];
    eprintln!(
        "schedules: waiting for the slots at {} and {}",
        slots[0], slots[1]
    );
    let deadline = Instant::now() + Duration::from_secs(PERIOD as u64 * 2 + 60);
    let (records, runs) = loop {
        let records: HashMap<String, SlotRecord> = buckets
            .slots
            .entries_matching(">")
            .await?
            .into_iter()
            .collect();
        let runs: HashMap<String, RunRecord> = buckets
            .runs
            .entries_matching(">")
            .await?
            .into_iter()
            .collect();
        let settled = names.iter().all(|n| {
            slots.iter().all(|s| {
                let fired_run = records
                    .get(&turnstile_shared::schedules::slot_key(n, *s))
                    .map(|r| &r.outcome);
                match fired_run {
                    Some(SlotOutcome::Fired { run, .. }) => runs
                        .get(run.as_str())
                        .is_some_and(|r| r.state.is_terminal()),
                    Some(_) => true,
                    None => false,
                }
            })
        });
        if settled {
            break (records, runs);
        }
        if Instant::now() > deadline {
            bail!("the slots at {} and {} were not all decided and done within a minute of the second", slots[0], slots[1]);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let mut per_slot = Vec::new();
    for slot in slots {
        per_slot.push(judge(&names, slot, &records, &runs));
    }
    scheduler.stop().await;
    broker.stop().await;
    transport.stop().await;
    lane.stop().await;
    Ok(serde_json::json!({
        "schedules": schedules,
        "sessions": sessions.len(),
        "add_seconds": (add_seconds * 100.0).round() / 100.0,
        "jetstream_floor": floor,
        "slot_claim_alone": claim,
        "slot_claim_over_floor": ((claim["p50_us"].as_f64().unwrap_or(f64::NAN) / floor["p50_us"].as_f64().unwrap_or(f64::NAN)) * 100.0).round() / 100.0,
        "slots": per_slot,
    }))
}

/// Until the scheduler in this process answers its API (bounded).
async fn wait_for_scheduler(client: &async_nats::Client) -> Result<()> {
    let req = turnstile_shared::schedules::ListSchedules::default();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = api::call::<_, turnstile_shared::page::Page<ScheduleRecord>>(
            client,
            subj::SCHEDULES_LIST,
            &req,
            Duration::from_secs(1),
        )
        .await;
        match r {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => bail!("the scheduler did not answer: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn spec(name: &str, session: &turnstile_shared::SessionId) -> ScheduleSpec {
    serde_json::from_value(serde_json::json!({
        "name": name,
        "cron": format!("*/{PERIOD} * * * * *"),
        "tz": "UTC",
        "session": session,
        "messages": ["bench"],
    }))
    .unwrap_or_else(|e| unreachable!("a fixed schedule spec: {e}"))
}

/// The first slot at or after `t`.
fn next_slot(t: DateTime<Utc>) -> DateTime<Utc> {
    let secs = t.timestamp();
    let up = (secs + PERIOD - 1).div_euclid(PERIOD) * PERIOD;
    DateTime::from_timestamp(up, 0).unwrap_or(t)
}

/// One slot across every schedule: outcomes, fire drift, run queue drift.
fn judge(
    names: &[String],
    slot: DateTime<Utc>,
    records: &HashMap<String, SlotRecord>,
    runs: &HashMap<String, RunRecord>,
) -> serde_json::Value {
    let (mut fired, mut skipped, mut missed, mut done) = (0, 0, 0, 0);
    let mut example = serde_json::Value::Null;
    let mut drift = Vec::new();
    let mut queued = Vec::new();
    for n in names {
        let Some(r) = records.get(&turnstile_shared::schedules::slot_key(n, slot)) else {
            continue;
        };
        match &r.outcome {
            SlotOutcome::Fired { fired_at, .. } => {
                fired += 1;
                drift.push((*fired_at - slot).num_microseconds().unwrap_or(i64::MAX) as f64);
                let run = slot_run(n, slot).and_then(|id| runs.get(id.as_str()));
                if let Some(run) = run {
                    queued.push(
                        (run.created_at - slot)
                            .num_microseconds()
                            .unwrap_or(i64::MAX) as f64,
                    );
                    if matches!(run.state, RunState::Completed { .. }) {
                        done += 1;
                    }
                }
            }
            SlotOutcome::Skipped { reason, yielded_to } => {
                skipped += 1;
                if example.is_null() {
                    let blocker = yielded_to.as_ref().and_then(|r| runs.get(r.as_str()));
                    example = serde_json::json!({
                        "schedule": n, "reason": reason,
                        "blocker": blocker.map(|b| serde_json::json!({"created_at": b.created_at, "state": b.state})),
                    });
                }
            }
            SlotOutcome::Missed { .. } => missed += 1,
        }
    }
    let mut max = drift.clone();
    max.sort_by(f64::total_cmp);
    serde_json::json!({
        "slot": slot,
        "fired": fired,
        "skipped": skipped,
        "a_skip": example,
        "missed": missed,
        "runs_done": done,
        "fire_drift": crate::stats::summary(drift),
        "fire_drift_max_us": max.last().copied().unwrap_or(f64::NAN).round(),
        "run_queued_drift": crate::stats::summary(queued),
    })
}

/// One slot claim at a time, the scheduler's own call on its own keys.
async fn claims(slots: &turnstile_shared::kv::Bucket) -> Result<serde_json::Value> {
    let base = Utc::now();
    let mut samples = Vec::with_capacity(CLAIMS);
    for i in 0..CLAIMS {
        let slot = base + TimeDelta::seconds(i as i64);
        let rec = SlotRecord {
            schedule: "bench-claims".into(),
            slot,
            recorded_at: Utc::now(),
            outcome: SlotOutcome::Missed {
                reason: "benchmark claim".into(),
            },
        };
        let key = turnstile_shared::schedules::slot_key("bench-claims", slot);
        let t0 = Instant::now();
        if slots.create(&key, &rec).await?.is_none() {
            bail!("claim {key} was taken");
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok(crate::stats::summary(samples))
}
