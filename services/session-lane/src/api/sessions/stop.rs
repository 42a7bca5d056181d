//! A session's stop: recorded stopped, the work it owns cancelled by the broker (R7), every
//! turn still on its lane failed and the lane removed (R13), its transport told.

use std::sync::Arc;

use chrono::Utc;
use serde_json::json;
use turnstile_shared::api::{ApiError, ErrorCode, SessionRef};
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::kv::Change;
use turnstile_shared::lane::LaneItem;
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{
    reason, SessionRecord, SessionState, StopCommand, TurnRecord, TurnState,
};
use turnstile_shared::{subjects, SessionId};

use super::command::{command, Verb};
use crate::ctx::Ctx;

pub(in crate::api) async fn stop(
    ctx: Arc<Ctx>,
    req: SessionRef,
) -> Result<SessionRecord, ApiError> {
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
pub(super) async fn drain_lane(ctx: &Ctx, session: &SessionId) -> Result<(), ApiError> {
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
        let item = match LaneItem::decode(&msg.payload, session) {
            Ok(LaneItem::Turn(item)) => item,
            // A run that had not started never will (a running one ends with its turn).
            Ok(LaneItem::Run(run)) => {
                crate::orphan_runs::end_stopped(ctx, &run.run)
                    .await
                    .map_err(ApiError::from)?;
                continue;
            }
            _ => continue,
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

pub(super) fn stopped_state(ended_at: chrono::DateTime<Utc>) -> TurnState {
    TurnState::Failed {
        ended_at,
        reason: reason::SESSION_STOPPED.to_string(),
        detail: "the session was stopped before this turn ended".to_string(),
        output: Vec::new(),
    }
}
