//! Completions on their way to the agent (R3, R8), shared by the delivery and run item
//! kinds: collect the session's pending completions (up to the cap) and check each is
//! addressed to a session that owns or watches it; after the turn that carried them, ack them
//! if it completed or leave them pending if it failed; clear and re-arm the delivery marker.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use serde_json::json;
use turnstile_shared::delivery::{
    self, Completion, DeliveryItem, DeliveryMarker, COMPLETION_KIND, DELIVERY_CAP,
};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::records::{Carried, SessionRecord, TurnRecord, TurnState};
use turnstile_shared::{
    arming, deadletter, subjects, topology, DeliveryId, ExecutionId, SessionId,
};

use super::admit::{check_first, check_known, wait_ended, Refusal};
use super::rearm::arm;
use crate::ctx::Ctx;

#[derive(Debug, thiserror::Error)]
pub(crate) enum DeliveryError {
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
    #[error("fetch completions of {session}: {source}")]
    Fetch {
        session: SessionId,
        source: async_nats::Error,
    },
    #[error(transparent)]
    Nats(#[from] async_nats::Error),
    #[error("turn {0} was recorded meanwhile; going on with it")]
    Recorded(turnstile_shared::TurnId),
}

/// Clears the session's marker, then arms the next delivery if completions are pending that
/// this one did not take (beyond the cap, or stored between its fetch and the clearing: their
/// routers saw the marker and left them to this delivery). Any completion stored after the
/// clearing arms a delivery itself, except the one that armed this delivery when this one
/// left it out at the cap before it was stored (`unseen`): its router counts on a delivery
/// waiting for it, so the next one is armed naming it, whatever is pending now.
pub(crate) async fn disarm_and_recheck(
    ctx: &Ctx,
    session: &SessionId,
    item: &DeliveryItem,
    unseen: Option<&ExecutionId>,
) -> Result<(), DeliveryError> {
    delivery::disarm(&ctx.buckets.deliveries, session, item).await?;
    if unseen.is_some() {
        arm(ctx, session, unseen).await;
        return Ok(());
    }
    let mut consumer = ctx.completion_consumer(session).await?;
    let info = consumer.info().await.map_err(|e| DeliveryError::Fetch {
        session: session.clone(),
        source: e.into(),
    })?;
    // What a standby of this lane holds, or was sent, is pending too: its router may have
    // seen the marker still set.
    if info.num_pending > 0 || ctx.standbys.owes(session, info.delivered.consumer_sequence) {
        arm(ctx, session, None).await;
    }
    Ok(())
}

/// Keeps a pull for the session's next completions out for a while (`standby`): opened by a
/// delivery that carried some, once its marker is cleared.
pub(crate) async fn keep_standby(ctx: &Ctx, session: &SessionId) {
    match ctx.completion_consumer(session).await {
        Ok(consumer) => ctx.standbys.open(consumer, session),
        Err(e) => tracing::debug!(%session, error = %e, "completion standby not opened"),
    }
}

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

/// The completion whose end armed a delivery, as its item names it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected<'a> {
    pub execution: &'a ExecutionId,
    /// When the end that armed the item ended: set for an item sent ahead of that end's
    /// registry write and of its marker's create (`DeliveryItem::first_ended_at`).
    pub ended_at: Option<chrono::DateTime<chrono::Utc>>,
    /// The item's delivery.
    pub delivery: &'a DeliveryId,
}

impl<'a> Expected<'a> {
    pub(crate) fn of(item: &'a DeliveryItem) -> Option<Self> {
        item.first.as_ref().map(|execution| Self {
            execution,
            ended_at: item.first_ended_at,
            delivery: &item.delivery,
        })
    }

    /// Whether this delivery has a completion to wait for, when its fetch did not find it:
    /// not if this replica collected it lately (handed over already), nor if the registry
    /// holds another end than the one the item was sent ahead for (that end routed its own).
    /// An extra delivery waits for nothing either ([`Expected::is_extra`], told by a read
    /// made only if this one says to wait).
    fn awaited(&self, collected: bool, registry: Option<&Result<Completion, Refusal>>) -> bool {
        if collected {
            return false;
        }
        match (self.ended_at, registry) {
            (Some(at), Some(Ok(recorded))) => recorded.ended_at == at,
            _ => true,
        }
    }

    /// Whether the item is an extra delivery, given the session's armed one (`armed`, its
    /// marker's): sent ahead, and its marker's create found another delivery armed. The
    /// armed one takes the completion.
    fn is_extra(&self, armed: Option<&DeliveryId>) -> bool {
        self.sent_ahead() && armed.is_some_and(|d| d != self.delivery)
    }

