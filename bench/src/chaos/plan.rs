//! The fault plan of a campaign: drawn from a seed alone, so the same seed replays the same
//! plan (what is hit, when, and for how long). Faults overlap: each is drawn independently
//! within the campaign's fault window, and the plan ends with a quiet period in which the
//! stack must recover (liveness).

use std::time::Duration;

use serde::Serialize;

/// SplitMix64: a small, well-mixed generator whose whole state is the seed (no dependency, and
/// the sequence is the same on every machine and build).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `lo..=hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi.saturating_sub(lo) + 1))
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// What a fault does to its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a service replica, start it again after the fault's duration.
    KillService,
    /// SIGSTOP a service replica for the duration (longer than the lanes' timeouts), then
    /// SIGCONT.
    PauseService,
    /// SIGKILL a nats-server node, start it again on the same port and store after the
    /// duration (only on a cluster).
    KillNats,
    /// SIGSTOP a nats-server node for the duration (only on a cluster).
    PauseNats,
    /// Cut a nats-server node off the network for the duration: its connections go silent
    /// without closing (only on a cluster).
    PartitionNats,
    /// Fill a nats-server node's store disk for the duration, then free it and restart the
    /// node (nats-server needs the restart to write again).
    DiskFull,
    /// SIGKILL the mock agent of a session, mid-turn or idle.
    KillAgent,
    /// Kill a host's tmux server (every terminal of the host at once).
    KillTmux,
    /// SIGSTOP a transport agent past its host TTL (its host is taken for gone), then SIGCONT.
    HostGone,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::KillService => "kill_service",
            Self::PauseService => "pause_service",
            Self::KillNats => "kill_nats",
            Self::PauseNats => "pause_nats",
            Self::PartitionNats => "partition_nats",
            Self::DiskFull => "disk_full",
            Self::KillAgent => "kill_agent",
            Self::KillTmux => "kill_tmux",
            Self::HostGone => "host_gone",
        }
    }
}

/// One fault of the plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fault {
    /// From the start of the campaign.
    #[serde(serialize_with = "millis")]
    pub at: Duration,
    pub kind: FaultKind,
    /// A service replica (`lane-a`, `broker-b1`, `transport-h1`, `scheduler-s1`), a nats node
    /// (`nats-1`), a host (`h1`) or `agent` (a session drawn when it is injected).
    pub target: String,
    /// How long the target stays down or paused.
    #[serde(serialize_with = "millis")]
    pub hold: Duration,
}

fn millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What may be hit.
#[derive(Debug, Clone)]
pub struct Targets {
    pub services: Vec<String>,
    pub transports: Vec<String>,
    pub hosts: Vec<String>,
    /// Empty on a single server: its faults are not drawn.
    pub nats_nodes: Vec<String>,
    /// Every node, whose store disk may fill up.
    pub stores: Vec<String>,
}

/// The plan for `window` of faults: on average one fault every `every`, each held for a
/// duration drawn for its kind.
pub fn draw(seed: u64, window: Duration, every: Duration, targets: &Targets) -> Vec<Fault> {
    let mut rng = Rng::new(seed);
    let mut kinds = vec![
        FaultKind::KillService,
        FaultKind::KillService,
        FaultKind::PauseService,
        FaultKind::KillAgent,
        FaultKind::KillAgent,
        FaultKind::KillTmux,
        FaultKind::HostGone,
    ];
    if !targets.stores.is_empty() {
        kinds.push(FaultKind::DiskFull);
    }
    if !targets.nats_nodes.is_empty() {
        kinds.extend([
            FaultKind::KillNats,
            FaultKind::PauseNats,
            FaultKind::PartitionNats,
        ]);
    }
    let mut out = Vec::new();
    let mut at = Duration::ZERO;
    let every_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1);
    loop {
        at += rng.millis(every_ms / 2, every_ms * 3 / 2);
        if at >= window {
            break;
        }
        let kind = *rng.pick(&kinds);
        let (target, hold) = match kind {
            FaultKind::KillService => (rng.pick(&targets.services).clone(), rng.millis(200, 3_000)),
            FaultKind::PauseService => (
                rng.pick(&targets.services).clone(),
                rng.millis(2_500, 6_000),
            ),
            FaultKind::KillNats => (
                rng.pick(&targets.nats_nodes).clone(),
                rng.millis(500, 4_000),
            ),
            FaultKind::PauseNats => (
                rng.pick(&targets.nats_nodes).clone(),
                rng.millis(1_000, 5_000),
            ),
            FaultKind::PartitionNats => (
                rng.pick(&targets.nats_nodes).clone(),
                rng.millis(2_000, 8_000),
            ),
            FaultKind::DiskFull => (rng.pick(&targets.stores).clone(), rng.millis(1_000, 4_000)),
            FaultKind::KillAgent => ("agent".to_string(), Duration::ZERO),
            FaultKind::KillTmux => (rng.pick(&targets.hosts).clone(), Duration::ZERO),
            FaultKind::HostGone => (
                rng.pick(&targets.transports).clone(),
                rng.millis(4_000, 7_000),
            ),
        };
        out.push(Fault {
            at,
            kind,
            target,
            hold,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets() -> Targets {
        Targets {
            services: vec!["lane-a".into(), "broker-b1".into()],
            transports: vec!["transport-h1".into()],
            hosts: vec!["h1".into()],
            nats_nodes: vec![],
            stores: vec!["nats-0".into()],
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_plan_and_another_seed_another() {
        let window = Duration::from_secs(600);
        let every = Duration::from_secs(5);
        let a = draw(42, window, every, &targets());
        assert_eq!(a, draw(42, window, every, &targets()));
        assert_ne!(a, draw(43, window, every, &targets()));
        assert!(a.len() > 60, "{} faults in 10 minutes", a.len());
        assert!(a.windows(2).all(|w| w[0].at < w[1].at));
        assert!(a.iter().all(|f| f.at < window));
        // Every kind is drawn, none of a cluster's on a single server.
        for kind in [
            FaultKind::KillService,
            FaultKind::PauseService,
            FaultKind::KillAgent,
            FaultKind::KillTmux,
            FaultKind::HostGone,
            FaultKind::DiskFull,
        ] {
            assert!(a.iter().any(|f| f.kind == kind), "{kind:?}");
        }
        for kind in [
            FaultKind::KillNats,
            FaultKind::PauseNats,
            FaultKind::PartitionNats,
        ] {
            assert!(!a.iter().any(|f| f.kind == kind), "{kind:?} on one server");
        }
    }
}
