//! Typed JSON access to KV buckets with revision compare-and-set, so every record update is
//! a read-modify-write that loses to a concurrent writer instead of overwriting it.

use std::time::Duration;

use async_nats::jetstream::kv::{Store, UpdateErrorKind};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::retention::Retained;

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("kv {op} {bucket}/{key}: {source}")]
    Nats {
        op: &'static str,
        bucket: String,
        key: String,
        source: async_nats::Error,
    },
    #[error("kv {bucket}/{key} holds a record this build cannot read: {source}")]
    Decode {
        bucket: String,
        key: String,
        source: serde_json::Error,
    },
    #[error("encode record for {bucket}/{key}: {source}")]
    Encode {
        bucket: String,
        key: String,
        source: serde_json::Error,
    },
    #[error("kv {bucket}/{key} changed under us {attempts} times in a row")]
    Contended {
        bucket: String,
        key: String,
        attempts: u32,
    },
}

/// A typed view of one bucket.
#[derive(Clone)]
pub struct Bucket {
    store: Store,
    name: String,
    /// Reads go to the stream's leader: the bucket has several copies, and a direct get may be
    /// answered by a follower that has not applied the latest acknowledged write yet (a record
    /// just created would read as absent, seen on a three-node cluster).
    leader_reads: bool,
    /// Finished records are written with this TTL (see `retention`).
    finished_ttl: Option<Duration>,
    /// Writes carrying a TTL are published here (the store has no public TTL update).
    js: async_nats::jetstream::Context,
}

/// A key's last entry: a value, or the marker of its delete or purge, with its revision.
enum Last {
    Value(bytes::Bytes, u64),
    Removed(u64),
}

/// What a compare-and-set closure decides for the current value.
pub enum Change<T> {
    Write(T),
    Keep,
}

impl Bucket {
    pub fn new(store: Store, name: &str, js: async_nats::jetstream::Context) -> Self {
        let config = &store.stream.cached_info().config;
        let leader_reads = config.num_replicas > 1;
        let finished_ttl = crate::retention::finished_ttl(config);
        Self {
            store,
            name: name.to_string(),
            leader_reads,
            finished_ttl,
            js,
        }
    }

