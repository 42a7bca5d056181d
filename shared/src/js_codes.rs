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

/// JetStream is not available in the cluster right now (no meta leader, a node catching up).
pub const CLUSTER_NOT_AVAILABLE: u64 = 10008;
/// The server is short of resources for the request (a store disk full, limits reached).
pub const INSUFFICIENT_RESOURCES: u64 = 10023;

/// What a caller decides on when a call to the server or the store fails, read from the
/// error's kinds and codes, never from its text (the `Error<Kind>` shape of async-nats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The server, the stream or its leader did not answer, or said it cannot now: a node
    /// cut off or restarting, a leader being elected, a stream whose subjects a rejoined node
    /// does not map yet, a full disk. Another try may succeed: callers are told
    /// `unavailable`, and retry.
    Unavailable,
    /// Anything else: a refusal another try would meet again, or this build's own fault.
    Internal,
}

/// The kind of the first failure in `err`'s source chain that says one.
pub fn failure_kind(err: &(dyn StdError + 'static)) -> FailureKind {
    use async_nats::jetstream::context::PublishErrorKind as Publish;
    use async_nats::RequestErrorKind as Request;
    let mut current: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(p) = e.downcast_ref::<async_nats::jetstream::context::PublishError>() {
            match p.kind() {
                Publish::StreamNotFound | Publish::TimedOut | Publish::BrokenPipe => {
                    return FailureKind::Unavailable
                }
                Publish::Other => {}
                _ => return FailureKind::Internal,
            }
        }
        if let Some(r) = e.downcast_ref::<async_nats::RequestError>() {
            if matches!(r.kind(), Request::TimedOut | Request::NoResponders) {
                return FailureKind::Unavailable;
            }
        }
        if let Some(js) = e.downcast_ref::<async_nats::jetstream::Error>() {
            return match js.error_code().0 {
                STREAM_NOT_FOUND | CLUSTER_NOT_AVAILABLE | INSUFFICIENT_RESOURCES => {
                    FailureKind::Unavailable
                }
                _ => FailureKind::Internal,
            };
        }
        if e.downcast_ref::<std::io::Error>().is_some() {
            return FailureKind::Unavailable;
        }
        current = e.source();
    }
    FailureKind::Internal
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

    /// A publish no stream answered (a cluster electing a leader, a rejoined node), a reply
    /// that did not come, a JetStream that says it cannot now: `unavailable`, worth another
    /// try. A refusal that would come again, or an error that says nothing: `internal`.
    #[test]
    fn failures_are_told_apart_by_kind_and_code_not_text() {
        use async_nats::jetstream::context::{PublishError, PublishErrorKind as P};
        use FailureKind::{Internal, Unavailable};
        let publish = |kind| Box::new(PublishError::new(kind)) as Box<dyn StdError>;
        let with_code = |code| {
            Box::new(PublishError::with_source(P::Other, js_error(code))) as Box<dyn StdError>
        };
        let cases: Vec<(Box<dyn StdError>, FailureKind)> = vec![
            (publish(P::StreamNotFound), Unavailable),
            (publish(P::TimedOut), Unavailable),
            (publish(P::MaxPayloadExceeded), Internal),
            (publish(P::WrongLastSequence), Internal),
            (with_code(CLUSTER_NOT_AVAILABLE), Unavailable),
            (with_code(10052), Internal),
            (
                Box::new(async_nats::RequestError::new(
                    async_nats::RequestErrorKind::NoResponders,
                )),
                Unavailable,
            ),
            // Text that reads like a transient failure decides nothing.
            ("no stream found for given subject".into(), Internal),
        ];
        for (err, kind) in cases {
            assert_eq!(failure_kind(&*err), kind, "{err}");
        }
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(failure_kind(&io), FailureKind::Unavailable);
    }
}
