//! Which host a new session goes to (the live host with the fewest active sessions, unless
//! the caller pinned one), and the host list (`turnstile host list`).

use std::sync::Arc;

use turnstile_shared::api::{ApiError, ErrorCode};
use turnstile_shared::records::HostRecord;
use turnstile_shared::HostName;

use crate::ctx::Ctx;

pub(super) async fn live_hosts(ctx: &Ctx) -> Result<Vec<HostRecord>, ApiError> {
    // The hosts bucket's age limit is the host TTL it was provisioned with.
    let ttl = ctx
        .buckets
        .hosts
        .store()
        .stream
        .cached_info()
        .config
        .max_age;
    let ttl = if ttl.is_zero() {
        ctx.topology.host_ttl
    } else {
        ttl
    };
    if let Some(hosts) = ctx.placement.live(ttl) {
        return Ok(hosts);
    }
    // Until the watch has caught up (a replica just started).
    ctx.buckets
        .hosts
        .values::<HostRecord>()
        .await
        .map_err(ApiError::from)
}

/// The live host with the fewest active sessions, unless the caller pinned one.
pub(super) async fn place(ctx: &Ctx, pinned: Option<HostName>) -> Result<HostName, ApiError> {
    let hosts = live_hosts(ctx).await?;
    if let Some(h) = pinned {
        if hosts.iter().any(|r| r.name == h) {
            return Ok(h);
        }
        return Err(ApiError::new(
            ErrorCode::NoHost,
            format!("host {h} is not heartbeating; start `turnstile-transport-agent --host {h}`"),
        ));
    }
    hosts
        .into_iter()
        .map(|h| (ctx.placement.count(&h.name), h.name))
        .min()
        .map(|(_, h)| h)
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::NoHost,
                "no transport host is heartbeating; start `turnstile-transport-agent --host NAME`",
            )
        })
}

/// Live hosts with their active sessions (`turnstile host list`).
pub(in crate::api) async fn hosts(
    ctx: Arc<Ctx>,
    _req: turnstile_shared::api::ListHosts,
) -> Result<Vec<turnstile_shared::api::HostView>, ApiError> {
    let mut live = live_hosts(&ctx).await?;
    live.sort_by(|a, b| a.name.cmp(&b.name));
    // The supervisor follows every session: its placement map answers without a store read.
    Ok(live
        .into_iter()
        .map(|h| turnstile_shared::api::HostView {
            sessions: ctx.placement.sessions_on(&h.name),
            host: h,
        })
        .collect())
}
