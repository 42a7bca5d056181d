//! Replica liveness: how a SIGKILLed replica's lanes are served by another in well under a
//! second, without shortening the ack wait and pin TTL that protect slow turns, and without
//! ever taking lanes from a replica that is alive.
//!
//! Each replica process is an *instance* (`<replica>-<random>`) with a key `live.<instance>`
//! in the replicas bucket, renewed every [`Timing::interval`] by compare-and-set on its own
//! revision, and a ping subject it answers on (`probe`). Every replica watches those keys and
//! pings every peer every [`Timing::probe`]. A peer is dead when
//! - the server says its connection is gone (pings get *no responders*, twice running) and its
//!   renewals stopped more than [`Timing::gone_after`] ago: a process that died, detected in
//!   a few hundred milliseconds; or
//! - it has not renewed for [`Timing::timeout`], connection or not: a paused or partitioned
//!   process.
//!
//! The first survivor to delete a dead peer's key *at the revision it last saw* (so a replica
//! that renewed meanwhile is never taken over, and only one survivor wins) takes its lanes
//! over (`takeover`): for each pin the dead instance recorded, the lane is unpinned and the
//! item it held in flight is given back, so a survivor's waiting pull gets it at once instead
//! of after the pin TTL and the ack wait.
//!
//! A replica acts only under its lease (`lease`): within [`Timing::lease`] of sending its last
//! successful renewal, which both paths above outwait. A replica that finds its own key gone
//! was taken for dead (a pause, a partition): it is *fenced*: it stops at once without giving
//! anything back (a survivor already did) and the service returns [`crate::Error::Fenced`], so
//! its supervisor restarts it clean.
//!
//! A watch that stalls (a NATS fail-over) must not make every peer look dead: a peer is judged
//! only while this replica sees its own renewals come back through the watch; after a gap in
//! those, every peer gets a fresh timeout. And the fast path is for a replica that has itself
//! been connected, watching, for [`Timing::timeout`]: after its own reconnect (a restarted
//! server drops every replica at once, and they come back at their own pace) a peer not back
//! yet is judged by silence only. A reconnect is read off the client's count of connections,
//! so one that happens between two checks is not missed. A gap in its own renewals alone
//! (this replica or its server slow under load, a stream leader moving) does not turn the fast
//! path off: a peer whose connection stayed open answers its pings or leaves them unanswered,
//! and only the server's *no responders*, for a connection gone, counts towards the fast path;
//! such a peer is still judged only [`Timing::gone_after`] after the fresh start the gap gave
//! it. (Turning it off there cost a loaded replica up to 1.25 s of detection: in
//! `turnstile-bench failover` every slow claim, 0.6-1.6 s after the kill, followed such a gap.)

mod lease;
mod probe;
mod rank;
mod takeover;

use std::collections::HashMap;
use std::sync::Arc;

use async_nats::jetstream::kv::{Entry, Operation};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnstile_shared::kv::Bucket;
use turnstile_shared::subjects;

use crate::ctx::{Ctx, Timing};

pub(crate) use lease::{Fenced, Lease};
use probe::Probe;
pub(crate) use rank::Rank;
use takeover::Evidence;
pub(crate) use takeover::{depart, forget_pin, lane_infos, record_pin};

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
    /// Probes running that found its connection gone (reset by an answer).
    gone: u32,
}

/// Consecutive *no responders* that count as a peer's connection gone.
const GONE_PROBES: u32 = 2;

/// Renews this instance's key, pings and judges peers and takes over dead ones until `stop`;
/// `Err` when this replica was fenced (its key was taken by a survivor).
pub(crate) async fn run(ctx: Arc<Ctx>, stop: CancellationToken) -> Result<(), Fenced> {
    let result = serve(&ctx, &stop).await;
    match result {
        Ok(()) => ctx.lease.depart(),
        Err(Fenced) => ctx.lease.fence(),
    }
    result
}

