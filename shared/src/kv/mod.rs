//! Typed JSON access to KV buckets with revision compare-and-set, so every record update is
//! a read-modify-write that loses to a concurrent writer instead of overwriting it.
//!
//! `mod.rs` holds the bucket and its single-key reads and writes, `modify.rs` the
//! read-modify-write loop, `scan.rs` the reads of many keys (filtered, newest first, all).

use std::time::Duration;

use async_nats::jetstream::kv::{Store, UpdateErrorKind};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::retention::Retained;

mod modify;
mod scan;

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
}