    /// Whether the item went out ahead of its marker's create (so it may be an extra one).
    fn sent_ahead(&self) -> bool {
        self.ended_at.is_some()
    }
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
    let (fetched, mut early) = tokio::join!(fetch(ctx, session), early);
    let mut fetched = fetched?;
    let mut unseen = None;
    if let Some(first) = expected.filter(|e| {
        !fetched
            .iter()
            .any(|f| f.completion.execution == *e.execution)
    }) {
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
    let (carried, held, left) = keep_admitted(ctx, &session.id, fetched, verdicts).await;
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

/// Whether `first`'s item is an extra delivery ([`Expected::is_extra`]): reads the
/// session's marker, for an item sent ahead only.
async fn extra(ctx: &Ctx, session: &SessionId, first: Expected<'_>) -> bool {
    if !first.sent_ahead() {
        return false;
    }
    let armed = ctx
        .buckets
        .deliveries
        .get::<DeliveryMarker>(session.as_str())
        .await
        .ok()
        .flatten()
        .map(|(m, _)| m.delivery);
    first.is_extra(armed.as_ref())
}

/// A pending completion pulled for a turn: its message, its stream sequence and what it
/// says.
struct Fetched {
    msg: jetstream::Message,
    seq: u64,
    completion: Completion,
}

/// Pulls up to the cap of pending completions: what this lane's standby holds, and, unless
/// it is still out, a fetch. Those that are not completions for this session (undecodable,
/// another kind, another session's) are refused here (R8); the rest still need their
/// registry [`check`].
async fn fetch(ctx: &Ctx, session: &SessionRecord) -> Result<Vec<Fetched>, DeliveryError> {
    let mut fetched = Vec::new();
    if let Some(held) = ctx.standbys.take(&session.id).await {
        for msg in held.messages {
            take_in(ctx, &session.id, msg, &mut fetched).await;
        }
        if held.open {
            return Ok(fetched);
        }
    }
    let consumer = ctx.completion_consumer(&session.id).await?;
    let fetch_err = |e: async_nats::Error| DeliveryError::Fetch {
        session: session.id.clone(),
        source: e,
    };
    let mut batch = consumer
        .fetch()
        .max_messages(DELIVERY_CAP.saturating_sub(fetched.len()).max(1))
        .messages()
        .await
        .map_err(|e| fetch_err(e.into()))?;
    while let Some(m) = batch.next().await {
        let msg = m.map_err(&fetch_err)?;
        take_in(ctx, &session.id, msg, &mut fetched).await;
    }
    Ok(fetched)
}

/// Adds a pulled message to what a delivery took, or refuses it (R8). A redelivery of one
/// taken already replaces it (its earlier delivery's ack would be void).
async fn take_in(
    ctx: &Ctx,
    session: &SessionId,
    msg: jetstream::Message,
    fetched: &mut Vec<Fetched>,
) {
    let (seq, delivered) = msg
        .info()
        .map(|i| (i.stream_sequence, i.consumer_sequence))
        .unwrap_or_default();
    ctx.standbys.seen(session, delivered);
    match decode(session, &msg) {
        Ok(completion)
            if ctx
                .handed_over
                .knows(&(session.clone(), completion.execution.clone())) =>
        {
            // A copy of a completion a completed turn carried: its ack or removal had not
            // landed when this copy was handed out (or a standby held it). Never typed again.
            tracing::info!(%session, execution = %completion.execution, "a completion handed over already came back; dropped");
            let _ = msg.ack_with(AckKind::Term).await;
        }
        Ok(completion) => {
            fetched.retain(|f| f.seq != seq);
            fetched.push(Fetched {
                msg,
                seq,
                completion,
            });
        }
        Err(reason) => reject(ctx, session, &msg, &reason).await,
    }
}

/// How a wait for the completion that armed a delivery ended.
#[derive(Debug, PartialEq, Eq)]
enum Waited {
    Found,
    /// The delivery is full: it goes without it, and the next one waits for it.
    AtCap,
    /// Not stored within [`arming::FIRST_WAIT`]: its router, that late, arms again.
    GaveUp,
    /// The item is an extra delivery (sent ahead, its marker's create found another armed):
    /// the armed one takes it.
    Extra,
}

/// The completion that armed this delivery was not pending yet: its router publishes the
/// item beside the completion's store, so the item can overtake it. Waits for it (taking
/// whatever else arrives meanwhile) up to [`arming::FIRST_WAIT`], or until the delivery is
/// full: from the lane's standby while it is out (the server pushes the completion to it as
/// it stores it), else by pulls. For an item sent ahead, its marker is read meanwhile: an
/// extra delivery waits for nothing.
async fn wait_for(
    ctx: &Ctx,
    session: &SessionRecord,
    first: Expected<'_>,
    fetched: &mut Vec<Fetched>,
) -> Result<Waited, DeliveryError> {
    let execution = first.execution;
    let found = |fetched: &[Fetched]| fetched.iter().any(|f| f.completion.execution == *execution);
    let deadline = tokio::time::Instant::now() + arming::FIRST_WAIT;
    let is_extra = extra(ctx, &session.id, first);
    tokio::pin!(is_extra);
    let mut extra_known = false;
    // From the standby while it is out. What it holds is taken before its state is looked
    // at: the message that fills it to the cap arrives as it closes.
    loop {
        let open = match ctx.standbys.take(&session.id).await {
            Some(held) => {
                for msg in held.messages {
                    take_in(ctx, &session.id, msg, fetched).await;
                }
                held.open
            }
            None => false,
        };
        if found(fetched) {
            return Ok(Waited::Found);
        }
        if !open || fetched.len() >= DELIVERY_CAP || tokio::time::Instant::now() >= deadline {
            break;
        }
        let arrival = ctx.standbys.arrival(&session.id, deadline);
        if extra_known {
            arrival.await;
        } else {
            tokio::select! {
                biased;
                extra = &mut is_extra => {
                    if extra {
                        return Ok(Waited::Extra);
                    }
                    extra_known = true;
                }
                () = arrival => {}
            }
        }
    }
    if !extra_known && is_extra.await {
        return Ok(Waited::Extra);
    }
    let consumer = ctx.completion_consumer(&session.id).await?;
    let fetch_err = |e: async_nats::Error| DeliveryError::Fetch {
        session: session.id.clone(),
        source: e,
    };
    while fetched.len() < DELIVERY_CAP {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left < std::time::Duration::from_millis(1) {
            tracing::info!(session = %session.id, %execution, "the completion that armed this delivery did not arrive; delivering without it");
            return Ok(Waited::GaveUp);
        }
        let mut batch = consumer
            .batch()
            .max_messages(1)
            .expires(left)
            .messages()
            .await
            .map_err(|e| fetch_err(e.into()))?;
        while let Some(m) = batch.next().await {
            let msg = m.map_err(&fetch_err)?;
            take_in(ctx, &session.id, msg, fetched).await;
            if found(fetched) {
                return Ok(Waited::Found);
            }
        }
    }
    Ok(Waited::AtCap)
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
            Err(Refusal::Reject(reason)) => reject(ctx, session, &f.msg, &reason).await,
        }
    }
    (carried, held, left)
}

