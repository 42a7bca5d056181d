//! The session-lane service: sessions, their exclusive lanes, and turn dispatch to each
//! session's host. Several replicas may run; each lane is pinned to exactly one of them (R1).
//!
//! Layout. Calls go down this list, never up, with one exception by design: `ctx` holds
//! state of modules above it, whose types live in files that import nothing of this crate
//! (`lane/pull.rs`, `handoff/collected.rs`, `handoff/standby.rs`, `liveness/lease.rs`). So
//! no two files import each other, even through others
//! (`house.rs::no_import_cycles_between_files`).
//!
//! - `api`: the request/reply APIs: `api/sessions/` (`ts.api.session.*`, a file per concern)
//!   and `api/runs.rs` (`ts.api.runs.*`). Calls `handoff`, `lane` (run events), `orphan_runs`,
//!   `ctx`.
//! - `sweep`: every 30 s, the repair of the two lane states no event ends: a lane consumer
//!   gone past items it never handed out (`sweep/stranded.rs`: the items published again at
//!   the lane's end), and completions waiting on an idle lane with no delivery armed
//!   (`sweep/unarmed.rs`: one armed). Calls `handoff` (arming), `liveness`, `ctx`.
//! - `orphan_runs`: the backstop that publishes again the lane item of a run queued with none,
//!   and ends a run queued on a stopped session. Calls `lane` (run events), `ctx`,
//!   `bucket_watch`.
//! - `supervisor`: one lane worker per active session on this replica, started and stopped
//!   from a watch of the sessions bucket. Calls `lane`, `ctx`, `bucket_watch`.
//! - `lane`: the lane worker: `lane/mod.rs` pulls the session's next item and matches on its
//!   kind; one file per kind: `lane/turn.rs`, `lane/delivery.rs`, `lane/run/` (the R5 loop).
//!   Calls `handoff`, `liveness` (pins, the lease), `ctx`.
//! - `handoff`: the primitives the kinds share: give back or refuse an item, dispatch a turn
//!   and wait for its outcome, collect and settle completions. Calls `ctx`, `turn_watch`.
//! - `liveness`: this replica's liveness key, and the take-over of a dead replica's lanes
//!   within seconds (unpin, give back its item in flight). Calls `ctx`, `bucket_watch`.
//! - `host_watch`: the watch of the hosts bucket that keeps `placement` up to date. Calls
//!   `ctx`, `bucket_watch`.
//! - `ctx`: what all of the above share (NATS handles, topology, per-replica state). Holds
//!   `placement`, `ended_view` and `turn_watch`.
//! - `placement`: the live hosts and the sessions on each, for placing new sessions. Leaf.
//! - `ended_view`: the executions' recent ends, from this replica's watch of the registry.
//!   Calls `bucket_watch`.
//! - `turn_watch`: the replica's one KV watch of turn records, with per-turn waiters. Calls
//!   `bucket_watch`.
//!
//! `bucket_watch` (the one loop behind a watch of a bucket's new writes) is shared's.

mod api;
mod ctx;
mod ended_view;
mod handoff;
mod host_watch;
mod lane;
mod liveness;
mod orphan_runs;
mod placement;
mod supervisor;
mod sweep;
mod turn_watch;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::Connected;
use turnstile_shared::topology::TopologyConfig;

pub use crate::ctx::Error;
pub use crate::ctx::Timing as LivenessTiming;
use crate::ctx::{Ctx, Handback};

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub topology: TopologyConfig,
    /// Names this replica in events (`turn.started` carries it), so operators see who served.
    pub replica: String,
    /// How long a graceful stop may take to hand lanes over before giving up.
    pub shutdown_grace: Duration,
    /// What `/healthz` and `/readyz` report (served by the binary with `--http`).
    pub health: std::sync::Arc<turnstile_shared::health::Health>,
    /// How often this replica says it is alive, and how long a silent one is given before a
    /// survivor takes its lanes over.
    pub liveness: LivenessTiming,
    /// How long a run may stay `queued` with no item on its lane before its item is published
    /// again (`orphan_runs`).
    pub orphan_run_after: Duration,
    /// How long a turn may go untaken by its live host before its lane looks for its command
    /// and sends it again if it is not stored (`handoff::lost_command`).
    pub lost_command_after: Duration,
    /// How often the lanes are swept for the states no event ends (`sweep`).
    pub sweep_every: Duration,
}

impl Config {
    pub fn new(nats_url: impl Into<String>) -> Self {
        Self {
            health: turnstile_shared::health::Health::new(),
            nats_url: nats_url.into(),
            topology: TopologyConfig::default(),
            replica: format!("lane-{}", std::process::id()),
            shutdown_grace: Duration::from_secs(10),
            liveness: LivenessTiming::default(),
            orphan_run_after: Duration::from_secs(60),
            lost_command_after: Duration::from_secs(30),
            sweep_every: Duration::from_secs(30),
        }
    }
}

