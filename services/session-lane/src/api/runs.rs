//! `ts.api.runs.*`: start, show, list, cancel and retry runs. A run's record is written
//! before its lane item (R14); cancel and retry act on the record, and the run's own loop on
//! the lane carries them out at its next boundary.

use std::sync::Arc;

use chrono::Utc;
use serde_json::json;
use turnstile_shared::api::{ApiError, ErrorCode, MAX_MESSAGE_BYTES};
use turnstile_shared::events::{self, session_event, EventKind};
use turnstile_shared::kv::Change;
use turnstile_shared::lane::LaneItem;
use turnstile_shared::records::{TurnRecord, TurnState};
use turnstile_shared::runs::{RunItem, RunRecord, RunRef, RunState, StartRun};
use turnstile_shared::subjects;

use super::sessions::active_session;
use crate::ctx::Ctx;

/// Queues a run on the session's lane: its record first (queued), then the lane item (R14).
pub(super) async fn start_run(ctx: Arc<Ctx>, req: StartRun) -> Result<RunRecord, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("a run needs at least one message"));
    }
    for m in req.messages.iter().chain(req.finalizer.iter()) {
        if m.trim().is_empty() || m.len() > MAX_MESSAGE_BYTES {
            return Err(ApiError::bad_request(format!(
                "every message must be 1-{MAX_MESSAGE_BYTES} bytes and not blank"
            )));
        }
    }
    if req.limits.max_rounds == 0 {
        return Err(ApiError::bad_request("max_rounds must be at least 1"));
    }
    let session = active_session(&ctx, &req.session).await?;
    let id = req.id.clone().unwrap_or_default();
    let record = RunRecord {
        id: id.clone(),
        session: session.id.clone(),
        schedule: req.schedule.clone(),
        created_at: Utc::now(),
        messages: req.messages.clone(),
        finalizer: req.finalizer.clone(),
        limits: req.limits,
        progress: Vec::new(),
        cancel: None,
        attempt: 0,
        driver: None,
        state: RunState::Queued,
    };
    let record = match ctx
        .buckets
        .runs
        .create(id.as_str(), &record)
        .await
        .map_err(ApiError::from)?
    {
        Some(_) => record,
        None => {
            let existing = ctx
                .buckets
                .runs
                .get::<RunRecord>(id.as_str())
                .await
                .map_err(ApiError::from)?
                .map(|(r, _)| r)
                .ok_or_else(|| ApiError::internal("run vanished"))?;
            if existing.session != session.id {
                return Err(ApiError::bad_request(format!(
                    "run {id} belongs to another session"
                )));
            }
            existing
        }
    };
    let item = LaneItem::Run(RunItem {
        run: id.clone(),
        attempt: 0,
    });
    let env = item.to_envelope(&session.id).map_err(ApiError::internal)?;
    events::publish_durable(&ctx.js, subjects::lane(&session.id), &env, None)
        .await
        .map_err(ApiError::from)?;
    let ev = session_event(
        EventKind::RunQueued,
        &session.id,
        None,
        &json!({ "run": id, "schedule": record.schedule }),
    )
    .map_err(ApiError::internal)?
    .with_id(format!("{id}:run.queued"));
    events::publish(&ctx.js, &ev)
        .await
        .map_err(ApiError::from)?;
    Ok(record)
}

pub(super) async fn show_run(ctx: Arc<Ctx>, req: RunRef) -> Result<RunRecord, ApiError> {
    ctx.buckets
        .runs
        .get::<RunRecord>(req.run.as_str())
        .await
        .map_err(ApiError::from)?
        .map(|(r, _)| r)
        .ok_or_else(|| ApiError::not_found(format!("no run {}", req.run)))
}

/// Runs, newest first, optionally of one schedule (a scan of `ts_runs`; at most 200).
pub(super) async fn list_runs(
    ctx: Arc<Ctx>,
    req: turnstile_shared::schedules::ListRuns,
) -> Result<turnstile_shared::page::Page<RunRecord>, ApiError> {
    // One page, most recently written first (see `page`): a schedule's runs are picked out of
    // the window read.
    turnstile_shared::page::newest(&ctx.buckets.runs, ">", &req.page, |_, r: RunRecord| {
        (req.schedule.is_none() || r.schedule == req.schedule).then_some(r)
    })
    .await
}