/// A completion message addressed to this session, or why it is not one.
fn decode(session: &SessionId, m: &jetstream::Message) -> Result<Completion, String> {
    let env = Envelope::decode(&m.payload).map_err(|e| e.to_string())?;
    env.expect_kind(COMPLETION_KIND)
        .map_err(|e| e.to_string())?;
    if env.session.as_ref() != Some(session) {
        return Err(format!(
            "completion names session {:?}, not {session}",
            env.session.map(|s| s.to_string())
        ));
    }
    env.data_as().map_err(|e| e.to_string())
}

/// R8 refusal: dead-lettered with the reason and recorded as `completion.rejected`.
async fn reject(ctx: &Ctx, session: &SessionId, m: &jetstream::Message, reason: &str) {
    let seq = m.info().map(|i| i.stream_sequence).unwrap_or_default();
    let dlq = subjects::completion_deadletter(session);
    let ev = session_event(
        EventKind::CompletionRejected,
        session,
        None,
        &json!({ "reason": reason, "subject": m.subject.as_str(), "seq": seq, "dead_letter": dlq }),
    )
    .map(|e| e.with_id(format!("{session}:completion.rejected:{seq}")));
    match ev {
        Ok(ev) => deadletter::refuse(&ctx.js, m, dlq, reason, &ev).await,
        Err(e) => tracing::error!(error = %e, "build completion.rejected"),
    }
}

