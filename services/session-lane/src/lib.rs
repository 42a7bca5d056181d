//! The session-lane service: sessions, their exclusive lanes, and turn dispatch to each
//! session's host. Several replicas may run; each lane is pinned to exactly one of them (R1).

mod api;
mod lane;
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
    });
    tracing::info!(replica = %ctx.replica, "session-lane running");

    let api = api::serve(ctx.clone(), shutdown.child_token());
    let lanes = supervisor::run(ctx.clone(), shutdown.clone());
    let (api_result, lanes_result) = tokio::join!(api, lanes);
    // Close the connection even when embedded in a longer-lived process: the server drops this
    // replica's waiting pull requests, so pins cannot land on them again (R13).
    let _ = tokio::time::timeout(config.shutdown_grace, ctx.client.drain()).await;
    api_result?;
    lanes_result
}
