//! The `ts.api.steps.*.report` handler: a step's runner moves it from queued to running
//! (`started`, one worker only), keeps it alive (`heartbeat`, forwarded as progress) and ends
//! it (`completed`/`failed`): the end is stored on the ended queue before the answer and
//! recorded inline beside it (the queue is the backstop). A repeated end is acknowledged with
//! the recorded status, and stored again if the step ended recently.

use std::sync::Arc;

use serde_json::json;
use turnstile_shared::api::{ApiError, ErrorCode};
use turnstile_shared::events::EventKind;
use turnstile_shared::execution::exec_reason;
use turnstile_shared::execution::{ExecStatus, ExecutionRecord};
use turnstile_shared::kv::Change;
use turnstile_shared::principal::Principal;
use turnstile_shared::step_api::{Ended, KnownRecord, Report, ReportAck, StepReport};
use turnstile_shared::{subjects, ExecutionId};

use crate::auth::{authenticate, same_secret};
use crate::ctx::Ctx;
use crate::registry;
use crate::step_events::step_event;

pub(in crate::api) async fn report(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: StepReport,
) -> Result<ReportAck, ApiError> {
    let exec_id = ExecutionId::from(&req.step);
    let caller = turnstile_shared::step_api::Caller {
        session: None,
        step: Some(req.step.clone()),
        token: req.token.clone(),
    };
    // A heartbeat or an end writes from the record this replica last wrote, if it holds it
    // (see `running`): no read before the write, which fails if the record moved since.
    let held = match req.report {
        Report::Started { .. } => None,
        Report::Heartbeat => ctx.running.get(&exec_id),
        Report::Completed { .. } | Report::Failed { .. } => ctx.running.take(&exec_id),
    };
    let read = match held {
        Some(h) => Some(h),
        None => registry::get_at(&ctx, &exec_id)
            .await
            .map_err(ApiError::from)?,
    };
    let authentic = read
        .as_ref()
        .and_then(|(r, _)| r.token.as_deref())
        .is_some_and(|t| same_secret(t, &req.token));
    if !authentic || !principal.admits(&caller) {
        // Let authenticate build and record the refusal with its reason.
        return match authenticate(&ctx, &principal, &caller, "report step").await {
            Ok(_) => Err(ApiError::new(ErrorCode::Unauthorized, "report refused")),
            Err(e) => Err(e),
        };
    }
    let (record, revision) =
        read.ok_or_else(|| ApiError::not_found(format!("no step {}", req.step)))?;
    if record.status.is_terminal() {
        // A heartbeat is its worker's, which reports its end (and stores it) itself.
        if !matches!(req.report, Report::Heartbeat) {
            resend_recent_end(&ctx, &record).await?;
        }
        return Ok(ack(&record.status));
    }
    match req.report {
        Report::Started { worker } => started(&ctx, record, revision, worker).await,
        Report::Heartbeat => heartbeat(&ctx, record, revision).await,
        Report::Completed { result } => {
            let ended = Ended {
                execution: record.id.clone(),
                status: ExecStatus::Completed {
                    started_at: record.status.started_at(),
                    ended_at: chrono::Utc::now(),
                    result,
                },
                known: Some(KnownRecord { revision, record }),
            };
            end_now(&ctx, ended).await
        }
        Report::Failed { reason, result } => {
            let ended = Ended {
                execution: record.id.clone(),
                status: ExecStatus::Failed {
                    started_at: record.status.started_at(),
                    ended_at: chrono::Utc::now(),
                    reason,
                    result,
                },
                known: Some(KnownRecord { revision, record }),
            };
            end_now(&ctx, ended).await
        }
    }
}

/// Records and routes the reported end at once on this replica, beside storing it on the
/// ended queue (durable: the worker may stop reporting once answered); the queued message is
/// the backstop if the attempt fails or this replica dies (`ended::Inline`). The message goes on
/// the wire first and the attempt's write right behind it, so a replica that dies between the
/// two cannot leave an end recorded without its message (the server takes one connection's
/// messages in order). A store the server refuses is answered `unavailable` while the attempt
/// goes on: the worker reports again, and that report finds the end recorded and stores it
/// then ([`resend_recent_end`]).
async fn end_now(ctx: &Arc<Ctx>, ended: Ended) -> Result<ReportAck, ApiError> {
    let reply = ack(&ended.status);
    let attempt = ctx.inline.announce(&ended.execution);
    let stored = match registry::send_end(ctx, &ended).await {
        Ok(stored) => stored,
        Err(e) => {
            attempt.cancel(ctx);
            return Err(unavailable(e));
        }
    };
    let (seq_tx, seq_rx) = tokio::sync::oneshot::channel();
    attempt.start(ctx, ended, seq_rx);
    let seq = stored.await.map_err(unavailable)?;
    let _ = seq_tx.send(seq);
    Ok(reply)
}

