//! Lifecycle events on `TS_EVENTS`: the public surface other tools follow. Every event is an
//! acknowledged JetStream write, de-duplicated by a stable id so a retry after a crash does not
//! show an event twice.

use async_nats::jetstream::message::PublishMessage as Publish;
use async_nats::HeaderMap;
use serde::Serialize;

use crate::envelope::{Envelope, EnvelopeError};
use crate::ids::{HostName, SessionId, TurnId};
use crate::subjects;

pub mod kind {
    pub const SESSION_CREATED: &str = "session.created";
    pub const SESSION_STOPPED: &str = "session.stopped";
    pub const TURN_QUEUED: &str = "turn.queued";
    pub const TURN_STARTED: &str = "turn.started";
    pub const TURN_COMPLETED: &str = "turn.completed";
    pub const TURN_FAILED: &str = "turn.failed";
    pub const LANE_REJECTED: &str = "lane.rejected";
    pub const TRANSPORT_REJECTED: &str = "transport.rejected";
    pub const TERMINAL_READY: &str = "terminal.ready";
    /// An agent's process exited while its session was idle, with evidence.
    pub const TERMINAL_DIED: &str = "terminal.died";
    pub const HOST_UP: &str = "host.up";
    pub const STEP_QUEUED: &str = "step.queued";
    pub const STEP_RUNNING: &str = "step.running";
    pub const STEP_COMPLETED: &str = "step.completed";
    pub const STEP_FAILED: &str = "step.failed";
    pub const STEP_CANCELLED: &str = "step.cancelled";
    /// A completion was left for a session (owner or watcher).
    pub const COMPLETION_ROUTED: &str = "completion.routed";
    /// A completion addressed to a session that neither owns nor watches it (R8).
    pub const COMPLETION_REJECTED: &str = "completion.rejected";
    pub const DELIVERY_QUEUED: &str = "delivery.queued";
    /// A delivery turn handed its completions over and they were acked.
    pub const DELIVERY_COMPLETED: &str = "delivery.completed";
    /// A delivery turn failed; its completions stay pending (R3).
    pub const DELIVERY_FAILED: &str = "delivery.failed";
    /// A call with missing, wrong or foreign credentials was refused.
    pub const AUTH_REFUSED: &str = "auth.refused";
    /// An unreadable message on the broker's ended queue was dead-lettered (R15).
    pub const END_REJECTED: &str = "end.rejected";
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("publish to {subject}: {source}")]
    Nats {
        subject: String,
        source: async_nats::Error,
    },
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
}

/// The subject an event envelope goes to, from the entity it is about.
pub fn event_subject(env: &Envelope) -> String {
    match (&env.session, &env.host) {
        (Some(s), _) => subjects::event("session", s.as_str(), &env.kind),
        (None, Some(h)) => subjects::event("host", h.as_str(), &env.kind),
        (None, None) => subjects::event("system", "-", &env.kind),
    }
}

/// Builds a session event with a de-duplication id made of what it is about.
pub fn session_event<T: Serialize>(
    kind: &str,
    session: &SessionId,
    turn: Option<&TurnId>,
    data: &T,
) -> Result<Envelope, EnvelopeError> {
    let mut env = Envelope::new(kind, data)?.with_session(session);
    let dedupe = match turn {
        Some(t) => {
            env = env.with_turn(t);
            format!("{t}:{kind}")
        }
        None => format!("{session}:{kind}"),
    };
    Ok(env.with_id(dedupe))
}

pub fn host_event<T: Serialize>(
    kind: &str,
    host: &HostName,
    data: &T,
) -> Result<Envelope, EnvelopeError> {
    Ok(Envelope::new(kind, data)?.with_host(host))
}

/// Publishes and waits for the stream's acknowledgement.
pub async fn publish(
    js: &async_nats::jetstream::Context,
    env: &Envelope,
) -> Result<(), PublishError> {
    send(js, env).await?.await
}

/// Sends now and returns the acknowledgement to await later, so a caller can pipeline an
/// event with its own next write.
pub async fn send(
    js: &async_nats::jetstream::Context,
    env: &Envelope,
) -> Result<impl std::future::Future<Output = Result<(), PublishError>>, PublishError> {
    send_to(js, event_subject(env), env, None).await
}

/// Publishes an enveloped payload on `subject`, de-duplicated by the envelope id, and waits
/// for the stream's acknowledgement.
pub async fn publish_durable(
    js: &async_nats::jetstream::Context,
    subject: String,
    env: &Envelope,
    headers: Option<HeaderMap>,
) -> Result<(), PublishError> {
    send_to(js, subject, env, headers).await?.await
}

/// The one place a JetStream publish is built: payload, optional headers, and the envelope id
/// as `Nats-Msg-Id`. Returns the acknowledgement to await.
pub async fn send_to(
    js: &async_nats::jetstream::Context,
    subject: String,
    env: &Envelope,
    headers: Option<HeaderMap>,
) -> Result<impl std::future::Future<Output = Result<(), PublishError>>, PublishError> {
    let payload = env.encode()?;
    // Headers first: `headers` replaces the map that `message_id` writes into.
    let mut publish = Publish::build().payload(payload);
    if let Some(h) = headers {
        publish = publish.headers(h);
    }
    let publish = publish.message_id(env.id.clone());
    let ack = js
        .send_publish(subject.clone(), publish)
        .await
        .map_err(|e| PublishError::Nats {
            subject: subject.clone(),
            source: e.into(),
        })?;
    Ok(async move {
        ack.await.map(|_| ()).map_err(|e| PublishError::Nats {
            subject,
            source: e.into(),
        })
    })
}
