//! The one loop behind a service's watches of a bucket's new writes (the session-lane's
//! `turn_watch`, `ended_view`, `orphan_runs`; the broker's `orphan_steps`): watch until cancelled, re-watch after an interruption (500 ms apart while
//! the watch cannot be made), and tell the follower each entry and when the watch goes up or
//! down. Writes made while it is down are missed: each follower has a fallback (a turn's
//! outcome is also read on the progress tick; an end not seen is read from the registry).

use std::time::Duration;

use crate::kv::Bucket;
use async_nats::jetstream::kv::Entry;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// What a follower is told.
pub enum Watched<'a> {
    /// The watch is made: writes from now on are seen.
    Up,
    Entry(&'a Entry),
    /// The watch was interrupted (or cancelled): writes until the next `Up` are missed.
    Down,
}

/// Follows `bucket`'s new writes until `cancel`; `name` is the bucket as logs name it.
pub async fn follow_new(
    bucket: Bucket,
    name: &'static str,
    cancel: CancellationToken,
    mut on: impl FnMut(Watched<'_>),
) {
    loop {
        let mut watch = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            w = bucket.store().watch_all() => match w {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(bucket = name, error = %e, "watch bucket; retrying");
                    sleep_or_cancel(&cancel, Duration::from_millis(500)).await;
                    continue;
                }
            },
        };
        on(Watched::Up);
        loop {
            let entry = tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    on(Watched::Down);
                    return;
                }
                e = watch.next() => e,
            };
            match entry {
                Some(Ok(entry)) => on(Watched::Entry(&entry)),
                Some(Err(e)) => {
                    tracing::warn!(bucket = name, error = %e, "bucket watch interrupted; re-watching");
                    break;
                }
                None => break,
            }
        }
        on(Watched::Down);
    }
}

/// Sleeps for `d`, or until `cancel`.
pub async fn sleep_or_cancel(cancel: &CancellationToken, d: Duration) {
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = tokio::time::sleep(d) => {}
    }
}
