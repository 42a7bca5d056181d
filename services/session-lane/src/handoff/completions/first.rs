//! The completion whose end armed a delivery (`first`, as its item names it): whether the
//! delivery waits for it when its fetch did not find it (an item can overtake its
//! completion's store; an item sent ahead may be an extra one), and the bounded wait.

use futures::StreamExt;
use turnstile_shared::delivery::{DeliveryItem, DeliveryMarker};
use turnstile_shared::records::SessionRecord;
use turnstile_shared::{arming, DeliveryId, ExecutionId, SessionId};

use super::batch::Batch;
use super::error::DeliveryError;
use crate::ctx::Ctx;
use crate::handoff::admit::Refusal;
use turnstile_shared::delivery::Completion;

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
    /// not if this replica collected it lately or the registry says a completed turn carried
    /// it (handed over already), nor if the registry holds another end than the one the item
    /// was sent ahead for (that end routed its own).
    /// An extra delivery waits for nothing either ([`Expected::is_extra`], told by a read
    /// made only if this one says to wait).
    pub(super) fn awaited(
        &self,
        collected: bool,
        registry: Option<&Result<Completion, Refusal>>,
    ) -> bool {
        if collected {
            return false;
        }
        match (self.ended_at, registry) {
            // A completed turn of this session carried it: nothing to wait for.
            (_, Some(Err(Refusal::HandedOver(_)))) => false,
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
    pub(super) fn sent_ahead(&self) -> bool {
        self.ended_at.is_some()
    }
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

/// How a wait for the completion that armed a delivery ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Waited {
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
pub(super) async fn wait_for(
    ctx: &Ctx,
    session: &SessionRecord,
    first: Expected<'_>,
    fetched: &mut Batch,
) -> Result<Waited, DeliveryError> {
    let execution = first.execution;
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
                    fetched.take_in(ctx, &session.id, msg).await;
                }
                held.open
            }
            None => false,
        };
        if fetched.holds(execution) {
            return Ok(Waited::Found);
        }
        if !open || fetched.is_full() || tokio::time::Instant::now() >= deadline {
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
    while !fetched.is_full() {
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
            fetched.take_in(ctx, &session.id, msg).await;
            if fetched.holds(execution) {
                return Ok(Waited::Found);
            }
        }
    }
    Ok(Waited::AtCap)
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
            !ahead.awaited(
                false,
                Some(&Err(Refusal::HandedOver(turnstile_shared::TurnId::new())))
            ),
            "the registry says a completed turn carried it: handed over already"
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