async fn serve(ctx: &Arc<Ctx>, stop: &CancellationToken) -> Result<(), Fenced> {
    let key = subjects::replica_live_key(&ctx.instance);
    let alive = Alive {
        replica: ctx.replica.clone(),
        instance: ctx.instance.clone(),
        since: chrono::Utc::now(),
    };
    let timing = ctx.liveness;
    let answering = stop.child_token();
    let _answering = answering.clone().drop_guard();
    // Answer pings before announcing: a peer never finds an announced instance unreachable.
    while let Err(e) = probe::answer(&ctx.client, &ctx.instance, answering.clone()).await {
        tracing::warn!(error = %e, "answer liveness pings; retrying");
        turnstile_shared::bucket_watch::sleep_or_cancel(stop, timing.interval).await;
        if stop.is_cancelled() {
            return Ok(());
        }
    }
    let mut revision = loop {
        let sent = Instant::now();
        match ctx.buckets.replicas.put(&key, &alive).await {
            Ok(r) => {
                ctx.lease.renewed(sent);
                break r;
            }
            Err(e) => {
                tracing::warn!(error = %e, "announce replica liveness; retrying");
                turnstile_shared::bucket_watch::sleep_or_cancel(stop, timing.interval).await;
                if stop.is_cancelled() {
                    return Ok(());
                }
            }
        }
    };
    let mut peers: HashMap<String, Peer> = HashMap::new();
    let mut own_seen = Instant::now();
    // Since when this replica has been connected and watching without a break.
    let mut settled = Settled::new(connects(&ctx.client));
    let mut renew = tokio::time::interval(timing.interval);
    renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ping = tokio::time::interval(timing.probe);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (probed_tx, mut probed) = tokio::sync::mpsc::unbounded_channel::<(String, Probe)>();
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
            settled.broken();
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
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
            Some((instance, found)) = probed.recv() => {
                probed_peer(&mut peers, &instance, found);
            }
            _ = renew.tick() => {
                revision = renew_own(ctx, &key, &alive, revision).await?;
                ctx.rank.set(&ctx.instance, peers.keys());
                settled.check(connected(&ctx.client), connects(&ctx.client));
                sweep(ctx, &mut peers, own_seen, settled.fast(timing), timing);
            }
            _ = ping.tick() => {
                ping_peers(ctx, &peers, &probed_tx);
                settled.check(connected(&ctx.client), connects(&ctx.client));
                sweep(ctx, &mut peers, own_seen, settled.fast(timing), timing);
            }
        }
    }
}

/// Since when this replica has been connected and watching its peers without a break: the
/// fast path is trusted only after [`Timing::timeout`] of that.
struct Settled {
    since: Instant,
    /// The client's count of connections made when last checked.
    connects: u64,
}

impl Settled {
    fn new(connects: u64) -> Self {
        Self {
            since: Instant::now(),
            connects,
        }
    }

    /// The watch was just (re)made, or the connection is being (or was) made again.
    fn broken(&mut self) {
        self.since = Instant::now();
    }

    /// One look at the connection: down now, or made again since the last look.
    fn check(&mut self, connected: bool, connects: u64) {
        if !connected || connects != self.connects {
            self.connects = connects;
            self.broken();
        }
    }

    /// Whether a peer gone from the server may be judged on that now.
    fn fast(&self, timing: Timing) -> bool {
        self.since.elapsed() > timing.timeout
    }
}

