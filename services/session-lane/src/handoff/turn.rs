//! The turn primitives every item kind hands its turns through: dispatch (`turn.started` and
//! the transport command, both acknowledged, R14), the wait for the transport's recorded
//! outcome (with progress acks, and a lapsed host failing the turn, R9), and the finish that
//! emits the outcome event and frees the lane.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::records::{SessionRecord, TurnCommand, TurnRecord, TurnState};
use turnstile_shared::subjects;

use turnstile_shared::retry::Backoff;

use super::lost_command::LostCommand;
use crate::ctx::Ctx;
use crate::turn_watch::TurnWaiter;

/// `turn.started` and the transport command, sent together and both acknowledged (R14). The
/// transport de-duplicates by turn id, so a repeat after a crash never types twice. The
/// command's session is the lane's own. Returns the command as sent (the wait sends it again
/// if it is lost: `lost_command`).
pub(crate) async fn dispatch(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    command: TurnCommand,
    kind: &'static str,
) -> Result<Envelope, async_nats::Error> {
    // Typed only under this replica's lease (`liveness::lease`).
    ctx.lease.hold().await?;
    let turn = command.turn.clone();
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let started = session_event(
        EventKind::TurnStarted,
        &session.id,
        Some(&turn),
        &json!({ "replica": ctx.replica, "host": session.host, "delivery": delivered }),
    )?;
    let event_ack = events::send(&ctx.js, &started).await?;
    let command = TurnCommand {
        session: session.id.clone(),
        ..command
    }
    .envelope()?;
    let command_ack = events::send_to(
        &ctx.js,
        subjects::transport(&session.host, "turn"),
        &command,
        None,
    )
    .await?;
    let (e, c) = tokio::join!(event_ack, command_ack);
    e?;
    c?;
    observe_dispatch(msg, kind);
    Ok(command)
}

/// `turnstile_turns_started`, and for an item's first attempt the time from its storage on
/// the lane stream to this dispatch (`turnstile_handoff_seconds`).
fn observe_dispatch(msg: &jetstream::Message, kind: &'static str) {
    let m = turnstile_shared::metrics::metrics();
    m.turns_started
        .get_or_create(&turnstile_shared::metrics::KindLabel { kind })
        .inc();
    if let Ok(info) = msg.info() {
        if info.delivered == 1 {
            let stored = info.published.unix_timestamp_nanos();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i128);
            m.handoff.observe(((now - stored) as f64 / 1e9).max(0.0));
        }
    }
}

/// `turnstile_turns_ended` and, for a completed turn, its duration.
fn observe_end(record: &TurnRecord) {
    use turnstile_shared::metrics::{item_kind, metrics, KindLabel};
    let m = metrics();
    let kind = if record.delivery.is_some() {
        item_kind::DELIVERY
    } else if record.parent.is_some() {
        item_kind::RUN
    } else {
        item_kind::TURN
    };
    match &record.state {
        TurnState::Completed {
            typed_at, ended_at, ..
        } => {
            m.turn_ended("completed", "none");
            let secs = (*ended_at - *typed_at).num_milliseconds() as f64 / 1000.0;
            m.turn_duration
                .get_or_create(&KindLabel { kind })
                .observe(secs.max(0.0));
        }
        TurnState::Failed { reason, .. } => m.turn_ended("failed", reason),
        _ => {}
    }
}

/// The turn a lane waits on, on its host.
#[derive(Clone, Copy)]
pub(crate) struct Watch<'a> {
    pub host: &'a turnstile_shared::HostName,
    pub turn: &'a turnstile_shared::TurnId,
    /// The record the turn's command asked the transport to write, when the lane wrote
    /// none: a lapsed host fails the turn by writing it, failed.
    pub unwritten: Option<&'a TurnRecord>,
    /// The command as this wait's dispatch sent it, sent again if it is lost
    /// (`lost_command`); none when the wait did not dispatch.
    pub command: Option<&'a Envelope>,
}

impl<'a> Watch<'a> {
    /// A turn whose record the lane (or its writer before it) wrote, its command as sent.
    pub fn recorded(
        host: &'a turnstile_shared::HostName,
        turn: &'a turnstile_shared::TurnId,
        command: &'a Envelope,
    ) -> Self {
        Self {
            host,
            turn,
            unwritten: None,
            command: Some(command),
        }
    }
}

