//! Completions and their hand-over (R3): the completion message a finished execution leaves
//! for each target session, the delivery item and the marker that keeps it to one per session
//! (arming it is in `arming`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::envelope::{Envelope, EnvelopeError};
use crate::execution::ExecutionRecord;
use crate::ids::{DeliveryId, ExecutionId, SessionId};
use crate::kv::{Bucket, KvError};

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

/// What a turn hands over, as its record keeps it: each completion's execution and its
/// sequence in `TS_COMPLETION`, under `delivery`.
pub fn carried(delivery: DeliveryId, batch: &[(Completion, u64)]) -> crate::records::Carried {
    crate::records::Carried {
        delivery,
        completions: batch
            .iter()
            .map(|(c, seq)| crate::records::CarriedCompletion {
                execution: c.execution.clone(),
                seq: *seq,
            })
            .collect(),
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
    /// The execution whose completion armed it: the lane checks that one in the registry (R8)
    /// while it fetches the pending completions, rather than after, and waits for it if the
    /// item overtook its store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first: Option<crate::ids::ExecutionId>,
    /// When `first`'s end ended, as the router that published this item was recording it.
    /// Set when the item went out beside that end's registry write and its marker's create,
    /// before its router knew whether that end would be the one recorded or its marker
    /// created: the lane waits for `first` only if the registry holds this end (or none yet).
    /// Another end that won routes its own completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_ended_at: Option<DateTime<Utc>>,
}

/// Clears the session's marker if it still names `delivery` (the lane does this once the
/// item holds the lane and its turn is dispatched, so a later completion arms a new one). The
/// marker is removed without a removal marker, so the next arming is one write.
pub async fn disarm(
    deliveries: &Bucket,
    session: &SessionId,
    item: &DeliveryItem,
) -> Result<(), KvError> {
    let key = session.as_str();
    if let Some(rev) = item.marker_rev {
        if deliveries.remove_revision(key, rev).await? {
            return Ok(());
        }
    }
    let delivery = &item.delivery;
    if let Some((m, rev)) = deliveries.get::<DeliveryMarker>(key).await? {
        if m.delivery == *delivery {
            deliveries.remove_revision(key, rev).await?;
        }
    }
    Ok(())
}

/// True when an execution's end should reach sessions as a completion (turns report
/// themselves through turn events instead).
pub fn routes_completions(record: &ExecutionRecord) -> bool {
    record.kind == crate::execution::ExecKind::Step && record.status.is_terminal()
}

/// A marker lives while a delivery is armed and is deleted when it is disarmed.
impl crate::retention::Retained for DeliveryMarker {
    fn finished(&self) -> bool {
        false
    }
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
