//! The notification-broker service: the execution registry and tree (R6), the step API agents'
//! tool calls use (authenticated by session or step token), completion routing to owners and
//! watchers (R8), delivery arming (R3) and cancellation by ownership (R7).
//!
//! # Layout
//!
//! [`run`] starts five tasks on one shared `Ctx`. Calls go down this list, never up:
//!
//! * `api`: step and exec APIs (`api/steps`, `api/exec`). Calls `auth`, `step_events`, `registry`.
//! * `ended`: the one writer of terminal states. Calls `step_events`, `registry`.
//! * `agents`: agent steps, each a run on a session of its own. Calls `step_events`, `registry`.
//! * `turns`: running turns become tree nodes; an ended one cancels its work. Calls `registry`.
//! * `runs_mirror`: runs and their messages become tree nodes. Calls nothing here.
//! * `callout`: agents' NATS identities (the server's auth callout), and ending a stopped
//!   session's connections. Calls `auth`.
//! * `auth`: who a step API call acts for (session or step token). Leaf.
//! * `step_events`: builds and publishes the `step.<status>` session events. Leaf.
//! * `registry`: executions in KV, the child index, the tree walk, cancel by ownership. Leaf.

mod agents;
mod api;
mod auth;
mod callout;
mod ended;
mod owned;
mod registry;
mod running;
mod runs_mirror;
mod step_events;
mod turns;

use std::collections::HashMap;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::{Connected, StartError};
use turnstile_shared::topology::{Buckets, TopologyConfig};
use turnstile_shared::ExecutionId;

pub use callout::{account_key, CalloutConfig};

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub topology: TopologyConfig,
    pub replica: String,
    /// Answer the NATS server's auth callouts (agents' identities), when configured.
    pub callout: Option<CalloutConfig>,
    /// What `/healthz` and `/readyz` report (served by the binary with `--http`).
    pub health: std::sync::Arc<turnstile_shared::health::Health>,
}

impl Config {
    pub fn new(nats_url: impl Into<String>) -> Self {
        Self {
            health: turnstile_shared::health::Health::new(),
            nats_url: nats_url.into(),
            topology: TopologyConfig::default(),
            replica: format!("broker-{}", std::process::id()),
            callout: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("start API service: {0}")]
    Api(async_nats::Error),
    #[error("auth callout: {0}")]
    Callout(#[from] callout::CalloutError),
}

pub(crate) struct Ctx {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: Buckets,
    pub topology: TopologyConfig,
    /// Ends this replica's report handler is recording itself (see `ended`).
    pub inline: ended::Inline,
    /// Sessions with a delivery armed or a run holding them, as this replica sees it
    /// (see `ended`).
    pub armed: ended::ArmedSessions,
    /// Running steps' records as this replica last wrote them (see `running`).
    pub running: running::Running,
    parent_locks: std::sync::Mutex<HashMap<ExecutionId, Arc<tokio::sync::Mutex<()>>>>,
}

impl Ctx {
    fn parent_lock(&self, parent: &ExecutionId) -> Arc<tokio::sync::Mutex<()>> {
        match self.parent_locks.lock() {
            Ok(mut m) => m.entry(parent.clone()).or_default().clone(),
            Err(_) => Arc::default(),
        }
    }

    /// Forgets the lock once nobody else holds or waits on it.
    fn release_parent_lock(&self, parent: &ExecutionId, lock: Arc<tokio::sync::Mutex<()>>) {
        if let Ok(mut m) = self.parent_locks.lock() {
            // Ours plus the map's: nobody else has it.
            if Arc::strong_count(&lock) == 2 {
                m.remove(parent);
            }
        }
    }
}

/// Runs the broker until `shutdown` is cancelled. Several replicas may run: the API is a
/// queue group, and the two durable consumers (execution ends, turn changes) share their work.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let Connected {
        client,
        js,
        buckets,
    } = turnstile_shared::config::start(&config.nats_url, &config.replica, &shutdown).await?;
    config.health.serving(&client);
    let ctx = Arc::new(Ctx {
        client,
        js,
        buckets,
        topology: config.topology.clone(),
        inline: Default::default(),
        armed: Default::default(),
        running: Default::default(),
        parent_locks: Default::default(),
    });
    tracing::info!(replica = %config.replica, "notification-broker running");
    let callout = async {
        match config.callout.clone() {
            Some(c) => callout::run(ctx.clone(), c, shutdown.clone()).await,
            None => Ok(()),
        }
    };
    let armed = async {
        if let Err(e) = ctx.armed.follow(&ctx.client, &shutdown).await {
            tracing::warn!(error = %e, "follow delivery and run events; no lane item is sent ahead of its marker's create");
        }
    };
    let (api, callout, (), (), (), (), ()) = tokio::join!(
        api::serve(ctx.clone(), shutdown.clone()),
        callout,
        armed,
        ended::run(ctx.clone(), shutdown.clone()),
        turns::run(ctx.clone(), shutdown.clone()),
        agents::run(ctx.clone(), shutdown.clone()),
        runs_mirror::run(ctx.clone(), shutdown.clone()),
    );
    let _ = ctx.client.drain().await;
    api?;
    callout.map_err(Error::from)
}
