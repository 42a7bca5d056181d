//! Reads of many keys: those matching a filter (one server-side filtered consumer), the
//! newest first (by the stream's time index), or every value.

use serde::de::DeserializeOwned;

use super::{Bucket, KvError};

impl Bucket {
    /// The live keys matching `filter` (a key pattern with `*`/`>` wildcards) with their
    /// values, read by one server-side filtered consumer: its cost grows with the matches, not
    /// the bucket. Unreadable values are logged and skipped.
    pub async fn entries_matching<T: DeserializeOwned>(
        &self,
        filter: &str,
    ) -> Result<Vec<(String, T)>, KvError> {
        self.entries_written_since(filter, None).await
    }

    /// Like [`Bucket::entries_matching`], only the entries last written at or after `since`
    /// (found by the stream's time index: the cost follows those entries).
    pub async fn entries_written_since<T: DeserializeOwned>(
        &self,
        filter: &str,
        since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<Vec<(String, T)>, KvError> {
        use async_nats::jetstream::consumer::DeliverPolicy;
        let err = |e: async_nats::Error| self.nats("keys", filter, e);
        let deliver_policy = match since {
            None => DeliverPolicy::LastPerSubject,
            Some(t) => DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(
                    t.timestamp_nanos_opt().unwrap_or(0),
                ))
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
            },
        };
        let mut entries = Vec::new();
        let Some(mut messages) = self.ordered(filter, deliver_policy).await? else {
            return Ok(entries);
        };
        while let Some(m) = futures::StreamExt::next(&mut messages).await {
            let m = m.map_err(|e| err(e.into()))?;
            entries.extend(self.live_entry(&m));
            if m.info().map(|i| i.pending).unwrap_or(0) == 0 {
                break;
            }
        }
        Ok(entries)
    }

    /// The live records among the stream messages in `[lo, before)` (newest first), where
    /// `lo` is at most `window` sequences back: one ordered consumer reads that range and no
    /// more, so the cost follows the window, not the bucket. `filter` narrows the keys (a key
    /// pattern with `*`/`>` wildcards). Returns the records with their stream sequences and
    /// where an older window would end (`None`: nothing older is left).
    pub async fn newest<T: DeserializeOwned>(
        &self,
        filter: &str,
        before: Option<u64>,
        window: u64,
    ) -> Result<(Vec<(u64, String, T)>, Option<u64>), KvError> {
        use async_nats::jetstream::consumer::DeliverPolicy;
        let err = |e: async_nats::Error| self.nats("page", filter, e);
        let info = self
            .store
            .stream
            .clone()
            .info()
            .await
            .map_err(|e| err(e.into()))?
            .state
            .clone();
        let hi = before
            .map(|b| b.saturating_sub(1))
            .unwrap_or(info.last_sequence)
            .min(info.last_sequence);
        let first = info.first_sequence.max(1);
        if hi < first {
            return Ok((Vec::new(), None));
        }
        let lo = hi.saturating_sub(window.max(1) - 1).max(first);
        let next = (lo > first).then_some(lo);
        let mut out = Vec::new();
        let start = DeliverPolicy::ByStartSequence { start_sequence: lo };
        let Some(mut messages) = self.ordered(filter, start).await? else {
            return Ok((out, next));
        };
        while let Some(m) = futures::StreamExt::next(&mut messages).await {
            let m = m.map_err(|e| err(e.into()))?;
            let Ok(meta) = m.info() else { break };
            let (seq, pending) = (meta.stream_sequence, meta.pending);
            if seq > hi {
                break;
            }
            if let Some((key, v)) = self.live_entry(&m) {
                out.push((seq, key, v));
            }
            if pending == 0 || seq == hi {
                break;
            }
        }
        out.reverse();
        Ok((out, next))
    }

    /// An ordered consumer's messages over the keys matching `filter` from `deliver_policy`;
    /// `None` when nothing is there to read.
    async fn ordered(
        &self,
        filter: &str,
        deliver_policy: async_nats::jetstream::consumer::DeliverPolicy,
    ) -> Result<Option<async_nats::jetstream::consumer::pull::Ordered>, KvError> {
        use async_nats::jetstream::consumer::pull::OrderedConfig;
        let err = |e: async_nats::Error| self.nats("read", filter, e);
        let consumer = self
            .store
            .stream
            .create_consumer(OrderedConfig {
                filter_subject: format!("{}{filter}", self.store.prefix),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| err(e.into()))?;
        if consumer.cached_info().num_pending == 0 {
            return Ok(None);
        }
        let messages = consumer.messages().await.map_err(|e| err(e.into()))?;
        Ok(Some(messages))
    }

    /// A bucket stream message as a key and its value: `None` for a delete or purge marker and
    /// for a value this build cannot read (logged).
    fn live_entry<T: DeserializeOwned>(
        &self,
        m: &async_nats::jetstream::Message,
    ) -> Option<(String, T)> {
        let live = m
            .headers
            .as_ref()
            .and_then(|h| h.get("KV-Operation"))
            .is_none_or(|op| op.as_str() == "PUT");
        let key = m.subject.as_str().strip_prefix(&self.store.prefix)?;
        if !live {
            return None;
        }
        match self.decode(key, &m.payload) {
            Ok(v) => Some((key.to_string(), v)),
            Err(e) => {
                tracing::warn!(bucket = %self.name, %key, error = %e, "skipping unreadable record");
                None
            }
        }
    }

    /// Every live key's value (skipping unreadable ones, which are logged).
    pub async fn values<T: DeserializeOwned>(&self) -> Result<Vec<T>, KvError> {
        use futures::TryStreamExt;
        let keys: Vec<String> = match self.store.keys().await {
            Ok(k) => k
                .try_collect()
                .await
                .map_err(|e| self.nats("keys", "*", e))?,
            Err(e) => return Err(self.nats("keys", "*", e)),
        };
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            match self.get::<T>(&key).await {
                Ok(Some((v, _))) => out.push(v),
                Ok(None) => {}
                Err(KvError::Decode { .. }) => {
                    tracing::warn!(bucket = %self.name, %key, "skipping unreadable record")
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}