    /// Writes `bytes` at `key`: if `expected` is given, only over that revision (0: only if
    /// absent); `Ok(None)` when that lost. A finished record carries the bucket's TTL.
    async fn write(
        &self,
        op: &'static str,
        key: &str,
        bytes: bytes::Bytes,
        expected: Option<u64>,
        finished: bool,
    ) -> Result<Option<u64>, KvError> {
        let Some(ttl) = self.finished_ttl.filter(|_| finished) else {
            let written = match expected {
                None => self
                    .store
                    .put(key, bytes)
                    .await
                    .map_err(|e| self.nats(op, key, e)),
                Some(rev) => match self.store.update(key, bytes, rev).await {
                    Ok(rev) => Ok(rev),
                    Err(e)
                        if e.kind() == UpdateErrorKind::WrongLastRevision
                            || crate::js_codes::is_wrong_last_sequence(&e) =>
                    {
                        return Ok(None)
                    }
                    Err(e) => Err(self.nats(op, key, e)),
                },
            };
            return written.map(Some);
        };
        use async_nats::header::{
            HeaderValue, NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, NATS_MESSAGE_TTL,
        };
        use async_nats::jetstream::context::PublishErrorKind;
        let mut headers = async_nats::HeaderMap::new();
        if let Some(rev) = expected {
            headers.insert(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE, HeaderValue::from(rev));
        }
        headers.insert(NATS_MESSAGE_TTL, HeaderValue::from(ttl.as_secs().max(1)));
        let subject = format!(
            "{}{key}",
            self.store.put_prefix.as_ref().unwrap_or(&self.store.prefix)
        );
        let acked = match self.js.publish_with_headers(subject, headers, bytes).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match acked {
            Ok(ack) => Ok(Some(ack.sequence)),
            Err(e)
                if e.kind() == PublishErrorKind::WrongLastSequence
                    || crate::js_codes::is_wrong_last_sequence(&e) =>
            {
                Ok(None)
            }
            Err(e) => Err(self.nats(op, key, e)),
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    fn nats(&self, op: &'static str, key: &str, source: impl Into<async_nats::Error>) -> KvError {
        KvError::Nats {
            op,
            bucket: self.name.clone(),
            key: key.to_string(),
            source: source.into(),
        }
    }

    fn decode<T: DeserializeOwned>(&self, key: &str, bytes: &[u8]) -> Result<T, KvError> {
        serde_json::from_slice(bytes).map_err(|source| KvError::Decode {
            bucket: self.name.clone(),
            key: key.to_string(),
            source,
        })
    }

    fn encode<T: Serialize>(&self, key: &str, value: &T) -> Result<bytes::Bytes, KvError> {
        serde_json::to_vec(value)
            .map(bytes::Bytes::from)
            .map_err(|source| KvError::Encode {
                bucket: self.name.clone(),
                key: key.to_string(),
                source,
            })
    }

    /// The value and its revision; `None` when absent or deleted.
    ///
    /// Read-your-writes: what this process (or any other) wrote and had acknowledged is seen,
    /// also on a replicated bucket (see `leader_reads`).
    pub async fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<(T, u64)>, KvError> {
        match self.last(key).await? {
            Some(Last::Value(value, revision)) => Ok(Some((self.decode(key, &value)?, revision))),
            _ => Ok(None),
        }
    }

    /// The key's last entry: from the stream's leader on a replicated bucket (`STREAM.MSG.GET`,
    /// which only the leader answers), else by direct get.
    async fn last(&self, key: &str) -> Result<Option<Last>, KvError> {
        if !self.leader_reads {
            let entry = self
                .store
                .entry(key)
                .await
                .map_err(|e| self.nats("get", key, e))?;
            return Ok(entry.map(|e| match e.operation {
                async_nats::jetstream::kv::Operation::Put => Last::Value(e.value, e.revision),
                _ => Last::Removed(e.revision),
            }));
        }
        use async_nats::jetstream::stream::LastRawMessageErrorKind;
        let subject = format!("{}{}", self.store.prefix, key);
        let message = match self
            .store
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
            Err(e) => return Err(self.nats("get", key, e)),
        };
        // A delete or purge is a marker message: the `KV-Operation` header (or, for a marker
        // the server wrote, `Nats-Marker-Reason`) says so; a plain value carries neither.
        let removed = message
            .headers
            .get("KV-Operation")
            .is_some_and(|op| op.as_str() != "PUT")
            || message.headers.get("Nats-Marker-Reason").is_some();
        Ok(Some(if removed {
            Last::Removed(message.sequence)
        } else {
            Last::Value(message.payload, message.sequence)
        }))
    }

    pub async fn put<T: Serialize + Retained>(&self, key: &str, value: &T) -> Result<u64, KvError> {
        let bytes = self.encode(key, value)?;
        let written = self
            .write("put", key, bytes, None, value.finished())
            .await?;
        written.ok_or_else(|| self.nats("put", key, "a write without a condition was refused"))
    }

    /// Writes only if the key does not exist (or was deleted); `Ok(None)` when it already did.
    ///
    /// A write refused for its expected revision means something is there: the current entry
    /// (read from the leader on a replicated bucket) tells a value (`None`) from a delete
    /// marker, which is written over at its revision. Any other failure is the caller's to
    /// retry (API callers see it as `unavailable`).
    pub async fn create<T: Serialize + Retained>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<Option<u64>, KvError> {
        const ATTEMPTS: u32 = 5;
        let bytes = self.encode(key, value)?;
        let finished = value.finished();
        let mut expected = 0;
        for attempt in 1..=ATTEMPTS {
            let written = self
                .write("create", key, bytes.clone(), Some(expected), finished)
                .await?;
            if let Some(rev) = written {
                return Ok(Some(rev));
            }
            match self.last(key).await? {
                Some(Last::Value(_, _)) => return Ok(None),
                Some(Last::Removed(revision)) => expected = revision,
                // Absent again: purged meanwhile (or, on a bucket read by direct get, a
                // lagging read): try again from scratch, briefly.
                None => {
                    expected = 0;
                    tokio::time::sleep(std::time::Duration::from_millis(10 * u64::from(attempt)))
                        .await;
                }
            }
        }
        // The stream keeps saying something is there; only the read disagrees.
        Ok(None)
    }

    /// Writes only if the key is still at `revision`; `Ok(None)` when someone wrote first.
    pub async fn update<T: Serialize + Retained>(
        &self,
        key: &str,
        value: &T,
        revision: u64,
    ) -> Result<Option<u64>, KvError> {
        let bytes = self.encode(key, value)?;
        self.write("update", key, bytes, Some(revision), value.finished())
            .await
    }

    /// Deletes the key only if it is still at `revision`; `Ok(false)` when someone wrote first.
    pub async fn delete_at(&self, key: &str, revision: u64) -> Result<bool, KvError> {
        match self.store.delete_expect_revision(key, Some(revision)).await {
            Ok(()) => Ok(true),
            Err(e)
                if e.kind() == async_nats::jetstream::kv::DeleteErrorKind::WrongLastRevision
                    || crate::js_codes::is_wrong_last_sequence(&e) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.nats("delete", key, e)),
        }
    }

