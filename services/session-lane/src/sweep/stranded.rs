//! The repair of a lane whose consumer went past items it never handed out.
//!
//! Found by the fault campaign on docker-compose.yml's cluster profile (60 min, nodes killed,
//! paused, cut off and their disks filled): one session's lane consumer said it had delivered
//! up to stream sequence 10,101 and counted nothing pending and nothing in flight, while lane
//! items of its session at lower sequences were still stored: 70 runs and 7 turns queued for
//! ever behind a consumer that would never hand them out. A consumer leader that did not learn
//! of some deliveries (a known nats-server defect after leader changes: the delivered position
//! moves ahead of messages never acknowledged) leaves a consumer in that state, and nothing on
//! the client side can make it deliver them again.
//!
//! What tells such a lane: its consumer is idle (nothing pending, nothing in flight) while an
//! item of its subject is stored at or below the consumer's delivered position. A consistent
//! lane has none: each item is removed right behind its ack. (The ack floor does not tell: on
//! a stream shared by every lane an idle consumer's delivered position follows the stream's end
//! while its floor stays at its last ack; a first version of this sweep keyed on the gap and
//! never acted, because the delivered position kept moving.)
//!
//! So on each sweep ([`super`]: one stream info lists the lane subjects that hold items, idle
//! lanes holding none, and one consumer list gives each lane's state) an idle
//! consumer whose subject holds an item at or below its delivered position is a candidate,
//! keyed by that first item's sequence. Seen so in two sweeps running (the same first item),
//! the items stored from it up to the delivered position are published again at the end of
//! the lane, in order, and the originals deleted. Each copy has a message id derived from the
//! original's sequence, so replicas sweeping at once store it once. A copy is an item like any
//! other: the lane's handlers serve an item from the records (R14), so an item that was done
//! after all (acked, its removal lost) is only finished again.
//!
//! The ack floor does not tell a done item from a stranded one either: a lane consumer made
//! again (the server reported lane consumers deleted in a quorum loss, and the lane makes its
//! consumer again) starts with its floor at its start, above items never handed out. So every
//! item at or below the delivered position is moved, none deleted: nothing is lost, and a done
//! one costs a repeat its handler recognises. A refused item (R15) is removed by its lane once
//! its termination is confirmed, so it is not moved and refused again.

use std::collections::{HashMap, HashSet};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::{DeleteMessageErrorKind, DirectGetErrorKind};
use async_nats::jetstream::{self, consumer::Info};
use turnstile_shared::{subjects, SessionId};

use super::look::{idle, SweepError};

/// Items moved at most per lane and sweep.
const MOST: usize = 1_000;

/// One sweep: the candidates of this sweep, by consumer, with their first stranded item;
/// those seen with the same item last time are moved.
pub(super) async fn sweep(
    js: &jetstream::Context,
    stored: &HashSet<String>,
    infos: &HashMap<String, Info>,
    last: &HashMap<String, u64>,
) -> HashMap<String, u64> {
    let mut now = HashMap::new();
    for info in infos.values() {
        let Some(session) = subjects::lane_consumer_session(&info.name) else {
            continue;
        };
        if !idle(info) || !stored.contains(&subjects::lane(&session)) {
            continue;
        }
        let delivered = info.delivered.stream_sequence;
        let first = match first_item(js, &session).await {
            Ok(Some(seq)) if seq <= delivered => seq,
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(%session, error = %e, "sweep for stranded lane items");
                continue;
            }
        };
        if last.get(&info.name) == Some(&first) {
            // The list may be seconds old by now: the lane is read again just before.
            match still_idle(js, &info.name).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(%session, error = %e, "sweep for stranded lane items");
                    continue;
                }
            }
            match move_stranded(js, &session, (first, delivered)).await {
                Ok(moved) => {
                    tracing::warn!(%session, moved, first, delivered,
                    "a lane consumer past items still stored (never handed out, or done and their removal lost): they are published again at the end of the lane")
                }
                Err(e) => tracing::warn!(%session, error = %e, "move a lane's stranded items"),
            }
        } else {
            tracing::info!(%session, first, delivered,
                "an idle lane consumer past an item of its lane still stored; moved if still so at the next sweep");
            now.insert(info.name.clone(), first);
        }
    }
    now
}

/// Whether a lane consumer is still idle, read now.
async fn still_idle(js: &jetstream::Context, consumer: &str) -> Result<bool, SweepError> {
    let failed = SweepError::at;
    let stream = js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| failed("read the lane stream")(e.into()))?;
    let info = stream
        .consumer_info(consumer)
        .await
        .map_err(|e| failed("read a lane consumer")(e.into()))?;
    Ok(idle(&info))
}

/// The sequence of the first item stored on a session's lane, if any.
async fn first_item(
    js: &jetstream::Context,
    session: &SessionId,
) -> Result<Option<u64>, SweepError> {
    let failed = SweepError::at;
    let stream = js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| failed("read the lane stream")(e.into()))?;
    match stream
        .direct_get_next_for_subject(subjects::lane(session).as_str(), Some(1))
        .await
    {
        Ok(m) => Ok(Some(m.sequence)),
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(None),
        Err(e) => Err(failed("read a stored item")(e.into())),
    }
}