/// Waits for the transport to record the outcome, keeping the item (and `held`, messages the
/// turn carries) alive with progress acks.
pub(crate) async fn wait_terminal(
    ctx: &Ctx,
    msg: &jetstream::Message,
    watch: Watch<'_>,
    mut waiter: TurnWaiter,
    cancel: &CancellationToken,
    held: &[jetstream::Message],
) -> Option<TurnRecord> {
    let turn = watch.turn;
    let period = ctx.topology.progress_interval();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let mut watching = true;
    let mut lost = watch.command.map(|c| LostCommand::new(ctx, c));
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            changed = waiter.rx.changed(), if watching => {
                if changed.is_err() {
                    watching = false;
                    continue;
                }
                let rec = waiter.rx.borrow_and_update().clone();
                if let Some(rec) = rec.filter(|r| r.state.is_terminal()) {
                    return Some(rec);
                }
            }
            _ = tick.tick() => {
                // Kept alive only under the lease: a replica that may have lost the lane
                // touches none of its items (`liveness::lease`).
                if ctx.lease.held() {
                    if let Err(e) = msg.ack_with(AckKind::Progress).await {
                        tracing::debug!(%turn, error = %e, "progress ack");
                    }
                    for h in held {
                        let _ = h.ack_with(AckKind::Progress).await;
                    }
                }
                // Fallback for a watch that missed an update across a reconnect.
                let read = ctx.buckets.turns.get::<TurnRecord>(turn.as_str()).await;
                if let Ok(Some((rec, _))) = &read {
                    if rec.state.is_terminal() {
                        return Some(rec.clone());
                    }
                }
                // A host that stopped heartbeating will not record the outcome: the turn
                // fails with the named error instead of waiting (R9), and only this host's
                // sessions are touched.
                let host = host_seen(ctx, watch.host).await;
                if host == HostSeen::Lapsed {
                    if let Some(rec) = fail_lapsed(ctx, watch).await {
                        return Some(rec);
                    }
                }
                // A live host that never took the turn: its command may be lost.
                if let (Some(lost), Ok(found), HostSeen::Alive, true) =
                    (lost.as_mut(), &read, host, ctx.lease.held())
                {
                    let untaken = found.as_ref().is_none_or(|(r, _)| r.state == TurnState::Queued);
                    lost.check(ctx, watch.host, turn, untaken).await;
                }
            }
        }
    }
}

/// What a host's heartbeat key says on one tick of the wait.
#[derive(Clone, Copy, PartialEq, Eq)]
enum HostSeen {
    Alive,
    Lapsed,
    /// The read failed: nothing is decided on it.
    Unknown,
}

async fn host_seen(ctx: &Ctx, host: &turnstile_shared::HostName) -> HostSeen {
    match ctx
        .buckets
        .hosts
        .get::<turnstile_shared::records::HostRecord>(host.as_str())
        .await
    {
        Ok(Some(_)) => HostSeen::Alive,
        Ok(None) => HostSeen::Lapsed,
        Err(_) => HostSeen::Unknown,
    }
}

/// Fails the turn `transport_unavailable`, its host's heartbeat key having lapsed. A turn with
/// no record yet (its command not taken) is recorded failed from the one its command carries;
/// a transport that comes back then finds it ended and types nothing.
async fn fail_lapsed(ctx: &Ctx, watch: Watch<'_>) -> Option<TurnRecord> {
    let Watch {
        host,
        turn,
        unwritten,
        ..
    } = watch;
    let ended_at = Utc::now();
    let ttl = ctx.topology.host_ttl;
    ctx.buckets
        .turns
        .modify::<TurnRecord, _>(turn.as_str(), |cur| match cur.or(unwritten) {
            Some(r) if !r.state.is_terminal() => turnstile_shared::kv::Change::Write(TurnRecord {
                state: TurnState::Failed {
                    ended_at,
                    reason: turnstile_shared::records::reason::TRANSPORT_UNAVAILABLE.to_string(),
                    detail: format!(
                        "host {host} has not heartbeaten for {ttl:?}; its transport agent is gone"
                    ),
                    output: Vec::new(),
                },
                ..r.clone()
            }),
            _ => turnstile_shared::kv::Change::Keep,
        })
        .await
        .ok()
        .flatten()
        .filter(|r| r.state.is_terminal())
}

