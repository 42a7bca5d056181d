//! The watch of `ts_hosts` that keeps this replica's `Placement` up to date. Apart from
//! `placement.rs` because it runs on `Ctx`, which holds the `Placement`: the type stays a leaf
//! that `ctx.rs` imports, and this file imports `ctx.rs`.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::records::HostRecord;

use crate::ctx::Ctx;
use turnstile_shared::bucket_watch::sleep_or_cancel;

/// How often `turnstile_hosts_alive` is brought up to date (a host lapses without an entry).
const HOSTS_GAUGE_PERIOD: Duration = Duration::from_secs(1);

/// Follows `ts_hosts` into `ctx.placement` until `shutdown`.
pub(crate) async fn watch_hosts(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    loop {
        let mut watch = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            w = ctx.buckets.hosts.store().watch_with_history(">") => match w {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "watch hosts bucket; retrying");
                    sleep_or_cancel(&shutdown, Duration::from_millis(500)).await;
                    continue;
                }
            },
        };
        let mut gauge = tokio::time::interval(HOSTS_GAUGE_PERIOD);
        loop {
            let entry = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                e = watch.next() => e,
                _ = gauge.tick() => {
                    if let Some(n) = ctx.placement.live_count(ctx.topology.host_ttl) {
                        turnstile_shared::metrics::metrics().hosts_alive.set(n as i64);
                    }
                    continue;
                }
            };
            match entry {
                Some(Ok(e)) => match e.operation {
                    Operation::Put => match serde_json::from_slice::<HostRecord>(&e.value) {
                        Ok(r) => {
                            let at = DateTime::from_timestamp(
                                e.created.unix_timestamp(),
                                e.created.nanosecond(),
                            )
                            .unwrap_or_else(Utc::now);
                            ctx.placement.heartbeat(r, at, e.delta == 0);
                        }
                        Err(err) => {
                            tracing::warn!(key = %e.key, error = %err, "unreadable host record")
                        }
                    },
                    Operation::Delete | Operation::Purge => ctx.placement.forget(&e.key),
                },
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "hosts watch interrupted; re-watching");
                    break;
                }
                None => break,
            }
        }
    }
}
