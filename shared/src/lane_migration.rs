//! Moving a deployment's lanes off the work-queue stream of builds before 0.2
//! ([`subjects::LEGACY_LANE_STREAM`]) onto the limits-retention one ([`subjects::LANE_STREAM`]).
//!
//! Why a move: the server checks, on every consumer created on a work-queue stream, that its
//! filter overlaps no other consumer's, which costs in proportion to the consumers already
//! there; at 10,000 lanes that check was most of the server's work when sessions were
//! created. It also refuses to change a stream's retention to or from work-queue in place
//! (error 10052), so the items are moved to a stream of another name.
//!
//! The steps, each safe to repeat, so a provision that died half-way is finished by the next:
//! 1. [`retire`]: the legacy stream stops listening on the lane subjects (its consumers go:
//!    every lane binds its consumer again on the new stream when its replica starts);
//! 2. the new stream is provisioned as any other;
//! 3. [`finish`]: every item still on the legacy stream (queued, or in flight when the
//!    services stopped) is published on the new one under its subject and its id, in order,
//!    then the legacy stream is deleted. An item copied twice (a provision that died during
//!    the copy and ran again later than the duplicate window) is served twice; a lane serves a
//!    repeat of an item as it serves a redelivery, from the records, so nothing runs twice.
//!
//! Run with the services stopped, as any upgrade: a replica of an older build still serving
//! would pull from a stream that is gone.

use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, stream};

use crate::subjects;

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("move lanes off {stream}: {step}: {source}")]
    Step {
        stream: &'static str,
        step: &'static str,
        source: async_nats::Error,
    },
}

fn step(step: &'static str) -> impl FnOnce(async_nats::Error) -> MigrationError {
    move |source| MigrationError::Step {
        stream: subjects::LEGACY_LANE_STREAM,
        step,
        source,
    }
}

/// Step 1: the legacy stream, if there is one, gives up the lane subjects and its consumers.
/// Returns whether there is a legacy stream to [`finish`].
pub async fn retire(js: &jetstream::Context) -> Result<bool, MigrationError> {
    let mut legacy = match js.get_stream(subjects::LEGACY_LANE_STREAM).await {
        Ok(s) => s,
        Err(e)
            if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref j)
                if j.error_code().0 == crate::js_codes::STREAM_NOT_FOUND) =>
        {
            return Ok(false)
        }
        Err(e) => return Err(step("look it up")(e.into())),
    };
    let info = legacy
        .info()
        .await
        .map_err(|e| step("read its config")(e.into()))?;
    let mut config = info.config.clone();
    if config.subjects == [subjects::LEGACY_LANE_RETIRED] {
        return Ok(true);
    }
    tracing::info!(
        from = subjects::LEGACY_LANE_STREAM,
        to = subjects::LANE_STREAM,
        messages = info.state.messages,
        "moving the lanes to a limits-retention stream"
    );
    // Its lane consumers filter on the subjects it gives up; each lane makes its consumer again
    // on the new stream when it binds.
    let names: Vec<String> = {
        use futures::TryStreamExt;
        legacy
            .consumer_names()
            .try_collect()
            .await
            .map_err(|e| step("list its consumers")(e.into()))?
    };
    for name in names {
        legacy
            .delete_consumer(&name)
            .await
            .map_err(|e| step("delete a consumer")(e.into()))?;
    }
    config.subjects = vec![subjects::LEGACY_LANE_RETIRED.to_string()];
    js.update_stream(config)
        .await
        .map_err(|e| step("retire its subjects")(e.into()))?;
    Ok(true)
}

/// Step 3: every item left on the legacy stream is published on the lane stream, in order,
/// then the legacy stream is deleted. Returns how many items were moved.
pub async fn finish(js: &jetstream::Context) -> Result<u64, MigrationError> {
    let legacy = js
        .get_stream_no_info(subjects::LEGACY_LANE_STREAM)
        .await
        .map_err(|e| step("open it")(e.into()))?;
    let mut moved = 0;
    let mut seq = 0;
    loop {
        let msg = match legacy
            .direct_get_next_for_subject(subjects::LANE_ALL, Some(seq + 1))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => break,
            Err(e) => return Err(step("read an item")(e.into())),
        };
        seq = msg.sequence;
        let headers = kept_headers(&msg.headers);
        js.publish_with_headers(msg.subject.to_string(), headers, msg.payload.clone())
            .await
            .map_err(|e| step("publish an item on the new stream")(e.into()))?
            .await
            .map_err(|e| step("store an item on the new stream")(e.into()))?;
        moved += 1;
    }
    js.delete_stream(subjects::LEGACY_LANE_STREAM)
        .await
        .map_err(|e| step("delete it")(e.into()))?;
    tracing::info!(
        from = subjects::LEGACY_LANE_STREAM,
        to = subjects::LANE_STREAM,
        moved,
        "lanes moved"
    );
    Ok(moved)
}

/// The headers an item was published with: what a direct get adds (`Nats-Stream`,
/// `Nats-Sequence`, `Nats-Subject`, `Nats-Time-Stamp`, ...) is the old stream's, and dropped;
/// its id (`Nats-Msg-Id`) is kept, so a copy made twice within the duplicate window is stored
/// once.
fn kept_headers(headers: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        if name.starts_with("Nats-") && name != "Nats-Msg-Id" {
            continue;
        }
        for v in values {
            kept.append(name, v.as_str());
        }
    }
    kept
}