fn connected(client: &async_nats::Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

/// How many times the client has connected (the first time included).
fn connects(client: &async_nats::Client) -> u64 {
    client
        .statistics()
        .connects
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// One renewal by compare-and-set: the new revision, or `Err(Fenced)` when the key was taken.
async fn renew_own(ctx: &Ctx, key: &str, alive: &Alive, revision: u64) -> Result<u64, Fenced> {
    let sent = Instant::now();
    // Bounded by the lease: a renewal whose reply was lost (sent as the server died) would
    // otherwise hold this loop, and with it the lease, for the whole request timeout.
    let renewal = tokio::time::timeout(
        ctx.liveness.lease,
        renew_at(&ctx.buckets.replicas, key, alive, revision),
    )
    .await
    .unwrap_or(Renewal::Late);
    match renewal {
        Renewal::Stored(r) => {
            ctx.lease.renewed(sent);
            Ok(r)
        }
        Renewal::Behind(r) => {
            // The lease is renewed by the next renewal, made at the revision found.
            tracing::info!(
                revision = r,
                "a renewal whose reply was lost was stored; renewing from it"
            );
            ctx.lease.lapse();
            Ok(r)
        }
        Renewal::Taken => {
            tracing::error!(instance = %ctx.instance, "this replica was taken for dead and its lanes taken over; stopping without handing anything back");
            Err(Fenced)
        }
        Renewal::Failed(e) => {
            ctx.lease.lapse();
            tracing::warn!(error = %e, "renew replica liveness");
            Ok(revision)
        }
        Renewal::Late => {
            // It may still be stored: the next renewal then finds itself `Behind`.
            ctx.lease.lapse();
            tracing::warn!("renew replica liveness: no answer within the lease; renewing again");
            Ok(revision)
        }
    }
}

/// What one renewal of this instance's key found.
#[derive(Debug)]
enum Renewal {
    /// Stored at this revision.
    Stored(u64),
    /// Refused, but the key still holds a value, at this revision: at a later one, one of
    /// this instance's own renewals was stored and its reply lost (a NATS restart); at an
    /// earlier one, the store lost this instance's last renewals (a node that restarted
    /// behind, or lost acknowledged writes). Nobody else ever writes a value to the key (a
    /// survivor only deletes it), so it is still ours either way.
    Behind(u64),
    /// The key is gone: a survivor took this instance over.
    Taken,
    /// NATS refused or failed the request: nothing is known.
    Failed(turnstile_shared::kv::KvError),
    /// No answer within the lease (the request or its reply may be lost).
    Late,
}

async fn renew_at(bucket: &Bucket, key: &str, alive: &Alive, revision: u64) -> Renewal {
    match bucket.update(key, alive, revision).await {
        Ok(Some(r)) => Renewal::Stored(r),
        Ok(None) => match bucket.get::<serde_json::Value>(key).await {
            Ok(Some((_, found))) => Renewal::Behind(found),
            Ok(None) => Renewal::Taken,
            Err(e) => Renewal::Failed(e),
        },
        Err(e) => Renewal::Failed(e),
    }
}

/// Pings every peer (spawned: a paused peer's ping waits out its timeout off this loop).
fn ping_peers(
    ctx: &Ctx,
    peers: &HashMap<String, Peer>,
    probed: &tokio::sync::mpsc::UnboundedSender<(String, Probe)>,
) {
    let wait = ctx.liveness.probe * 3;
    for instance in peers.keys() {
        let client = ctx.client.clone();
        let instance = instance.clone();
        let probed = probed.clone();
        tokio::spawn(async move {
            let found = probe::ask(&client, &instance, wait).await;
            let _ = probed.send((instance, found));
        });
    }
}

/// A probe's answer: *gone* counts towards the fast path, an answer resets it.
fn probed_peer(peers: &mut HashMap<String, Peer>, instance: &str, found: Probe) {
    if let Some(p) = peers.get_mut(instance) {
        match found {
            Probe::Answered => p.gone = 0,
            Probe::Gone => p.gone += 1,
            Probe::Unknown => {}
        }
    }
}

/// One watch entry: a peer's renewal or departure, or our own renewal coming back (after a
/// stall of those, every peer starts afresh).
fn observe(
    own_key: &str,
    entry: Entry,
    peers: &mut HashMap<String, Peer>,
    own_seen: &mut Instant,
    timing: Timing,
) {
    let now = Instant::now();
    if entry.key == own_key {
        let gap = now.duration_since(*own_seen);
        if gap > timing.lease {
            // Our own renewals stalled (NATS or this process): nobody is judged on that gap.
            tracing::info!(
                gap_ms = gap.as_millis() as u64,
                "own renewals stalled; every peer's silence counts from now"
            );
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
                    gone: 0,
                },
            );
        }
        Operation::Delete | Operation::Purge => {
            peers.remove(instance);
        }
    }
}

/// Claims each dead peer (see the module's two paths) and takes its lanes over (spawned:
/// renewals go on meanwhile).
fn sweep(
    ctx: &Arc<Ctx>,
    peers: &mut HashMap<String, Peer>,
    own_seen: Instant,
    fast: bool,
    timing: Timing,
) {
    let now = Instant::now();
    if now.duration_since(own_seen) > timing.lease {
        // This replica does not see its own renewals: it cannot judge anyone.
        return;
    }
    let dead: Vec<(String, u64, Evidence)> = peers
        .iter()
        .filter_map(|(i, p)| Some((i.clone(), p.revision, judge(p, now, fast, timing)?)))
        .collect();
    for (instance, revision, evidence) in dead {
        peers.remove(&instance);
        tokio::spawn(takeover::claim(ctx.clone(), instance, revision, evidence));
    }
}

