//! Paginated lists (`--limit`, `--after`): every `list` API returns one page of records, the
//! most recently written first, and a cursor for the next page. A page reads a bounded window
//! of the bucket's stream (see `kv::Bucket::newest`), so its cost follows the page size and
//! never the bucket's history; a filtered list (one schedule's runs, one session's steps) may
//! return fewer items than asked with a cursor to go on from, when its budget of records
//! read ran out first.
//!
//! This file holds the types list requests embed (`api.rs` among them); checking a request and
//! reading a page answer with an `api::ApiError`, so they live in `page/read.rs`, and the
//! imports go one way.

use serde::{Deserialize, Serialize};

mod read;

pub use read::newest;

/// Items a page holds unless asked otherwise.
pub const DEFAULT_LIMIT: u32 = 50;
/// Most items a page may hold.
pub const MAX_LIMIT: u32 = 1000;

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