/// A failed store of an end: the reporter should report again (its worker retries
/// `unavailable`, and gives up on anything else).
fn unavailable(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Unavailable, format!("store the end: {e}"))
}

/// How long after an end a report on it stores the end on the ended queue again: well inside
/// the queue's and the completions' duplicate window (2 minutes), so a repeat is dropped there
/// and its routing repeats nothing. It covers the one case where a recorded end may have no
/// queued message: its report's store failed (or its replica died) while the end was recorded
/// beside it; the worker's next report, or a second worker taking the redelivered work,
/// stores it.
const RESEND_WITHIN: chrono::TimeDelta = chrono::TimeDelta::seconds(60);

async fn resend_recent_end(ctx: &Ctx, record: &ExecutionRecord) -> Result<(), ApiError> {
    let recent = record
        .status
        .ended_at()
        .is_some_and(|at| chrono::Utc::now() - at < RESEND_WITHIN);
    if !recent || !turnstile_shared::delivery::routes_completions(record) {
        return Ok(());
    }
    let ended = Ended {
        execution: record.id.clone(),
        status: record.status.clone(),
        known: None,
    };
    registry::publish_end(ctx, &ended)
        .await
        .map_err(unavailable)
}

fn ack(status: &ExecStatus) -> ReportAck {
    ReportAck {
        status: status.name().to_string(),
        stop: status.is_terminal(),
    }
}

/// A worker takes the step. A second attempt (its first worker died with it) is refused and
/// the step fails `worker_lost`: a step never runs twice (R14).
async fn started(
    ctx: &Arc<Ctx>,
    record: ExecutionRecord,
    revision: u64,
    worker: String,
) -> Result<ReportAck, ApiError> {
    if let ExecStatus::Running {
        worker: Some(w), ..
    } = &record.status
    {
        if *w == worker {
            return Ok(ack(&record.status));
        }
        let ended = Ended {
            execution: record.id.clone(),
            status: ExecStatus::Failed {
                started_at: record.status.started_at(),
                ended_at: chrono::Utc::now(),
                reason: exec_reason::WORKER_LOST.to_string(),
                result: turnstile_shared::execution::StepResult {
                    exit_code: None,
                    summary: format!("worker {w} was lost while running it; not run again"),
                    output: Vec::new(),
                },
            },
            known: None,
        };
        return end_now(ctx, ended).await;
    }
    let now = chrono::Utc::now();
    let id = record.id.clone();
    let (next, revision) = ctx
        .buckets
        .executions
        .modify_at::<ExecutionRecord, _>(id.as_str(), Some((record, revision)), |cur| match cur {
            Some(r) if r.status == ExecStatus::Queued => Change::Write(ExecutionRecord {
                status: ExecStatus::Running {
                    started_at: now,
                    worker: Some(worker.clone()),
                    heartbeat_at: Some(now),
                },
                ..r.clone()
            }),
            _ => Change::Keep,
        })
        .await
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found(format!("no step {id}")))?;
    ctx.running.remember(&next, revision);
    match &next.status {
        ExecStatus::Running {
            worker: Some(w), ..
        } if *w == worker => {
            step_event(ctx, &next, EventKind::StepRunning).await;
            Ok(ReportAck {
                status: next.status.name().to_string(),
                stop: false,
            })
        }
        // Another attempt won the race, or it ended meanwhile: this worker must not run it.
        other => Ok(ReportAck {
            status: other.name().to_string(),
            stop: true,
        }),
    }
}

async fn heartbeat(
    ctx: &Ctx,
    record: ExecutionRecord,
    revision: u64,
) -> Result<ReportAck, ApiError> {
    let now = chrono::Utc::now();
    let id = record.id.clone();
    let (session, targets) = (record.session.clone(), record.targets());
    let next = ctx
        .buckets
        .executions
        .modify_at::<ExecutionRecord, _>(id.as_str(), Some((record, revision)), |cur| match cur {
            Some(r) => match &r.status {
                ExecStatus::Running {
                    started_at, worker, ..
                } => Change::Write(ExecutionRecord {
                    status: ExecStatus::Running {
                        started_at: *started_at,
                        worker: worker.clone(),
                        heartbeat_at: Some(now),
                    },
                    ..r.clone()
                }),
                _ => Change::Keep,
            },
            None => Change::Keep,
        })
        .await
        .map_err(ApiError::from)?;
    if let Some((r, revision)) = &next {
        ctx.running.remember(r, *revision);
    }
    let next = next.map(|(r, _)| r);
    // Progress for a run waiting on this step (R10): core NATS, nothing kept.
    let payload = serde_json::to_vec(&json!({ "execution": id })).unwrap_or_default();
    for s in std::iter::once(&session).chain(targets.iter()) {
        let _ = ctx
            .client
            .publish(subjects::progress(s), payload.clone().into())
            .await;
    }
    Ok(next.map_or(
        ReportAck {
            status: "unknown".into(),
            stop: true,
        },
        |r| ack(&r.status),
    ))
}
