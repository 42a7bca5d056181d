//! What every lane worker and API handler of one replica shares: the NATS handles, the
//! topology, the replica's one turn watch, and the small per-replica state (lanes to hand back
//! at shutdown, sessions whose last delivery failed, bound completion consumers).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::StartError;
use turnstile_shared::topology::{Buckets, TopologyConfig};

use crate::liveness::Fenced;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("start API service: {0}")]
    Api(async_nats::Error),
    #[error("subscribe the lanes' pull replies: {0}")]
    Pulls(async_nats::SubscribeError),
    #[error(transparent)]
    Fenced(#[from] Fenced),
}

/// How often a replica renews its liveness key, how long it may act on its last renewal, and
/// when a survivor takes a peer for dead (`liveness`).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Between two renewals of this replica's key.
    pub interval: Duration,
    /// How long after *sending* its last successful renewal this replica may still act
    /// (`liveness::lease`): shorter than [`Timing::gone_after`] and [`Timing::timeout`], so no
    /// replica acts once a survivor may have taken it over.
    pub lease: Duration,
    /// Between two pings of each peer (`liveness::probe`).
    pub probe: Duration,
    /// A peer the server says is disconnected (its pings get no responders) and whose
    /// renewals stopped this long ago is dead: the fast path, for a process that died.
    pub gone_after: Duration,
    /// A peer silent this long is dead even while its connection stays open: the slow path,
    /// for a paused or partitioned process.
    pub timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            // Renewing every 50 ms keeps a 200 ms lease held while a renewal answers within
            // about 100 ms; a dead peer is then taken over 250 ms after its last renewal.
            interval: Duration::from_millis(50),
            lease: Duration::from_millis(200),
            probe: Duration::from_millis(50),
            gone_after: Duration::from_millis(250),
            timeout: Duration::from_millis(1250),
        }
    }
}

/// Everything a lane worker or API handler needs, shared by reference.
pub(crate) struct Ctx {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: Buckets,
    pub topology: TopologyConfig,
    pub replica: String,
    /// This process among the replicas: `<replica>-<random>`, the name liveness and pin
    /// records use (a restarted replica is a new instance, even under the same name).
    pub instance: String,
    pub liveness: Timing,
    /// Cancelled when a survivor took this replica for dead and took its lanes over: nothing
    /// may be acked, given back or handed back from then on.
    pub fenced: CancellationToken,
    /// Whether this replica may act now: its last renewal is recent (`liveness::lease`).
    pub lease: crate::liveness::Lease,
    /// Whether this replica is the first live one, the one that sweeps (`liveness::rank`).
    pub rank: crate::liveness::Rank,
    pub turns: crate::turn_watch::TurnWatch,
    /// The process-wide shutdown, as distinct from one lane's cancellation.
    pub shutdown: CancellationToken,
    pub handback: std::sync::Mutex<Handback>,
    /// Sessions whose last delivery failed: their next turn end re-arms a delivery.
    pub left_pending: std::sync::Mutex<std::collections::HashSet<turnstile_shared::SessionId>>,
    /// Executions whose completions this replica's lanes collected lately (`handoff`).
    pub collected: crate::handoff::Collected,
    /// Completions this replica's lanes handed over lately (`handoff`).
    pub handed_over: crate::handoff::HandedOver,
    /// Completions pushed to this replica by the pulls its busy lanes keep out (`handoff`).
    pub standbys: crate::handoff::Standbys,
    /// The executions' recent ends, from this replica's watch of the registry.
    pub ended: crate::ended_view::EndedView,
    /// Lanes setting up (consumer, pull stream) at once: see `lane::serve`.
    pub lane_setup: tokio::sync::Semaphore,
    /// Every lane's pull requests and their replies, on one subscription.
    pub pulls: std::sync::Arc<crate::lane::PullHub>,
    /// Live hosts and sessions per host, for placing new sessions.
    pub placement: crate::placement::Placement,
    /// How long a turn goes untaken before its command is looked for (`handoff::lost_command`).
    pub lost_command_after: std::time::Duration,
    /// Each session's completion consumer, bound once (deliveries are on the hot path).
    pub completions: std::sync::Mutex<
        std::collections::HashMap<
            turnstile_shared::SessionId,
            async_nats::jetstream::consumer::PullConsumer,
        >,
    >,
}

/// What a stopping replica gives back once its connection is closed.
#[derive(Default)]
pub(crate) struct Handback {
    /// Lane consumers this replica held the pin of.
    pub lanes: Vec<String>,
    /// Ack subjects of the items it held in flight.
    pub items: Vec<String>,
}

impl Ctx {
    pub async fn completion_consumer(
        &self,
        session: &turnstile_shared::SessionId,
    ) -> Result<
        async_nats::jetstream::consumer::PullConsumer,
        turnstile_shared::topology::TopologyError,
    > {
        if let Some(c) = self
            .completions
            .lock()
            .ok()
            .and_then(|m| m.get(session).cloned())
        {
            return Ok(c);
        }
        let c = turnstile_shared::topology::ensure_completion_consumer(
            &self.js,
            &self.topology,
            session,
        )
        .await?;
        // Not kept for a session that stopped meanwhile (its stop may have been seen already).
        if self.placement.knows(session) {
            if let Ok(mut m) = self.completions.lock() {
                m.insert(session.clone(), c.clone());
            }
        }
        Ok(c)
    }

    /// Records whether the session's last delivery failed (its completions wait unarmed).
    pub fn mark_left_pending(&self, session: &turnstile_shared::SessionId, pending: bool) {
        if let Ok(mut s) = self.left_pending.lock() {
            if pending && self.placement.knows(session) {
                s.insert(session.clone());
            } else {
                s.remove(session);
            }
        }
    }

    pub fn left_pending(&self, session: &turnstile_shared::SessionId) -> bool {
        self.left_pending
            .lock()
            .map(|mut s| s.remove(session))
            .unwrap_or(false)
    }

    /// Drops what this replica keeps in memory for a session that stopped (R13): every
    /// replica calls it when its watch of the sessions bucket sees the stop, whichever replica
    /// answered it.
    pub fn forget_session(&self, session: &turnstile_shared::SessionId) {
        if let Ok(mut m) = self.completions.lock() {
            m.remove(session);
        }
        if let Ok(mut s) = self.left_pending.lock() {
            s.remove(session);
        }
        self.standbys.forget(session);
    }

    /// Registers the sizes of this replica's per-session maps with the metrics
    /// (`turnstile_session_state_entries`), read at each scrape while the replica lives.
    pub fn probe_session_state(self: &std::sync::Arc<Self>) {
        let m = turnstile_shared::metrics::metrics();
        m.probe_of("completion_consumers", self, |c| {
            c.completions.lock().map(|m| m.len()).unwrap_or(0)
        });
        m.probe_of("left_pending", self, |c| {
            c.left_pending.lock().map(|s| s.len()).unwrap_or(0)
        });
        m.probe_of("completion_standbys", self, |c| c.standbys.len());
        m.probe_of("placed_sessions", self, |c| c.placement.sessions());
        m.probe_of("lane_pulls", self, |c| c.pulls.waiting());
    }

    pub fn hand_back_lane(&self, consumer: String) {
        if let Ok(mut h) = self.handback.lock() {
            h.lanes.push(consumer);
        }
    }

    pub fn hand_back_item(&self, ack_subject: String) {
        if let Ok(mut h) = self.handback.lock() {
            h.items.push(ack_subject);
        }
    }
}
