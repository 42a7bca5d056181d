//! The JetStream API error codes Turnstile branches on, in one place. async-nats maps only
//! some of them to error kinds; a clustered stream reports a failed compare-and-set with a
//! code of its own (10164) that the client leaves as `Other`, so the codes are read off the
//! error's source chain here instead of being matched by text in each caller.

use std::error::Error as StdError;

/// A single server: the expected last (subject) sequence did not match.
pub const WRONG_LAST_SEQUENCE: u64 = 10071;
/// A clustered stream: the same compare-and-set failure, detected before the proposal.
pub const WRONG_LAST_SEQUENCE_CONSTANT: u64 = 10164;
/// A message with the same `Nats-Msg-Id` is being stored right now by another publisher.
pub const DUPLICATE_IN_PROCESS: u64 = 10158;

/// The stream named does not exist.
pub const STREAM_NOT_FOUND: u64 = 10059;

/// A message delete named a sequence the stream does not hold (any more).
pub const SEQUENCE_NOT_FOUND: u64 = 10043;
/// A message delete the store refused. The server gives one code for every reason, and
/// says which in the description: `no message found` (removed already), `stream store EOF`
/// (never written), `message delete not permitted` (a stream that denies deletes).
pub const MESSAGE_DELETE_FAILED: u64 = 10057;

/// Whether a message delete's error says the message is not there (any more).
pub fn is_message_gone(err: &async_nats::jetstream::Error) -> bool {
    let code = err.error_code().0;
    let text = err.to_string();
    let said = |what: &str| text.contains(what);
    code == SEQUENCE_NOT_FOUND
        || (code == MESSAGE_DELETE_FAILED && (said("no message found") || said("EOF")))
}

/// Whether a message delete was refused because the stream denies deletes.
pub fn is_delete_denied(err: &async_nats::jetstream::Error) -> bool {
    err.error_code().0 == MESSAGE_DELETE_FAILED && err.to_string().contains("not permitted")
}

/// The first JetStream API error code found in `err`'s source chain.
pub fn code_of(err: &(dyn StdError + 'static)) -> Option<u64> {
    let mut current: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return Some(js.error_code().0);
        }
        current = e.source();
    }
    None
}

/// Whether `err` is a lost compare-and-set (on a single server or a cluster).
pub fn is_wrong_last_sequence(err: &(dyn StdError + 'static)) -> bool {
    matches!(
        code_of(err),
        Some(WRONG_LAST_SEQUENCE | WRONG_LAST_SEQUENCE_CONSTANT)
    )
}

/// Whether `err` says another publisher is storing the same message id at this moment.
pub fn is_duplicate_in_process(err: &(dyn StdError + 'static)) -> bool {
    code_of(err) == Some(DUPLICATE_IN_PROCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn js_error(code: u64) -> async_nats::jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 400, "err_code": code, "description": "wrong last sequence"
        }))
        .expect("a JetStream error")
    }

    #[test]
    fn codes_are_found_through_the_source_chain() {
        let inner = js_error(WRONG_LAST_SEQUENCE_CONSTANT);
        let wrapped = async_nats::jetstream::context::PublishError::with_source(
            async_nats::jetstream::context::PublishErrorKind::Other,
            inner,
        );
        assert!(is_wrong_last_sequence(&wrapped));
        assert!(!is_duplicate_in_process(&wrapped));
        assert!(is_duplicate_in_process(&js_error(DUPLICATE_IN_PROCESS)));
        let io = std::io::Error::other("no code here");
        assert_eq!(code_of(&io), None);
    }
}
