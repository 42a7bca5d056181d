//! Lane hand-off and throughput with the agent replaced by the in-process instant adapter:
//! session-lane and a transport agent run in this process against a real nats-server.
//! Hand-off = the next turn's `typed_at` minus the previous turn's `ended_at`, both stamped
//! by the transport: record the outcome, wake the lane, ack, take the next item, dispatch it,
//! deliver it to the transport.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::deployment::Deployment;
use crate::inproc::{create_sessions, start_lane, start_transport};
use futures::StreamExt;
use turnstile_shared::events;
use turnstile_shared::lane::{LaneItem, TurnItem};
use turnstile_shared::records::{TurnRecord, TurnState};
use turnstile_shared::subjects;
use turnstile_shared::{SessionId, TurnId};

pub struct LaneFigures {
    pub handoff: serde_json::Value,
    /// The hand-off's p50 split into stages (`handoff_stages.rs`).
    pub handoff_stages: serde_json::Value,
    /// The floor measured right before and right after the hand-off's turns.
    pub floor_beside: serde_json::Value,
    pub throughput: serde_json::Value,
}

/// Round trips of the floor measured right before, and again right after, the hand-off.
const FLOOR_BESIDE: usize = 500;

pub async fn measure(
    d: &Deployment,
    single_turns: usize,
    sessions: usize,
    turns_each: usize,
) -> Result<LaneFigures> {
    let client = Deployment::connect(&d.operator).await?;
    let js = async_nats::jetstream::new(client.clone());
    let dir = tempfile::tempdir()?;
    let lane = start_lane(&d.lane);
    let mut transport = Transport::start(d, dir.path())?;
    let one = create_sessions(&client, 1).await?;
    let many = create_sessions(&client, sessions).await?;
    transport.pause().await;

    eprintln!("lanes: {single_turns} turns on one session");
    let mut floor = crate::floor::Floor::open(&d.floor, d.replicas).await?;
    let mut floor_us = floor.warm_block(FLOOR_BESIDE).await?;
    let single = queue(&js, &one, single_turns).await?;
    transport.resume()?;
    wait_all(&js, &single).await?;
    transport.pause().await;
    floor_us.extend(floor.warm_block(FLOOR_BESIDE).await?);
    let single_records = records(&js, &single).await?;
    let handoff = handoffs(&single_records);
    let handoff_stages =
        crate::handoff_stages::measure(&js, &one[0], &single_records, SKIPPED).await?;

    eprintln!("lanes: {turns_each} turns on each of {sessions} sessions");
    let all = queue(&js, &many, turns_each).await?;
    let started = Instant::now();
    transport.resume()?;
    wait_all(&js, &all).await?;
    let seconds = started.elapsed().as_secs_f64();
    transport.stop().await;
    lane.stop().await;
    Ok(LaneFigures {
        handoff: crate::stats::summary(handoff),
        handoff_stages,
        floor_beside: crate::stats::summary(floor_us),
        throughput: serde_json::json!({
            "sessions": sessions,
            "turns": all.len(),
            "seconds": (seconds * 1000.0).round() / 1000.0,
            "turns_per_sec": (all.len() as f64 / seconds).round(),
        }),
    })
}

/// The benchmark's transport agent. With it paused, every turn is queued first, so each
/// hand-off finds its next item already waiting on the lane. Not on a cluster: there a stopped
/// client's pull requests outlive its connection at a consumer leader on another node (until
/// they expire), and a command delivered to one waits for the ack wait (30 s); the turns are
/// queued with the transport running instead (the first hand-offs, skipped, may wait).
struct Transport<'a> {
    url: &'a str,
    dir: &'a std::path::Path,
    running: Option<crate::inproc::Running>,
    pauses: bool,
}

impl<'a> Transport<'a> {
    fn start(d: &'a Deployment, dir: &'a std::path::Path) -> Result<Self> {
        Ok(Self {
            url: &d.transport,
            dir,
            running: Some(start_transport(&d.transport, dir)?),
            pauses: d.replicas == 1,
        })
    }

    async fn pause(&mut self) {
        if self.pauses {
            if let Some(t) = self.running.take() {
                t.stop().await;
            }
        }
    }

    fn resume(&mut self) -> Result<()> {
        if self.running.is_none() {
            self.running = Some(start_transport(self.url, self.dir)?);
        }
        Ok(())
    }

    async fn stop(mut self) {
        if let Some(t) = self.running.take() {
            t.stop().await;
        }
    }
}

/// Acknowledgements awaited at once: async-nats holds at most 5,000 in flight and waits for
/// room, so publishing more before awaiting any would wait forever.
const PIPELINE: usize = 1000;