/// Publishes the lane's items stored in `[first, delivered]` again at the end of the lane, in
/// order, and deletes the originals. Returns how many it moved.
///
/// Each copy is published only if the lane's last item is still the one seen (the previous
/// copy, or the lane's end before the first): a lane purged meanwhile (its session stopped)
/// gets no copy that nothing would ever serve, and an item sent meanwhile stops the move (the
/// rest is moved at a later sweep, behind it). A replica moving the same items at once stores
/// no second copy (message ids) and finds the originals gone.
pub(super) async fn move_stranded(
    js: &jetstream::Context,
    session: &SessionId,
    (first, delivered): (u64, u64),
) -> Result<usize, SweepError> {
    let failed = SweepError::at;
    let stream = js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| failed("read the lane stream")(e.into()))?;
    let subject = subjects::lane(session);
    let mut last = match stream.direct_get_last_for_subject(subject.as_str()).await {
        Ok(m) => m.sequence,
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(failed("read the lane's last item")(e.into())),
    };
    let mut seq = first;
    let mut moved = 0;
    while moved < MOST && seq <= delivered {
        let msg = match stream
            .direct_get_next_for_subject(subject.as_str(), Some(seq))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => break,
            Err(e) => return Err(failed("read a stored item")(e.into())),
        };
        if msg.sequence > delivered {
            break;
        }
        seq = msg.sequence + 1;
        let copy = jetstream::message::PublishMessage::build()
            .payload(msg.payload.clone())
            .message_id(format!("{}:stranded:{}", subject, msg.sequence))
            .expected_last_subject_sequence(last);
        let publish = async { js.send_publish(subject.clone(), copy).await?.await };
        match publish.await {
            Ok(ack) => last = ack.sequence,
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                tracing::info!(%session, moved, "the lane changed while its stranded items moved (an item sent, or the lane purged); the rest waits for a later sweep");
                return Ok(moved);
            }
            Err(e) => return Err(failed("publish an item again")(e.into())),
        }
        match stream.delete_message(msg.sequence).await {
            Ok(_) => {}
            // Another replica moved it first.
            Err(e) if no_message(&e) => {}
            Err(e) => return Err(failed("delete the original")(e.into())),
        }
        moved += 1;
    }
    Ok(moved)
}

/// Whether a delete failed because the message is gone already.
fn no_message(e: &async_nats::jetstream::stream::DeleteMessageError) -> bool {
    matches!(e.kind(), DeleteMessageErrorKind::JetStream(j)
        if j.error_code() == async_nats::jetstream::ErrorCode::NO_MESSAGE_FOUND)
}

#[cfg(test)]
mod tests {
    use super::super::look::look;
    use super::*;
    use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
    use futures::StreamExt;
    use std::time::Duration;

    async fn lane_stream(js: &jetstream::Context) -> anyhow::Result<()> {
        js.create_stream(jetstream::stream::Config {
            name: subjects::LANE_STREAM.into(),
            subjects: vec![subjects::LANE_ALL.into()],
            allow_direct: true,
            ..Default::default()
        })
        .await?;
        Ok(())
    }

