//! `ts.api.session.*`: create, send, stop, list, show, and the host list. Any replica answers;
//! every change is a KV compare-and-set or an acknowledged publish (R14). `busy` and `queued`
//! are read off the session's lane consumer, never stored (R1).

use std::sync::Arc;

use chrono::Utc;
use serde_json::json;
use turnstile_shared::api::{
    ApiError, CreateSession, ErrorCode, ListSessions, SendTurn, SessionRef, SessionView,
    MAX_MESSAGE_BYTES,
};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::kv::Change;
use turnstile_shared::lane::{LaneItem, TurnItem};
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{
    reason, transport_kind, AgentKind, HostRecord, SessionRecord, SessionState, StartCommand,
    StopCommand, TurnRecord, TurnState,
};
use turnstile_shared::{subjects, topology, HostName, SessionId, TurnId};

use crate::ctx::Ctx;

async fn live_hosts(ctx: &Ctx) -> Result<Vec<HostRecord>, ApiError> {
    // The hosts bucket's age limit is the host TTL it was provisioned with.
    let ttl = ctx
        .buckets
        .hosts
        .store()
        .stream
        .cached_info()
        .config
        .max_age;
    let ttl = if ttl.is_zero() {
        ctx.topology.host_ttl
    } else {
        ttl
    };
    if let Some(hosts) = ctx.placement.live(ttl) {
        return Ok(hosts);
    }
    // Until the watch has caught up (a replica just started).
    ctx.buckets
        .hosts
        .values::<HostRecord>()
        .await
        .map_err(ApiError::from)
}

/// The live host with the fewest active sessions, unless the caller pinned one.
async fn place(ctx: &Ctx, pinned: Option<HostName>) -> Result<HostName, ApiError> {
    let hosts = live_hosts(ctx).await?;
    if let Some(h) = pinned {
        if hosts.iter().any(|r| r.name == h) {
            return Ok(h);
        }
        return Err(ApiError::new(
            ErrorCode::NoHost,
            format!("host {h} is not heartbeating; start `turnstile-transport-agent --host {h}`"),
        ));
    }
    hosts
        .into_iter()
        .map(|h| (ctx.placement.count(&h.name), h.name))
        .min()
        .map(|(_, h)| h)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::NoHost,
                "no transport host is heartbeating; start `turnstile-transport-agent --host NAME`",
            )
        })
}

pub(super) async fn create(ctx: Arc<Ctx>, req: CreateSession) -> Result<SessionRecord, ApiError> {
    let name = req.name.trim();
    if name.is_empty() || name.len() > 128 {
        return Err(ApiError::bad_request(
            "session name must be 1-128 characters",
        ));
    }
    if let Some(id) = &req.id {
        if let Some((existing, _)) = ctx
            .buckets
            .sessions
            .get::<SessionRecord>(id.as_str())
            .await
            .map_err(ApiError::from)?
        {
            if existing.name == name {
                return Ok(existing.redacted());
            }
            return Err(ApiError::bad_request(format!(
                "session {id} exists under another name"
            )));
        }
    }
    match (&req.agent, &req.launch) {
        (AgentKind::Tmux, None) => {
            return Err(ApiError::bad_request(
                "a tmux session needs `launch`: the command (argv) and its ready text",
            ))
        }
        (AgentKind::Tmux, Some(l)) if l.argv.is_empty() || l.ready.is_empty() => {
            return Err(ApiError::bad_request(
                "launch needs a non-empty argv and ready text",
            ))
        }
        (AgentKind::Tmux, Some(l)) => {
            // The ready and busy texts are regular expressions: refused here, not found
            // wanting at the first launch.
            for (what, pattern) in [("ready", Some(&l.ready)), ("busy", l.busy.as_ref())] {
                if let Some(Err(e)) = pattern.map(|p| regex::Regex::new(p)) {
                    return Err(ApiError::bad_request(format!(
                        "launch {what} pattern is not a regular expression: {e}"
                    )));
                }
            }
        }
        (_, None) => {}
        (_, Some(_)) => return Err(ApiError::bad_request("`launch` is only for agent tmux")),
    }
    let host = place(&ctx, req.host).await?;
    let record = SessionRecord {
        id: req.id.clone().unwrap_or_default(),
        name: name.to_string(),
        agent: req.agent,
        host: host.clone(),
        cwd: req.cwd,
        token: turnstile_shared::ids::new_secret(),
        created_at: Utc::now(),
        conversation: None,
        launch: req.launch.clone(),
        ready_timeout_ms: req.ready_timeout_ms,
        policy: req.policy.clone().unwrap_or_default(),
        state: SessionState::Active,
    };
    // The consumer first: a replica that sees the record starts pulling from it at once.
    topology::ensure_lane_consumer(&ctx.js, &ctx.topology, &record.id)
        .await
        .map_err(ApiError::from)?;
    ctx.buckets
        .sessions
        .create(record.id.as_str(), &record)
        .await
        .map_err(ApiError::from)?;
    // Counted at once, so a burst of creates spreads over the hosts (the supervisor's watch
    // would count it a little later).
    ctx.placement.session(&record.id, Some(&host));
    let start = StartCommand {
        session: record.id.clone(),
    };
    command(&ctx, &host, &record.id, Verb::Start, &start).await?;
    let ev = session_event(
        EventKind::SessionCreated,
        &record.id,
        None,
        &json!({ "name": record.name, "agent": record.agent, "host": host, "cwd": record.cwd }),
    )
    .map_err(ApiError::internal)?;
    events::publish(&ctx.js, &ev)
        .await
        .map_err(ApiError::from)?;
    Ok(record.redacted())
}

