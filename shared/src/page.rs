//! Paginated lists (`--limit`, `--after`): every `list` API returns one page of records, the
//! most recently written first, and a cursor for the next page. A page reads a bounded window
//! of the bucket's stream (see `kv::Bucket::newest`), so its cost follows the page size and
//! never the bucket's history; a filtered list (one schedule's runs, one session's steps) may
//! return fewer items than asked with a cursor to go on from, when its budget of records
//! read ran out first.

use serde::{Deserialize, Serialize};

use crate::api::ApiError;
use crate::kv::Bucket;

/// Items a page holds unless asked otherwise.
pub const DEFAULT_LIMIT: u32 = 50;
/// Most items a page may hold.
pub const MAX_LIMIT: u32 = 1000;
/// Records one page reads at most, as a multiple of its limit (filtered lists).
const SCAN_FACTOR: u64 = 8;

/// The paging half of a list request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PageRequest {
    /// Items wanted (1..=1000; default 50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// The `next` cursor of the previous page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Where the next page starts (`--after`); absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

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