/// Queues `n` turns per session the way `session send` does (the turn's record, then its lane
/// item), both pipelined: the records first, all acknowledged, then the items.
pub(crate) async fn queue(
    js: &async_nats::jetstream::Context,
    sessions: &[SessionId],
    n: usize,
) -> Result<Vec<TurnId>> {
    let mut items = Vec::new();
    let mut writes = Vec::new();
    for i in 0..n {
        for s in sessions {
            let turn = TurnId::new();
            let text = format!("bench turn {i}");
            let record = TurnRecord {
                id: turn.clone(),
                session: s.clone(),
                text: text.clone(),
                queued_at: chrono::Utc::now(),
                delivery: None,
                parent: None,
                state: TurnState::Queued,
            };
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, "0");
            let subject = subjects::turn_kv_subject(&turn);
            let body = serde_json::to_vec(&record)?;
            let ack = js
                .publish_with_headers(subject, headers, body.into())
                .await?;
            writes.push((s.clone(), record, ack));
            if writes.len() >= PIPELINE {
                for (s, record, ack) in writes.drain(..) {
                    // As `session send` queues it: the item says at which revision the
                    // record was written.
                    let item = TurnItem::of_record(&record, ack.await?.sequence);
                    items.push((s, LaneItem::Turn(item)));
                }
            }
        }
    }
    for (s, record, ack) in writes {
        let item = TurnItem::of_record(&record, ack.await?.sequence);
        items.push((s, LaneItem::Turn(item)));
    }
    let mut acks = Vec::new();
    let mut turns = Vec::new();
    for (s, item) in items {
        let env = item.to_envelope(&s)?;
        acks.push((
            events::send_to(js, subjects::lane(&s), &env, None).await?,
            s,
            env,
        ));
        if acks.len() >= PIPELINE {
            for (a, s, env) in acks.drain(..) {
                if a.await.is_err() {
                    resend(js, &s, &env).await?;
                }
            }
        }
        if let LaneItem::Turn(t) = item {
            turns.push(t.turn);
        }
    }
    for (a, s, env) in acks {
        if a.await.is_err() {
            resend(js, &s, &env).await?;
        }
    }
    Ok(turns)
}

/// How long a lane item whose acknowledgement did not come is published again. A server
/// taking over 10,000 lanes (fail-over) can leave publishes unanswered for tens of seconds.
const RESEND_FOR: Duration = Duration::from_secs(120);

/// Publishes a lane item whose acknowledgement did not come (a server busy with thousands of
/// new pull requests, during fail-over): its message id makes a repeat of a stored one a no-op.
async fn resend(
    js: &async_nats::jetstream::Context,
    session: &SessionId,
    env: &turnstile_shared::envelope::Envelope,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + RESEND_FOR;
    let mut pause = Duration::from_millis(200);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let last = match events::send_to(js, subjects::lane(session), env, None).await {
            Ok(ack) => match ack.await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            },
            Err(e) => e,
        };
        if tokio::time::Instant::now() + pause >= deadline {
            bail!("publish lane item for {session}: {attempts} attempts in {RESEND_FOR:?}, last: {last}");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

async fn turn(js: &async_nats::jetstream::Context, t: &TurnId) -> Result<TurnRecord> {
    let kv = js.get_key_value(subjects::TURNS_BUCKET).await?;
    let b = kv
        .get(t.as_str())
        .await?
        .with_context(|| format!("no record for {t}"))?;
    Ok(serde_json::from_slice(&b)?)
}

/// The records of `turns`, in order.
pub(crate) async fn records(
    js: &async_nats::jetstream::Context,
    turns: &[TurnId],
) -> Result<Vec<TurnRecord>> {
    let mut out = Vec::with_capacity(turns.len());
    for t in turns {
        out.push(turn(js, t).await?);
    }
    Ok(out)
}

/// Waits for every turn to end, following the turns bucket.
pub(crate) async fn wait_all(js: &async_nats::jetstream::Context, turns: &[TurnId]) -> Result<()> {
    let kv = js.get_key_value(subjects::TURNS_BUCKET).await?;
    let mut pending: std::collections::HashSet<String> =
        turns.iter().map(|t| t.to_string()).collect();
    let mut watch = kv.watch_with_history(">").await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while !pending.is_empty() {
        let Ok(next) = tokio::time::timeout_at(deadline, watch.next()).await else {
            let mut left: Vec<&String> = pending.iter().collect();
            left.sort();
            let mut states = Vec::new();
            for t in left.iter().take(3) {
                let state = match kv.get(t.as_str()).await {
                    Ok(Some(b)) => serde_json::from_slice::<TurnRecord>(&b)
                        .map(|r| format!("{:?}", r.state))
                        .unwrap_or_else(|e| format!("unreadable: {e}")),
                    Ok(None) => "no record".to_string(),
                    Err(e) => format!("unreadable: {e}"),
                };
                states.push(format!("{t}: {state}"));
            }
            bail!(
                "{} of {} turns did not finish within 300 s; {}",
                pending.len(),
                turns.len(),
                states.join("; ")
            );
        };
        let entry = next.context("watch ended")??;
        if let Ok(r) = serde_json::from_slice::<TurnRecord>(&entry.value) {
            if r.state.is_terminal() {
                if !matches!(r.state, TurnState::Completed { .. }) {
                    bail!("turn {} failed: {:?}", r.id, r.state);
                }
                pending.remove(r.id.as_str());
            }
        }
    }
    Ok(())
}

/// The first hand-offs, left out of the figures (connections and caches warming).
const SKIPPED: usize = 10;

fn handoffs(records: &[TurnRecord]) -> Vec<f64> {
    let mut spans: Vec<_> = records
        .iter()
        .filter_map(|r| match &r.state {
            TurnState::Completed {
                typed_at, ended_at, ..
            } => Some((*typed_at, *ended_at)),
            _ => None,
        })
        .collect();
    spans.sort_by_key(|(typed, _)| *typed);
    spans
        .windows(2)
        .filter_map(|w| (w[1].0 - w[0].1).num_microseconds())
        .map(|us| us as f64)
        .skip(SKIPPED)
        .collect()
}
