//! The repair of a lane whose consumer went past items it never handed out.
//!
//! Found by the fault campaign on docker-compose.yml's cluster profile (60 min, nodes killed,
//! paused, cut off and their disks filled): one session's lane consumer said it had delivered
//! up to stream sequence 10,101, its ack floor stood at 10,073, and it counted nothing pending
//! and nothing in flight, while the lane's items between the two were still stored: 70 runs
//! and 7 turns queued for ever behind a consumer that would never hand them out. A consumer
//! leader that did not learn of some deliveries (a known nats-server defect after leader
//! changes: the delivered position moves ahead of messages never acknowledged) leaves a
//! consumer in that state, and nothing on the client side can make it deliver them again.
//!
//! So every replica sweeps the lane consumers every [`EVERY`]: a consumer with nothing pending
//! and nothing in flight whose delivered position is past its ack floor (a lane has at most
//! one item in flight, so a consistent one has the two equal) is a candidate; seen so in two
//! sweeps running (the same positions), the items stored between the two positions are
//! published again at the end of the lane, in order, and the originals deleted. Each copy has
//! a message id derived from the original's sequence, so replicas sweeping at once store it
//! once. A copy is an item like any other: the lane's handlers serve an item from the records
//! (R14), so an item that was done after all is only finished again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::Info, stream::DirectGetErrorKind};
use tokio_util::sync::CancellationToken;
use turnstile_shared::{subjects, SessionId};

use crate::ctx::Ctx;

/// How often the lane consumers are swept.
const EVERY: Duration = Duration::from_secs(30);

/// Items moved at most per lane and sweep.
const MOST: usize = 1_000;

/// Sweeps until `cancel`.
pub(crate) async fn run(ctx: Arc<Ctx>, cancel: CancellationToken) {
    let mut seen: HashMap<String, (u64, u64)> = HashMap::new();
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
        if !ctx.lease.held() {
            continue;
        }
        match crate::liveness::lane_infos(&ctx.js).await {
            Ok(infos) => seen = sweep(&ctx, &infos, &seen).await,
            Err(e) => {
                tracing::warn!(error = %e, "sweep for stranded lane items: list the lane consumers")
            }
        }
    }
}

/// One sweep: the candidates of this sweep, those also seen last time repaired.
async fn sweep(
    ctx: &Ctx,
    infos: &HashMap<String, Info>,
    last: &HashMap<String, (u64, u64)>,
) -> HashMap<String, (u64, u64)> {
    let mut now = HashMap::new();
    for info in infos.values() {
        let Some(span) = stranded_span(info) else {
            continue;
        };
        if !last.contains_key(&info.name) {
            tracing::info!(consumer = %info.name, ack_floor = span.0, delivered = span.1,
                "a lane consumer past its ack floor with nothing pending or in flight; moved if still so at the next sweep");
        }
        if last.get(&info.name) == Some(&span) {
            let Some(session) = subjects::lane_consumer_session(&info.name) else {
                continue;
            };
            match move_stranded(&ctx.js, &session, span).await {
                Ok(0) => {
                    tracing::warn!(%session, ack_floor = span.0, delivered = span.1,
                    "a lane consumer past its ack floor with nothing pending or in flight, but no item of its lane stored between: nothing moved")
                }
                Ok(moved) => {
                    tracing::warn!(%session, moved, ack_floor = span.0, delivered = span.1,
                    "a lane consumer past items it never handed out: they are published again at the end of the lane")
                }
                Err(e) => tracing::warn!(%session, error = %e, "move a lane's stranded items"),
            }
        }
        now.insert(info.name.clone(), span);
    }
    now
}

/// `(ack floor, delivered)` stream sequences of a consumer that is past items it may never
/// hand out: nothing pending, nothing in flight, delivered past the ack floor.
pub(crate) fn stranded_span(info: &Info) -> Option<(u64, u64)> {
    let (floor, delivered) = (
        info.ack_floor.stream_sequence,
        info.delivered.stream_sequence,
    );
    (info.num_pending == 0 && info.num_ack_pending == 0 && delivered > floor)
        .then_some((floor, delivered))
}

/// Publishes the lane's items stored in `(floor, delivered]` again at the end of the lane, in
/// order, and deletes the originals. Returns how many it moved.
pub(crate) async fn move_stranded(
    js: &jetstream::Context,
    session: &SessionId,
    (floor, delivered): (u64, u64),
) -> Result<usize, StrandedError> {
    let failed = |what| move |e: async_nats::Error| StrandedError { what, source: e };
    let stream = js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| failed("read the lane stream")(e.into()))?;
    let subject = subjects::lane(session);
    let mut seq = floor + 1;
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
            .message_id(format!("{}:stranded:{}", subject, msg.sequence));
        let publish = async { js.send_publish(subject.clone(), copy).await?.await };
        publish
            .await
            .map_err(|e| failed("publish an item again")(e.into()))?;
        stream
            .delete_message(msg.sequence)
            .await
            .map_err(|e| failed("delete the original")(e.into()))?;
        moved += 1;
    }
    Ok(moved)
}

/// A step of moving a lane's stranded items that failed.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub(crate) struct StrandedError {
    what: &'static str,
    source: async_nats::Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pending: u64, ack_pending: usize, floor: u64, delivered: u64) -> Info {
        let now = chrono::Utc::now().to_rfc3339();
        serde_json::from_value(serde_json::json!({
            "type": "io.nats.jetstream.api.v1.consumer_info_response",
            "stream_name": subjects::LANE_STREAM,
            "name": "lane_x",
            "created": now,
            "config": {"durable_name": "lane_x", "ack_policy": "explicit", "deliver_policy": "all", "replay_policy": "instant"},
            "delivered": {"consumer_seq": 9, "stream_seq": delivered},
            "ack_floor": {"consumer_seq": 9, "stream_seq": floor},
            "num_ack_pending": ack_pending,
            "num_redelivered": 0,
            "num_waiting": 1,
            "num_pending": pending,
        }))
        .unwrap_or_else(|e| panic!("a consumer info: {e}"))
    }

    #[test]
    fn only_a_consumer_past_its_ack_floor_with_nothing_pending_or_in_flight_is_stranded() {
        assert_eq!(stranded_span(&info(0, 0, 73, 101)), Some((73, 101)));
        assert_eq!(stranded_span(&info(0, 0, 101, 101)), None, "consistent");
        assert_eq!(stranded_span(&info(0, 1, 100, 101)), None, "one in flight");
        assert_eq!(
            stranded_span(&info(2, 0, 73, 101)),
            None,
            "items to hand out"
        );
    }

    /// The items between the two positions go to the end of the lane in order, the originals
    /// are deleted, items outside the span stay, and a second sweep's copy is stored once.
    #[tokio::test]
    async fn stranded_items_are_published_again_in_order_and_the_originals_deleted(
    ) -> anyhow::Result<()> {
        let server = turnstile_tests::NatsServer::start().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        js.create_stream(jetstream::stream::Config {
            name: subjects::LANE_STREAM.into(),
            subjects: vec![subjects::LANE_ALL.into()],
            allow_direct: true,
            ..Default::default()
        })
        .await?;
        let session = SessionId::new();
        let lane = subjects::lane(&session);
        for i in 1..=4 {
            js.publish(lane.clone(), format!("item {i}").into())
                .await?
                .await?;
        }
        // Items 2 and 3 stranded between a floor of 1 and a delivered position of 3.
        assert_eq!(move_stranded(&js, &session, (1, 3)).await?, 2);
        assert_eq!(move_stranded(&js, &session, (1, 3)).await?, 0, "moved once");
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
}
