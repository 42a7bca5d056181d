//! Removing one message from a stream by its sequence (`STREAM.MSG.DELETE` with `no_erase`):
//! what a delivery does to its marker and a handed-over completion, and a router to a lane
//! item it takes back. `no_erase` drops the message from the index; overwriting its bytes
//! (the API's default, and async-nats's `delete_message`) is for secrets, and costs a
//! rewrite of the block.

use async_nats::jetstream::{self, response::Response};

/// What became of a removal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    /// The message was there and is gone now.
    Now,
    /// It was not there (any more): removed, or overwritten under history 1, before.
    Already,
    /// The stream denies message deletes (a bucket an older build provisioned).
    Denied,
}

/// Removes the message at `seq` from `stream`.
pub async fn remove(
    js: &jetstream::Context,
    stream: &str,
    seq: u64,
) -> Result<Removed, async_nats::Error> {
    #[derive(serde::Deserialize)]
    struct Deleted {
        #[serde(default)]
        success: bool,
    }
    let request = serde_json::json!({ "seq": seq, "no_erase": true });
    let response: Response<Deleted> = js
        .request(format!("STREAM.MSG.DELETE.{stream}"), &request)
        .await?;
    Ok(match response {
        Response::Ok(d) if d.success => Removed::Now,
        Response::Ok(_) => Removed::Already,
        Response::Err { error } if crate::js_codes::is_message_gone(&error) => Removed::Already,
        Response::Err { error } if crate::js_codes::is_delete_denied(&error) => Removed::Denied,
        Response::Err { error } => return Err(error.into()),
    })
}