/// Whether a peer is dead, and on what evidence (`fast`: whether this replica's own view is
/// settled enough to trust the server's word that the peer's connection is gone).
fn judge(peer: &Peer, now: Instant, fast: bool, timing: Timing) -> Option<Evidence> {
    let silent = now.duration_since(peer.seen);
    if silent > timing.timeout {
        Some(Evidence::Silent { silent })
    } else if fast && peer.gone >= GONE_PROBES && silent > timing.gone_after {
        Some(Evidence::Gone { silent })
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn peer(silent: Duration, gone: u32) -> (Peer, Instant) {
        let now = Instant::now();
        let seen = now.checked_sub(silent).unwrap_or(now);
        (
            Peer {
                revision: 1,
                seen,
                gone,
            },
            now,
        )
    }

    #[test]
    fn the_timings_keep_every_act_inside_what_a_survivor_waits() {
        let t = Timing::default();
        assert!(t.lease < t.gone_after && t.lease < t.timeout);
        assert!(
            t.interval * 2 < t.lease,
            "a late renewal does not lapse the lease"
        );
    }

    #[test]
    fn a_peer_gone_from_the_server_is_dead_once_its_lease_has_run_out() {
        let t = Timing::default();
        let (p, now) = peer(t.gone_after + Duration::from_millis(20), GONE_PROBES);
        assert!(matches!(
            judge(&p, now, true, t),
            Some(Evidence::Gone { .. })
        ));
        // Just after this replica's own reconnect: the peer may only be slower to come back.
        assert!(judge(&p, now, false, t).is_none());
        // Gone but renewed lately: a replica reconnecting after its NATS node died.
        let (p, now) = peer(t.lease, GONE_PROBES + 3);
        assert!(judge(&p, now, true, t).is_none());
        // One lost ping is not enough.
        let (p, now) = peer(t.gone_after * 2, GONE_PROBES - 1);
        assert!(judge(&p, now, true, t).is_none());
    }

    #[test]
    fn a_connected_peer_is_dead_only_after_the_silence_timeout() {
        let t = Timing::default();
        let (p, now) = peer(t.gone_after * 2, 0);
        assert!(
            judge(&p, now, true, t).is_none(),
            "paused or partitioned, not yet"
        );
        let (p, now) = peer(t.timeout + Duration::from_millis(20), 0);
        assert!(matches!(
            judge(&p, now, true, t),
            Some(Evidence::Silent { .. })
        ));
        assert!(matches!(
            judge(&p, now, false, t),
            Some(Evidence::Silent { .. })
        ));
    }

    #[test]
    fn a_reconnect_between_two_looks_turns_the_fast_path_off_and_a_steady_connection_keeps_it() {
        let t = Timing::default();
        let long_ago = Instant::now()
            .checked_sub(t.timeout * 2)
            .expect("the clock is past that");
        let mut s = Settled {
            since: long_ago,
            connects: 1,
        };
        s.check(true, 1);
        assert!(s.fast(t), "connected throughout");
        s.check(true, 2);
        assert!(
            !s.fast(t),
            "connected again between two looks: peers may not be back yet"
        );
        let mut s = Settled {
            since: long_ago,
            connects: 1,
        };
        s.check(false, 1);
        assert!(!s.fast(t), "reconnecting now");
    }

    #[test]
    fn an_answer_resets_the_count_of_missing_responders() {
        let (p, _) = peer(Duration::ZERO, 0);
        let mut peers = HashMap::from([("b-1".to_string(), p)]);
        probed_peer(&mut peers, "b-1", Probe::Gone);
        probed_peer(&mut peers, "b-1", Probe::Unknown);
        probed_peer(&mut peers, "b-1", Probe::Gone);
        assert_eq!(peers["b-1"].gone, 2);
        probed_peer(&mut peers, "b-1", Probe::Answered);
        assert_eq!(peers["b-1"].gone, 0);
    }

    /// A renewal stored whose reply was lost (a NATS restart between the two) leaves the
    /// replica one revision behind its own key: the next renewal is refused, and that must
    /// not read as "taken over" (the replica would fence itself and stop serving).
    #[tokio::test]
    async fn a_renewal_refused_behind_its_own_stored_renewal_is_not_a_take_over(
    ) -> anyhow::Result<()> {
        let server = turnstile_tests::NatsServer::start().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        let store = js
            .create_key_value(async_nats::jetstream::kv::Config {
                bucket: "replicas".into(),
                ..Default::default()
            })
            .await?;
        let bucket = Bucket::new(store, "replicas", js);
        let alive = Alive {
            replica: "a".into(),
            instance: "a-1".into(),
            since: chrono::Utc::now(),
        };
        let key = "live.a-1";
        let first = bucket.put(key, &alive).await?;
        // Stored, but the replica never heard back: it still holds `first`.
        let lost = bucket.put(key, &alive).await?;
        let found = renew_at(&bucket, key, &alive, first).await;
        assert!(
            matches!(found, Renewal::Behind(r) if r == lost),
            "{found:?}"
        );
        let stored = match renew_at(&bucket, key, &alive, lost).await {
            Renewal::Stored(r) if r > lost => r,
            other => anyhow::bail!("renewal at the revision found: {other:?}"),
        };
        // The store lost renewals it had acknowledged (the replica believes a later revision
        // than the key holds): the key still holds a value, so it is still this instance's.
        let found = renew_at(&bucket, key, &alive, stored + 5).await;
        assert!(
            matches!(found, Renewal::Behind(r) if r == stored),
            "{found:?}"
        );
        // A survivor's take-over deletes the key: then the refusal is a fence.
        let now = bucket
            .get::<serde_json::Value>(key)
            .await?
            .map(|(_, r)| r)
            .unwrap_or_default();
        assert!(bucket.delete_at(key, now).await?);
        assert!(matches!(
            renew_at(&bucket, key, &alive, now).await,
            Renewal::Taken
        ));
        Ok(())
    }
}
