//! Arming a session's one `delivery` lane item (R3): the marker in the deliveries bucket is
//! claimed first, then the item is published under the same id (beside the completion's
//! store, by a router: see [`FIRST_WAIT`]). Above both the lane item and
//! the delivery records, as the broker and the lane use it.

use std::time::Duration;

use async_nats::jetstream;
use chrono::Utc;

use crate::delivery::{DeliveryItem, DeliveryMarker};
use crate::envelope::{Envelope, EnvelopeError};
use crate::ids::{DeliveryId, ExecutionId, SessionId};
use crate::kv::{Bucket, KvError};
use crate::lane::{lane_kind, LaneItem};
use crate::{events, subjects};

#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Publish(#[from] events::PublishError),
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("read lane of {session}: {source}")]
    Lane {
        session: SessionId,
        source: async_nats::Error,
    },
}

/// How long a delivery waits for the completion that armed it (named in its item as
/// `first`) when its fetch does not find it: its router publishes the item beside the
/// completion's store, so the item may overtake it. A router whose store took half this long
/// or more arms again, in case the delivery stopped waiting before the store landed.
pub const FIRST_WAIT: Duration = Duration::from_secs(2);

/// A marker younger than this is trusted to have its item on the lane (its publish may still
/// be in flight); an older one is checked against the lane itself.
const MARKER_TRUST: Duration = Duration::from_secs(5);

/// Makes sure one `delivery` item waits on the session's lane (R3): claims the marker and
/// publishes the item, or finds the one already armed. Returns the delivery it armed, if new.
/// Safe to repeat and to race: a marker exists at most once per session, and a marker whose
/// item was lost (a crash between the two writes) is re-published under the same id.
pub async fn arm(
    js: &jetstream::Context,
    deliveries: &Bucket,
    session: &SessionId,
) -> Result<Option<DeliveryId>, ArmError> {
    arm_naming(js, deliveries, session, None).await
}

/// [`arm`], the item naming `first` as the execution whose completion it waits for.
pub async fn arm_naming(
    js: &jetstream::Context,
    deliveries: &Bucket,
    session: &SessionId,
    first: Option<&ExecutionId>,
) -> Result<Option<DeliveryId>, ArmError> {
    match claim(js, deliveries, session, Trust::YoungMarkers).await? {
        Some((marker, rev)) => {
            publish_item(js, session, &marker, rev, first).await?;
            Ok(Some(marker.delivery))
        }
        None => Ok(None),
    }
}

/// How far a claim trusts a marker it finds to have its item on the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    /// A marker younger than [`MARKER_TRUST`] is trusted: its router may still be publishing
    /// the item, and that router's end is redone if it dies first.
    YoungMarkers,
    /// Only the lane is: a repeat of an end may be the only thing left that will publish the
    /// item (the end's other copy acked, its router dead). A duplicate item is dropped by its
    /// id, so publishing one that is on its way already costs nothing.
    OnlyTheLane,
}

/// The first half of [`arm`]: the marker this caller must publish an item for, if any. Tries
/// the create first (one round trip when nothing is armed, the common case: a delivery
/// removes its marker without leaving a removal behind).
pub async fn claim(
    js: &jetstream::Context,
    deliveries: &Bucket,
    session: &SessionId,
    trust: Trust,
) -> Result<Option<(DeliveryMarker, u64)>, ArmError> {
    let key = session.as_str();
    let fresh = DeliveryMarker {
        delivery: DeliveryId::new(),
        armed_at: Utc::now(),
    };
    if let Some(rev) = deliveries.create(key, &fresh).await? {
        return Ok(Some((fresh, rev)));
    }
    let Some((m, rev)) = deliveries.get::<DeliveryMarker>(key).await? else {
        // Taken by the lane between the two calls: a later completion arms again.
        return Ok(None);
    };
    let age = (Utc::now() - m.armed_at).to_std().unwrap_or_default();
    let young = trust == Trust::YoungMarkers && age < MARKER_TRUST;
    if young || on_lane(js, session, &m.delivery).await? {
        return Ok(None);
    }
    Ok(Some((m, rev)))
}