/// Emits the outcome event (derived from the durable record) and frees the lane.
pub(crate) async fn finish(
    ctx: &Ctx,
    session: &SessionRecord,
    msg: &jetstream::Message,
    record: &TurnRecord,
) {
    if ctx.lease.hold().await.is_err() {
        // Taken over: the survivor finishes the turn from its record.
        return;
    }
    observe_end(record);
    let event = end_event(record);
    // The event is sent before the ack (so readers see it before the next turn starts), and
    // both acknowledgements are awaited together, keeping the hand-off to one round trip: the
    // server serves the lane's next item as soon as it has taken the ack. An ack lost with a
    // connection comes back as a redelivery, which finds the turn ended and only finishes it.
    // Once the ack is confirmed the item is removed from the lane stream (`remove_item`).
    // A reply lost with a reconnect is not waited out (`reconnect`): the ack counts as
    // unconfirmed, the event is published again (de-duplicated by its id).
    let reconnects = ctx.pulls.reconnects();
    let sent = match &event {
        Some(ev) => Some(events::send(&ctx.js, ev).await),
        None => None,
    };
    let event_acked = async {
        match sent {
            Some(Ok(ack)) => match super::reconnect::unless_reconnected(reconnects, ack).await {
                Some(r) => r.map_err(|e| e.to_string()),
                None => Err("its reply was lost with a reconnect".to_string()),
            },
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(()),
        }
    };
    let (acked, lane_acked) = tokio::join!(event_acked, super::reconnect::double_ack(ctx, msg));
    match lane_acked {
        Ok(()) => super::remove_item(ctx, session, msg).await,
        Err(e) => {
            tracing::warn!(session = %session.id, turn = %record.id, error = %e, "ack lane item")
        }
    }
    if let (Err(e), Some(ev)) = (acked, event) {
        tracing::warn!(turn = %record.id, error = %e, "outcome event; retrying");
        tokio::spawn(republish(ctx.js.clone(), ev));
    }
}

/// Tells a turn's end without freeing the lane: a run's turn, whose lane item the run holds
/// on. Its metrics and its outcome event, the same as [`finish`] gives a lane's own turn (a
/// repeat after a resume is dropped by the event's stable id).
pub(crate) async fn tell_end(ctx: &Ctx, record: &TurnRecord) {
    observe_end(record);
    let Some(event) = end_event(record) else {
        return;
    };
    if let Err(e) = events::publish(&ctx.js, &event).await {
        tracing::warn!(turn = %record.id, error = %e, "outcome event; retrying");
        tokio::spawn(republish(ctx.js.clone(), event));
    }
}

fn end_event(record: &TurnRecord) -> Option<Envelope> {
    outcome_event(record)
        .map_err(|e| tracing::error!(turn = %record.id, error = %e, "build outcome event"))
        .ok()
}

/// How an outcome event whose publish failed is retried (its stable id makes a repeat harmless).
const REPUBLISH: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
const REPUBLISH_TRIES: usize = 10;

/// Retries an event whose publish failed after its lane item was acked (bounded; the event's
/// stable id makes a repeat harmless).
async fn republish(js: jetstream::Context, event: Envelope) {
    for delay in REPUBLISH.delays().take(REPUBLISH_TRIES) {
        tokio::time::sleep(delay).await;
        match events::publish(&js, &event).await {
            Ok(()) => return,
            Err(e) => tracing::warn!(event = %event.id, error = %e, "outcome event retry"),
        }
    }
    tracing::error!(event = %event.id, "outcome event lost after {REPUBLISH_TRIES} attempts");
}

/// `turn.completed` or `turn.failed` for a terminal record; shared with the stop path.
pub(crate) fn outcome_event(
    record: &TurnRecord,
) -> Result<Envelope, turnstile_shared::EnvelopeError> {
    let (k, data) = match &record.state {
        TurnState::Completed {
            host,
            typed_at,
            ended_at,
            output,
        } => (
            EventKind::TurnCompleted,
            json!({ "host": host, "typed_at": typed_at, "ended_at": ended_at, "output": output }),
        ),
        TurnState::Failed {
            reason,
            detail,
            ended_at,
            output,
        } => (
            EventKind::TurnFailed,
            json!({ "reason": reason, "detail": detail, "ended_at": ended_at, "output": output }),
        ),
        other => (
            EventKind::TurnFailed,
            json!({ "reason": "not_terminal", "detail": other.name() }),
        ),
    };
    session_event(k, &record.session, Some(&record.id), &data)
}
