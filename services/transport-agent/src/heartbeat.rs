//! Registers this host and keeps its record alive in the TTL'd hosts bucket; a host that stops
//! heartbeating drops out by itself, which is how others learn it is gone.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnstile_shared::events::{self, host_event, EventKind};
use turnstile_shared::records::HostRecord;

use crate::ctx::{Ctx, Error};

/// How soon a heartbeat that failed is tried again: the moment the connection is back (on
/// another node after a partition), the host is alive again, well inside its TTL.
const RETRY: Duration = Duration::from_millis(500);

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    let host = ctx.config.host.clone();
    let started_at = Utc::now();
    // Five beats per TTL, each bounded by the period: a beat lost with a dead connection is
    // retried on the new one instead of waiting out the JetStream timeout.
    let period = (ctx.config.topology.host_ttl / 5).max(Duration::from_millis(200));
    let mut next = Instant::now();
    let mut announced = false;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep_until(next) => {}
        }
        let record = HostRecord {
            name: host.clone(),
            started_at,
            heartbeat_at: Utc::now(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let beat = tokio::time::timeout(period, ctx.buckets.hosts.put(host.as_str(), &record));
        next = match beat.await {
            Ok(Ok(_)) => {
                if !announced {
                    announced = true;
                    announce(&ctx, &host, started_at).await;
                }
                Instant::now() + period
            }
            Ok(Err(e)) => {
                tracing::warn!(%host, error = %e, "heartbeat; retrying");
                Instant::now() + RETRY
            }
            Err(_) => {
                tracing::warn!(%host, "heartbeat not acknowledged within {period:?}; retrying");
                Instant::now() + RETRY
            }
        };
    }
    // Leaving on purpose: say so at once rather than letting the TTL run out.
    let _ = ctx.buckets.hosts.store().delete(host.as_str()).await;
    Ok(())
}

async fn announce(ctx: &Ctx, host: &turnstile_shared::HostName, started_at: chrono::DateTime<Utc>) {
    if let Ok(ev) = host_event(
        EventKind::HostUp,
        host,
        &json!({ "started_at": started_at }),
    ) {
        let _ = events::publish(&ctx.js, &ev).await;
    }
}