/// Cancels a run: a queued one ends `failed: cancelled` at once; a running one stops at its
/// next boundary (its turn in flight is not interrupted) and cancels the work it owns.
pub(super) async fn cancel_run(ctx: Arc<Ctx>, req: RunRef) -> Result<RunRecord, ApiError> {
    use turnstile_shared::runs::{run_reason, CancelRequest};
    let now = Utc::now();
    let rec = ctx
        .buckets
        .runs
        .modify::<RunRecord, _>(req.run.as_str(), |cur| match cur {
            Some(r) if r.state.is_terminal() || r.cancel.is_some() => Change::Keep,
            Some(r) if matches!(r.state, RunState::Queued) => Change::Write(RunRecord {
                cancel: Some(CancelRequest {
                    at: now,
                    by: "api".into(),
                }),
                state: RunState::Failed {
                    started_at: None,
                    ended_at: now,
                    reason: run_reason::CANCELLED.to_string(),
                    detail: "cancelled before it started".to_string(),
                    message_index: 0,
                    execution: None,
                },
                ..r.clone()
            }),
            Some(r) => Change::Write(RunRecord {
                cancel: Some(CancelRequest {
                    at: now,
                    by: "api".into(),
                }),
                ..r.clone()
            }),
            None => Change::Keep,
        })
        .await
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found(format!("no run {}", req.run)))?;
    // A queued run ends here, not in a run loop: its end is said here too (the lane acks its
    // item without a word when it reaches it).
    let ended_now = rec.cancel.as_ref().is_some_and(|c| c.at == now)
        && matches!(rec.state, RunState::Failed { .. });
    if ended_now {
        let data = json!({ "state": rec.state, "rounds": rec.rounds() });
        crate::lane::run_event(&ctx, &rec, EventKind::RunFailed, data).await;
    }
    if let Err(e) = ctx
        .client
        .publish(subjects::run_cancel(&req.run), "cancel".into())
        .await
    {
        tracing::debug!(run = %req.run, error = %e, "cancel notice");
    }
    Ok(rec)
}

/// Retries a failed run (R9): it continues where it failed. The failed turn is dropped from its
/// progress (a hand-over is redone with whatever completions are pending now; a failed
/// message turn is typed again), finished children are never re-run, and its turns get fresh
/// ids. The run's record keeps its history; `attempt` counts the retries. Answers the record
/// queued again even when its lane item could not be published (the backstop publishes it).
pub(super) async fn retry_run(ctx: Arc<Ctx>, req: RunRef) -> Result<RunRecord, ApiError> {
    let current = ctx
        .buckets
        .runs
        .get::<RunRecord>(req.run.as_str())
        .await
        .map_err(ApiError::from)?
        .map(|(r, _)| r)
        .ok_or_else(|| ApiError::not_found(format!("no run {}", req.run)))?;
    let RunState::Failed { message_index, .. } = current.state else {
        return Err(ApiError::new(
            ErrorCode::NotFailed,
            format!(
                "run {} is {}; only a failed run is retried",
                req.run,
                current.state.name()
            ),
        ));
    };
    let session = active_session(&ctx, &current.session).await?;
    // The failed turn, if the message got that far.
    let failed_turn = current
        .progress
        .get(message_index)
        .and_then(|m| m.turns.last())
        .cloned();
    let drop_last = match &failed_turn {
        Some(t) => ctx
            .buckets
            .turns
            .get::<TurnRecord>(t.as_str())
            .await
            .map_err(ApiError::from)?
            .is_some_and(|(r, _)| matches!(r.state, TurnState::Failed { .. })),
        None => false,
    };
    let next = ctx
        .buckets
        .runs
        .modify::<RunRecord, _>(req.run.as_str(), |cur| match cur {
            Some(r) if matches!(r.state, RunState::Failed { .. }) => {
                let mut n = r.clone();
                n.attempt += 1;
                n.cancel = None;
                n.state = RunState::Queued;
                if drop_last {
                    if let Some(m) = n.progress.get_mut(message_index) {
                        m.turns.pop();
                    }
                }
                Change::Write(n)
            }
            _ => Change::Keep,
        })
        .await
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found(format!("no run {}", req.run)))?;
    let item = LaneItem::Run(RunItem {
        run: next.id.clone(),
        attempt: next.attempt,
    });
    let env = item.to_envelope(&session.id).map_err(ApiError::internal)?;
    // The run is queued again once its record says so: an item that could not be published
    // (the store out of reach a moment) is published again by the orphan-run backstop, so
    // the caller is told the truth, `queued`, and not an error whose retry is refused
    // `not_failed`.
    if let Err(e) = events::publish_durable(&ctx.js, subjects::lane(&session.id), &env, None).await
    {
        tracing::warn!(run = %next.id, attempt = next.attempt, error = %e, "retried run queued; its lane item was not published, the orphan-run backstop publishes it");
    }
    let ev = session_event(
        EventKind::RunRetried,
        &session.id,
        None,
        &json!({ "run": next.id, "attempt": next.attempt, "message_index": message_index }),
    )
    .map_err(ApiError::internal)?
    .with_id(format!("{}:run.retried:{}", next.id, next.attempt));
    if let Err(e) = events::publish(&ctx.js, &ev).await {
        tracing::warn!(run = %next.id, error = %e, "run.retried event");
    }
    Ok(next)
}
