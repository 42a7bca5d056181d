//! Taking a dead replica's lanes over, and the pin records that make it possible.
//!
//! A lane worker records the pin it holds (`pin.<instance>.<session>` = the server's
//! `Nats-Pin-Id`) when it first sees it: once per lane and holder, off the hand-off path.
//! A survivor that claimed a dead instance reads those records and, for each lane still pinned
//! to the dead instance, releases the pin and gives back the item it held in flight. With at
//! most one item in flight per lane (`max_ack_pending` 1), that item is the last one the
//! consumer delivered, so its acknowledgement subject can be written from the consumer's info
//! (read for every lane at once, by listing the lane stream's consumers).
//! The survivor's own waiting pull then gets the item, and the item kind's resume logic (R14)
//! carries on from what the dead replica recorded.
//!
//! Some lanes the records cannot name: an idle lane (never pinned, so nothing recorded) whose
//! first item came as the replica died was seen pinned to a pin nobody holds, with nothing
//! delivered: the server pinned a request of the dead connection and then found nobody to
//! deliver to. Such a lane waits, item pending and a survivor's pull waiting, until the pin
//! TTL lets it go (about 30 s at 10,000 lanes, in `turnstile-bench scale`). So the claim also
//! sweeps every lane for that state ([`stranded`]), once at once and once more when every
//! request the dead replica left has expired, and unpins what it finds. An unpin with
//! nothing in flight cannot break R1: at worst a live holder between two pulls loses its pin
//! and pulls again without it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::Info;
use futures::StreamExt;
use turnstile_shared::{subjects, SessionId};

use crate::ctx::Ctx;

/// Why a peer was taken for dead (logged with the claim).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Evidence {
    /// Its connection is gone from the server and its renewals stopped.
    Gone { silent: std::time::Duration },
    /// Silent past the timeout, connection or not.
    Silent { silent: std::time::Duration },
}

/// Lanes taken over at once (each is a consumer info, an unpin and a nak: requests the
/// JetStream API answers many at a time).
const CONCURRENCY: usize = 128;

/// Records that this replica holds `pin` on `session`'s lane (spawned by the lane worker).
pub(crate) fn record_pin(ctx: &Arc<Ctx>, session: &SessionId, pin: String) {
    let ctx = ctx.clone();
    let key = subjects::replica_pin_key(&ctx.instance, session);
    tokio::spawn(async move {
        if let Err(e) = ctx.buckets.replicas.put(&key, &pin).await {
            tracing::warn!(%key, error = %e, "record lane pin; a crash of this replica would strand the lane until its pin TTL");
        }
    });
}

/// Drops the pin record of a lane this replica stopped serving (its session stopped).
pub(crate) async fn forget_pin(ctx: &Ctx, session: &SessionId) {
    purge(ctx, &subjects::replica_pin_key(&ctx.instance, session)).await;
}

/// Removes a key, or every key matching a pattern, with its markers: nothing stays behind.
async fn purge(ctx: &Ctx, key_filter: &str) {
    purge_in(&ctx.js, key_filter).await
}

async fn purge_in(js: &async_nats::jetstream::Context, key_filter: &str) {
    let filter = subjects::replicas_kv_subjects(key_filter);
    let purged: Result<(), async_nats::Error> =
        match js.get_stream_no_info(subjects::REPLICAS_KV_STREAM).await {
            Ok(stream) => stream
                .purge()
                .filter(filter.as_str())
                .await
                .map(|_| ())
                .map_err(Into::into),
            Err(e) => Err(e.into()),
        };
    if let Err(e) = purged {
        tracing::debug!(filter, error = %e, "purge replica keys");
    }
}

/// On a graceful stop, after the lanes were handed back (over the hand-back's own
/// connection): this instance's records go, so no survivor takes it for dead.
pub(crate) async fn depart(js: &async_nats::jetstream::Context, instance: &str) {
    purge_in(js, &subjects::replica_pins(instance)).await;
    purge_in(js, &subjects::replica_live_key(instance)).await;
}

