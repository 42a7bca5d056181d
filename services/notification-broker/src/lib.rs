//! The notification-broker service: the execution registry and tree (R6), the step API agents'
//! tool calls use (authenticated by session or step token), completion routing to owners and
//! watchers (R8), delivery arming (R3) and cancellation by ownership (R7).
//!
//! # Layout
//!
//! [`run`] starts its tasks on one shared `Ctx`. Calls go down this list, never up, file by
//! file (`house.rs::no_import_cycles_between_files` checks that no two files import each
//! other, even through others):
//!
//! * `api`: step and exec APIs (`api/steps`, `api/exec`). Calls `auth`, `step_events`, `owned`,
//!   `registry`.
//! * `ended`: the one writer of terminal states. Calls `step_events`, `owned`, `registry`.
//! * `agents`: agent steps, each a run on a session of its own. Calls `step_events`, `registry`.
//! * `turns`: running turns become tree nodes; an ended one cancels its work. Calls `registry`.
//! * `runs_mirror`: runs and their messages become tree nodes. Calls nothing here but `ctx`.
//! * `orphan_steps`: the backstop that publishes again the work item of a step queued with
//!   none stored. Calls nothing here but `ctx`.
//! * `callout`: agents' NATS identities (the server's auth callout), and ending a stopped
//!   session's connections. Calls `auth`.
//! * `auth`: who a step API call acts for (session or step token). Calls `ctx` only.
//! * `step_events`: builds and publishes the `step.<status>` session events. Calls `ctx` only.
//! * `owned`: the index of the `session`-scoped work each session owns (R7). Calls `registry`.
//! * `registry`: executions in KV, the child index, the tree walk, cancel by ownership. Calls
//!   `ctx` only.
//! * `ctx`: the shared `Ctx` and the service's `Error`, used by all of the above. It holds
//!   state of modules above it whose types live in files that import nothing here:
//!   `ended/attempts.rs` (`Inline`), `ended/armed.rs`, `callout/error.rs`; and `running`.
//! * `running`: running steps' records as this replica last wrote them. Leaf.

mod agents;
mod api;
mod auth;
mod callout;
mod ctx;
mod ended;
mod orphan_steps;
mod owned;
mod registry;
mod running;
mod runs_mirror;
mod step_events;
mod turns;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::Connected;
use turnstile_shared::topology::TopologyConfig;

pub use callout::{account_key, CalloutConfig};
use ctx::Ctx;
pub use ctx::Error;

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub topology: TopologyConfig,
    pub replica: String,
    /// Answer the NATS server's auth callouts (agents' identities), when configured.
    pub callout: Option<CalloutConfig>,
    /// What `/healthz` and `/readyz` report (served by the binary with `--http`).
    pub health: std::sync::Arc<turnstile_shared::health::Health>,
    /// How long a step may stay queued before its work item is looked for, and published
    /// again if it is not stored (`orphan_steps`).
    pub orphan_step_after: std::time::Duration,
}

impl Config {
    pub fn new(nats_url: impl Into<String>) -> Self {
        Self {
            health: turnstile_shared::health::Health::new(),
            nats_url: nats_url.into(),
            topology: TopologyConfig::default(),
            replica: format!("broker-{}", std::process::id()),
            callout: None,
            orphan_step_after: std::time::Duration::from_secs(60),
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
    let (api, callout, (), (), (), (), (), ()) = tokio::join!(
        api::serve(ctx.clone(), shutdown.clone()),
        callout,
        armed,
        ended::run(ctx.clone(), shutdown.clone()),
        turns::run(ctx.clone(), shutdown.clone()),
        agents::run(ctx.clone(), shutdown.clone()),
        runs_mirror::run(ctx.clone(), shutdown.clone()),
        orphan_steps::run(ctx.clone(), config.orphan_step_after, shutdown.clone()),
    );
    let _ = ctx.client.drain().await;
    api?;
    callout.map_err(Error::from)
}
