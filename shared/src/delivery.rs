//! Completions and their hand-over (R3): the completion message a finished execution leaves
//! for each target session, and arming the one `delivery` lane item a session may have waiting.

use std::time::Duration;

use async_nats::jetstream;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::envelope::{Envelope, EnvelopeError};
use crate::execution::ExecutionRecord;
use crate::ids::{DeliveryId, ExecutionId, SessionId};
use crate::kv::{Bucket, KvError};
use crate::records::{lane_kind, LaneItem};
use crate::{events, subjects};

/// The most completions one delivery turn carries; the rest go in the next delivery.
pub const DELIVERY_CAP: usize = 100;

/// Envelope type of a completion message on `ts.completion.<session>.<execution>`.
pub const COMPLETION_KIND: &str = "completion";

/// What the agent is told about one finished child.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub execution: ExecutionId,
    pub name: String,
    pub status: String,
    pub summary: String,
    pub ended_at: DateTime<Utc>,
}

impl Completion {
    pub fn of(record: &ExecutionRecord) -> Self {
        Self {
            execution: record.id.clone(),
            name: record.name.clone(),
            status: record.status.name().to_string(),
            summary: record.status.summary(),
            ended_at: record.status.ended_at().unwrap_or_else(Utc::now),
        }
    }

    /// The envelope for `target`, de-duplicated per (execution, target) so a re-routed end
    /// never leaves two completions (R14).
    pub fn envelope(&self, target: &SessionId) -> Result<Envelope, EnvelopeError> {
        Ok(Envelope::new(COMPLETION_KIND, self)?
            .with_session(target)
            .with_id(format!("{}:{target}:completion", self.execution)))
    }
}

/// The one message a delivery turn types: every carried child with its status, summary and id.
pub fn render_batch(completions: &[Completion]) -> String {
    let mut out = if completions.len() == 1 {
        "[turnstile] 1 background execution finished:".to_string()
    } else {
        format!(
            "[turnstile] {} background executions finished:",
            completions.len()
        )
    };
    for c in completions {
        let summary: String = c
            .summary
            .chars()
            .filter(|ch| !ch.is_control())
            .take(200)
            .collect();
        out.push_str(&format!(
            "\n- {} [{}] {}: {}",
            c.name, c.status, c.execution, summary
        ));
    }
    out
}

/// The marker of a session's waiting delivery item, kept in the deliveries bucket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryMarker {
    pub delivery: DeliveryId,
    pub armed_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryItem {
    pub delivery: DeliveryId,
    /// The revision of the marker that armed it, so the lane clears it in one round trip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marker_rev: Option<u64>,
}

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
    match claim(js, deliveries, session).await? {
        Some((marker, rev)) => {
            publish_item(js, session, &marker, rev).await?;
            Ok(Some(marker.delivery))
        }
        None => Ok(None),
    }
}

/// The first half of [`arm`]: the marker this caller must publish an item for, if any. Tries
/// the create first (one round trip when nothing is armed, the common case).
pub async fn claim(
    js: &jetstream::Context,
    deliveries: &Bucket,
    session: &SessionId,
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
    if age < MARKER_TRUST || on_lane(js, session, &m.delivery).await? {
        return Ok(None);
    }
    Ok(Some((m, rev)))
}

/// The second half of [`arm`]: the lane item, de-duplicated by the delivery id.
pub async fn publish_item(
    js: &jetstream::Context,
    session: &SessionId,
    marker: &DeliveryMarker,
    rev: u64,
) -> Result<(), ArmError> {
    let item = LaneItem::Delivery(DeliveryItem {
        delivery: marker.delivery.clone(),
        marker_rev: Some(rev),
    });
    let env = item.to_envelope(session)?;
    events::publish_durable(js, subjects::lane(session), &env, None).await?;
    Ok(())
}

/// Whether the delivery item is still on the session's lane (queued or in flight), or a run
/// is, which hands completions over itself.
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
    let mut seq = 0;
    loop {
        match stream
            .direct_get_next_for_subject(subject.as_str(), Some(seq + 1))
            .await
        {
            Ok(msg) => {
                seq = msg.sequence;
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

/// Clears the session's marker if it still names `delivery` (the lane does this when the item
/// takes the lane, before it collects completions, so a later completion arms a new one).
pub async fn disarm(
    deliveries: &Bucket,
    session: &SessionId,
    item: &DeliveryItem,
) -> Result<(), KvError> {
    let key = session.as_str();
    if let Some(rev) = item.marker_rev {
        if deliveries.delete_at(key, rev).await? {
            return Ok(());
        }
    }
    let delivery = &item.delivery;
    if let Some((m, rev)) = deliveries.get::<DeliveryMarker>(key).await? {
        if m.delivery == *delivery {
            deliveries.delete_at(key, rev).await?;
        }
    }
    Ok(())
}

/// True when an execution's end should reach sessions as a completion (turns report
/// themselves through turn events instead).
pub fn routes_completions(record: &ExecutionRecord) -> bool {
    record.kind == crate::execution::ExecKind::Step && record.status.is_terminal()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lists_every_child_once() {
        let mk = |name: &str, status: &str| Completion {
            execution: crate::ids::StepId::new().into(),
            name: name.into(),
            status: status.into(),
            summary: "exit 0\u{1b}[2J".into(),
            ended_at: Utc::now(),
        };
        let batch = vec![mk("a", "completed"), mk("b", "failed")];
        let text = render_batch(&batch);
        assert!(text.starts_with("[turnstile] 2 background executions finished:"));
        assert_eq!(text.lines().count(), 3);
        assert!(text.contains(&format!("- a [completed] {}", batch[0].execution)));
        assert!(!text.contains('\u{1b}'));
        let env = batch[0].envelope(&SessionId::new()).expect("env");
        assert!(env.id.ends_with(":completion"));
    }
}
