//! One subscription to the lifecycle events (`ts.events.>`) shared by every open page: each
//! event goes out once to all of them through a broadcast channel. Core NATS delivers events
//! only while connected, so when the connection comes back the feed tells every page to
//! `Resync` (take a fresh snapshot) rather than go on with a gap.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use turnstile_shared::subjects;

/// Events a page may fall behind by before it is told to resync.
const BACKLOG: usize = 4096;
/// How often the connection's reconnect count is looked at (a local counter, not a read).
const RECONNECT_CHECK: Duration = Duration::from_secs(1);

/// What every page receives.
#[derive(Debug, Clone)]
pub enum Feed {
    /// One lifecycle event, as JSON with any token removed.
    Event(Arc<str>),
    /// Events may have been missed (the NATS connection came back): start over.
    Resync,
}

/// Subscribes now (so nothing published after this returns is missed by a page that
/// subscribes to the sender before it takes its snapshot) and forwards until `shutdown`.
pub async fn start(
    client: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<broadcast::Sender<Feed>, async_nats::SubscribeError> {
    let sub = client.subscribe(subjects::EVENTS_ALL).await?;
    let (tx, _) = broadcast::channel(BACKLOG);
    tokio::spawn(forward(client, sub, tx.clone(), shutdown));
    Ok(tx)
}

async fn forward(
    client: async_nats::Client,
    mut sub: async_nats::Subscriber,
    tx: broadcast::Sender<Feed>,
    shutdown: CancellationToken,
) {
    let mut connects = client
        .statistics()
        .connects
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut tick = tokio::time::interval(RECONNECT_CHECK);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            msg = sub.next() => match msg {
                Some(msg) => {
                    if let Some(event) = clean(&msg.payload) {
                        // No page open is not an error.
                        let _ = tx.send(Feed::Event(event));
                    }
                }
                None => {
                    tracing::warn!("event subscription ended");
                    let _ = tx.send(Feed::Resync);
                    return;
                }
            },
            _ = tick.tick() => {
                let now = client.statistics().connects.load(std::sync::atomic::Ordering::Relaxed);
                if now != connects {
                    connects = now;
                    tracing::info!("NATS connection re-established; pages resync");
                    let _ = tx.send(Feed::Resync);
                }
            }
        }
    }
}

/// The event as the page gets it: one line of JSON, tokens removed; `None` when it is not
/// JSON (the page would not read it; `turnstile events` shows such messages raw).
fn clean(payload: &[u8]) -> Option<Arc<str>> {
    let mut value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    super::snapshot::redact(&mut value);
    Some(Arc::from(value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_reach_pages_as_one_line_without_tokens() {
        let line = clean(
            br#"{"v":1,"type":"auth.refused",
            "data":{"token":"secret","reason":"wrong"}}"#,
        )
        .expect("json");
        assert!(!line.contains('\n') && !line.contains("secret"), "{line}");
        assert!(clean(b"not json").is_none());
    }
}