pub(super) async fn active_session(ctx: &Ctx, id: &SessionId) -> Result<SessionRecord, ApiError> {
    match ctx.buckets.sessions.get::<SessionRecord>(id.as_str()).await {
        Ok(Some((r, _))) if r.is_active() => Ok(r),
        Ok(Some(_)) => Err(ApiError::new(
            ErrorCode::Stopped,
            format!("session {id} is stopped"),
        )),
        Ok(None) => Err(ApiError::not_found(format!("no session {id}"))),
        Err(e) => Err(ApiError::from(e)),
    }
}

pub(super) async fn send(ctx: Arc<Ctx>, req: SendTurn) -> Result<TurnRecord, ApiError> {
    if req.text.trim().is_empty() {
        return Err(ApiError::bad_request("message text is empty"));
    }
    if req.text.len() > MAX_MESSAGE_BYTES {
        return Err(ApiError::bad_request(format!(
            "message text is {} bytes; the limit is {MAX_MESSAGE_BYTES}",
            req.text.len()
        )));
    }
    let session = active_session(&ctx, &req.session).await?;
    let turn = req.turn.unwrap_or_default();
    let record = TurnRecord::queued(turn.clone(), session.id.clone(), req.text.clone());
    let (record, revision) = match ctx
        .buckets
        .turns
        .create(turn.as_str(), &record)
        .await
        .map_err(ApiError::from)?
    {
        Some(rev) => (record, Some(rev)),
        // A retry of the same turn id: idempotent, as long as it is the same session's. Its
        // record may have moved on: the item says nothing of it.
        None => match ctx.buckets.turns.get::<TurnRecord>(turn.as_str()).await {
            Ok(Some((r, _))) if r.session == session.id => (r, None),
            Ok(_) => return Err(ApiError::bad_request(format!("turn id {turn} is taken"))),
            Err(e) => return Err(ApiError::from(e)),
        },
    };
    // `turn.queued` before the item, so no reader sees a turn start before it was queued.
    let ev = session_event(
        EventKind::TurnQueued,
        &session.id,
        Some(&turn),
        &json!({ "text": req.text }),
    )
    .map_err(ApiError::internal)?;
    events::publish(&ctx.js, &ev)
        .await
        .map_err(ApiError::from)?;
    let item = match revision {
        Some(rev) => TurnItem::of_record(&record, rev),
        None => TurnItem {
            turn: turn.clone(),
            text: req.text,
            recorded: None,
        },
    };
    let item = LaneItem::Turn(item)
        .to_envelope(&session.id)
        .map_err(ApiError::internal)?;
    events::publish_durable(&ctx.js, subjects::lane(&session.id), &item, None)
        .await
        .map_err(ApiError::from)?;
    // A stop that ran between the check above and this publish has already drained the lane:
    // drain again, so this turn fails rather than waiting forever on a stopped session (R13).
    if let Err(e) = active_session(&ctx, &session.id).await {
        drain_lane(&ctx, &session.id).await?;
        return Err(e);
    }
    Ok(record)
}

pub(super) async fn stop(ctx: Arc<Ctx>, req: SessionRef) -> Result<SessionRecord, ApiError> {
    let stopped_at = Utc::now();
    let record = ctx
        .buckets
        .sessions
        .modify::<SessionRecord, _>(req.session.as_str(), |cur| match cur {
            Some(r) if r.is_active() => Change::Write(SessionRecord {
                state: SessionState::Stopped { stopped_at },
                ..r.clone()
            }),
            _ => Change::Keep,
        })
        .await
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found(format!("no session {}", req.session)))?;
    let stop = StopCommand {
        session: record.id.clone(),
    };
    command(&ctx, &record.host, &record.id, Verb::Stop, &stop).await?;
    drain_lane(&ctx, &record.id).await?;
    cancel_owned_work(&ctx, &record.id).await?;
    ctx.forget_session(&record.id);
    let ev = session_event(EventKind::SessionStopped, &record.id, None, &json!({}))
        .map_err(ApiError::internal)?;
    events::publish(&ctx.js, &ev)
        .await
        .map_err(ApiError::from)?;
    Ok(record.redacted())
}

