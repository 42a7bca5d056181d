//! Lifecycle events on `TS_EVENTS`: the public surface other tools follow. Every event is an
//! acknowledged JetStream write, de-duplicated by a stable id so a retry after a crash does not
//! show an event twice.

use async_nats::jetstream::message::PublishMessage as Publish;
use async_nats::HeaderMap;
use serde::Serialize;

use crate::envelope::{Envelope, EnvelopeError};
use crate::ids::{HostName, SessionId, TurnId};
use crate::subjects;

/// Every lifecycle event kind (the envelope's `type`): the one registry of them. Each kind is
/// spelled once, here; producers build events from it and readers parse `type` back into it
/// (`"turn.completed".parse::<EventKind>()`); a kind this build does not know fails to parse,
/// so a reader can show it raw.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    strum::Display,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
pub enum EventKind {
    #[strum(serialize = "session.created")]
    SessionCreated,
    #[strum(serialize = "session.stopped")]
    SessionStopped,
    #[strum(serialize = "turn.queued")]
    TurnQueued,
    #[strum(serialize = "turn.started")]
    TurnStarted,
    #[strum(serialize = "turn.completed")]
    TurnCompleted,
    #[strum(serialize = "turn.failed")]
    TurnFailed,
    /// A lane item this build cannot take was dead-lettered (R15).
    #[strum(serialize = "lane.rejected")]
    LaneRejected,
    /// An unreadable transport command was dead-lettered (R15).
    #[strum(serialize = "transport.rejected")]
    TransportRejected,
    #[strum(serialize = "terminal.ready")]
    TerminalReady,
    /// An agent's process exited while its session was idle, with evidence.
    #[strum(serialize = "terminal.died")]
    TerminalDied,
    #[strum(serialize = "host.up")]
    HostUp,
    #[strum(serialize = "step.queued")]
    StepQueued,
    #[strum(serialize = "step.running")]
    StepRunning,
    #[strum(serialize = "step.completed")]
    StepCompleted,
    #[strum(serialize = "step.failed")]
    StepFailed,
    #[strum(serialize = "step.cancelled")]
    StepCancelled,
    /// A completion was left for a session (owner or watcher).
    #[strum(serialize = "completion.routed")]
    CompletionRouted,
    /// A completion addressed to a session that neither owns nor watches it (R8).
    #[strum(serialize = "completion.rejected")]
    CompletionRejected,
    #[strum(serialize = "delivery.queued")]
    DeliveryQueued,
    /// A delivery turn handed its completions over and they were acked.
    #[strum(serialize = "delivery.completed")]
    DeliveryCompleted,
    /// A delivery turn failed; its completions stay pending (R3).
    #[strum(serialize = "delivery.failed")]
    DeliveryFailed,
    /// A call with missing, wrong or foreign credentials was refused.
    #[strum(serialize = "auth.refused")]
    AuthRefused,
    /// An unreadable message on the broker's ended queue was dead-lettered (R15).
    #[strum(serialize = "end.rejected")]
    EndRejected,
    #[strum(serialize = "run.queued")]
    RunQueued,
    #[strum(serialize = "run.started")]
    RunStarted,
    /// A run turn ended and the run goes on waiting for what it started (R5).
    #[strum(serialize = "run.round")]
    RunRound,
    #[strum(serialize = "run.completed")]
    RunCompleted,
    #[strum(serialize = "run.failed")]
    RunFailed,
    /// A failed run was queued again to continue where it failed.
    #[strum(serialize = "run.retried")]
    RunRetried,
    #[strum(serialize = "schedule.added")]
    ScheduleAdded,
    #[strum(serialize = "schedule.paused")]
    SchedulePaused,
    #[strum(serialize = "schedule.resumed")]
    ScheduleResumed,
    #[strum(serialize = "schedule.triggered")]
    ScheduleTriggered,
    #[strum(serialize = "schedule.deleted")]
    ScheduleDeleted,
    /// A slot fired a run (R11); `late` in its data when over the late threshold.
    #[strum(serialize = "slot.fired")]
    SlotFired,
    /// A slot yielded to a running run under its overlap policy (R11).
    #[strum(serialize = "slot.skipped")]
    SlotSkipped,
    /// A slot fell outside the catch-up window (R11).
    #[strum(serialize = "slot.missed")]
    SlotMissed,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Every kind, in registry order (for documentation checks and readers listing them).
    pub fn all() -> impl Iterator<Item = EventKind> {
        <Self as strum::IntoEnumIterator>::iter()
    }
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
        (Some(s), _) => subjects::session_event(s.as_str(), &env.kind),
        (None, Some(h)) => subjects::host_event(h.as_str(), &env.kind),
        (None, None) => subjects::system_event(&env.kind),
    }
}