/// The second half of [`arm`]: the lane item, de-duplicated by the delivery id. `first` names
/// the execution whose completion armed it, when there is one. Returns the item's sequence on
/// the lane stream.
pub async fn publish_item(
    js: &jetstream::Context,
    session: &SessionId,
    marker: &DeliveryMarker,
    rev: u64,
    first: Option<&ExecutionId>,
) -> Result<u64, ArmError> {
    publish(
        js,
        session,
        DeliveryItem {
            delivery: marker.delivery.clone(),
            marker_rev: Some(rev),
            first: first.cloned(),
            first_ended_at: None,
        },
    )
    .await
}

/// The completion whose end a delivery item is published ahead for.
#[derive(Debug, Clone, Copy)]
pub struct First<'a> {
    pub execution: &'a ExecutionId,
    /// When that end ended, as its router is recording it.
    pub ended_at: Option<chrono::DateTime<Utc>>,
}

/// The item of `marker` published beside its create and its end's registry write, before
/// either is known to have succeeded (the broker's routing ahead): it names the execution and
/// the end it was published for (`DeliveryItem::first_ended_at`), and not the marker's
/// revision, which is not known yet. If the create found a delivery armed, this item is an
/// extra delivery: it carries whatever is pending when it runs, or nothing.
pub async fn publish_item_ahead(
    js: &jetstream::Context,
    session: &SessionId,
    marker: &DeliveryMarker,
    first: First<'_>,
) -> Result<u64, ArmError> {
    publish(
        js,
        session,
        DeliveryItem {
            delivery: marker.delivery.clone(),
            marker_rev: None,
            first: Some(first.execution.clone()),
            first_ended_at: first.ended_at,
        },
    )
    .await
}

async fn publish(
    js: &jetstream::Context,
    session: &SessionId,
    item: DeliveryItem,
) -> Result<u64, ArmError> {
    let env = LaneItem::Delivery(item).to_envelope(session)?;
    Ok(events::publish_durable_at(js, subjects::lane(session), &env).await?)
}

/// Takes back a delivery item published for a session that turned out stopped (its router
/// publishes the item before the session's read is in): removed from the lane stream by its
/// sequence, so nothing waits on a lane nobody serves. Gone already is fine.
pub async fn take_back_item(
    js: &jetstream::Context,
    session: &SessionId,
    seq: u64,
) -> Result<(), ArmError> {
    crate::removal::remove(js, subjects::LANE_STREAM, seq)
        .await
        .map_err(|e| ArmError::Lane {
            session: session.clone(),
            source: e,
        })?;
    Ok(())
}

/// Whether the delivery item is still on the session's lane (queued or in flight), or a run
/// is, which hands completions over itself. Items the lane is done with whose removal has not
/// landed (at or below its consumer's ack floor) are not on it: a run ended there must not
/// keep completions from being armed (R4).
async fn on_lane(
    js: &jetstream::Context,
    session: &SessionId,
    delivery: &DeliveryId,
) -> Result<bool, ArmError> {
    let lane_err = |e: async_nats::Error| ArmError::Lane {
        session: session.clone(),
        source: e,
    };
    let stream = js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| lane_err(e.into()))?;
    let subject = subjects::lane(session);
    let mut next = crate::lane::undone_from(&stream, session)
        .await
        .map_err(lane_err)?;
    loop {
        match stream
            .direct_get_next_for_subject(subject.as_str(), Some(next))
            .await
        {
            Ok(msg) => {
                next = msg.sequence + 1;
                if let Ok(env) = Envelope::decode(&msg.payload) {
                    // A run on the lane is the session's deliverer while it lasts (R4).
                    if (env.kind == lane_kind::DELIVERY && env.id == delivery.as_str())
                        || env.kind == lane_kind::RUN
                    {
                        return Ok(true);
                    }
                }
            }
            Err(e) if e.kind() == jetstream::stream::DirectGetErrorKind::NotFound => {
                return Ok(false)
            }
            Err(e) => return Err(lane_err(e.into())),
        }
    }
}
