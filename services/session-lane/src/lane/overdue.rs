//! A bound on how long a lane waits for a handler once the server has handed out an item
//! again while it runs.
//!
//! A lane has at most one item pending at the server (`max_ack_pending` 1). An item handed
//! out while this worker's handler runs is either another one (so the held one is done at the
//! server: acked by this handler, finishing its tail, or by another replica's delivery of it,
//! which makes this handler a stale one) or the held one again (its ack wait ran out: the
//! handler has not kept it alive). The worker keeps that delivery until the handler returns,
//! and normally that is a moment, or the handler's progress acks resume after an outage. A
//! handler that never returns would hold the lane for ever while the worker keeps pulling
//! (so the server keeps the lane's pin here and hands the item only here, again after each
//! ack wait): seen in the fault campaign, a three-node cluster's lane left with one item
//! pending and nothing served for minutes after the faults stopped. So once an item has come
//! while the handler runs, the handler gets a grace ([`grace`]) and is then dropped, with a
//! warning naming both items, and the delivery kept is served. Dropping is what a take-over
//! does to a handler on another replica: the later delivery resumes from the records (R14;
//! a run's later delivery supersedes its earlier driver's claim).

use std::time::Duration;

use tokio::time::Instant;

/// The least grace: longer than any request a handler's tail awaits (5 s) several times.
const LEAST: Duration = Duration::from_secs(30);

/// How long a handler may run on once the server has handed out another item: twice the lane
/// ack wait, at least [`LEAST`].
pub(super) fn grace(lane_ack_wait: Duration) -> Duration {
    lane_ack_wait.saturating_mul(2).max(LEAST)
}

/// When the handler in flight is to be dropped, if the server has moved past its item.
#[derive(Debug, Default)]
pub(super) struct Overdue {
    since: Option<(u64, Instant)>,
}

impl Overdue {
    /// An item (`arrived`: its stream sequence) came while the handler runs: the first one
    /// starts the grace; later ones do not move the bound.
    pub(super) fn arrived(&mut self, arrived: u64, now: Instant) {
        if self.since.is_none() {
            self.since = Some((arrived, now));
        }
    }

    /// The handler in flight ended (or was dropped): nothing is overdue.
    pub(super) fn clear(&mut self) {
        self.since = None;
    }

    /// When the handler is to be dropped, and the item that says its own is done.
    pub(super) fn due(&self, grace: Duration) -> Option<(u64, Instant)> {
        self.since.map(|(item, at)| (item, at + grace))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(30);

    #[test]
    fn the_first_item_that_comes_starts_the_grace_and_later_ones_do_not_move_it() {
        let start = Instant::now();
        let mut o = Overdue::default();
        assert!(o.due(GRACE).is_none(), "nothing came");
        o.arrived(9, start);
        assert_eq!(o.due(GRACE), Some((9, start + GRACE)));
        o.arrived(9, start + Duration::from_secs(10));
        o.arrived(11, start + Duration::from_secs(20));
        assert_eq!(
            o.due(GRACE),
            Some((9, start + GRACE)),
            "later deliveries keep the bound"
        );
        o.clear();
        assert!(o.due(GRACE).is_none(), "the handler ended");
    }

    #[test]
    fn the_grace_outlasts_a_tails_requests_and_follows_the_ack_wait() {
        assert_eq!(grace(Duration::from_secs(2)), LEAST);
        assert_eq!(grace(Duration::from_secs(30)), Duration::from_secs(60));
    }
}
