//! Which replica sweeps: the first live instance by name.
//!
//! The sweep (`crate::sweep`) lists every lane consumer and every completion consumer: at
//! 10,000 sessions about 80 pages of consumer states, some 20 MB of JSON the server builds
//! every sweep. Its repairs are safe to race, so every replica used to sweep, multiplying that
//! cost, and a session the unarmed sweep armed for was re-armed once per replica per period.
//! Now only the replica whose instance name sorts first among itself and the peers it sees
//! sweeps. A first replica that dies is taken over (and so dropped from every survivor's
//! peers) within a second or so; the next one sweeps from its next turn on. Two replicas that
//! each think they are first for a moment (one has not seen the other yet) both sweep, which
//! is what every replica did before.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this replica is first among the live ones (set by the liveness loop).
#[derive(Debug)]
pub(crate) struct Rank(AtomicBool);

impl Default for Rank {
    /// First until the liveness loop has seen its peers: a replica alone sweeps.
    fn default() -> Self {
        Self(AtomicBool::new(true))
    }
}

impl Rank {
    pub(crate) fn first(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Ranks `instance` among the `peers` this replica sees alive.
    pub(crate) fn set<'a>(&self, instance: &str, peers: impl IntoIterator<Item = &'a String>) {
        self.0.store(is_first(instance, peers), Ordering::Relaxed);
    }
}

fn is_first<'a>(instance: &str, peers: impl IntoIterator<Item = &'a String>) -> bool {
    peers.into_iter().all(|p| p.as_str() > instance)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_instance_by_name_sweeps_and_a_replica_alone_does() {
        let peers = ["lane-b-2".to_string(), "lane-c-1".to_string()];
        assert!(is_first("lane-a-9", &peers));
        assert!(!is_first("lane-c-0", &peers));
        assert!(is_first("lane-c-0", &[] as &[String]));
        let rank = Rank::default();
        assert!(rank.first(), "first until peers are seen");
        rank.set("lane-b-3", &peers);
        assert!(!rank.first());
        rank.set("lane-b-3", &peers[..0]);
        assert!(rank.first(), "first again once the others are gone");
    }
}