    /// Removes the entry written at `revision` if it is still the key's value, leaving no
    /// removal behind it: the key is absent afterwards, so the next [`Bucket::create`] is one
    /// round trip (over a removal marker it costs two). `Ok(false)` when that entry is gone
    /// already (overwritten, or removed). Only for buckets whose stream allows message deletes
    /// (the deliveries bucket), and for keys nobody watches: no watcher sees this removal.
    pub async fn remove_revision(&self, key: &str, revision: u64) -> Result<bool, KvError> {
        use crate::removal::{remove, Removed};
        match remove(&self.js, &self.store.stream_name, revision)
            .await
            .map_err(|e| self.nats("remove", key, e))?
        {
            Removed::Now => Ok(true),
            Removed::Already => Ok(false),
            // A bucket an older build provisioned (until `provision` runs again): removed as
            // a KV delete, leaving its marker.
            Removed::Denied => {
                tracing::debug!(bucket = %self.name, "stream denies message deletes; deleting through the KV");
                self.delete_at(key, revision).await
            }
        }
    }

    /// Read-modify-write with retries on conflict. `f` sees the current value (or `None`) and
    /// decides; returns the value that is stored afterwards.
    pub async fn modify<T, F>(&self, key: &str, f: F) -> Result<Option<T>, KvError>
    where
        T: Serialize + DeserializeOwned + Retained,
        F: FnMut(Option<&T>) -> Change<T>,
    {
        self.modify_from(key, None, f).await
    }

    /// Edits an existing record in place with `f` (compare-and-set, retried on conflict); writes
    /// only if `f` changed it. Returns the record stored afterwards, `None` if there is none.
    pub async fn edit<T, F>(&self, key: &str, f: F) -> Result<Option<T>, KvError>
    where
        T: Serialize + DeserializeOwned + Retained + Clone + PartialEq,
        F: Fn(&mut T),
    {
        self.modify::<T, _>(key, |cur| match cur {
            Some(r) => {
                let mut next = r.clone();
                f(&mut next);
                if next == *r {
                    Change::Keep
                } else {
                    Change::Write(next)
                }
            }
            None => Change::Keep,
        })
        .await
    }

    /// Like [`Bucket::modify`], starting from a value and revision the caller already holds
    /// (saving a read on the hot path); falls back to reading on a conflict.
    pub async fn modify_from<T, F>(
        &self,
        key: &str,
        known: Option<(T, u64)>,
        f: F,
    ) -> Result<Option<T>, KvError>
    where
        T: Serialize + DeserializeOwned + Retained,
        F: FnMut(Option<&T>) -> Change<T>,
    {
        Ok(self.modify_at(key, known, f).await?.map(|(v, _)| v))
    }

    /// [`Bucket::modify_from`], also returning the revision the record is stored at
    /// afterwards, so the caller can write it again without a read.
    pub async fn modify_at<T, F>(
        &self,
        key: &str,
        mut known: Option<(T, u64)>,
        mut f: F,
    ) -> Result<Option<(T, u64)>, KvError>
    where
        T: Serialize + DeserializeOwned + Retained,
        F: FnMut(Option<&T>) -> Change<T>,
    {
        const ATTEMPTS: u32 = 16;
        let mut attempt = 0u64;
        for _ in 0..ATTEMPTS {
            let current = match known.take() {
                Some(k) => Some(k),
                None => self.get::<T>(key).await?,
            };
            let change = f(current.as_ref().map(|(v, _)| v));
            let next = match change {
                Change::Keep => return Ok(current),
                Change::Write(next) => next,
            };
            let written = match &current {
                Some((_, rev)) => self.update(key, &next, *rev).await?,
                None => self.create(key, &next).await?,
            };
            if let Some(rev) = written {
                return Ok(Some((next, rev)));
            }
            attempt += 1;
            // Lost to another writer: back off a little, randomly, so contenders spread out.
            let jitter = u64::from(uuid::Uuid::new_v4().as_bytes()[0]) % (attempt * 4);
            tokio::time::sleep(std::time::Duration::from_millis(jitter)).await;
        }
        Err(KvError::Contended {
            bucket: self.name.clone(),
            key: key.to_string(),
            attempts: ATTEMPTS,
        })
    }

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
