//! One look at every lane for the sweep: the lane subjects holding items, every lane
//! consumer's state and every completion consumer's. A leaf: the repairs read what it found.

use std::collections::{HashMap, HashSet};

use async_nats::jetstream::{self, consumer::Info};
use futures::TryStreamExt;
use turnstile_shared::{subjects, SessionId};

/// What one look found.
pub(super) struct Looked {
    /// The lane subjects holding items.
    pub stored: HashSet<String>,
    /// Every lane consumer's state, by name.
    pub lanes: HashMap<String, Info>,
    /// Every completion consumer's state, by name (empty when the list failed: the stranded
    /// lanes are still looked at).
    pub completions: HashMap<String, Info>,
    /// The sessions with completions stored (not handed over yet, or acked and their removal
    /// lost): for a session whose completion consumer was never made (it is made by the first
    /// delivery).
    pub completions_stored: HashSet<SessionId>,
}

/// The lane subjects holding items, then every lane consumer's state (in that order: an item
/// stored after the list is above its consumer's delivered position, and so no candidate),
/// then every completion consumer's.
pub(super) async fn look(js: &jetstream::Context) -> Result<Looked, SweepError> {
    let failed = SweepError::at;
    let stream = js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| failed("read the lane stream")(e.into()))?;
    let stored: HashSet<String> = stream
        .info_with_subjects(subjects::LANE_ALL)
        .await
        .map_err(|e| failed("list the lane subjects holding items")(e.into()))?
        .map_ok(|(subject, _)| subject)
        .try_collect()
        .await
        .map_err(|e| failed("list the lane subjects holding items")(e.into()))?;
    let lanes = crate::liveness::lane_infos(js)
        .await
        .map_err(|e| failed("list the lane consumers")(e.into()))?;
    let (completions, completions_stored) = match completion_infos(js).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "sweep the lanes");
            Default::default()
        }
    };
    Ok(Looked {
        stored,
        lanes,
        completions,
        completions_stored,
    })
}

/// Every completion consumer's state, and the sessions with completions stored.
async fn completion_infos(
    js: &jetstream::Context,
) -> Result<(HashMap<String, Info>, HashSet<SessionId>), SweepError> {
    let failed = SweepError::at;
    let stream = js
        .get_stream_no_info(subjects::COMPLETION_STREAM)
        .await
        .map_err(|e| failed("read the completion stream")(e.into()))?;
    let stored = stream
        .info_with_subjects(subjects::COMPLETION_ALL)
        .await
        .map_err(|e| failed("list the completions stored")(e.into()))?
        .try_filter_map(|(subject, _)| async move { Ok(subjects::completion_session(&subject)) })
        .try_collect()
        .await
        .map_err(|e| failed("list the completions stored")(e.into()))?;
    let infos = stream
        .consumers()
        .map_ok(|i| (i.name.clone(), i))
        .try_collect()
        .await
        .map_err(|e| failed("list the completion consumers")(e.into()))?;
    Ok((infos, stored))
}

/// Nothing to hand out and nothing in flight.
pub(super) fn idle(info: &Info) -> bool {
    info.num_pending == 0 && info.num_ack_pending == 0
}

/// A step of the sweep or of a repair that failed.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub(super) struct SweepError {
    what: &'static str,
    source: async_nats::Error,
}

impl SweepError {
    pub(super) fn at(what: &'static str) -> impl FnOnce(async_nats::Error) -> Self {
        move |source| Self { what, source }
    }
}
