//! A session's side of the transport commands: its spec (read from its record, cached while
//! it runs), its agent readied or resumed (one launch per session at a time) and stopped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::kv::Change;
use turnstile_shared::records::{reason, SessionRecord};
use turnstile_shared::SessionId;

use crate::adapters::{Adapter, SessionSpec, TurnEnd};
use crate::ctx::Ctx;

pub(super) async fn spec_for(ctx: &Ctx, session: &SessionId) -> Option<(SessionSpec, bool)> {
    let stops = {
        let Ok(map) = ctx.sessions.lock() else {
            return None;
        };
        if let Some(spec) = map.get(session) {
            return Some((spec.clone(), true));
        }
        ctx.stops.load(Ordering::Acquire)
    };
    let record = match ctx
        .buckets
        .sessions
        .get::<SessionRecord>(session.as_str())
        .await
    {
        Ok(Some((r, _))) => r,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(%session, error = %e, "read session");
            return None;
        }
    };
    let active = record.is_active();
    let spec = SessionSpec {
        id: record.id.clone(),
        agent: record.agent,
        cwd: record.cwd.map(Into::into),
        conversation: record.conversation,
        token: record.token,
        launch: record.launch,
        ready_timeout: record.ready_timeout_ms.map(Duration::from_millis),
        policy: record.policy,
    };
    if active {
        if let Ok(mut map) = ctx.sessions.lock() {
            // A stop handled since the read may be this session's: not cached then (the
            // next turn reads the record again).
            if ctx.stops.load(Ordering::Acquire) == stops {
                map.insert(session.clone(), spec.clone());
            }
        }
    }
    Some((spec, active))
}

pub(super) fn adapter(ctx: &Ctx, spec: &SessionSpec) -> Option<Arc<dyn Adapter>> {
    ctx.adapters.get(&spec.agent).cloned()
}

/// Whether the session's record says it stopped (read when a turn failed, to name why).
pub(super) async fn is_stopped(ctx: &Ctx, session: &SessionId) -> bool {
    match ctx
        .buckets
        .sessions
        .get::<SessionRecord>(session.as_str())
        .await
    {
        Ok(Some((r, _))) => !r.is_active(),
        Ok(None) => true,
        Err(e) => {
            tracing::debug!(%session, error = %e, "read session");
            false
        }
    }
}

/// Launches (or resumes) the agent if needed; one launch per session at a time.
pub(super) async fn ensure_ready(ctx: &Ctx, spec: &SessionSpec) -> Result<(), TurnEnd> {
    let Some(adapter) = adapter(ctx, spec) else {
        return Err(TurnEnd::Failed {
            reason: reason::TRANSPORT_ERROR,
            detail: format!(
                "host {} has no adapter for agent {}",
                ctx.config.host, spec.agent
            ),
            output: Vec::new(),
        });
    };
    let lock = {
        let mut locks = match ctx.launch_locks.lock() {
            Ok(l) => l,
            Err(p) => p.into_inner(),
        };
        locks.entry(spec.id.clone()).or_default().clone()
    };
    let _guard = lock.lock().await;
    let ready_timeout = spec.ready_timeout.unwrap_or(ctx.config.ready_timeout);
    match adapter.ensure_ready(spec, ready_timeout).await {
        Ok(ready) => {
            if ready.conversation.is_some() && ready.conversation != spec.conversation {
                remember_conversation(ctx, spec, ready.conversation.clone()).await;
            }
            if ready.launched {
                let ev = session_event(
                    EventKind::TerminalReady,
                    &spec.id,
                    None,
                    &json!({ "host": ctx.config.host, "conversation": ready.conversation }),
                )
                .map(|e| e.with_id(uuid::Uuid::now_v7().simple().to_string()));
                if let Ok(ev) = ev {
                    let _ = events::publish(&ctx.js, &ev).await;
                }
            }
            Ok(())
        }
        Err(u) => Err(TurnEnd::Failed {
            reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
            detail: format!(
                "host {}, terminal {}: {}",
                ctx.config.host, spec.id, u.detail
            ),
            output: u.last_lines,
        }),
    }
}

async fn remember_conversation(
    ctx: &Ctx,
    spec: &SessionSpec,
    conversation: Option<turnstile_shared::ConversationId>,
) {
    if let Ok(mut map) = ctx.sessions.lock() {
        if let Some(s) = map.get_mut(&spec.id) {
            s.conversation = conversation.clone();
        }
    }
    let r = ctx
        .buckets
        .sessions
        .modify::<SessionRecord, _>(spec.id.as_str(), |cur| match cur {
            Some(r) if r.conversation != conversation => Change::Write(SessionRecord {
                conversation: conversation.clone(),
                ..r.clone()
            }),
            _ => Change::Keep,
        })
        .await;
    if let Err(e) = r {
        tracing::warn!(session = %spec.id, error = %e, "record conversation id");
    }
}

pub(super) async fn handle_start(ctx: &Ctx, session: &SessionId) {
    let Some((spec, true)) = spec_for(ctx, session).await else {
        return;
    };
    if let Err(TurnEnd::Failed { detail, .. }) = ensure_ready(ctx, &spec).await {
        tracing::warn!(%session, detail, "agent not ready after start; the next turn retries");
    }
}

pub(super) async fn handle_stop(ctx: &Ctx, session: &SessionId) {
    let spec = spec_for(ctx, session).await.map(|(s, _)| s);
    if let Ok(mut map) = ctx.sessions.lock() {
        ctx.stops.fetch_add(1, Ordering::AcqRel);
        map.remove(session);
    }
    if let Ok(mut locks) = ctx.launch_locks.lock() {
        locks.remove(session);
    }
    if let Some(spec) = spec {
        if let Some(adapter) = adapter(ctx, &spec) {
            adapter.stop(&spec).await;
        }
    }
}