/// Releases the pins and naks the items this replica held, and removes its liveness and pin
/// records, over a short-lived connection.
async fn hand_back(config: &Config, handback: Handback, instance: &str) {
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
    liveness::depart(&js, instance).await;
    let _ = client.flush().await;
    tracing::info!(lanes = handback.lanes.len(), "lanes handed back");
}

/// Lanes a replica sets up at once (consumer create and pull stream).
const LANE_SETUP_CONCURRENCY: usize = 64;

/// Runs the service until `shutdown` is cancelled, then hands its lanes over and returns.
/// Returns [`Error::Fenced`] at once, handing nothing back, if a survivor took this replica for
/// dead and took its lanes over.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let Connected {
        client,
        js,
        buckets,
    } = turnstile_shared::config::start(&config.nats_url, &config.replica, &shutdown).await?;
    config.health.serving(&client);
    // Stops on `shutdown`, or when this replica is fenced.
    let stop = shutdown.child_token();
    let turns = turn_watch::TurnWatch::start(buckets.turns.clone(), stop.child_token());
    let ended = ended_view::EndedView::start(buckets.executions.clone(), stop.child_token());
    let fenced = CancellationToken::new();
    let pulls = lane::PullHub::start(
        client.clone(),
        js.clone(),
        fenced.clone(),
        stop.child_token(),
    )
    .await
    .map_err(Error::Pulls)?;
    let lease = liveness::Lease::on(config.liveness.lease, client.clone());
    let ctx = Arc::new(Ctx {
        client,
        js,
        buckets,
        topology: config.topology.clone(),
        instance: format!(
            "{}-{}",
            turnstile_shared::subjects::replica_token(&config.replica),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        ),
        replica: config.replica.clone(),
        liveness: config.liveness,
        lease,
        rank: liveness::Rank::default(),
        fenced,
        turns,
        shutdown: stop.clone(),
        handback: Default::default(),
        completions: Default::default(),
        left_pending: Default::default(),
        collected: Default::default(),
        handed_over: Default::default(),
        standbys: handoff::Standbys::new(config.topology.lane_ack_wait),
        ended,
        placement: Default::default(),
        lost_command_after: config.lost_command_after,
        lane_setup: tokio::sync::Semaphore::new(LANE_SETUP_CONCURRENCY),
        pulls,
    });
    ctx.probe_session_state();
    tokio::spawn(host_watch::watch_hosts(ctx.clone(), stop.child_token()));
    tokio::spawn(orphan_runs::run(
        ctx.clone(),
        config.orphan_run_after,
        stop.child_token(),
    ));
    tokio::spawn(sweep::run(
        ctx.clone(),
        config.sweep_every,
        stop.child_token(),
    ));
    tracing::info!(replica = %ctx.replica, instance = %ctx.instance, "session-lane running");

    // Liveness outlives the lanes on a graceful stop: their last acts run under its lease.
    let live = CancellationToken::new();
    let liveness = {
        let ctx = ctx.clone();
        let stop = stop.clone();
        let live = live.clone();
        tokio::spawn(async move {
            let result = liveness::run(ctx.clone(), live).await;
            if result.is_err() {
                ctx.fenced.cancel();
                stop.cancel();
            }
            result
        })
    };
    let api = api::serve(ctx.clone(), stop.child_token());
    let lanes = supervisor::run(ctx.clone(), stop.clone());
    let (api_result, lanes_result) = tokio::join!(api, lanes);
    stop.cancel();
    live.cancel();
    if let Ok(Err(fenced)) = liveness.await {
        ctx.client.drain().await.ok();
        return Err(fenced.into());
    }
    // Close the connection first: the server then drops this replica's waiting pull requests,
    // so releasing the pins and naking the items from a fresh connection hands them to another
    // replica at once instead of back to a request of this one (and a pin stranded until its
    // TTL). Also what makes an in-process restart (`turnstile dev`, the bench) clean (R13).
    let _ = tokio::time::timeout(config.shutdown_grace, ctx.client.drain()).await;
    let mut handback = ctx
        .handback
        .lock()
        .map(|mut h| std::mem::take(&mut *h))
        .unwrap_or_default();
    handback.items.extend(ctx.standbys.give_back());
    if let Err(e) = tokio::time::timeout(
        config.shutdown_grace,
        hand_back(&config, handback, &ctx.instance),
    )
    .await
    {
        tracing::warn!(error = %e, "hand-back of lanes timed out; they move after the pin TTL");
    }
    api_result?;
    lanes_result
}