/// After the delivery turn: completed → ack what it carried (messages held now, or by
/// sequence for a delivery resumed after a crash); failed → leave them pending (R3).
pub(crate) async fn settle(
    ctx: &Ctx,
    session: &SessionRecord,
    record: &TurnRecord,
    held: &[jetstream::Message],
) {
    let Some(carried) = &record.delivery else {
        return;
    };
    let completed = matches!(record.state, TurnState::Completed { .. });
    let m = turnstile_shared::metrics::metrics();
    let count = carried.completions.len() as u64;
    m.delivery_batch.observe(count as f64);
    if completed {
        m.completions_handed_over.inc_by(count);
    } else {
        m.completions_left_pending.inc_by(count);
    }
    // A failed hand-over leaves its completions pending (R3); the session's next turn end
    // arms a delivery for them again.
    ctx.mark_left_pending(&session.id, !completed);
    // The recorded list is what was typed. A held message it does not name (the record was
    // written from an earlier attempt's command, with another batch) stays pending.
    let (held, extra): (Vec<_>, Vec<_>) = held.iter().partition(|h| {
        h.info().is_ok_and(|i| {
            carried
                .completions
                .iter()
                .any(|c| c.seq == i.stream_sequence)
        })
    });
    for h in extra {
        let _ = h.ack_with(AckKind::Nak(None)).await;
    }
    if completed {
        ctx.handed_over.note(
            &carried
                .completions
                .iter()
                .map(|c| (session.id.clone(), c.execution.clone()))
                .collect::<Vec<_>>(),
        );
        // Acked through the messages held; by sequence for what is not held (a delivery
        // resumed after a crash, or a failed ack). Removal is idempotent.
        let mut all = held.len() == carried.completions.len();
        for h in &held {
            if let Err(e) = super::reconnect::double_ack(ctx, h).await {
                tracing::warn!(session = %session.id, error = %e, "ack completion; removing by sequence");
                all = false;
                break;
            }
        }
        if !all {
            remove_by_seq(ctx, carried).await;
        }
    } else {
        for h in held {
            let _ = h.ack_with(AckKind::Nak(None)).await;
        }
    }
    let k = if completed {
        EventKind::DeliveryCompleted
    } else {
        EventKind::DeliveryFailed
    };
    let data = json!({
        "delivery": carried.delivery,
        "turn": record.id,
        "executions": carried.completions.iter().map(|c| &c.execution).collect::<Vec<_>>(),
        "count": carried.completions.len(),
    });
    match session_event(k, &session.id, Some(&record.id), &data) {
        Ok(ev) => {
            if let Err(e) = events::publish(&ctx.js, &ev).await {
                tracing::warn!(error = %e, "delivery event");
            }
        }
        Err(e) => tracing::warn!(error = %e, "build delivery event"),
    }
}

/// Removes carried completions from the work-queue stream by sequence: the ack of a delivery
/// resumed by another replica, which no longer holds the messages. Idempotent.
async fn remove_by_seq(ctx: &Ctx, carried: &Carried) {
    for c in &carried.completions {
        match turnstile_shared::removal::remove(&ctx.js, subjects::COMPLETION_STREAM, c.seq).await {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(execution = %c.execution, seq = c.seq, error = %e, "remove carried completion; it stays pending")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::StepId;

    fn recorded(execution: &ExecutionId, at: chrono::DateTime<chrono::Utc>) -> Completion {
        Completion {
            execution: execution.clone(),
            name: "n".into(),
            status: "completed".into(),
            summary: String::new(),
            ended_at: at,
        }
    }

    #[test]
    fn a_delivery_waits_only_for_a_completion_that_may_still_come() {
        let x: ExecutionId = StepId::new().into();
        let d = DeliveryId::new();
        let at = chrono::Utc::now();
        let ahead = Expected {
            execution: &x,
            ended_at: Some(at),
            delivery: &d,
        };
        let ours = Ok(recorded(&x, at));
        let theirs = Ok(recorded(&x, at + chrono::TimeDelta::milliseconds(3)));
        assert!(
            ahead.awaited(false, Some(&ours)),
            "its end recorded: stored soon"
        );
        assert!(
            ahead.awaited(false, Some(&Err(Refusal::NotEnded))),
            "its end not recorded yet: both on their way"
        );
        assert!(
            !ahead.awaited(false, Some(&theirs)),
            "another end won: that one routed its own completion"
        );
        assert!(
            !ahead.awaited(true, Some(&ours)),
            "collected lately here: handed over already"
        );
        assert!(
            ahead.is_extra(Some(&DeliveryId::new())),
            "an extra delivery: the armed one takes it"
        );
        assert!(!ahead.is_extra(Some(&d)), "its own marker: the armed one");
        assert!(!ahead.is_extra(None), "nothing armed: not an extra one");
        let armed_after_store = Expected {
            execution: &x,
            ended_at: None,
            delivery: &d,
        };
        assert!(armed_after_store.awaited(false, Some(&theirs)));
        assert!(
            !armed_after_store.is_extra(Some(&DeliveryId::new())),
            "armed after its store: its marker's own item"
        );
        assert!(ahead.sent_ahead() && !armed_after_store.sent_ahead());
    }
}
