//! The lane item: what a session's lane carries, one at a time (R1). It sits above the
//! records it carries (a turn's text, a delivery, a run), encodes each as a versioned envelope
//! de-duplicated by its id, and refuses on decode anything that is not for its lane (R15).
//!
//! The lane stream keeps an item until it is removed ([`send_removal`]): by its lane once done
//! with it, or with the whole lane when its session stops. An item can outlive its end for as
//! long as that removal takes, or, when its replica died in between (or it was dead-lettered),
//! until its session stops; readers that ask what is still on a lane start above its
//! consumer's ack floor ([`undone_from`]).

use async_nats::jetstream;
use serde::{Deserialize, Serialize};

use crate::delivery::DeliveryItem;
use crate::envelope::{Envelope, EnvelopeError};
use crate::ids::{SessionId, TurnId};
use crate::kv::{Bucket, KvError};
use crate::records::{KnownTurn, TurnRecord};
use crate::runs::{RunItem, RunRecord};

/// Lane item types (the envelope's `type`).
pub mod lane_kind {
    pub const TURN: &str = "lane.turn";
    pub const DELIVERY: &str = "lane.delivery";
    pub const RUN: &str = "lane.run";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnItem {
    pub turn: TurnId,
    pub text: String,
    /// How the turn's record was written when the item was queued (`session send` writes it
    /// first): with this item's turn, session and text it is the whole record, so the lane can
    /// tell the transport its revision ([`TurnItem::known`]). Absent from items queued without
    /// a record of their own, and from older publishers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<Recorded>,
}

/// A queued turn record's revision and queue time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recorded {
    pub revision: u64,
    pub queued_at: chrono::DateTime<chrono::Utc>,
}

impl TurnItem {
    /// The item for a turn whose queued record was written at `revision`.
    pub fn of_record(record: &TurnRecord, revision: u64) -> Self {
        Self {
            turn: record.id.clone(),
            text: record.text.clone(),
            recorded: Some(Recorded {
                revision,
                queued_at: record.queued_at,
            }),
        }
    }

    /// The queued record this item was published with, as `session` wrote it, if it says.
    pub fn known(&self, session: &SessionId) -> Option<KnownTurn> {
        self.recorded.as_ref().map(|r| KnownTurn {
            revision: r.revision,
            record: TurnRecord {
                queued_at: r.queued_at,
                ..TurnRecord::queued(self.turn.clone(), session.clone(), self.text.clone())
            },
        })
    }
}

/// What a session's lane carries.
#[derive(Debug, Clone, PartialEq)]
pub enum LaneItem {
    Turn(TurnItem),
    /// Hand every pending completion over in one turn (R3).
    Delivery(DeliveryItem),
    /// Drive a run's messages to completion (R5).
    Run(RunItem),
}

impl LaneItem {
    pub fn to_envelope(&self, session: &SessionId) -> Result<Envelope, EnvelopeError> {
        match self {
            Self::Turn(item) => Ok(Envelope::new(lane_kind::TURN, item)?
                .with_session(session)
                .with_turn(&item.turn)
                .with_id(item.turn.to_string())),
            Self::Delivery(item) => Ok(Envelope::new(lane_kind::DELIVERY, item)?
                .with_session(session)
                .with_id(item.delivery.to_string())),
            Self::Run(item) => {
                let id = match item.attempt {
                    0 => item.run.to_string(),
                    n => format!("{}:a{n}", item.run),
                };
                Ok(Envelope::new(lane_kind::RUN, item)?
                    .with_session(session)
                    .with_id(id))
            }
        }
    }

    /// Decodes a lane message, checking that it belongs to the lane it arrived on.
    pub fn decode(bytes: &[u8], lane_session: &SessionId) -> Result<Self, LaneItemError> {
        let env = Envelope::decode(bytes)?;
        if env.session.as_ref() != Some(lane_session) {
            return Err(LaneItemError::WrongSession {
                found: env.session.map(|s| s.to_string()),
            });
        }
        match env.kind.as_str() {
            lane_kind::TURN => {
                let item: TurnItem = env.data_as()?;
                if env.turn.as_ref().is_some_and(|t| *t != item.turn) {
                    return Err(LaneItemError::TurnMismatch);
                }
                Ok(Self::Turn(item))
            }
            lane_kind::DELIVERY => Ok(Self::Delivery(env.data_as()?)),
            lane_kind::RUN => Ok(Self::Run(env.data_as()?)),
            other => Err(LaneItemError::UnknownKind(other.to_string())),
        }
    }
}