/// The work the session started that outlives its turns (`session` scope) ends with it (R7):
/// the broker cancels what the session's notes name. A stop that cannot reach the broker is
/// answered `unavailable`; the session is stopped already, and a repeated stop finishes it.
async fn cancel_owned_work(ctx: &Ctx, session: &SessionId) -> Result<(), ApiError> {
    let req = SessionRef {
        session: session.clone(),
    };
    let cancelled: turnstile_shared::step_api::Cancelled = turnstile_shared::api::call(
        &ctx.client,
        &Principal::Operator.exec(subjects::api::CANCEL_SESSION),
        &req,
        BROKER_CALL,
    )
    .await
    .map_err(|e| {
        ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "session {session} is stopped, but its work was not cancelled ({e}): stop it again"
            ),
        )
    })?;
    if !cancelled.cancelled.is_empty() {
        tracing::info!(%session, count = cancelled.cancelled.len(), "cancelled the stopped session's work");
    }
    Ok(())
}

/// How long a stop waits for the broker to cancel the session's work.
const BROKER_CALL: std::time::Duration = std::time::Duration::from_secs(10);

/// Fails every turn still on a stopped session's lane, then removes the lane and its
/// consumer, so nothing keeps waiting on the session (R13).
async fn drain_lane(ctx: &Ctx, session: &SessionId) -> Result<(), ApiError> {
    let stream = ctx
        .js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(ApiError::failure)?;
    let subject = subjects::lane(session);
    // From above the ack floor: a done item whose removal was lost is no turn to fail (its
    // record may be gone by its retention, and would be written again).
    let mut seq = turnstile_shared::lane::undone_from(&stream, session)
        .await
        .map_err(ApiError::failure_boxed)?
        - 1;
    loop {
        let msg = match stream
            .direct_get_next_for_subject(subject.as_str(), Some(seq + 1))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound => {
                break
            }
            Err(e) => return Err(ApiError::failure(e)),
        };
        seq = msg.sequence;
        let Ok(LaneItem::Turn(item)) = LaneItem::decode(&msg.payload, session) else {
            continue;
        };
        let ended_at = Utc::now();
        let rec = ctx
            .buckets
            .turns
            .modify::<TurnRecord, _>(item.turn.as_str(), |cur| match cur {
                Some(r) if r.state.is_terminal() => Change::Keep,
                Some(r) => Change::Write(TurnRecord {
                    state: stopped_state(ended_at),
                    ..r.clone()
                }),
                None => Change::Write(TurnRecord {
                    id: item.turn.clone(),
                    session: session.clone(),
                    text: item.text.clone(),
                    queued_at: ended_at,
                    delivery: None,
                    parent: None,
                    state: stopped_state(ended_at),
                }),
            })
            .await
            .map_err(ApiError::from)?;
        if let Some(rec) = rec {
            let ev = crate::handoff::outcome_event(&rec).map_err(ApiError::internal)?;
            events::publish(&ctx.js, &ev)
                .await
                .map_err(ApiError::from)?;
        }
    }
    stream
        .purge()
        .filter(subject)
        .await
        .map_err(ApiError::failure)?;
    match stream
        .delete_consumer(&subjects::lane_consumer(session))
        .await
    {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::debug!(%session, error = %e, "delete lane consumer");
            Ok(())
        }
    }
}

fn stopped_state(ended_at: chrono::DateTime<Utc>) -> TurnState {
    TurnState::Failed {
        ended_at,
        reason: reason::SESSION_STOPPED.to_string(),
        detail: "the session was stopped before this turn ended".to_string(),
        output: Vec::new(),
    }
}

/// One page of sessions, most recently written first, each with its lane's state.
pub(super) async fn list(
    ctx: Arc<Ctx>,
    req: ListSessions,
) -> Result<turnstile_shared::page::Page<SessionView>, ApiError> {
    let page = turnstile_shared::page::newest(&ctx.buckets.sessions, ">", &req.page, |_, s| {
        Some::<SessionRecord>(s)
    })
    .await?;
    let hosts = live_hosts(&ctx).await?;
    let views = futures::future::join_all(page.items.into_iter().map(|s| view(&ctx, s, &hosts)));
    let items = views.await.into_iter().collect::<Result<Vec<_>, _>>()?;
    Ok(turnstile_shared::page::Page {
        items,
        next: page.next,
    })
}

