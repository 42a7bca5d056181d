//! How a campaign's end is judged beside the history check: once the faults stop, every
//! lane drains, every session goes idle and every turn, run and step ends within
//! [`LIVENESS_BOUND`] (else the sessions still busy are named, with their completion
//! consumers' state), and each service's resident memory.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tokio::sync::Mutex;
use turnstile_shared::api::SessionView;
use turnstile_shared::subjects::api as subj;

use super::history::{self, History};
use super::stack::ChaosStack;
use super::workload;

/// How long the stack may take to go quiet once the faults stopped.
pub(super) const LIVENESS_BOUND: Duration = Duration::from_secs(240);

/// Waits until every active session is idle with nothing pending and every turn, run and
/// step has ended, within [`LIVENESS_BOUND`].
pub(super) async fn quiet(
    client: &async_nats::Client,
    js: &async_nats::jetstream::Context,
    mock_dir: &std::path::Path,
    trace: &std::path::Path,
    crons: &[history::ScheduleCron],
) -> Result<()> {
    let deadline = Instant::now() + LIVENESS_BOUND;
    let mut last = String::new();
    let mut lane = None;
    while Instant::now() < deadline {
        match still_busy(client, js, mock_dir, trace, crons).await {
            Ok(None) => return Ok(()),
            Ok(Some((why, session))) => (last, lane) = (why, session),
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let handed = match lane {
        Some(session) => format!("; {}", handed_out_again(js, &session).await),
        None => String::new(),
    };
    bail!("still busy: {last}{handed}")
}

/// Whether the lane's item is being handed out again and again (its deliveries grow over a
/// little more than two campaign ack waits: every ack of it is lost) or not (held by a
/// handler that keeps it alive, or not handed out at all).
async fn handed_out_again(
    js: &async_nats::jetstream::Context,
    session: &turnstile_shared::SessionId,
) -> String {
    let name = turnstile_shared::subjects::lane_consumer(session);
    let deliveries = || async {
        let stream = js
            .get_stream_no_info(turnstile_shared::subjects::LANE_STREAM)
            .await?;
        let info = stream.consumer_info(&name).await?;
        anyhow::Ok(info.delivered.consumer_sequence)
    };
    let before = deliveries().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    match (before, deliveries().await) {
        (Ok(a), Ok(b)) => format!("lane {session}: {} deliveries in 5 s", b.saturating_sub(a)),
        (Err(e), _) | (_, Err(e)) => format!("lane {session}: deliveries unread ({e:#})"),
    }
}

async fn still_busy(
    client: &async_nats::Client,
    js: &async_nats::jetstream::Context,
    mock_dir: &std::path::Path,
    trace: &std::path::Path,
    crons: &[history::ScheduleCron],
) -> Result<Option<(String, Option<turnstile_shared::SessionId>)>> {
    let h = History::load(js, mock_dir, trace, crons.to_vec()).await?;
    if let Some(t) = h.turns.values().find(|t| !t.state.is_terminal()) {
        let lane = lane_state(js, &t.session).await;
        return Ok(Some((
            format!("turn {} not ended ({lane})", t.id),
            Some(t.session.clone()),
        )));
    }
    if let Some(r) = h.runs.values().find(|r| !r.state.is_terminal()) {
        let lane = lane_state(js, &r.session).await;
        return Ok(Some((
            format!("run {} not ended ({lane})", r.id),
            Some(r.session.clone()),
        )));
    }
    if let Some(e) = h.executions.values().find(|e| !e.status.is_terminal()) {
        let kind = e.work.as_ref().map_or("no work", |w| w.kind());
        return Ok(Some((
            format!(
                "execution {} not ended ({}, {kind}, session {})",
                e.id,
                e.status.name(),
                e.session
            ),
            None,
        )));
    }
    for s in h.sessions.values().filter(|s| s.is_active()) {
        let view: SessionView = workload::call(
            client,
            subj::SESSION_SHOW,
            &turnstile_shared::api::SessionRef {
                session: s.id.clone(),
            },
        )
        .await?;
        if view.busy || view.queued > 0 || view.pending > 0 {
            let consumer = completion_state(js, &s.id).await;
            let lane = lane_state(js, &s.id).await;
            return Ok(Some((
                format!(
                    "session {} busy {} queued {} pending {} ({consumer}; {lane})",
                    s.id, view.busy, view.queued, view.pending
                ),
                Some(s.id.clone()),
            )));
        }
    }
    Ok(None)
}

/// Where the session's completion consumer stands, for a session left with completions: a
/// message below its ack floor was acked but not removed by the store; one above it was never
/// handed out.
async fn completion_state(
    js: &async_nats::jetstream::Context,
    session: &turnstile_shared::SessionId,
) -> String {
    let name = turnstile_shared::subjects::completion_consumer(session);
    match js
        .get_stream_no_info(turnstile_shared::subjects::COMPLETION_STREAM)
        .await
    {
        Ok(stream) => match stream.consumer_info(&name).await {
            Ok(i) => format!(
                "completion consumer: delivered stream seq {}, ack floor stream seq {}, \
                 num_pending {}, num_ack_pending {}",
                i.delivered.stream_sequence,
                i.ack_floor.stream_sequence,
                i.num_pending,
                i.num_ack_pending
            ),
            Err(e) => format!("completion consumer {name}: {e}"),
        },
        Err(e) => format!("completion stream: {e}"),
    }
}

/// Where the session's lane consumer stands, and whether the item it last delivered is still
/// stored: a lane held busy by an item the stream no longer has is the server's state, not a
/// handler still at work.
async fn lane_state(
    js: &async_nats::jetstream::Context,
    session: &turnstile_shared::SessionId,
) -> String {
    let name = turnstile_shared::subjects::lane_consumer(session);
    let stream = match js
        .get_stream_no_info(turnstile_shared::subjects::LANE_STREAM)
        .await
    {
        Ok(s) => s,
        Err(e) => return format!("lane stream: {e}"),
    };
    let info = match stream.consumer_info(&name).await {
        Ok(i) => i,
        Err(e) => return format!("lane consumer {name}: {e}"),
    };

    let last = info.delivered.stream_sequence;
    let item = match stream.get_raw_message(last).await {
        Ok(m) => match turnstile_shared::lane::LaneItem::decode(&m.payload, session) {
            Ok(item) => format!("{item:?}"),
            Err(e) => format!("unreadable: {e}"),
        },
        Err(e) => format!("not stored ({e})"),
    };
    format!(
        "lane consumer: delivered stream seq {last} ({item}), ack floor stream seq {}, \
         num_pending {}, num_ack_pending {}, num_redelivered {}, deliveries so far {}",
        info.ack_floor.stream_sequence,
        info.num_pending,
        info.num_ack_pending,
        info.num_redelivered,
        info.delivered.consumer_sequence
    )
}

/// Each service's resident memory (kB) now.
pub(super) async fn memory(stack: &Mutex<ChaosStack>) -> BTreeMap<String, u64> {
    let stack = stack.lock().await;
    let mut out = BTreeMap::new();
    for (name, p) in &stack.services {
        let kb = p
            .pid()
            .and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0);
        out.insert(name.clone(), kb);
    }
    out
}