/// Sends the removal of the lane item at `seq`, the one its lane is done with. Sent, not
/// awaited: the lane goes on at once, and the server's answer goes to an inbox nobody reads.
/// Send it once the item's ack is confirmed, never before (see the session-lane's
/// `remove_item`). An item whose removal is lost (its replica killed first) stays until its
/// session stops; readers skip it ([`undone_from`]).
pub async fn send_removal(
    client: &async_nats::Client,
    seq: u64,
) -> Result<(), async_nats::PublishError> {
    let request = serde_json::json!({ "seq": seq, "no_erase": true });
    client
        .publish_with_reply(
            crate::subjects::lane_item_delete(),
            client.new_inbox(),
            request.to_string().into(),
        )
        .await
}

/// The first stream sequence of a lane that may hold an item not yet done: one above its
/// consumer's ack floor (every item at or below it is acked or refused, its removal maybe
/// still on its way). 1 for a lane without a consumer (not bound yet, or stopped).
pub async fn undone_from(
    stream: &jetstream::stream::Stream<()>,
    session: &SessionId,
) -> Result<u64, async_nats::Error> {
    match stream
        .consumer_info(crate::subjects::lane_consumer(session))
        .await
    {
        Ok(info) => Ok(info.ack_floor.stream_sequence + 1),
        Err(e) if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => Ok(1),
        Err(e) => Err(e.into()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LaneItemError {
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("lane item names session {found:?}, not the lane's own session")]
    WrongSession { found: Option<String> },
    #[error("lane item's envelope turn differs from its data's turn")]
    TurnMismatch,
    #[error("unknown lane item type {0:?}")]
    UnknownKind(String),
}

/// The turn a lane item has in flight: the turn itself, a delivery's derived turn, or a run's
/// latest turn (from its record). `None` for a run that has not typed anything yet.
pub async fn current_turn(item: &LaneItem, runs: &Bucket) -> Result<Option<TurnId>, KvError> {
    Ok(match item {
        LaneItem::Turn(t) => Some(t.turn.clone()),
        LaneItem::Delivery(d) => Some(d.delivery.turn()),
        LaneItem::Run(r) => runs
            .get::<RunRecord>(r.run.as_str())
            .await?
            .and_then(|(rec, _)| rec.progress.last().and_then(|m| m.turns.last().cloned())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_item_of_a_record_gives_that_record_back() {
        let s = SessionId::new();
        let record = TurnRecord::queued(TurnId::new(), s.clone(), "hello".into());
        let item = LaneItem::Turn(TurnItem::of_record(&record, 7));
        let bytes = item.to_envelope(&s).expect("env").encode().expect("bytes");
        let LaneItem::Turn(back) = LaneItem::decode(&bytes, &s).expect("decode") else {
            panic!("not a turn item");
        };
        assert_eq!(
            back.known(&s),
            Some(KnownTurn {
                revision: 7,
                record
            })
        );
        let plain = TurnItem {
            recorded: None,
            ..back
        };
        assert_eq!(plain.known(&s), None, "no record, no revision");
    }

    #[test]
    fn lane_items_refuse_foreign_sessions_and_types() {
        let s = SessionId::new();
        let item = LaneItem::Turn(TurnItem {
            turn: TurnId::new(),
            text: "hello".into(),
            recorded: None,
        });
        let bytes = item.to_envelope(&s).expect("env").encode().expect("bytes");
        assert_eq!(LaneItem::decode(&bytes, &s).expect("decode"), item);
        let other = SessionId::new();
        assert!(matches!(
            LaneItem::decode(&bytes, &other),
            Err(LaneItemError::WrongSession { .. })
        ));
        let env = Envelope::new("lane.bogus", &serde_json::json!({}))
            .expect("env")
            .with_session(&s);
        let err = LaneItem::decode(&env.encode().expect("bytes"), &s).expect_err("kind");
        assert!(err.to_string().contains("lane.bogus"));
    }
}