pub(super) async fn show(ctx: Arc<Ctx>, req: SessionRef) -> Result<SessionView, ApiError> {
    let record = match ctx
        .buckets
        .sessions
        .get::<SessionRecord>(req.session.as_str())
        .await
    {
        Ok(Some((r, _))) => r,
        Ok(None) => return Err(ApiError::not_found(format!("no session {}", req.session))),
        Err(e) => return Err(ApiError::from(e)),
    };
    let hosts = live_hosts(&ctx).await?;
    view(&ctx, record, &hosts).await
}

/// Busy and queued are read off the lane consumer itself (R1), never from a flag.
async fn view(
    ctx: &Ctx,
    record: SessionRecord,
    hosts: &[HostRecord],
) -> Result<SessionView, ApiError> {
    let transport = if hosts.iter().any(|h| h.name == record.host) {
        "up"
    } else {
        "transport_unavailable"
    };
    let mut busy = false;
    let mut queued = 0;
    let mut in_flight = None;
    let mut pending = 0;
    if record.is_active() {
        let stream = ctx
            .js
            .get_stream_no_info(subjects::LANE_STREAM)
            .await
            .map_err(ApiError::failure)?;
        if let Ok(info) = stream
            .consumer_info(subjects::lane_consumer(&record.id))
            .await
        {
            busy = info.num_ack_pending > 0;
            queued = info.num_pending;
            if busy {
                in_flight =
                    in_flight_turn(ctx, &stream, &record.id, info.delivered.stream_sequence).await;
            }
        }
        // Best effort, like the lane's figures above: a list still answers without it.
        pending = completion_backlog(ctx, &record.id)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(session = %record.id, error = %e, "count pending completions");
                0
            });
    }
    Ok(SessionView {
        session: record.redacted(),
        busy,
        in_flight,
        queued,
        pending,
        transport: transport.to_string(),
    })
}

/// The session's completions still on `TS_COMPLETION`: a handed-over one is deleted (R3),
/// so what is left is pending or being delivered.
async fn completion_backlog(ctx: &Ctx, session: &SessionId) -> Result<u64, ApiError> {
    let stream = ctx
        .js
        .get_stream_no_info(subjects::COMPLETION_STREAM)
        .await
        .map_err(ApiError::failure)?;
    let mut per_subject = stream
        .info_with_subjects(subjects::completion_session_all(session))
        .await
        .map_err(ApiError::failure)?;
    let mut total = 0u64;
    while let Some(entry) = futures::StreamExt::next(&mut per_subject).await {
        total += entry.map_err(ApiError::failure)?.1 as u64;
    }
    Ok(total)
}

async fn in_flight_turn(
    ctx: &Ctx,
    stream: &async_nats::jetstream::stream::Stream<()>,
    session: &SessionId,
    seq: u64,
) -> Option<TurnRecord> {
    let msg = stream.direct_get(seq).await.ok()?;
    let item = LaneItem::decode(&msg.payload, session).ok()?;
    let turn: TurnId = turnstile_shared::lane::current_turn(&item, &ctx.buckets.runs)
        .await
        .ok()
        .flatten()?;
    ctx.buckets
        .turns
        .get::<TurnRecord>(turn.as_str())
        .await
        .ok()
        .flatten()
        .map(|(r, _)| r)
}

/// Live hosts with their active sessions (`turnstile host list`).
pub(super) async fn hosts(
    ctx: Arc<Ctx>,
    _req: turnstile_shared::api::ListHosts,
) -> Result<Vec<turnstile_shared::api::HostView>, ApiError> {
    let mut live = live_hosts(&ctx).await?;
    live.sort_by(|a, b| a.name.cmp(&b.name));
    // The supervisor follows every session: its placement map answers without a store read.
    Ok(live
        .into_iter()
        .map(|h| turnstile_shared::api::HostView {
            sessions: ctx.placement.sessions_on(&h.name),
            host: h,
        })
        .collect())
}

/// The session commands this API sends a host's transport agent.
#[derive(Clone, Copy)]
enum Verb {
    Start,
    Stop,
}

/// Sends a session command to its host's transport, de-duplicated per session and verb, and
/// waits for the stream's acknowledgement (R14).
async fn command<T: serde::Serialize>(
    ctx: &Ctx,
    host: &HostName,
    session: &SessionId,
    verb: Verb,
    payload: &T,
) -> Result<(), ApiError> {
    let (kind, name) = match verb {
        Verb::Start => (transport_kind::START, "start"),
        Verb::Stop => (transport_kind::STOP, "stop"),
    };
    let env = Envelope::new(kind, payload)
        .map_err(ApiError::internal)?
        .with_session(session)
        .with_id(format!("{session}:{name}"));
    events::publish_durable(&ctx.js, subjects::transport(host, name), &env, None)
        .await
        .map_err(ApiError::from)
}
