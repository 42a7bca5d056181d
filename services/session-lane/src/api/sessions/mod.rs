//! `ts.api.session.*`: create, send, stop, list, show, and the host list. Any replica answers;
//! every change is a KV compare-and-set or an acknowledged publish (R14). `busy` and `queued`
//! are read off the session's lane consumer, never stored (R1).
//!
//! `mod.rs` creates sessions and queues their turns, `stop.rs` stops one (its owned work
//! cancelled, its lane drained), `view.rs` lists and shows them, `hosts.rs` places a new
//! session on a live host and lists the hosts.

use std::sync::Arc;

use chrono::Utc;
use serde_json::json;
use turnstile_shared::api::{ApiError, CreateSession, ErrorCode, SendTurn, MAX_MESSAGE_BYTES};
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::lane::{LaneItem, TurnItem};
use turnstile_shared::records::{AgentKind, SessionRecord, SessionState, StartCommand, TurnRecord};
use turnstile_shared::{subjects, topology, SessionId};

use crate::ctx::Ctx;

mod command;
mod hosts;
mod stop;
mod view;

use command::{command, Verb};
pub(in crate::api) use hosts::hosts;
use hosts::place;
use stop::drain_lane;
pub(in crate::api) use stop::stop;
pub(in crate::api) use view::{list, show};

pub(in crate::api) async fn create(
    ctx: Arc<Ctx>,
    req: CreateSession,
) -> Result<SessionRecord, ApiError> {
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

pub(in crate::api) async fn active_session(
    ctx: &Ctx,
    id: &SessionId,
) -> Result<SessionRecord, ApiError> {
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

pub(in crate::api) async fn send(ctx: Arc<Ctx>, req: SendTurn) -> Result<TurnRecord, ApiError> {
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
