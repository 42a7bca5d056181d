//! Registers this host and keeps its record alive in the TTL'd hosts bucket; a host that stops
//! heartbeating drops out by itself, which is how others learn it is gone.

use std::sync::Arc;

use chrono::Utc;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::events::{self, host_event, EventKind};
use turnstile_shared::records::HostRecord;

use crate::{Ctx, Error};

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    let host = ctx.config.host.clone();
    let started_at = Utc::now();
    let period = (ctx.config.topology.host_ttl / 3).max(std::time::Duration::from_millis(200));
    let mut tick = tokio::time::interval(period);
    let mut announced = false;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {
                let record = HostRecord {
                    name: host.clone(),
                    started_at,
                    heartbeat_at: Utc::now(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                };
                match ctx.buckets.hosts.put(host.as_str(), &record).await {
                    Ok(_) if !announced => {
                        announced = true;
                        if let Ok(ev) = host_event(EventKind::HostUp, &host, &json!({ "started_at": started_at })) {
                            let _ = events::publish(&ctx.js, &ev).await;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(%host, error = %e, "heartbeat"),
                }
            }
        }
    }
    // Leaving on purpose: say so at once rather than letting the TTL run out.
    let _ = ctx.buckets.hosts.store().delete(host.as_str()).await;
    Ok(())
}
