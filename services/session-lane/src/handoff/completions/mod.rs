//! Completions on their way to the agent (R3, R8), shared by the delivery and run item
//! kinds: collect the session's pending completions (up to the cap, a [`batch::Batch`]) and
//! check each is addressed to a session that owns or watches it and was not handed to it
//! already (`admit`); the completion that armed a delivery is waited for (`first`); after the
//! turn that carried them, `settle` records the hand-over and acks them if it completed, or
//! leaves them pending if it failed, and clears and re-arms the delivery marker.

mod batch;
mod error;
mod first;
mod settle;

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use turnstile_shared::delivery::Completion;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::{ExecutionId, SessionId};

use super::admit::{check_first, check_known, wait_ended, Refusal};
use crate::ctx::Ctx;
use batch::{reject, Batch, Fetched};
use first::{wait_for, Waited};

pub(crate) use error::DeliveryError;
pub(crate) use first::Expected;
pub(crate) use settle::{disarm_and_recheck, keep_standby, settle};

/// Pulls up to the cap of pending completions; refuses those not addressed to a session that
/// owns or watches them (R8). Returns what to carry and the messages held.
pub(crate) async fn collect(
    ctx: &Ctx,
    session: &SessionRecord,
) -> Result<(Vec<(Completion, u64)>, Vec<jetstream::Message>), DeliveryError> {
    let taken = collect_expecting(ctx, session, None).await?;
    Ok((taken.carried, taken.held))
}

/// What a delivery took: the completions it carries and their messages, and the completion
/// that armed it if it was left out at the cap before it was stored (see
/// [`disarm_and_recheck`]).
pub(crate) struct Taken {
    pub carried: Vec<(Completion, u64)>,
    pub held: Vec<jetstream::Message>,
    pub unseen: Option<ExecutionId>,
}

/// How many times a completion whose end the registry does not hold yet is left pending with
/// the next delivery armed for it; past that, a new end routed for it arms one.
const LEFT_TRIES: i64 = 5;

/// Like [`collect`], with the registry check of `expected` (the execution whose completion
/// armed the delivery) run beside the fetch: the common delivery of one completion then
/// costs one round trip before its turn is recorded, not two.
pub(crate) async fn collect_expecting(
    ctx: &Ctx,
    session: &SessionRecord,
    expected: Option<Expected<'_>>,
) -> Result<Taken, DeliveryError> {
    let early = async {
        match expected {
            Some(e) => Some((
                e.execution,
                check_first(ctx, &session.id, e.execution, e.sent_ahead()).await,
            )),
            None => None,
        }
    };
    let (fetched, mut early) = tokio::join!(Batch::fetch(ctx, session), early);
    let mut fetched = fetched?;
    let mut unseen = None;
    if let Some(first) = expected.filter(|e| !fetched.holds(e.execution)) {
        let collected = ctx.collected.knows(first.execution);
        // An item sent ahead may also be an extra one: `wait_for` reads its marker meanwhile.
        if first.awaited(collected, early.as_ref().map(|(_, v)| v))
            && wait_for(ctx, session, first, &mut fetched).await? == Waited::AtCap
        {
            unseen = Some(first.execution.clone());
        }
    }
    let verdicts = futures::future::join_all(fetched.iter().map(|f| {
        let known = early
            .take_if(|(e, _)| **e == f.completion.execution)
            .map(|(_, v)| v);
        let execution = &f.completion.execution;
        async move {
            // Read again if the end was not recorded when it was first read (the completion
            // may have been waited for since).
            let verdict = match known {
                Some(Err(Refusal::NotEnded)) | None => {
                    check_known(ctx, &session.id, execution).await
                }
                Some(v) => v,
            };
            // Stored beside its end's registry write, which lands a moment later.
            match verdict {
                Err(Refusal::NotEnded) => wait_ended(ctx, &session.id, execution).await,
                v => v,
            }
        }
    }))
    .await;
    let (carried, held, left) =
        keep_admitted(ctx, &session.id, fetched.into_items(), verdicts).await;
    ctx.collected
        .note(carried.iter().map(|(c, _)| &c.execution));
    Ok(Taken {
        carried,
        held,
        // Left pending for its end: the next delivery is armed naming it, so it waits for
        // its redelivery rather than finding nothing.
        unseen: unseen.or(left),
    })
}

/// Keeps what the registry admitted, as the registry has it; the rest is retried later or
/// refused (dead-lettered). Also returns a completion left pending because its end is not
/// recorded yet, to arm the next delivery for (up to [`LEFT_TRIES`] times).
async fn keep_admitted(
    ctx: &Ctx,
    session: &SessionId,
    fetched: Vec<Fetched>,
    verdicts: Vec<Result<Completion, Refusal>>,
) -> (
    Vec<(Completion, u64)>,
    Vec<jetstream::Message>,
    Option<ExecutionId>,
) {
    let mut carried = Vec::new();
    let mut held = Vec::new();
    let mut left = None;
    for (f, verdict) in fetched.into_iter().zip(verdicts) {
        match verdict {
            Ok(completion) => {
                carried.push((completion, f.seq));
                held.push(f.msg);
            }
            Err(Refusal::NotEnded) => {
                let tries = f.msg.info().map_or(1, |i| i.delivered);
                let _ = f
                    .msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
                tracing::info!(%session, execution = %f.completion.execution, tries, "a completion whose end the registry does not hold yet; retried later");
                if tries < LEFT_TRIES {
                    left.get_or_insert(f.completion.execution);
                }
            }
            Err(Refusal::Retry(e)) => {
                let _ = f
                    .msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
                tracing::warn!(%session, error = %e, "check completion; retried later");
            }
            Err(Refusal::HandedOver(turn)) => {
                // Another copy of a completion a completed turn carried (its removal was
                // lost, or its end was routed again): removed, not typed twice.
                tracing::info!(%session, execution = %f.completion.execution, %turn, "a completion the registry says was handed over already came back; dropped");
                ctx.handed_over
                    .note([&(session.clone(), f.completion.execution.clone())]);
                let _ = f.msg.ack_with(AckKind::Term).await;
            }
            Err(Refusal::Reject(reason)) => reject(ctx, session, &f.msg, &reason).await,
        }
    }
    (carried, held, left)
}
