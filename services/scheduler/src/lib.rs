//! The scheduler service: schedules and their API, cron in IANA zones, slot claims (R11),
//! overlap and catch-up. Several replicas may run: each slot is decided by whoever creates its
//! record first, and the run it fires is queued on the session's lane through session-lane.
//!
//! # Layout
//!
//! [`run`] starts the API and the ticker on one shared `Ctx`. Calls go down this list, never up:
//!
//! * `api`: the `ts.api.schedules.*` service (add, list, show, ... delete). Calls `ticker`, `cron`.
//! * `ticker`: the loop that claims due slots and fires their runs. Calls `audit`,
//!   `slot_record`, `table`, `plan`, `cron`.
//! * `audit`: every slot before a cursor has a record (a store fault's loss recorded
//!   `missed`). Calls `slot_record`, `cron`.
//! * `slot_record`: a slot's one record (the claim, its event) and a pass's error. Leaf.
//! * `table`: the schedules as the ticker holds them (kept by a watch), due and wake times.
//! * `plan`: what becomes of a due slot (skip, miss, fire, overlap), pure. Leaf.
//! * `cron`: cron expressions in an IANA zone to slot instants (UTC), pure. Leaf.
//! * `ctx`: what the API and the ticker share (NATS handles, buckets), and the service's
//!   `Error`. Leaf.

mod api;
mod audit;
pub mod cron;
mod ctx;
pub mod plan;
mod slot_record;
mod table;
mod ticker;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::Connected;
use turnstile_shared::topology::TopologyConfig;

use crate::ctx::Ctx;
pub use crate::ctx::Error;

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub topology: TopologyConfig,
    pub replica: String,
    /// What `/healthz` and `/readyz` report (served by the binary with `--http`).
    pub health: std::sync::Arc<turnstile_shared::health::Health>,
}

impl Config {
    pub fn new(nats_url: impl Into<String>) -> Self {
        Self {
            health: turnstile_shared::health::Health::new(),
            nats_url: nats_url.into(),
            topology: TopologyConfig::default(),
            replica: format!("scheduler-{}", std::process::id()),
        }
    }
}

/// Runs the scheduler until `shutdown` is cancelled.
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
    });
    tracing::info!(replica = %config.replica, "scheduler running");
    let (api, ()) = tokio::join!(
        api::serve(ctx.clone(), shutdown.clone()),
        ticker::run(ctx.clone(), shutdown.clone()),
    );
    let _ = ctx.client.drain().await;
    api
}
