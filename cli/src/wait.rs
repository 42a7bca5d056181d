//! Waiting for a record to end, the one way `run start --wait` and `session send --wait` do it:
//! a watch of its key (prompt), and a direct read every few seconds (sure). A watch is an
//! ephemeral consumer: it can break when its stream's leader moves, fail to be created, or
//! stall without a word while a cluster counts a dead server as alive (for a minute or two);
//! a direct read is answered by any server holding a copy.

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::kv::{Store, Watch};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use turnstile_shared::retry::Backoff;

/// How often the record is read directly besides being watched.
const POLL: Duration = Duration::from_secs(2);
/// How a broken or refused watch is made again.
const WATCH_RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// A wait on one key of a bucket, set up before the request that writes it.
pub(crate) struct RecordWait {
    kv: Store,
    key: String,
    watch: Option<Watch>,
}

impl RecordWait {
    /// Opens `bucket` and watches `key` if it can (a watch refused now is retried later).
    pub async fn start(
        client: &async_nats::Client,
        bucket: &str,
        key: &str,
    ) -> anyhow::Result<Self> {
        let js = async_nats::jetstream::new(client.clone());
        let kv = js
            .get_key_value(bucket)
            .await
            .with_context(|| format!("open bucket {bucket}"))?;
        let watch = kv.watch_with_history(key).await.ok();
        Ok(Self {
            kv,
            key: key.to_string(),
            watch,
        })
    }

    /// The record once `ended` holds for it. Runs until then: bound it with a timeout.
    pub async fn until<T: DeserializeOwned>(mut self, ended: impl Fn(&T) -> bool) -> T {
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut delays = WATCH_RETRY.delays();
        let mut retry_at = tokio::time::Instant::now();
        loop {
            if self.watch.is_none() && tokio::time::Instant::now() >= retry_at {
                match self.kv.watch_with_history(self.key.as_str()).await {
                    Ok(w) => self.watch = Some(w),
                    Err(e) => {
                        eprintln!("watch {} again: {e}", self.key);
                        retry_at = tokio::time::Instant::now() + delays.next().unwrap_or(POLL);
                    }
                }
            }
            let entry = tokio::select! {
                e = async {
                    match self.watch.as_mut() {
                        Some(w) => w.next().await,
                        None => std::future::pending().await,
                    }
                } => e,
                _ = poll.tick() => {
                    if let Some(r) = self.read(&ended).await {
                        return r;
                    }
                    continue;
                }
            };
            match entry {
                Some(Ok(entry)) => {
                    if let Some(r) = serde_json::from_slice::<T>(&entry.value)
                        .ok()
                        .filter(|r| ended(r))
                    {
                        return r;
                    }
                }
                Some(Err(e)) => {
                    eprintln!("watch of {} interrupted ({e}); watching again", self.key);
                    self.watch = None;
                }
                None => self.watch = None,
            }
        }
    }

    async fn read<T: DeserializeOwned>(&self, ended: &impl Fn(&T) -> bool) -> Option<T> {
        let bytes = self.kv.get(self.key.as_str()).await.ok()??;
        serde_json::from_slice::<T>(&bytes)
            .ok()
            .filter(|r| ended(r))
    }
}
