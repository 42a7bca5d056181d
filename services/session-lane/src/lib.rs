//! The session-lane service: sessions, their exclusive lanes, and turn dispatch to each
//! session's host. Several replicas may run; each lane is pinned to exactly one of them (R1).

mod api;
mod delivery;
mod lane;
mod run;
mod supervisor;
mod turn_watch;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::{Connected, StartError};
use turnstile_shared::topology::{Buckets, TopologyConfig};

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub topology: TopologyConfig,
    /// Names this replica in events (`turn.started` carries it), so operators see who served.
    pub replica: String,
    /// How long a graceful stop may take to hand lanes over before giving up.
    pub shutdown_grace: Duration,
}

impl Config {
    pub fn new(nats_url: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            topology: TopologyConfig::default(),
            replica: format!("lane-{}", std::process::id()),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("start API service: {0}")]
    Api(async_nats::Error),
}

/// Everything a lane worker or API handler needs, shared by reference.
pub(crate) struct Ctx {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: Buckets,
    pub topology: TopologyConfig,
    pub replica: String,
    pub turns: turn_watch::TurnWatch,
    /// The process-wide shutdown, as distinct from one lane's cancellation.
    pub shutdown: CancellationToken,
    handback: std::sync::Mutex<Handback>,
    /// Sessions whose last delivery failed: their next turn end re-arms a delivery.
    left_pending: std::sync::Mutex<std::collections::HashSet<turnstile_shared::SessionId>>,
    /// Each session's completion consumer, bound once (deliveries are on the hot path).
    completions: std::sync::Mutex<
        std::collections::HashMap<
            turnstile_shared::SessionId,
            async_nats::jetstream::consumer::PullConsumer,
        >,
    >,
}

/// What a stopping replica gives back once its connection is closed.
#[derive(Default)]
struct Handback {
    /// Lane consumers this replica held the pin of.
    lanes: Vec<String>,
    /// Ack subjects of the items it held in flight.
    items: Vec<String>,
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
        if let Ok(mut m) = self.completions.lock() {
            m.insert(session.clone(), c.clone());
        }
        Ok(c)
    }

    /// Records whether the session's last delivery failed (its completions wait unarmed).
    pub fn mark_left_pending(&self, session: &turnstile_shared::SessionId, pending: bool) {
        if let Ok(mut s) = self.left_pending.lock() {
            if pending {
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

    pub fn forget_completion_consumer(&self, session: &turnstile_shared::SessionId) {
        if let Ok(mut m) = self.completions.lock() {
            m.remove(session);
        }
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

/// Releases the pins and naks the items this replica held, over a short-lived connection.
async fn hand_back(config: &Config, handback: Handback) {
    if handback.lanes.is_empty() && handback.items.is_empty() {
        return;
    }
    let name = format!("{}-handback", config.replica);
    let client = match turnstile_shared::config::connect_once(&config.nats_url, &name).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "hand-back: connect; lanes move after the pin TTL");
            return;
        }
    };
    let js = async_nats::jetstream::new(client.clone());
    if let Ok(stream) = js
        .get_stream_no_info(turnstile_shared::subjects::LANE_STREAM)
        .await
    {
        for consumer in &handback.lanes {
            if let Err(e) = stream
                .unpin_consumer(consumer, turnstile_shared::subjects::LANE_GROUP)
                .await
            {
                tracing::debug!(consumer, error = %e, "hand-back: unpin");
            }
        }
    }
    for ack in handback.items {
        if let Err(e) = client.publish(ack, "-NAK".into()).await {
            tracing::debug!(error = %e, "hand-back: nak");
        }
    }
    let _ = client.flush().await;
    tracing::info!(lanes = handback.lanes.len(), "lanes handed back");
}

/// Runs the service until `shutdown` is cancelled, then hands its lanes over and returns.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let Connected {
        client,
        js,
        buckets,
    } = turnstile_shared::config::start(&config.nats_url, &config.replica, &config.topology)
        .await?;
    let turns = turn_watch::TurnWatch::start(buckets.turns.clone(), shutdown.child_token());
    let ctx = Arc::new(Ctx {
        client,
        js,
        buckets,
        topology: config.topology.clone(),
        replica: config.replica.clone(),
        turns,
        shutdown: shutdown.clone(),
        handback: Default::default(),
        completions: Default::default(),
        left_pending: Default::default(),
    });
    tracing::info!(replica = %ctx.replica, "session-lane running");

    let api = api::serve(ctx.clone(), shutdown.child_token());
    let lanes = supervisor::run(ctx.clone(), shutdown.clone());
    let (api_result, lanes_result) = tokio::join!(api, lanes);
    // Close the connection first: the server then drops this replica's waiting pull requests,
    // so releasing the pins and naking the items from a fresh connection hands them to another
    // replica at once instead of back to a request of this one (and a pin stranded until its
    // TTL). Also what makes an in-process restart (`turnstile dev`, the bench) clean (R13).
    let _ = tokio::time::timeout(config.shutdown_grace, ctx.client.drain()).await;
    let handback = ctx
        .handback
        .lock()
        .map(|mut h| std::mem::take(&mut *h))
        .unwrap_or_default();
    if let Err(e) = tokio::time::timeout(config.shutdown_grace, hand_back(&config, handback)).await
    {
        tracing::warn!(error = %e, "hand-back of lanes timed out; they move after the pin TTL");
    }
    api_result?;
    lanes_result
}
