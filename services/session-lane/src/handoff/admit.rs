//! Whether a fetched completion may be handed over now (R8, R12): only to a session that
//! owns or watches its execution, and only once the registry holds the execution's end,
//! saying what the registry says, and never to a session a completed turn handed it to
//! already. Answered from this replica's view of recent ends when it admits the completion
//! (`crate::ended_view`), else by a read; a completion stored beside its end's write is read
//! again until the end lands.

use std::time::Duration;

use turnstile_shared::delivery::Completion;
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::{ExecutionId, SessionId};

use crate::ctx::Ctx;

/// Why a fetched completion is not carried now.
pub(super) enum Refusal {
    Retry(turnstile_shared::kv::KvError),
    /// The registry does not hold its execution's end yet: its router stores the completion
    /// beside the end's write, which may land a moment later (or fail, and be redone).
    NotEnded,
    /// A completed turn of this session carried it already (the registry says which): a
    /// copy that came back is dropped, never typed again (R3, R14).
    HandedOver(turnstile_shared::TurnId),
    Reject(String),
}

/// How long the check of the completion that armed a delivery sent ahead waits for its end
/// to arrive by this replica's watch of the registry before it reads it (a few round trips:
/// its write went out beside the item).
const VIEW_WAIT: Duration = Duration::from_millis(3);

/// [`check`] of the completion that armed a delivery: from this replica's view of recent
/// ends if it holds it; for an item sent ahead of its end's write, waiting briefly for it
/// there first.
pub(super) async fn check_first(
    ctx: &Ctx,
    session: &SessionId,
    execution: &ExecutionId,
    sent_ahead: bool,
) -> Result<Completion, Refusal> {
    if sent_ahead {
        if let Some(c) = ctx
            .ended
            .admitted_within(execution, session, VIEW_WAIT)
            .await
        {
            return Ok(c);
        }
    }
    check_known(ctx, session, execution).await
}

/// [`check`], answered from this replica's view of recent ends when it admits the
/// completion (the view never refuses one: what it does not admit is read).
pub(super) async fn check_known(
    ctx: &Ctx,
    session: &SessionId,
    execution: &ExecutionId,
) -> Result<Completion, Refusal> {
    match ctx.ended.admitted(execution, session) {
        Some(c) => Ok(c),
        None => check(ctx, session, execution).await,
    }
}

/// A completion is handed over only to its owner or a registered watcher (R8), and only
/// once the registry holds its execution's end: what the agent is told is the end recorded
/// there (R12), whatever the message says.
async fn check(
    ctx: &Ctx,
    session: &SessionId,
    execution: &ExecutionId,
) -> Result<Completion, Refusal> {
    let record = ctx
        .buckets
        .executions
        .get::<ExecutionRecord>(execution.as_str())
        .await
        .map_err(Refusal::Retry)?;
    match record {
        Some((r, _)) if r.may_receive(session) && r.status.is_terminal() => {
            match r.handed_to(session) {
                Some(turn) => Err(Refusal::HandedOver(turn.clone())),
                None => Ok(Completion::of(&r)),
            }
        }
        Some((r, _)) if r.may_receive(session) => Err(Refusal::NotEnded),
        Some((r, _)) => Err(Refusal::Reject(format!(
            "execution {} belongs to {}; session {session} neither owns nor watches it",
            r.id,
            r.owner
                .as_ref()
                .map_or("no owner".to_string(), |o| o.to_string())
        ))),
        None => Err(Refusal::Reject(format!(
            "no execution {execution} in the registry"
        ))),
    }
}

/// How long a delivery reads a completion's record again for its end ([`wait_ended`]):
/// well inside a lane item's ack wait, with its fetch.
const ENDED_WAIT: Duration = Duration::from_secs(1);

/// Checks again until the registry holds the end, for up to [`ENDED_WAIT`]: a completion
/// sent ahead is stored beside its end's registry write, which may land a moment after it
/// (or, a conflict re-read first, a few round trips after).
pub(super) async fn wait_ended(
    ctx: &Ctx,
    session: &SessionId,
    execution: &ExecutionId,
) -> Result<Completion, Refusal> {
    let deadline = tokio::time::Instant::now() + ENDED_WAIT;
    let mut pause = Duration::from_millis(1);
    loop {
        // Woken early if this replica's watch of the registry sees the end.
        if let Some(c) = ctx.ended.admitted_within(execution, session, pause).await {
            return Ok(c);
        }
        if !ctx.ended.following() {
            tokio::time::sleep(pause).await;
        }
        match check(ctx, session, execution).await {
            Err(Refusal::NotEnded) if tokio::time::Instant::now() < deadline => {
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            v => return v,
        }
    }
}
