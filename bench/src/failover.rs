//! `turnstile-bench failover`: a session-lane replica serving N sessions is SIGKILLed; how long
//! until each session is served again by the survivor, with the default (30 s) pin TTL and lane
//! ack wait that the liveness take-over must beat.
//!
//! Both replicas run as processes of the `turnstile-session-lane` binary (so one can be
//! SIGKILLed); the transport agent with the instant agent runs in this process. Replica A
//! starts alone, so every lane is pinned to it (each session runs one turn); B then starts and
//! waits on every lane; A is killed, one turn is queued on every session at once, and a
//! session's time to service is its new turn's `typed_at` (stamped by the transport) minus the
//! moment of the kill.

use std::time::Duration;

use anyhow::{bail, Result};
use chrono::Utc;
use turnstile_shared::records::TurnState;
use turnstile_shared::SessionId;
use turnstile_tests::ServiceProcess;

use crate::deployment::Deployment;
use crate::inproc::{create_sessions, start_transport};
use crate::lanes::{queue, records, wait_all};

pub async fn measure(d: &Deployment, sessions: usize) -> Result<serde_json::Value> {
    let client = Deployment::connect(&d.operator).await?;
    let js = async_nats::jetstream::new(client.clone());
    let dir = tempfile::tempdir()?;
    let env = vec![
        ("TURNSTILE_NATS_URL".to_string(), d.lane.clone()),
        ("RUST_LOG".to_string(), "info".to_string()),
    ];
    let replica = |name: &str| {
        ServiceProcess::spawn(
            "turnstile-session-lane",
            &["--replica".to_string(), name.to_string()],
            &env,
            &format!("lane-{name}.log"),
        )
    };
    let mut a = replica("a")?;
    let transport = start_transport(&d.transport, dir.path())?;
    let ids = create_sessions(&client, sessions).await?;
    // One turn each, served by A alone: A holds every lane's pin.
    let warm = queue(&js, &ids, 1).await?;
    wait_all(&js, &warm).await?;
    let b = replica("b")?;
    let all: Vec<&SessionId> = ids.iter().collect();
    turnstile_tests::wait_lanes_pulled(&js, &all, 2, Duration::from_secs(120)).await?;

    // The same load with no fault first: one turn on every session at once, served by A. What
    // the machine takes to type N turns at once is in every fail-over figure below too.
    let queued_at = Utc::now();
    let turns = queue(&js, &ids, 1).await?;
    wait_all(&js, &turns).await?;
    let calm = served_since(&js, &turns, queued_at).await?;

    let killed_at = Utc::now();
    a.kill().await?;
    let turns = queue(&js, &ids, 1).await?;
    wait_all(&js, &turns).await?;
    let served = served_since(&js, &turns, killed_at).await?;
    transport.stop().await;
    let survivor = survivor_account(&b.log_tail(400), killed_at);
    drop(b);
    let ms = |v: &[f64], p: f64| (crate::stats::percentile(v, p) / 100.0).round() / 10.0;
    Ok(serde_json::json!({
        "served_without_kill_ms": {
            "p50": ms(&calm, 50.0),
            "p99": ms(&calm, 99.0),
            "max": ms(&calm, 100.0),
        },
        "sessions": sessions,
        "replicas": d.replicas,
        "pin_ttl_s": 30,
        "lane_ack_wait_s": 30,
        "served_again_after_kill_ms": {
            "p50": ms(&served, 50.0),
            "p99": ms(&served, 99.0),
            "max": ms(&served, 100.0),
        },
        "survivor": survivor,
    }))
}

/// Each turn's time from `since` until its agent was typed (µs, sorted); every turn must have
/// completed.
async fn served_since(
    js: &async_nats::jetstream::Context,
    turns: &[turnstile_shared::TurnId],
    since: chrono::DateTime<Utc>,
) -> Result<Vec<f64>> {
    let mut served = Vec::with_capacity(turns.len());
    for r in records(js, turns).await? {
        match r.state {
            TurnState::Completed { typed_at, .. } => {
                served.push((typed_at - since).num_microseconds().unwrap_or(i64::MAX) as f64)
            }
            other => bail!("turn {} did not complete: {other:?}", r.id),
        }
    }
    served.sort_by(f64::total_cmp);
    Ok(served)
}