/// Builds a session event with a de-duplication id made of what it is about.
pub fn session_event<T: Serialize>(
    kind: EventKind,
    session: &SessionId,
    turn: Option<&TurnId>,
    data: &T,
) -> Result<Envelope, EnvelopeError> {
    let mut env = Envelope::new(kind.as_str(), data)?.with_session(session);
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
    kind: EventKind,
    host: &HostName,
    data: &T,
) -> Result<Envelope, EnvelopeError> {
    Ok(Envelope::new(kind.as_str(), data)?.with_host(host))
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

/// Publishes an enveloped payload on `subject` like [`publish_durable`]; returns the stream
/// sequence it is stored at (the first copy's, for a repeat the stream dropped).
pub async fn publish_durable_at(
    js: &async_nats::jetstream::Context,
    subject: String,
    env: &Envelope,
) -> Result<u64, PublishError> {
    send_stored(js, subject, env, None).await?.await
}

/// Sends now and returns the acknowledgement to await (see [`send_stored`]).
pub async fn send_to(
    js: &async_nats::jetstream::Context,
    subject: String,
    env: &Envelope,
    headers: Option<HeaderMap>,
) -> Result<impl std::future::Future<Output = Result<(), PublishError>>, PublishError> {
    let ack = send_stored(js, subject, env, headers).await?;
    Ok(async move { ack.await.map(|_| ()) })
}

/// The one place a JetStream publish is built: payload, optional headers, and the envelope id
/// as `Nats-Msg-Id`. Returns the acknowledgement to await, which gives the stream sequence.
pub async fn send_stored(
    js: &async_nats::jetstream::Context,
    subject: String,
    env: &Envelope,
    headers: Option<HeaderMap>,
) -> Result<impl std::future::Future<Output = Result<u64, PublishError>>, PublishError> {
    let payload = env.encode()?;
    // Headers first: `headers` replaces the map that `message_id` writes into.
    let mut publish = Publish::build().payload(payload);
    if let Some(h) = headers {
        publish = publish.headers(h);
    }
    let publish = publish.message_id(env.id.clone());
    let ack = js
        .send_publish(subject.clone(), publish.clone())
        .await
        .map_err(|e| PublishError::Nats {
            subject: subject.clone(),
            source: e.into(),
        })?;
    let js = js.clone();
    Ok(async move {
        let mut result = ack.await;
        // Another replica is storing the same message id right now (replicas that race to
        // do the same thing, by design). Its write either lands, and the repeat is then
        // acknowledged as a duplicate, or fails, and the repeat stores ours.
        let mut attempt = 0;
        while let Err(e) = &result {
            attempt += 1;
            if attempt > 5 || !crate::js_codes::is_duplicate_in_process(e) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20 * attempt)).await;
            result = match js.send_publish(subject.clone(), publish.clone()).await {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
        }
        result.map(|a| a.sequence).map_err(|e| PublishError::Nats {
            subject,
            source: e.into(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use strum::IntoEnumIterator;

    #[test]
    fn every_kind_round_trips_and_names_its_entity() {
        for k in EventKind::iter() {
            assert_eq!(k.as_str().parse::<EventKind>().expect("parse"), k);
            assert!(k.as_str().contains('.'), "{k}");
        }
        assert!("turn.bogus".parse::<EventKind>().is_err());
    }
}
