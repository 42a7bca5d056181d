//! The index of the live `session`-scoped work each session owns (R7): `session`-scoped work
//! outlives the turn that started it, so no turn's end finds it; when its owner session stops,
//! this index does. A start notes its step here beside indexing it under its parent, an end
//! removes the note once the end is routed, and a stop cancels whatever its notes still name
//! and removes them all. Entries are purged by subject, so nothing stays behind in the stream.
//!
//! A note that outlives its step (its end's removal failed, or a start that never wrote its
//! record) is harmless: the stop reads each record and cancels only live work.

use turnstile_shared::execution::{exec_reason, ExecKind, ExecutionRecord, Scope};
use turnstile_shared::kv::KvError;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::step_api::Ended;
use turnstile_shared::{subjects, ExecutionId, SessionId};

use crate::ctx::Ctx;
use crate::registry::{self, RegistryError};

/// Whether `record` is noted in its owner's index: `session`-scoped steps with an owner.
pub(crate) fn noted(record: &ExecutionRecord) -> Option<&SessionId> {
    (record.kind == ExecKind::Step && record.scope == Scope::Session)
        .then_some(record.owner.as_ref())
        .flatten()
}

/// Notes `execution` as owned by `owner` (idempotent: a retried start writes it again).
pub(crate) async fn note(
    ctx: &Ctx,
    owner: &SessionId,
    execution: &ExecutionId,
) -> Result<(), KvError> {
    let key = subjects::owned_key(owner, execution);
    ctx.buckets
        .owned
        .put(&key, &execution.to_string())
        .await
        .map(|_| ())
}

/// Removes the note of an ended execution, in the background: the end is recorded and routed
/// already, and a removal that fails leaves a note the stop skips.
pub(crate) fn forget(ctx: &Ctx, record: &ExecutionRecord) {
    let Some(owner) = noted(record) else {
        return;
    };
    let (js, filter) = (
        ctx.js.clone(),
        subjects::owned_kv_subjects(&subjects::owned_key(owner, &record.id)),
    );
    tokio::spawn(async move {
        if let Err(e) = purge(&js, &filter).await {
            tracing::debug!(filter, error = %e, "forget owned work");
        }
    });
}

async fn purge(js: &async_nats::jetstream::Context, filter: &str) -> Result<(), async_nats::Error> {
    js.get_stream_no_info(subjects::OWNED_KV_STREAM)
        .await?
        .purge()
        .filter(filter)
        .await?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum StopError {
    #[error("session {0} is active: stop it first")]
    Active(SessionId),
    #[error("no session {0}")]
    Unknown(SessionId),
    #[error("read the work session {session} owns: {source}")]
    Read { session: SessionId, source: KvError },
    #[error("list the work session {session} owns: {source}")]
    Notes {
        session: SessionId,
        source: async_nats::Error,
    },
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("remove the notes of session {session}: {source}")]
    Purge {
        session: SessionId,
        source: async_nats::Error,
    },
}

/// Cancels every live execution a stopped session's notes name (`session_stopped`), then
/// removes its notes. Returns what it cancelled. A start racing the stop either wrote its note
/// before this read it, or reads the session stopped after writing its record and cancels
/// itself (`cancel_if_abandoned`).
pub(crate) async fn cancel_stopped(
    ctx: &Ctx,
    session: &SessionId,
) -> Result<Vec<ExecutionId>, StopError> {
    match ctx
        .buckets
        .sessions
        .get::<SessionRecord>(session.as_str())
        .await
    {
        Ok(Some((r, _))) if r.is_active() => return Err(StopError::Active(session.clone())),
        Ok(Some(_)) => {}
        Ok(None) => return Err(StopError::Unknown(session.clone())),
        Err(source) => {
            return Err(StopError::Read {
                session: session.clone(),
                source,
            })
        }
    }
    let notes = notes_of(ctx, session)
        .await
        .map_err(|source| StopError::Notes {
            session: session.clone(),
            source,
        })?;
    let mut cancelled = Vec::new();
    for id in notes {
        let Some(record) = registry::get(ctx, &id).await.map_err(RegistryError::from)? else {
            continue;
        };
        if record.status.is_terminal() || noted(&record) != Some(session) {
            continue;
        }
        let ended = Ended::cancelled(
            record.id.clone(),
            exec_reason::SESSION_STOPPED,
            record.status.started_at(),
        );
        registry::publish_end(ctx, &ended).await?;
        cancelled.push(record.id);
    }
    let filter = subjects::owned_kv_subjects(&subjects::owned_by(session));
    purge(&ctx.js, &filter)
        .await
        .map_err(|source| StopError::Purge {
            session: session.clone(),
            source,
        })?;
    Ok(cancelled)
}

/// Cancels a step just recorded whose parent ended meanwhile (`registry::orphaned_by`), or
/// whose owner session stopped meanwhile (its stop read the notes before this one was
/// written: [`cancel_stopped`]). Both are read after the record is written. Returns whether
/// it cancelled the step.
pub(crate) async fn cancel_if_abandoned(
    ctx: &Ctx,
    step: &ExecutionRecord,
) -> Result<bool, RegistryError> {
    let (orphaned, stopped) =
        tokio::join!(registry::orphaned_by(ctx, step), owner_stopped(ctx, step));
    let reason = match (orphaned?, stopped?) {
        (Some(reason), _) => reason,
        (None, true) => exec_reason::SESSION_STOPPED,
        (None, false) => return Ok(false),
    };
    let ended = Ended::cancelled(step.id.clone(), reason, None);
    registry::publish_end(ctx, &ended).await?;
    Ok(true)
}

/// The executions a session's notes name, read one message at a time by direct gets (no
/// consumer: stops in a burst would pass the stream's consumer limit with a listing consumer
/// each, as they linger after use).
async fn notes_of(ctx: &Ctx, session: &SessionId) -> Result<Vec<ExecutionId>, async_nats::Error> {
    use async_nats::jetstream::stream::DirectGetErrorKind;
    let stream = ctx.js.get_stream_no_info(subjects::OWNED_KV_STREAM).await?;
    let filter = subjects::owned_kv_subjects(&subjects::owned_by(session));
    let mut out = Vec::new();
    let mut seq = 0;
    loop {
        let msg = match stream
            .direct_get_next_for_subject(filter.as_str(), Some(seq + 1))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e.into()),
        };
        seq = msg.sequence;
        match msg
            .subject
            .rsplit('.')
            .next()
            .map(str::parse::<ExecutionId>)
        {
            Some(Ok(id)) => out.push(id),
            _ => {
                tracing::warn!(%session, subject = %msg.subject, "unreadable owned-work note; skipped")
            }
        }
    }
}

/// Whether `record`'s owner session has stopped.
async fn owner_stopped(ctx: &Ctx, record: &ExecutionRecord) -> Result<bool, KvError> {
    let Some(owner) = noted(record) else {
        return Ok(false);
    };
    Ok(ctx
        .buckets
        .sessions
        .get::<SessionRecord>(owner.as_str())
        .await?
        .is_some_and(|(s, _)| !s.is_active()))
}