/// The survivor's own account of a fail-over, from its log: when it claimed the dead replica
/// after the kill (detection) and on what evidence, then how many lanes it moved and how long
/// that took (take-over). Each log line starts with its RFC 3339 time.
pub fn survivor_account(log: &str, killed_at: chrono::DateTime<Utc>) -> serde_json::Value {
    let field = |line: &str, name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .map(|v| v.trim_matches('"').to_string())
    };
    let claimed = log
        .lines()
        .rev()
        .find(|l| l.contains("claimed a dead replica"));
    let since_kill = |l: &str| {
        let at = l.split_whitespace().next()?;
        let at = chrono::DateTime::parse_from_rfc3339(at).ok()?;
        Some((at.with_timezone(&Utc) - killed_at).num_milliseconds())
    };
    let detected_ms = claimed.and_then(since_kill);
    // When, from the kill, the survivor's own renewals came back late (every peer's silence
    // then counts afresh: a claim comes at least 250 ms after the gap), and when one of its
    // renewals went unanswered within its lease or failed. Before 3ee95b6 such a gap also
    // turned its fast path off for the 1.25 s silence timeout.
    let near_claim = |needle: &str| -> Vec<i64> {
        log.lines()
            .filter(|l| l.contains(needle))
            .filter_map(since_kill)
            .filter(|ms| *ms >= -STALL_WINDOW_MS && detected_ms.is_none_or(|d| *ms <= d))
            .collect()
    };
    let own_stalls_ms = near_claim("own renewals stalled");
    let renewals_late_ms = near_claim("renew replica liveness");
    let evidence = claimed.and_then(|l| {
        let (_, rest) = l.split_once("evidence=")?;
        Some(if rest.starts_with("\"its connection is gone") {
            "gone from the server"
        } else {
            "silent"
        })
    });
    let took_over = log
        .lines()
        .rev()
        .find(|l| l.contains("took over a dead replica's lanes"));
    let num = |name: &str| {
        took_over
            .and_then(|l| field(l, name))
            .and_then(|v| v.parse::<u64>().ok())
    };
    serde_json::json!({
        "detected_after_kill_ms": detected_ms,
        "evidence": evidence,
        "lanes_moved": num("lanes="),
        "takeover_ms": num("elapsed_ms="),
        // Of which reading the dead instance's pin records, and the last page of the lane
        // consumers' list come (lanes are taken as their page comes).
        "pins_read_ms": num("pinned_ms="),
        "listed_ms": num("listed_ms="),
        "own_stalls_ms": own_stalls_ms,
        "renewals_late_ms": renewals_late_ms,
    })
}

/// How long before the kill a stall of the survivor's own renewals is reported (one that
/// old could delay the claim by the 1.25 s silence timeout on builds before 3ee95b6).
const STALL_WINDOW_MS: i64 = 1_500;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_survivor_account_reads_detection_and_take_over_off_its_log() {
        let killed_at = chrono::DateTime::parse_from_rfc3339("2026-12-05T06:00:00.000000Z")
            .map(|t| t.with_timezone(&Utc))
            .expect("a time");
        let log = "2026-12-05T05:59:59.000000Z  INFO turnstile_session_lane: session-lane running\n\
            2026-12-05T05:59:57.000000Z  INFO turnstile_session_lane::liveness: own renewals stalled; every peer's silence counts from now gap_ms=300\n\
            2026-12-05T05:59:59.500000Z  INFO turnstile_session_lane::liveness: own renewals stalled; every peer's silence counts from now gap_ms=260\n\
            2026-12-05T06:00:00.100000Z  WARN turnstile_session_lane::liveness: renew replica liveness: no answer within the lease; renewing again\n\
            2026-12-05T06:00:00.412000Z  INFO turnstile_session_lane::liveness::takeover: claimed a dead replica instance=a-1 evidence=\"its connection is gone from the server\" silent_ms=405\n\
            2026-12-05T06:00:00.700000Z  INFO turnstile_session_lane::liveness::takeover: took over a dead replica's lanes instance=a-1 lanes=1000 pins=1000 pinned_ms=20 listed=true listed_ms=150 elapsed_ms=288\n\
            2026-12-05T06:00:01.000000Z  INFO turnstile_session_lane::liveness: own renewals stalled; every peer's silence counts from now gap_ms=210\n";
        let a = survivor_account(log, killed_at);
        assert_eq!(a["detected_after_kill_ms"], 412);
        assert_eq!(a["evidence"], "gone from the server");
        assert_eq!(a["lanes_moved"], 1000);
        assert_eq!(a["takeover_ms"], 288);
        assert_eq!(a["pins_read_ms"], 20);
        assert_eq!(a["listed_ms"], 150);
        // Only the stall that can bear on the claim: 0.5 s before the kill; not 3 s before,
        // nor one after the claim.
        assert_eq!(a["own_stalls_ms"], serde_json::json!([-500]));
        assert_eq!(a["renewals_late_ms"], serde_json::json!([100]));
        let none = survivor_account("nothing\n", killed_at);
        assert!(none["detected_after_kill_ms"].is_null());
    }
}
