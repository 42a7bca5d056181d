//! Typed JSON access to KV buckets with revision compare-and-set, so every record update is
//! a read-modify-write that loses to a concurrent writer instead of overwriting it.

use async_nats::jetstream::kv::{Store, UpdateErrorKind};
use serde::de::DeserializeOwned;
use serde::Serialize;

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
    pub fn new(store: Store, name: &str) -> Self {
        let leader_reads = store.stream.cached_info().config.num_replicas > 1;
        Self {
            store,
            name: name.to_string(),
            leader_reads,
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

    pub async fn put<T: Serialize>(&self, key: &str, value: &T) -> Result<u64, KvError> {
        let bytes = self.encode(key, value)?;
        self.store
            .put(key, bytes)
            .await
            .map_err(|e| self.nats("put", key, e))
    }

    /// Writes only if the key does not exist (or was deleted); `Ok(None)` when it already did.
    ///
    /// A write refused for its expected revision means something is there: the current entry
    /// (read from the leader on a replicated bucket) tells a value (`None`) from a delete
    /// marker, which is written over at its revision. Any other failure is the caller's to
    /// retry (API callers see it as `unavailable`).
    pub async fn create<T: Serialize>(&self, key: &str, value: &T) -> Result<Option<u64>, KvError> {
        const ATTEMPTS: u32 = 5;
        let bytes = self.encode(key, value)?;
        let mut expected = 0;
        for attempt in 1..=ATTEMPTS {
            match self.store.update(key, bytes.clone(), expected).await {
                Ok(rev) => return Ok(Some(rev)),
                Err(e)
                    if e.kind() == UpdateErrorKind::WrongLastRevision
                        || crate::js_codes::is_wrong_last_sequence(&e) => {}
                Err(e) => return Err(self.nats("create", key, e)),
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
    pub async fn update<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: u64,
    ) -> Result<Option<u64>, KvError> {
        let bytes = self.encode(key, value)?;
        match self.store.update(key, bytes, revision).await {
            Ok(rev) => Ok(Some(rev)),
            Err(e)
                if e.kind() == UpdateErrorKind::WrongLastRevision
                    || crate::js_codes::is_wrong_last_sequence(&e) =>
            {
                Ok(None)
            }
            Err(e) => Err(self.nats("update", key, e)),
        }
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

    /// Read-modify-write with retries on conflict. `f` sees the current value (or `None`) and
    /// decides; returns the value that is stored afterwards.
    pub async fn modify<T, F>(&self, key: &str, f: F) -> Result<Option<T>, KvError>
    where
        T: Serialize + DeserializeOwned,
        F: FnMut(Option<&T>) -> Change<T>,
    {
        self.modify_from(key, None, f).await
    }

    /// Edits an existing record in place with `f` (compare-and-set, retried on conflict); writes
    /// only if `f` changed it. Returns the record stored afterwards, `None` if there is none.
    pub async fn edit<T, F>(&self, key: &str, f: F) -> Result<Option<T>, KvError>
    where
        T: Serialize + DeserializeOwned + Clone + PartialEq,
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
        mut known: Option<(T, u64)>,
        mut f: F,
    ) -> Result<Option<T>, KvError>
    where
        T: Serialize + DeserializeOwned,
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
                Change::Keep => return Ok(current.map(|(v, _)| v)),
                Change::Write(next) => next,
            };
            let written = match &current {
                Some((_, rev)) => self.update(key, &next, *rev).await?,
                None => self.create(key, &next).await?,
            };
            if written.is_some() {
                return Ok(Some(next));
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
        use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
        let err = |e: async_nats::Error| self.nats("keys", filter, e);
        let consumer = self
            .store
            .stream
            .create_consumer(OrderedConfig {
                filter_subject: format!("{}{filter}", self.store.prefix),
                deliver_policy: DeliverPolicy::LastPerSubject,
                ..Default::default()
            })
            .await
            .map_err(|e| err(e.into()))?;
        let mut entries = Vec::new();
        if consumer.cached_info().num_pending == 0 {
            return Ok(entries);
        }
        let mut messages = consumer
            .clone()
            .messages()
            .await
            .map_err(|e| err(e.into()))?;
        while let Some(m) = futures::StreamExt::next(&mut messages).await {
            let m = m.map_err(|e| err(e.into()))?;
            let live = m
                .headers
                .as_ref()
                .and_then(|h| h.get("KV-Operation"))
                .is_none_or(|op| op.as_str() == "PUT");
            let key = m.subject.as_str().strip_prefix(&self.store.prefix);
            if let (true, Some(key)) = (live, key) {
                match self.decode(key, &m.payload) {
                    Ok(v) => entries.push((key.to_string(), v)),
                    Err(e) => {
                        tracing::warn!(bucket = %self.name, %key, error = %e, "skipping unreadable record")
                    }
                }
            }
            if m.info().map(|i| i.pending).unwrap_or(0) == 0 {
                break;
            }
        }
        Ok(entries)
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
