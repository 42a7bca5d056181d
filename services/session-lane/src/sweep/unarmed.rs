//! Completions waiting on an idle lane with no delivery on its way.
//!
//! Found by the fault campaign on docker-compose.yml's cluster profile (20 min): after the
//! faults one session held a completion its consumer counted in flight (fetched by a delivery
//! whose handler was cut off, neither handed over nor given back) while its lane was idle:
//! nothing armed a delivery, so nothing fetched it again once its ack wait ran out, and the
//! step's result was never handed over. A delivery is armed by the router when a completion
//! is stored and by the lane after a turn, a run or a delivery that left completions behind;
//! a handler cut off between fetching and handing over (its fetch cut at its bound, the
//! handler dropped, the replica fenced) or a re-arm lost on a failing store leaves none.
//!
//! So on each sweep ([`super`]) a session whose completion consumer counts completions to
//! hand out or in flight (or, with no consumer yet, has completions stored) while its lane
//! consumer is idle (no item queued or in flight: no
//! delivery armed, none running), seen so twice running, gets a delivery armed. Arming is
//! safe at any time: a young marker (a router arming right now) is trusted, an old one whose
//! item is not on the lane is published again, and a delivery that finds the completions still
//! in flight arms again once their ack wait has passed.

use std::collections::HashSet;

use turnstile_shared::{subjects, SessionId};

use super::look::{idle, Looked};
use crate::ctx::Ctx;

/// One sweep: the sessions waiting so on this sweep; those also waiting last time get a
/// delivery armed.
pub(super) async fn sweep(
    ctx: &Ctx,
    looked: &Looked,
    last: &HashSet<SessionId>,
) -> HashSet<SessionId> {
    let mut now = HashSet::new();
    for session in waiting(looked) {
        if !last.contains(&session) {
            tracing::info!(%session, "completions waiting on an idle lane with no delivery armed; armed if still so at the next sweep");
            now.insert(session);
            continue;
        }
        match crate::handoff::arm_for_waiting(ctx, &session).await {
            Some(delivery) => tracing::warn!(%session, %delivery,
                "completions waited on an idle lane with no delivery armed: one is armed"),
            // A marker on its way was found (trusted, or its item on the lane): it delivers.
            None => {
                tracing::info!(%session, "completions waiting on an idle lane: a delivery is on its way")
            }
        }
    }
    now
}

/// The sessions whose lane is idle while their completion consumer counts completions.
pub(super) fn waiting(looked: &Looked) -> Vec<SessionId> {
    looked
        .lanes
        .values()
        .filter(|lane| idle(lane))
        .filter_map(|lane| subjects::lane_consumer_session(&lane.name))
        .filter(|session| {
            match looked
                .completions
                .get(&subjects::completion_consumer(session))
            {
                Some(c) => c.num_pending + c.num_ack_pending as u64 > 0,
                // No consumer yet (the first delivery makes it): what is stored waits.
                None => looked.completions_stored.contains(session),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::consumer::Info;
    use std::collections::HashMap;

    fn info(name: String, pending: u64, ack_pending: usize) -> Info {
        let now = chrono::Utc::now().to_rfc3339();
        serde_json::from_value(serde_json::json!({
            "type": "io.nats.jetstream.api.v1.consumer_info_response",
            "stream_name": "S",
            "name": name,
            "created": now,
            "config": {"durable_name": name, "ack_policy": "explicit", "deliver_policy": "all", "replay_policy": "instant"},
            "delivered": {"consumer_seq": 9, "stream_seq": 9},
            "ack_floor": {"consumer_seq": 9, "stream_seq": 9},
            "num_ack_pending": ack_pending,
            "num_redelivered": 0,
            "num_waiting": 1,
            "num_pending": pending,
        }))
        .unwrap_or_else(|e| panic!("a consumer info: {e}"))
    }

    /// (lane pending, lane in flight, completions pending, completions in flight) per session.
    fn looked(sessions: &[(SessionId, u64, usize, u64, usize)]) -> Looked {
        let mut lanes = HashMap::new();
        let mut completions = HashMap::new();
        for (s, lp, lf, cp, cf) in sessions {
            let lane = subjects::lane_consumer(s);
            lanes.insert(lane.clone(), info(lane, *lp, *lf));
            let c = subjects::completion_consumer(s);
            completions.insert(c.clone(), info(c, *cp, *cf));
        }
        Looked {
            stored: HashSet::new(),
            lanes,
            completions,
            completions_stored: HashSet::new(),
        }
    }

    #[test]
    fn only_an_idle_lane_with_completions_counted_is_waiting() {
        let (held, queued, busy, quiet) = (
            SessionId::new(),
            SessionId::new(),
            SessionId::new(),
            SessionId::new(),
        );
        let found = waiting(&looked(&[
            // The campaign's state: one completion in flight, the lane idle.
            (held.clone(), 0, 0, 0, 1),
            (queued.clone(), 0, 0, 2, 0),
            // A turn running (its completions wait for it to end), or a delivery queued.
            (busy.clone(), 1, 1, 3, 0),
            (quiet.clone(), 0, 0, 0, 0),
        ]));
        let found: HashSet<_> = found.into_iter().collect();
        assert_eq!(found, HashSet::from([held, queued]));
    }

    #[test]
    fn with_no_completion_consumer_yet_what_is_stored_waits() {
        let (stored, none) = (SessionId::new(), SessionId::new());
        let mut l = looked(&[(stored.clone(), 0, 0, 0, 0), (none.clone(), 0, 0, 0, 0)]);
        l.completions.clear();
        l.completions_stored.insert(stored.clone());
        assert_eq!(waiting(&l), vec![stored.clone()]);
        // A consumer that counts nothing decides: a stored completion it counts neither way
        // was acked (its removal lost) and waits for nothing.
        let mut l = looked(&[(stored.clone(), 0, 0, 0, 0)]);
        l.completions_stored.insert(stored);
        assert!(waiting(&l).is_empty());
    }
}
