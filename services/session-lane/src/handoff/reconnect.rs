//! Waits for a reply that a reconnect cuts short. A request whose reply was lost with its
//! connection (the server died between taking the request and answering it) would be waited
//! for until the JetStream request timeout, 5 s, although the client reconnected long
//! before: a lane finishing a turn at that instant held its session that long. Here such a
//! wait ends as soon as the replica's [`crate::lane::PullHub`] sees the reconnect, and the
//! caller goes on as for any unconfirmed ack. Not sent again: a restarted server that lost
//! the ack with its consumer state redelivers the item, and gives no answer to an ack of the
//! earlier delivery; the lane keeps that redelivery and finishes the item through it
//! (`lane::run_lane`).

use async_nats::jetstream;
use tokio::sync::watch;

use crate::ctx::Ctx;

/// Why a wait for a reply ended without one.
#[derive(Debug, thiserror::Error)]
#[error("the connection was made again while waiting; its reply was lost with the old one")]
pub(crate) struct Reconnected;

/// `double_ack`, unless the connection is made again while it waits.
pub(crate) async fn double_ack(
    ctx: &Ctx,
    msg: &jetstream::Message,
) -> Result<(), async_nats::Error> {
    // Never for a lane this replica may have lost (`liveness::lease`).
    ctx.lease.hold().await?;
    let reconnects = ctx.pulls.reconnects();
    match unless_reconnected(reconnects, msg.double_ack()).await {
        Some(acked) => acked,
        None => Err(Box::new(Reconnected)),
    }
}

/// `reply`, or `None` if the connection was made again since `reconnects` was taken (before
/// the request was sent): its reply is lost. A fresh receiver has seen the current count, so
/// a reconnect between taking it and this wait still counts (not marked seen here).
pub(crate) async fn unless_reconnected<T>(
    mut reconnects: watch::Receiver<u64>,
    reply: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        r = reply => Some(r),
        Ok(()) = reconnects.changed() => None,
    }
}