    /// A lane consumer made past `start`: the state the campaign found (items stored below
    /// the consumer's position, never to be handed out), which the server cannot be led into
    /// on purpose otherwise.
    async fn consumer_from(
        js: &jetstream::Context,
        session: &SessionId,
        start: u64,
    ) -> anyhow::Result<jetstream::consumer::Consumer<pull::Config>> {
        let stream = js.get_stream(subjects::LANE_STREAM).await?;
        Ok(stream
            .create_consumer(pull::Config {
                durable_name: Some(subjects::lane_consumer(session)),
                filter_subject: subjects::lane(session),
                ack_policy: AckPolicy::Explicit,
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: start,
                },
                ..Default::default()
            })
            .await?)
    }

    /// The next item handed out, not acked.
    async fn take_one(
        consumer: &jetstream::consumer::Consumer<pull::Config>,
    ) -> anyhow::Result<jetstream::Message> {
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(5))
            .messages()
            .await?;
        batch
            .next()
            .await
            .ok_or_else(|| anyhow::anyhow!("no item handed out"))?
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// Takes the next item, acks it and removes it, as a lane's handler does.
    async fn serve_one(
        js: &jetstream::Context,
        consumer: &jetstream::consumer::Consumer<pull::Config>,
    ) -> anyhow::Result<(u64, String)> {
        let msg = take_one(consumer).await?;
        let seq = msg
            .info()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .stream_sequence;
        msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        js.get_stream(subjects::LANE_STREAM)
            .await?
            .delete_message(seq)
            .await?;
        Ok((seq, String::from_utf8_lossy(&msg.payload).into_owned()))
    }

    /// An idle lane consumer past items of its lane still stored is found, kept a sweep, then
    /// its items are published again in order and handed out; a consistent idle lane, whose
    /// delivered position moved past other lanes' items, is left alone.
    #[tokio::test]
    async fn an_idle_lane_past_its_stored_items_has_them_handed_out_again_in_order(
    ) -> anyhow::Result<()> {
        let server = turnstile_tests::NatsServer::start().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        lane_stream(&js).await?;
        let (stuck, fine) = (SessionId::new(), SessionId::new());
        for i in 1..=4 {
            js.publish(subjects::lane(&stuck), format!("item {i}").into())
                .await?
                .await?;
        }
        // Items 1-3 behind a consumer that starts at 4 and serves it.
        let stuck_consumer = consumer_from(&js, &stuck, 4).await?;
        assert_eq!(serve_one(&js, &stuck_consumer).await?.1, "item 4");
        // A consistent lane: its item served and removed, then other lanes' items stored
        // after it (its delivered position follows them; its ack floor does not).
        js.publish(subjects::lane(&fine), "fine 1".into())
            .await?
            .await?;
        let fine_consumer = consumer_from(&js, &fine, 1).await?;
        assert_eq!(serve_one(&js, &fine_consumer).await?.1, "fine 1");
        js.publish(subjects::lane(&SessionId::new()), "other".into())
            .await?
            .await?;

        let (stored, infos) = {
            let l = look(&js).await?;
            (l.stored, l.lanes)
        };
        let first = sweep(&js, &stored, &infos, &HashMap::new()).await;
        assert_eq!(
            first,
            HashMap::from([(subjects::lane_consumer(&stuck), 1)]),
            "only the stuck lane is a candidate"
        );
        let (stored, infos) = {
            let l = look(&js).await?;
            (l.stored, l.lanes)
        };
        let second = sweep(&js, &stored, &infos, &first).await;
        assert!(
            second.is_empty(),
            "moved, no longer a candidate: {second:?}"
        );

        let mut handed = Vec::new();
        for _ in 0..3 {
            handed.push(serve_one(&js, &stuck_consumer).await?.1);
        }
        assert_eq!(handed, ["item 1", "item 2", "item 3"]);
        let (stored, infos) = {
            let l = look(&js).await?;
            (l.stored, l.lanes)
        };
        assert!(
            sweep(&js, &stored, &infos, &second).await.is_empty(),
            "nothing stranded once they are served"
        );
        Ok(())
    }

    /// A second sweep's copy is stored once (replicas race on the same lane).
    #[tokio::test]
    async fn stranded_items_are_moved_once() -> anyhow::Result<()> {
        let server = turnstile_tests::NatsServer::start().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        lane_stream(&js).await?;
        let session = SessionId::new();
        let lane = subjects::lane(&session);
        for i in 1..=4 {
            js.publish(lane.clone(), format!("item {i}").into())
                .await?
                .await?;
        }
        assert_eq!(move_stranded(&js, &session, (2, 3)).await?, 2);
        assert_eq!(move_stranded(&js, &session, (2, 3)).await?, 0, "moved once");
        let stream = js.get_stream(subjects::LANE_STREAM).await?;
        let mut left = Vec::new();
        let mut seq = 1;
        while let Ok(m) = stream
            .direct_get_next_for_subject(lane.as_str(), Some(seq))
            .await
        {
            seq = m.sequence + 1;
            left.push((m.sequence, String::from_utf8_lossy(&m.payload).into_owned()));
        }
        assert_eq!(
            left,
            vec![
                (1, "item 1".to_string()),
                (4, "item 4".to_string()),
                (5, "item 2".to_string()),
                (6, "item 3".to_string()),
            ]
        );
        Ok(())
    }

    /// A lane item refused (R15) is terminated with the server's confirmation, so the lane
    /// removes it like a done one (`handoff::item::reject`): left stored past an idle lane's
    /// position, the sweep would hand it out again, to be refused again, every minute.
    #[tokio::test]
    async fn a_refused_lane_item_is_confirmed_terminated() -> anyhow::Result<()> {
        use turnstile_shared::deadletter::{refuse, Refused};
        let server = turnstile_tests::NatsServer::start().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        lane_stream(&js).await?;
        for (name, subject) in [
            (subjects::DEADLETTER_STREAM, subjects::DEADLETTER_ALL),
            (subjects::EVENTS_STREAM, subjects::EVENTS_ALL),
        ] {
            js.create_stream(jetstream::stream::Config {
                name: name.into(),
                subjects: vec![subject.into()],
                ..Default::default()
            })
            .await?;
        }
        let session = SessionId::new();
        js.publish(subjects::lane(&session), "not an item".into())
            .await?
            .await?;
        let consumer = consumer_from(&js, &session, 1).await?;
        let msg = take_one(&consumer).await?;
        let event = turnstile_shared::events::session_event(
            turnstile_shared::events::EventKind::LaneRejected,
            &session,
            None,
            &serde_json::json!({ "reason": "unreadable" }),
        )?;
        let refused = refuse(
            &js,
            &msg,
            subjects::lane_deadletter(&session),
            "unreadable",
            &event,
        )
        .await;
        assert_eq!(refused, Refused::Terminated);
        Ok(())
    }
}
