//! `turnstile-bench scale`: many sessions created and held, each with its lane. Every service
//! runs as its own process (`turnstile-session-lane`, `turnstile-transport-agent` with the
//! instant agent, `turnstile-notification-broker`, `turnstile-scheduler` of this build), so
//! each one's resident memory can be read off `/proc`. Measured, beside the raw JetStream floor
//! of the same run:
//! - the creation rate through the session API (`CREATE_CONCURRENCY` requests in flight);
//! - resident memory per idle session of each service and of nats-server: the growth from
//!   one session to all of them, once every lane is pulled, divided by the sessions added;
//! - the CPU each process spends holding the idle sessions, over `IDLE_WINDOW` with nothing
//!   to do (pull renewals, timers), in `IDLE_WINDOWS` windows one after another;
//! - lane hand-off (the gap between one turn's end and the next one's typing, both stamped by
//!   the transport) for `BUSY` busy sessions at once, with their turns per second, and for one
//!   busy session alone: each measured on the same sessions before the idle ones exist and
//!   among them, so what the idle sessions cost the busy ones is read side by side. With
//!   `BUSY` lanes turning at once on two cores a hand-off waits its turn behind the others'
//!   work: that figure is throughput; the one session alone is the hand-off's latency;
//! - fail-over: a second replica waits on every lane, the first is SIGKILLed, one turn is
//!   queued on every session, and the time from the kill until each is typed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::deployment::Deployment;
use crate::inproc::{create_sessions, CREATE_CONCURRENCY};
use crate::lanes::{queue, records, wait_all};
use crate::procs::{cpu_ns_all, rss_all, spawn, Services};
use anyhow::{bail, Result};
use chrono::Utc;
use turnstile_shared::records::TurnState;
use turnstile_shared::SessionId;

/// How long the idle sessions' CPU use is watched, in how many windows.
const IDLE_WINDOW: Duration = Duration::from_secs(10);
const IDLE_WINDOWS: usize = 3;

/// Busy sessions among the idle ones, and turns queued on each; turns queued on the one busy
/// session alone.
const BUSY: usize = 100;
const BUSY_TURNS: usize = 20;
const ALONE_TURNS: usize = 200;

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

    // The busy sessions, measured before any idle one exists. They count among the sessions
    // created, and their turns' memory among the idle sessions' (it can only raise that).
    if sessions == 0 {
        bail!("scale needs at least one session");
    }
    let busy_n = BUSY.min(sessions);
    eprintln!("scale: {busy_n} busy sessions, no idle ones yet");
    let started = Instant::now();
    let busy = create_sessions(&client, busy_n).await?;
    let mut create_s = started.elapsed().as_secs_f64();
    let pulled: Vec<&SessionId> = busy.iter().collect();
    turnstile_tests::wait_lanes_pulled(&js, &pulled, 1, Duration::from_secs(60)).await?;
    let without_idle = busy_handoffs(&js, &busy, &floor).await?;
    eprintln!("scale: without idle sessions {without_idle}");

    let idle_n = sessions - busy_n;
    eprintln!("scale: creating {idle_n} more sessions");
    let started = Instant::now();
    let mut ids = create_sessions(&client, idle_n).await?;
    create_s += started.elapsed().as_secs_f64();
    ids.extend(busy.iter().cloned());
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

    // What holding the idle sessions costs while nothing happens (pull renewals, timers), in
    // windows one after another: the first may still hold the creation's after-work.
    let mut idle_cpu = Vec::new();
    for _ in 0..IDLE_WINDOWS {
        let cpu0 = cpu_ns_all(&procs)?;
        tokio::time::sleep(IDLE_WINDOW).await;
        let cpu1 = cpu_ns_all(&procs)?;
        let mut window = serde_json::Map::new();
        for ((name, a), (_, b)) in cpu0.iter().zip(&cpu1) {
            let pct = b.saturating_sub(*a) as f64 / IDLE_WINDOW.as_nanos() as f64 * 100.0;
            window.insert(name.to_string(), ((pct * 10.0).round() / 10.0).into());
        }
        eprintln!(
            "scale: idle CPU, % of one core: {}",
            serde_json::Value::Object(window.clone())
        );
        idle_cpu.push(serde_json::Value::Object(window));
    }

    // Printed as they come: a later stage that fails leaves these on record.
    eprintln!(
        "scale: {} sessions/s; per idle session, services {services_kb:.1} KB: {}",
        (sessions as f64 / create_s).round(),
        serde_json::Value::Object(memory.clone())
    );
    eprintln!("scale: the same busy sessions among {idle_n} idle ones");
    let among_idle = busy_handoffs(&js, &busy, &floor).await?;
    eprintln!("scale: among the idle {among_idle}, floor {floor}");

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
    let survivor = crate::failover::survivor_account(&lane_b.log_tail(400), killed_at);
    drop((lane_b, services));
    Ok(serde_json::json!({
        "sessions": sessions,
        "create": {
            "concurrency": CREATE_CONCURRENCY,
            "seconds": (create_s * 100.0).round() / 100.0,
            "per_sec": (sessions as f64 / create_s).round(),
            "all_lanes_pulled_after_s": (settle_s * 100.0).round() / 100.0,
        },
        "memory": memory,
        "idle_cpu_percent_of_a_core": idle_cpu,
        "services_per_idle_session_kb": (services_kb * 10.0).round() / 10.0,
        "jetstream_floor": floor,
        "busy_sessions": busy_n,
        "idle_sessions": idle_n,
        "handoff_among_idle": among_idle,
        "handoff_without_idle": without_idle,
        "failover_all_served_after_kill_ms": {
            "p50": crate::stats::percentile(&served, 50.0),
            "p99": crate::stats::percentile(&served, 99.0),
            "max": served.last().copied().unwrap_or(f64::NAN),
        },
        "failover_survivor": survivor,
    }))
}

/// Hand-off of the busy sessions, `BUSY_TURNS` queued on each at once (with their turns per
/// second), then of the first of them alone, `ALONE_TURNS` queued on it; each over the floor.
async fn busy_handoffs(
    js: &async_nats::jetstream::Context,
    busy: &[SessionId],
    floor: &serde_json::Value,
) -> Result<serde_json::Value> {
    let started = Instant::now();
    let turns = queue(js, busy, BUSY_TURNS).await?;
    wait_all(js, &turns).await?;
    let per_sec = turns.len() as f64 / started.elapsed().as_secs_f64();
    let all = crate::stats::summary(handoffs_per_session(&records(js, &turns).await?));
    let turns = queue(js, &busy[..1], ALONE_TURNS).await?;
    wait_all(js, &turns).await?;
    let alone = crate::stats::summary(handoffs_per_session(&records(js, &turns).await?));
    let over = |v: &serde_json::Value| {
        serde_json::json!({
            "p50": crate::stats::over(v, floor, "p50_us"),
            "p99": crate::stats::over(v, floor, "p99_us"),
        })
    };
    Ok(serde_json::json!({
        "all_busy": {
            "sessions": busy.len(),
            "turns_per_sec": per_sec.round(),
            "handoff": all,
            "over_floor": over(&all),
        },
        "one_alone": {
            "handoff": alone,
            "over_floor": over(&alone),
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
