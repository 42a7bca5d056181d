//! `--limit N --after CURSOR` for every `list` command, and how a page ends: `--json` prints
//! the page as the API returned it (`{"items": [...], "next": "..."}`); the table view says
//! on stderr how to get the next page, so piping the table stays clean.

use turnstile_shared::page::{Page, PageRequest};

#[derive(Debug, Clone, clap::Args)]
pub struct PageArgs {
    /// Items on this page (1-1000; default 50), most recently written first.
    #[arg(long)]
    pub limit: Option<u32>,
    /// Continue after a previous page: its `next` cursor.
    #[arg(long)]
    pub after: Option<String>,
}

impl PageArgs {
    pub fn request(&self) -> PageRequest {
        PageRequest {
            limit: self.limit,
            after: self.after.clone(),
        }
    }
}

/// Tells (on stderr) how to get the page after `page`, when there is one.
pub fn more<T>(page: &Page<T>) {
    if let Some(next) = &page.next {
        eprintln!("more: add --after {next}");
    }
}
