//! How the broker's own failures become API answers. A caller decides on the code: an
//! `unavailable` answer is retried (the store or the server did not answer now: a leader being
//! elected, a node cut off), an `internal` one is not (a record or envelope this build cannot
//! handle). So the code is read off the failure's kind, never its text, and the message keeps
//! the context.

use turnstile_shared::api::{failure_code, ApiError, ErrorCode};

use crate::owned::StopError;
use crate::registry::RegistryError;

impl RegistryError {
    pub(crate) fn api_code(&self) -> ErrorCode {
        match self {
            RegistryError::Kv(e) => e.api_code(),
            RegistryError::Publish(e) => e.api_code(),
            RegistryError::Envelope(_) => ErrorCode::Internal,
            RegistryError::Lane { source, .. } => failure_code(&**source),
        }
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        Self::new(e.api_code(), e.to_string())
    }
}

impl StopError {
    /// The refusals say what to do; a store or server failure goes by its kind.
    pub(crate) fn api_code(&self) -> ErrorCode {
        match self {
            StopError::Active(_) => ErrorCode::BadRequest,
            StopError::Unknown(_) => ErrorCode::NotFound,
            StopError::Read { source, .. } => source.api_code(),
            StopError::Notes { source, .. } | StopError::Purge { source, .. } => {
                failure_code(&**source)
            }
            StopError::Registry(e) => e.api_code(),
        }
    }
}

impl From<StopError> for ApiError {
    fn from(e: StopError) -> Self {
        Self::new(e.api_code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::kv::KvError;
    use turnstile_shared::SessionId;

    fn contended() -> KvError {
        KvError::Contended {
            bucket: "ts_executions".into(),
            key: "exe_1".into(),
            attempts: 5,
        }
    }

    fn undecodable() -> KvError {
        KvError::Decode {
            bucket: "ts_executions".into(),
            key: "exe_1".into(),
            source: serde_json::from_str::<u8>("x").expect_err("not a number"),
        }
    }

    fn no_responders() -> async_nats::Error {
        Box::new(async_nats::RequestError::new(
            async_nats::RequestErrorKind::NoResponders,
        ))
    }

    /// A store that did not answer now is worth another try (`unavailable`); a record this
    /// build cannot read is not (`internal`): the step API once answered `internal` to both.
    #[test]
    fn registry_failures_answer_by_kind_and_keep_their_context() {
        let session: SessionId = "ses_a".parse().expect("an id");
        for (err, code) in [
            (RegistryError::Kv(contended()), ErrorCode::Unavailable),
            (RegistryError::Kv(undecodable()), ErrorCode::Internal),
            (
                RegistryError::Lane {
                    session: session.clone(),
                    source: no_responders(),
                },
                ErrorCode::Unavailable,
            ),
            (
                RegistryError::Lane {
                    session: session.clone(),
                    source: "something else".into(),
                },
                ErrorCode::Internal,
            ),
        ] {
            let text = err.to_string();
            let answer = ApiError::from(err);
            assert_eq!(answer.code, code, "{text}");
            assert_eq!(answer.message, text);
        }
    }

    #[test]
    fn a_stop_cancellation_answers_its_refusals_as_such_and_failures_by_kind() {
        let session: SessionId = "ses_a".parse().expect("an id");
        for (err, code) in [
            (StopError::Active(session.clone()), ErrorCode::BadRequest),
            (StopError::Unknown(session.clone()), ErrorCode::NotFound),
            (
                StopError::Read {
                    session: session.clone(),
                    source: contended(),
                },
                ErrorCode::Unavailable,
            ),
            (
                StopError::Notes {
                    session: session.clone(),
                    source: no_responders(),
                },
                ErrorCode::Unavailable,
            ),
            (
                StopError::Registry(RegistryError::Kv(undecodable())),
                ErrorCode::Internal,
            ),
        ] {
            let text = err.to_string();
            assert_eq!(ApiError::from(err).code, code, "{text}");
        }
    }
}