/// Claims a dead instance (deleting its key at the revision last seen: only one survivor
/// wins, and never over a renewal) and takes its lanes over.
pub(crate) async fn claim(ctx: Arc<Ctx>, instance: String, revision: u64, evidence: Evidence) {
    let key = subjects::replica_live_key(&instance);
    match ctx.buckets.replicas.delete_at(&key, revision).await {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::warn!(%instance, error = %e, "claim a dead replica");
            return;
        }
    }
    let (how, silent) = match evidence {
        Evidence::Gone { silent } => ("its connection is gone from the server", silent),
        Evidence::Silent { silent } => ("silent past the timeout", silent),
    };
    tracing::info!(%instance, evidence = how, silent_ms = silent.as_millis() as u64, "claimed a dead replica");
    let started = std::time::Instant::now();
    let stream = match ctx.js.get_stream_no_info(subjects::LANE_STREAM).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(%instance, error = %e, "lane stream; a dead replica's lanes move after the pin TTL");
            return;
        }
    };
    // The dead instance's pin records first (one scan of its keys), then every lane
    // consumer's state in pages of 256, fetched side by side; each page's lanes of the dead
    // instance are taken as the page arrives (128 at a time), not after the whole list: at
    // 10,000 lanes the list alone took longer than a take-over of the first pages.
    let pin_keys = subjects::replica_pins(&instance);
    let pins: HashMap<String, String> = match ctx
        .buckets
        .replicas
        .entries_matching::<String>(&pin_keys)
        .await
    {
        Ok(k) => k
            .into_iter()
            .filter_map(|(key, pin)| {
                let session = key.rsplit('.').next()?.parse::<SessionId>().ok()?;
                Some((subjects::lane_consumer(&session), pin))
            })
            .collect(),
        Err(e) => {
            tracing::error!(%instance, error = %e, "list a dead replica's lanes; they move after the pin TTL");
            return;
        }
    };
    let pinned_ms = started.elapsed().as_millis() as u64;
    let mut listed = true;
    let mut listed_ms = 0u64;
    let moved = lane_pages(&ctx.js)
        .inspect(|_| listed_ms = started.elapsed().as_millis() as u64)
        .flat_map(|page: Result<Vec<Info>, ListError>| {
            let infos = page.unwrap_or_else(|e| {
                tracing::error!(%instance, error = %e, "the dead replica's lanes not listed move after the pin TTL");
                listed = false;
                Vec::new()
            });
            futures::stream::iter(infos)
        })
        .filter_map(|info| {
            let pin = pins.get(&info.name).cloned();
            std::future::ready(pin.map(|p| (info, p)))
        })
        .map(|(info, pin)| {
            let stream = stream.clone();
            let ctx = &ctx;
            async move { take_lane(ctx, &stream, &info, &pin).await }
        })
        .buffer_unordered(CONCURRENCY)
        .filter(|moved| std::future::ready(*moved))
        .count()
        .await;
    purge(&ctx, &subjects::replica_pins(&instance)).await;
    purge(&ctx, &key).await;
    tracing::info!(%instance, lanes = moved, pins = pins.len(), pinned_ms, listed, listed_ms, elapsed_ms = started.elapsed().as_millis() as u64, "took over a dead replica's lanes");
    // A request of the dead replica's can be chosen, and pin its lane, until it expires.
    let last = ctx.topology.lane_pull_expiry() + SWEEP_MARGIN;
    for wait in [SWEEP_MARGIN, last] {
        tokio::time::sleep(wait).await;
        sweep(&ctx, &stream, &instance).await;
    }
}

/// How long a pin must have been held, with an item waiting and nothing delivered, before a
/// sweep takes it for stranded; and the wait before the first sweep.
const SWEEP_MARGIN: Duration = Duration::from_secs(1);

