//! Sessions as the operator sees them: a page of them, or one, with busy and queued read off
//! the lane consumer (R1) and the completions still pending for it.

use std::sync::Arc;

use turnstile_shared::api::{ApiError, ListSessions, SessionRef, SessionView};
use turnstile_shared::lane::LaneItem;
use turnstile_shared::records::{HostRecord, SessionRecord, TurnRecord};
use turnstile_shared::{subjects, SessionId, TurnId};

use crate::ctx::Ctx;

use super::hosts::live_hosts;

/// One page of sessions, most recently written first, each with its lane's state.
pub(in crate::api) async fn list(
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

pub(in crate::api) async fn show(ctx: Arc<Ctx>, req: SessionRef) -> Result<SessionView, ApiError> {
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

/// The session's completions not handed over yet: what its completion consumer has still to
/// deliver or holds unacked. A handed-over one is acked, then deleted (R3); a deletion the
/// store refused (a full disk) leaves an acked copy on `TS_COMPLETION`, which is not pending
/// (it is never delivered again), so the consumer's counts are read, not the stream's. Before
/// the session's consumer exists, the stream's messages for the session are counted.
async fn completion_backlog(ctx: &Ctx, session: &SessionId) -> Result<u64, ApiError> {
    let stream = ctx
        .js
        .get_stream_no_info(subjects::COMPLETION_STREAM)
        .await
        .map_err(ApiError::failure)?;
    if let Some(n) = crate::handoff::pending_completions(&stream, session).await {
        return Ok(n);
    }
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
