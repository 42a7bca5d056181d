//! The session commands (start, stop) this API sends a host's transport agent, de-duplicated
//! per session and verb.

use turnstile_shared::api::ApiError;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events;
use turnstile_shared::records::transport_kind;
use turnstile_shared::{subjects, HostName, SessionId};

use crate::ctx::Ctx;

/// Which session command.
#[derive(Clone, Copy)]
pub(super) enum Verb {
    Start,
    Stop,
}

/// Sends a session command to its host's transport, de-duplicated per session and verb, and
/// waits for the stream's acknowledgement (R14).
pub(super) async fn command<T: serde::Serialize>(
    ctx: &Ctx,
    host: &HostName,
    session: &SessionId,
    verb: Verb,
    payload: &T,
) -> Result<(), ApiError> {
    let (kind, name) = match verb {
        Verb::Start => (transport_kind::START, "start"),
        Verb::Stop => (transport_kind::STOP, "stop"),
    };
    let env = Envelope::new(kind, payload)
        .map_err(ApiError::internal)?
        .with_session(session)
        .with_id(format!("{session}:{name}"));
    events::publish_durable(&ctx.js, subjects::transport(host, name), &env, None)
        .await
        .map_err(ApiError::from)
}