/// Unpins every lane in the [`stranded`] state whose pin no replica recorded.
async fn sweep(ctx: &Ctx, stream: &async_nats::jetstream::stream::Stream<()>, instance: &str) {
    let infos = match lane_infos(&ctx.js).await {
        Ok(i) => i,
        Err(e) => {
            tracing::warn!(%instance, error = %e, "sweep for stranded lanes: list the lane consumers");
            return;
        }
    };
    let now = chrono::Utc::now().timestamp_nanos_opt().map(i128::from);
    let mut freed = 0;
    for info in infos.values() {
        let Some(pin) = stranded(info, now) else {
            continue;
        };
        let Some(session) = subjects::lane_consumer_session(&info.name) else {
            continue;
        };
        match ctx
            .buckets
            .replicas
            .entries_matching::<String>(&subjects::replica_pins_of(&session))
            .await
        {
            Ok(held) if held.iter().any(|(_, p)| *p == pin) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(%session, error = %e, "sweep for stranded lanes: pin records");
                continue;
            }
        }
        match stream
            .unpin_consumer(&info.name, subjects::LANE_GROUP)
            .await
        {
            Ok(_) => freed += 1,
            Err(e) => tracing::warn!(%session, error = %e, "sweep for stranded lanes: unpin"),
        }
    }
    if freed > 0 {
        tracing::info!(%instance, lanes = freed, "unpinned lanes stranded on a pin nobody holds");
    }
}

/// The pin of a lane that waits on it for nothing: pinned for at least [`SWEEP_MARGIN`], an
/// item pending, nothing in flight, and a pull waiting to take it.
fn stranded(info: &Info, now_nanos: Option<i128>) -> Option<String> {
    if info.num_ack_pending > 0 || info.num_pending == 0 || info.num_waiting == 0 {
        return None;
    }
    let group = info
        .priority_groups
        .iter()
        .find(|g| g.group == subjects::LANE_GROUP)?;
    let held_nanos = now_nanos? - group.pinned_ts?.unix_timestamp_nanos();
    if held_nanos < SWEEP_MARGIN.as_nanos() as i128 {
        return None;
    }
    group.pinned_client_id.clone()
}

/// One lane of a dead instance (its consumer's state as listed): if still pinned to the dead
/// instance's `pin`, unpin it and give back its item in flight. Returns whether it was moved.
async fn take_lane(
    ctx: &Ctx,
    stream: &async_nats::jetstream::stream::Stream<()>,
    info: &Info,
    pin: &str,
) -> bool {
    let pinned = info
        .priority_groups
        .iter()
        .any(|g| g.group == subjects::LANE_GROUP && g.pinned_client_id.as_deref() == Some(pin));
    if !pinned {
        // Someone else holds it already (or nobody): nothing of the dead replica's is left.
        return false;
    }
    if let Err(e) = stream
        .unpin_consumer(&info.name, subjects::LANE_GROUP)
        .await
    {
        tracing::warn!(consumer = %info.name, error = %e, "take over lane: unpin");
        return false;
    }
    if info.num_ack_pending > 0 {
        give_back_in_flight(ctx, &info.name, info).await;
    }
    true
}

/// One page of `CONSUMER.LIST` (the server's page is 256 consumers).
#[derive(serde::Deserialize)]
struct Page {
    total: usize,
    #[serde(default)]
    consumers: Vec<Info>,
}

/// Pages of the consumer list fetched at once after the first (each is a request the server
/// answers with 256 consumers' states).
const PAGES_AT_ONCE: usize = 8;

/// The state of every consumer on the lane stream, page by page: the first page says how
/// many there are, the rest are fetched side by side ([`PAGES_AT_ONCE`]), each yielded as it
/// arrives. An error ends the pages.
fn lane_pages(
    js: &async_nats::jetstream::Context,
) -> impl futures::Stream<Item = Result<Vec<Info>, ListError>> + '_ {
    let subject = subjects::lane_consumer_list();
    let page = move |offset: usize| {
        let subject = subject.clone();
        async move {
            let page: async_nats::jetstream::response::Response<Page> = js
                .request(subject, &serde_json::json!({ "offset": offset }))
                .await
                .map_err(|e| ListError(e.to_string()))?;
            match page {
                async_nats::jetstream::response::Response::Ok(p) => Ok(p),
                async_nats::jetstream::response::Response::Err { error } => {
                    Err(ListError(error.to_string()))
                }
            }
        }
    };
    futures::stream::once(page(0))
        .map(move |first| {
            let (head, rest): (_, Vec<usize>) = match first {
                Ok(p) => {
                    let step = p.consumers.len().max(1);
                    let rest = (step..p.total).step_by(step).collect();
                    (Ok(p.consumers), rest)
                }
                Err(e) => (Err(e), Vec::new()),
            };
            let rest = futures::stream::iter(rest)
                .map(page.clone())
                .buffer_unordered(PAGES_AT_ONCE)
                .map(|p| p.map(|p| p.consumers));
            futures::stream::once(std::future::ready(head)).chain(rest)
        })
        .flatten()
        .scan(false, |failed, page| {
            // Nothing after an error: a page missing would go unnoticed in a count.
            if *failed {
                return std::future::ready(None);
            }
            *failed = page.is_err();
            std::future::ready(Some(page))
        })
}

