//! Read-modify-write of one record: compare-and-set on the revision read, retried with a
//! little random back-off when another writer won, so no update overwrites another.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{Bucket, Change, KvError};
use crate::retention::Retained;

impl Bucket {
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
}
