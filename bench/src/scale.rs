//! `turnstile-bench scale`: many sessions created and held, each with its lane. Every service
//! runs as its own process (`turnstile-session-lane`, `turnstile-transport-agent` with the
//! instant agent, `turnstile-notification-broker`, `turnstile-scheduler` of this build), so
//! each one's resident memory can be read off `/proc`. Measured, beside the raw JetStream floor
//! of the same run:
//! - the creation rate through the session API (`CREATE_CONCURRENCY` requests in flight);
//! - resident memory per idle session of each service and of nats-server: the growth from
//!   one session to all of them, once every lane is pulled, divided by the sessions added;
//! - lane hand-off for `BUSY` busy sessions among the idle ones (turns queued on each, the
//!   gap between one turn's end and the next one's typing, both stamped by the transport);
//! - fail-over: a second replica waits on every lane, the first is SIGKILLed, one turn is
//!   queued on every session, and the time from the kill until each is typed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::deployment::Deployment;
use crate::inproc::{create_sessions, CREATE_CONCURRENCY};
use crate::lanes::{queue, records, wait_all};
use crate::procs::{rss_all, spawn, Services};
use anyhow::{bail, Result};
use chrono::Utc;
use turnstile_shared::records::TurnState;
use turnstile_shared::SessionId;

/// Busy sessions among the idle ones, and turns queued on each.
const BUSY: usize = 100;
const BUSY_TURNS: usize = 20;

pub async fn measure(d: &Deployment, sessions: usize) -> Result<serde_json::Value> {
    let client = Deployment::connect(&d.operator).await?;
    let js = async_nats::jetstream::new(client.clone());
    eprintln!("scale: floor, 2000 round trips");
    let floor = crate::floor::measure(d, 2000).await?;
    let mut services = Services::start(d)?;
    // One session first: every lazily built structure exists before the baseline.
    let first = create_sessions(&client, 1).await?;
    turnstile_tests::wait_lanes_pulled(&js, &[&first[0]], 1, Duration::from_secs(30)).await?;
    let procs = services.pids(d);
    let before = rss_all(&procs)?;

    eprintln!("scale: creating {sessions} sessions");
    let started = Instant::now();
    let ids = create_sessions(&client, sessions).await?;
    let create_s = started.elapsed().as_secs_f64();
    eprintln!("scale: created in {create_s:.1} s; waiting for every lane to be pulled");
    let all: Vec<&SessionId> = ids.iter().collect();
    let settle = Instant::now();
    turnstile_tests::wait_lanes_pulled(&js, &all, 1, Duration::from_secs(600)).await?;
    let settle_s = settle.elapsed().as_secs_f64();
    let after = rss_all(&procs)?;
    let mut memory = serde_json::Map::new();
    let mut services_kb = 0.0;
    for ((name, kb0), (_, kb1)) in before.iter().zip(&after) {
        let per = (*kb1 as f64 - *kb0 as f64) * 1024.0 / sessions as f64 / 1000.0;
        if *name != "nats-server" {
            services_kb += per;
        }
        memory.insert(
            name.to_string(),
            serde_json::json!({
                "rss_before_kb": kb0,
                "rss_after_kb": kb1,
                "per_idle_session_kb": (per * 10.0).round() / 10.0,
            }),
        );
    }

    // Printed as they come: a later stage that fails leaves these on record.
    eprintln!(
        "scale: {} sessions/s; per idle session, services {services_kb:.1} KB: {}",
        (sessions as f64 / create_s).round(),
        serde_json::Value::Object(memory.clone())
    );
    eprintln!("scale: {BUSY_TURNS} turns on each of {BUSY} sessions among the idle");
    let busy: Vec<SessionId> = ids
        .iter()
        .step_by((sessions / BUSY).max(1))
        .take(BUSY)
        .cloned()
        .collect();
    let turns = queue(&js, &busy, BUSY_TURNS).await?;
    wait_all(&js, &turns).await?;
    let handoff = crate::summary(handoffs_per_session(&records(&js, &turns).await?));
    eprintln!("scale: hand-off {handoff}, floor {floor}");

    eprintln!("scale: fail-over of {} sessions", ids.len());
    let lane_b = spawn(
        "turnstile-session-lane",
        &["--replica", "b"],
        &d.lane,
        "lane-b.log",
    )?;
    turnstile_tests::wait_lanes_pulled(&js, &all, 2, Duration::from_secs(600)).await?;
    let killed_at = Utc::now();
    services.lane.kill().await?;
    let turns = queue(&js, &ids, 1).await?;
    wait_all(&js, &turns).await?;
    let mut served = Vec::with_capacity(turns.len());
    for r in records(&js, &turns).await? {
        match r.state {
            TurnState::Completed { typed_at, .. } => {
                served.push((typed_at - killed_at).num_milliseconds() as f64)
            }
            other => bail!("turn {} did not complete: {other:?}", r.id),
        }
    }
    served.sort_by(f64::total_cmp);
    drop((lane_b, services));
    let ratio = |p: &str| {
        let a = handoff[p].as_f64().unwrap_or(f64::NAN);
        let b = floor[p].as_f64().unwrap_or(f64::NAN);
        ((a / b) * 100.0).round() / 100.0
    };
    Ok(serde_json::json!({
        "sessions": sessions,
        "create": {
            "concurrency": CREATE_CONCURRENCY,
            "seconds": (create_s * 100.0).round() / 100.0,
            "per_sec": (sessions as f64 / create_s).round(),
            "all_lanes_pulled_after_s": (settle_s * 100.0).round() / 100.0,
        },
        "memory": memory,
        "services_per_idle_session_kb": (services_kb * 10.0).round() / 10.0,
        "jetstream_floor": floor,
        "busy_sessions": BUSY,
        "lane_handoff": handoff,
        "handoff_over_floor": { "p50": ratio("p50_us"), "p99": ratio("p99_us") },
        "failover_all_served_after_kill_ms": {
            "p50": crate::percentile(&served, 50.0),
            "p99": crate::percentile(&served, 99.0),
            "max": served.last().copied().unwrap_or(f64::NAN),
        },
    }))
}

/// Hand-offs within each session (records of several sessions), the first turns skipped.
fn handoffs_per_session(records: &[turnstile_shared::records::TurnRecord]) -> Vec<f64> {
    let mut by: HashMap<&SessionId, Vec<_>> = HashMap::new();
    for r in records {
        if let TurnState::Completed {
            typed_at, ended_at, ..
        } = &r.state
        {
            by.entry(&r.session)
                .or_default()
                .push((*typed_at, *ended_at));
        }
    }
    let mut out = Vec::new();
    for spans in by.values_mut() {
        spans.sort_by_key(|(typed, _)| *typed);
        out.extend(
            spans
                .windows(2)
                .skip(3)
                .filter_map(|w| (w[1].0 - w[0].1).num_microseconds())
                .map(|us| us as f64),
        );
    }
    out
}
