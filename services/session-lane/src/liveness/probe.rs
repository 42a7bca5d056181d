//! Asking the server whether a peer replica's connection is still there.
//!
//! Every replica answers requests on its own ping subject (`subjects::replica_ping`),
//! subscribed before it announces itself. When a replica's process dies, the kernel closes its
//! TCP connection at once and the server drops its subscriptions: a request to its ping
//! subject then fails at once with *no responders* (the server's own answer, through any node
//! of a cluster, as soon as the interest is gone). A paused or partitioned replica keeps its
//! connection and subscription: the request just times out, and only silence judges it (the
//! slower path of `liveness`).
//!
//! No responders alone is not death: a live replica whose NATS node died has no subscription
//! until it reconnects. So the fast path also needs the peer's renewals to have stopped for
//! longer than its lease (`Timing::gone_after`): a replica that reconnects in time renews and
//! is left alone; one that does not cannot act on its lapsed lease and is fenced by its next
//! renewal.

use std::time::Duration;

use async_nats::{Client, RequestErrorKind};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::subjects;

/// What one probe of a peer found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The peer answered: alive and connected.
    Answered,
    /// The server knows nobody on the peer's ping subject: its connection is gone.
    Gone,
    /// No answer in time, or this replica could not ask (its own connection is down): says
    /// nothing either way.
    Unknown,
}

/// Subscribes this instance's ping subject (before the instance announces itself, so a peer
/// never finds it missing) and answers every ping until `stop`.
pub(crate) async fn answer(
    client: &Client,
    instance: &str,
    stop: CancellationToken,
) -> Result<(), async_nats::SubscribeError> {
    let mut pings = client.subscribe(subjects::replica_ping(instance)).await?;
    let client = client.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                ping = pings.next() => match ping {
                    Some(ping) => {
                        if let Some(reply) = ping.reply {
                            if let Err(e) = client.publish(reply, bytes::Bytes::new()).await {
                                tracing::debug!(error = %e, "answer a liveness ping");
                            }
                        }
                    }
                    None => break,
                },
            }
        }
        let _ = pings.unsubscribe().await;
    });
    Ok(())
}

/// Asks whether `instance` is connected, waiting at most `wait` for its answer.
pub(crate) async fn ask(client: &Client, instance: &str, wait: Duration) -> Probe {
    let request = async_nats::Request::new()
        .payload(bytes::Bytes::new())
        .timeout(Some(wait));
    match client
        .send_request(subjects::replica_ping(instance), request)
        .await
    {
        Ok(_) => Probe::Answered,
        Err(e) if e.kind() == RequestErrorKind::NoResponders => Probe::Gone,
        Err(_) => Probe::Unknown,
    }
}
