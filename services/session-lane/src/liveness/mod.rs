//! Replica liveness: how a SIGKILLed replica's lanes are served by another within seconds,
//! without shortening the ack wait and pin TTL that protect slow turns.
//!
//! Each replica process is an *instance* (`<replica>-<random>`) with a key `live.<instance>`
//! in the replicas bucket, renewed every [`Timing::interval`] by compare-and-set on its own
//! revision. Every replica watches those keys. An instance not renewed for
//! [`Timing::timeout`] is dead: the first survivor to delete its key *at the revision it last
//! saw* (so a replica that renewed meanwhile is never taken over, and only one survivor wins)
//! takes its lanes over (`takeover`): for each pin the dead instance recorded, the lane is
//! unpinned and the item it held in flight is given back, so a survivor's waiting pull gets it
//! at once instead of after the pin TTL and the ack wait.
//!
//! A replica that finds its own key gone was taken for dead (a pause, a partition): it is
//! *fenced*: it stops at once without giving anything back (a survivor already did) and the
//! service returns [`crate::Error::Fenced`], so its supervisor restarts it clean.
//!
//! A watch that stalls (a NATS fail-over) must not make every peer look dead: a peer is judged
//! only while this replica sees its own renewals come back through the watch; after a gap in
//! those, every peer gets a fresh timeout.

mod takeover;

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::jetstream::kv::{Entry, Operation};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnstile_shared::subjects;

use crate::ctx::{Ctx, Fenced, Timing};

pub(crate) use takeover::{depart, forget_pin, record_pin};

/// The value of a `live.<instance>` key (for operators reading the bucket).
#[derive(Debug, Serialize, Deserialize)]
struct Alive {
    replica: String,
    instance: String,
    since: chrono::DateTime<chrono::Utc>,
}

/// Live while renewed; purged with the instance's pins when a survivor takes it over.
impl turnstile_shared::retention::Retained for Alive {
    fn finished(&self) -> bool {
        false
    }
}

/// A peer as this replica last saw it.
struct Peer {
    revision: u64,
    seen: Instant,
}

/// Renews this instance's key and takes over dead peers until `shutdown`; `Err` when this
/// replica was fenced (its key was taken by a survivor).
pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Fenced> {
    let key = subjects::replica_live_key(&ctx.instance);
    let alive = Alive {
        replica: ctx.replica.clone(),
        instance: ctx.instance.clone(),
        since: chrono::Utc::now(),
    };
    let timing = ctx.liveness;
    let mut revision = loop {
        match ctx.buckets.replicas.put(&key, &alive).await {
            Ok(r) => break r,
            Err(e) => {
                tracing::warn!(error = %e, "announce replica liveness; retrying");
                crate::bucket_watch::sleep_or_cancel(&shutdown, timing.interval).await;
                if shutdown.is_cancelled() {
                    return Ok(());
                }
            }
        }
    };
    let mut peers: HashMap<String, Peer> = HashMap::new();
    let mut own_seen = Instant::now();
    let mut renew = tokio::time::interval(timing.interval);
    renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = None;
    loop {
        if watch.is_none() {
            match ctx
                .buckets
                .replicas
                .store()
                .watch_with_history(subjects::REPLICA_LIVE_ALL)
                .await
            {
                Ok(w) => watch = Some(w),
                Err(e) => tracing::warn!(error = %e, "watch replica liveness; retrying"),
            }
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            entry = async {
                match watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            } => match entry {
                Some(Ok(entry)) => observe(&key, entry, &mut peers, &mut own_seen, timing),
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "replica liveness watch; re-watching");
                    watch = None;
                }
                None => watch = None,
            },
            _ = renew.tick() => {
                match ctx.buckets.replicas.update(&key, &alive, revision).await {
                    Ok(Some(r)) => revision = r,
                    Ok(None) => {
                        tracing::error!(instance = %ctx.instance, "this replica was taken for dead and its lanes taken over; stopping without handing anything back");
                        return Err(Fenced);
                    }
                    Err(e) => tracing::warn!(error = %e, "renew replica liveness"),
                }
                sweep(&ctx, &mut peers, own_seen, timing);
            }
        }
    }
}

/// One watch entry: a peer's renewal or departure, or our own renewal coming back.
fn observe(
    own_key: &str,
    entry: Entry,
    peers: &mut HashMap<String, Peer>,
    own_seen: &mut Instant,
    timing: Timing,
) {
    let now = Instant::now();
    if entry.key == own_key {
        if now.duration_since(*own_seen) > timing.interval * 2 {
            // Our own renewals stalled (NATS or this process): nobody is judged on that gap.
            for p in peers.values_mut() {
                p.seen = now;
            }
        }
        *own_seen = now;
        return;
    }
    let Some(instance) = entry.key.strip_prefix("live.") else {
        return;
    };
    match entry.operation {
        Operation::Put => {
            peers.insert(
                instance.to_string(),
                Peer {
                    revision: entry.revision,
                    seen: now,
                },
            );
        }
        Operation::Delete | Operation::Purge => {
            peers.remove(instance);
        }
    }
}

/// Claims each peer silent for longer than the timeout and takes its lanes over (spawned:
/// renewals go on meanwhile).
fn sweep(ctx: &Arc<Ctx>, peers: &mut HashMap<String, Peer>, own_seen: Instant, timing: Timing) {
    let now = Instant::now();
    if now.duration_since(own_seen) > timing.interval * 2 {
        // This replica does not see its own renewals: it cannot judge anyone.
        return;
    }
    let dead: Vec<(String, u64)> = peers
        .iter()
        .filter(|(_, p)| now.duration_since(p.seen) > timing.timeout)
        .map(|(i, p)| (i.clone(), p.revision))
        .collect();
    for (instance, revision) in dead {
        peers.remove(&instance);
        tokio::spawn(takeover::claim(ctx.clone(), instance, revision));
    }
}
