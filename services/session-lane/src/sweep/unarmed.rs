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
//!
//! A session still waiting after a delivery the sweep armed (the delivery failed: its agent or
//! host down) is armed again after [`FIRST_WAIT`], then twice as long each time up to
//! [`MOST_WAIT`]: R3 leaves a failed hand-over to the session's next turn end, and the sweep's
//! retries are for a session that gets none, not a delivery turn every minute.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;
use turnstile_shared::{subjects, SessionId};

use super::look::{idle, Looked};
use crate::ctx::Ctx;

/// The wait after this replica armed a delivery for a session before it arms another one if
/// the session still waits (the delivery failed: its agent or host down); doubled each time
/// up to [`MOST_WAIT`]. A failed hand-over is otherwise re-armed by the session's next turn
/// end (R3); the sweep's retries are for a session that gets no further turn.
const FIRST_WAIT: Duration = Duration::from_secs(120);
const MOST_WAIT: Duration = Duration::from_secs(30 * 60);

/// What the sweep keeps from one sweep to the next: the sessions seen waiting, and when it may
/// arm again for those it armed a delivery for. A session no longer waiting is forgotten.
#[derive(Default)]
pub(super) struct Memory {
    seen: HashSet<SessionId>,
    armed: HashMap<SessionId, Retry>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Retry {
    not_before: Instant,
    wait: Duration,
}

/// What to do for a session seen waiting.
#[derive(Debug, PartialEq)]
enum Decision {
    /// First seen so: noted, acted on if still so at the next sweep.
    Note,
    /// Armed lately: not again before then.
    Hold(Retry),
    /// Arm a delivery; if one is armed, not again for `wait`.
    Arm { wait: Duration },
}

impl Memory {
    fn decide(&self, session: &SessionId, now: Instant) -> Decision {
        match self.armed.get(session) {
            _ if !self.seen.contains(session) => Decision::Note,
            Some(r) if now < r.not_before => Decision::Hold(*r),
            Some(r) => Decision::Arm {
                wait: (r.wait * 2).min(MOST_WAIT),
            },
            None => Decision::Arm { wait: FIRST_WAIT },
        }
    }
}

/// One sweep: what to remember for the next one.
pub(super) async fn sweep(ctx: &Ctx, looked: &Looked, last: &Memory) -> Memory {
    let now = Instant::now();
    let mut next = Memory::default();
    for session in waiting(looked) {
        next.seen.insert(session.clone());
        let wait = match last.decide(&session, now) {
            Decision::Note => {
                tracing::info!(%session, "completions waiting on an idle lane with no delivery armed; armed if still so at the next sweep");
                continue;
            }
            Decision::Hold(retry) => {
                next.armed.insert(session, retry);
                continue;
            }
            Decision::Arm { wait } => wait,
        };
        match crate::handoff::arm_for_waiting(ctx, &session).await {
            Ok(Some(delivery)) => {
                tracing::warn!(%session, %delivery, retry_after_s = wait.as_secs(),
                    "completions waited on an idle lane with no delivery armed: one is armed");
                next.armed.insert(
                    session,
                    Retry {
                        not_before: now + wait,
                        wait,
                    },
                );
            }
            // A marker on its way was found (trusted, or its item on the lane): it delivers.
            Ok(None) => {
                tracing::info!(%session, "completions waiting on an idle lane: a delivery is on its way")
            }
            Err(e) => tracing::warn!(%session, error = %e,
                "arm a delivery for completions waiting on an idle lane; tried again at the next sweep"),
        }
    }
    // A session not seen waiting this time may be in the middle of the delivery armed for it
    // (its lane busy): what was armed is kept for a while, so a delivery that fails again
    // waits longer rather than starting over.
    for (session, retry) in &last.armed {
        if !next.armed.contains_key(session) && now < retry.not_before + retry.wait {
            next.armed.insert(session.clone(), *retry);
        }
    }
    next
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

    #[test]
    fn a_session_still_waiting_is_armed_again_later_and_later_and_forgotten_once_served() {
        let s = SessionId::new();
        let now = Instant::now();
        let mut m = Memory::default();
        assert_eq!(m.decide(&s, now), Decision::Note, "first seen");
        m.seen.insert(s.clone());
        assert_eq!(m.decide(&s, now), Decision::Arm { wait: FIRST_WAIT });
        let retry = Retry {
            not_before: now + FIRST_WAIT,
            wait: FIRST_WAIT,
        };
        m.armed.insert(s.clone(), retry);
        assert_eq!(
            m.decide(&s, now + Duration::from_secs(60)),
            Decision::Hold(retry),
            "a delivery armed a minute ago is not armed again"
        );
        assert_eq!(
            m.decide(&s, now + FIRST_WAIT),
            Decision::Arm {
                wait: FIRST_WAIT * 2
            }
        );
        m.armed.insert(
            s.clone(),
            Retry {
                not_before: now,
                wait: MOST_WAIT,
            },
        );
        assert_eq!(m.decide(&s, now), Decision::Arm { wait: MOST_WAIT });
        // Not waiting at a sweep: forgotten, so noted afresh the next time.
        assert_eq!(Memory::default().decide(&s, now), Decision::Note);
    }
}