/// A page of the lane consumers' states that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("list the lane consumers: {0}")]
pub(crate) struct ListError(String);

/// The state of every consumer on the lane stream, by name ([`lane_pages`], collected).
pub(crate) async fn lane_infos(
    js: &async_nats::jetstream::Context,
) -> Result<HashMap<String, Info>, ListError> {
    let mut out = HashMap::new();
    let mut pages = std::pin::pin!(lane_pages(js));
    while let Some(p) = pages.next().await {
        out.extend(p?.into_iter().map(|i| (i.name.clone(), i)));
    }
    Ok(out)
}

/// Naks the one item in flight on a lane consumer on behalf of its dead holder.
async fn give_back_in_flight(ctx: &Ctx, consumer: &str, info: &Info) {
    let ack = subjects::lane_ack_subject(
        consumer,
        info.delivered.stream_sequence,
        info.delivered.consumer_sequence,
    );
    if let Err(e) = ctx.client.publish(ack, "-NAK".into()).await {
        tracing::warn!(consumer, error = %e, "take over lane: give back its item");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane consumer's info as the server reports it, with `pinned_ts` `held` ago.
    fn lane(
        ack_pending: u64,
        pending: u64,
        waiting: usize,
        pinned: Option<Duration>,
    ) -> (Info, i128) {
        let now = chrono::Utc::now();
        let group = match pinned {
            Some(held) => serde_json::json!({
                "group": subjects::LANE_GROUP,
                "pinned_client_id": "PIN",
                "pinned_ts": (now - chrono::Duration::from_std(held).expect("short")).to_rfc3339(),
            }),
            None => serde_json::json!({ "group": subjects::LANE_GROUP }),
        };
        let info = serde_json::json!({
            "type": "io.nats.jetstream.api.v1.consumer_info_response",
            "stream_name": subjects::LANE_STREAM,
            "name": "lane_x",
            "created": now.to_rfc3339(),
            "config": {"durable_name": "lane_x", "ack_policy": "explicit", "deliver_policy": "all", "replay_policy": "instant"},
            "delivered": {"consumer_seq": 0, "stream_seq": 0},
            "ack_floor": {"consumer_seq": 0, "stream_seq": 0},
            "num_ack_pending": ack_pending,
            "num_redelivered": 0,
            "num_waiting": waiting,
            "num_pending": pending,
            "priority_groups": [group],
        });
        let info = serde_json::from_value(info).unwrap_or_else(|e| panic!("a consumer info: {e}"));
        (
            info,
            now.timestamp_nanos_opt().map(i128::from).expect("in range"),
        )
    }

    #[test]
    fn a_lane_pinned_with_an_item_waiting_and_nothing_delivered_is_stranded() {
        let (info, now) = lane(0, 1, 1, Some(Duration::from_secs(3)));
        assert_eq!(stranded(&info, Some(now)).as_deref(), Some("PIN"));
    }

    #[test]
    fn a_lane_with_an_item_in_flight_or_nothing_to_take_or_a_fresh_pin_is_left_alone() {
        let held = Some(Duration::from_secs(3));
        for (case, (info, now)) in [
            ("in flight (R1)", lane(1, 1, 1, held)),
            ("nothing pending", lane(0, 0, 1, held)),
            ("nobody waiting", lane(0, 1, 0, held)),
            (
                "pinned just now",
                lane(0, 1, 1, Some(Duration::from_millis(100))),
            ),
            ("not pinned", lane(0, 1, 1, None)),
        ] {
            assert_eq!(stranded(&info, Some(now)), None, "{case}");
        }
    }
}
