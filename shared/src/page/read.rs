//! Checking a page request and reading one page of a bucket: apart from the types in
//! `page.rs` because it answers with `api::ApiError`, while `api.rs`'s list requests embed
//! `PageRequest` (so `api.rs` needs `page.rs`, and only this file needs `api.rs`).

use crate::api::ApiError;
use crate::kv::Bucket;

use super::{Page, PageRequest, DEFAULT_LIMIT, MAX_LIMIT};

/// Records one page reads at most, as a multiple of its limit (filtered lists).
const SCAN_FACTOR: u64 = 8;

impl PageRequest {
    /// The limit, checked.
    pub fn limit(&self) -> Result<u32, ApiError> {
        match self.limit {
            None => Ok(DEFAULT_LIMIT),
            Some(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
            Some(n) => Err(ApiError::bad_request(format!(
                "limit {n} is out of range: 1 to {MAX_LIMIT}"
            ))),
        }
    }

    /// The cursor, checked: `None` for the first page.
    pub fn cursor(&self) -> Result<Option<u64>, ApiError> {
        match self.after.as_deref() {
            None | Some("") => Ok(None),
            Some(c) => c.parse::<u64>().map(Some).map_err(|_| {
                ApiError::bad_request(format!(
                    "cursor {c:?} is not one a list returned (pass a page's `next` as --after)"
                ))
            }),
        }
    }
}

/// One page of `bucket`'s records under `filter` that `keep` accepts, mapped by `keep`.
pub async fn newest<T, U, F>(
    bucket: &Bucket,
    filter: &str,
    req: &PageRequest,
    mut keep: F,
) -> Result<Page<U>, ApiError>
where
    T: serde::de::DeserializeOwned,
    F: FnMut(String, T) -> Option<U>,
{
    let limit = req.limit()? as usize;
    let mut before = req.cursor()?;
    let budget = limit as u64 * SCAN_FACTOR;
    let mut read = 0u64;
    let mut items = Vec::new();
    loop {
        let window = (limit as u64 * 2).min(budget - read).max(1);
        let (batch, older) = bucket
            .newest::<T>(filter, before, window)
            .await
            .map_err(ApiError::from)?;
        read += window;
        for (seq, key, value) in batch {
            if let Some(item) = keep(key, value) {
                items.push(item);
                if items.len() == limit {
                    return Ok(Page {
                        items,
                        next: Some(seq.to_string()),
                    });
                }
            }
        }
        before = older;
        if before.is_none() || read >= budget {
            return Ok(Page {
                items,
                next: before.map(|b| b.to_string()),
            });
        }
    }
}
