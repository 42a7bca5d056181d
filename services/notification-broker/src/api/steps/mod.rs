//! The `ts.api.steps.*` handlers: start, report, status and list. Steps are parented to the
//! turn the caller's lane holds at that moment (R6), never to "whatever runs in that session";
//! every call that acts for a session or step is authenticated by its token. A start lands the
//! step in the registry and queues its work; reports move it from queued to running to its end.
//!
//! Reports (started, heartbeat, end) are in `report.rs`.

use std::sync::Arc;

use turnstile_shared::api::{ApiError, ErrorCode};
use turnstile_shared::events::{self, EventKind};
use turnstile_shared::execution::{ExecKind, ExecStatus, ExecutionRecord, Scope, StepWork};
use turnstile_shared::ids::{is_token, new_secret};
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{SessionRecord, TurnRecord, TurnState};
use turnstile_shared::step_api::{ListSteps, StartStep, StepKind, StepStatus, StepWorkItem};
use turnstile_shared::{ExecutionId, StepId};

use crate::auth::{authenticate, Identity};
use crate::ctx::Ctx;
use crate::step_events::step_event;
use crate::{owned, registry};

mod report;

pub(super) use report::report;

const MAX_NAME: usize = 200;
const MAX_ARGV: usize = 64 * 1024;

/// Where a new step hangs in the tree and who owns it.
struct Placement {
    parent: ExecutionRecord,
    session: SessionRecord,
    owner: Option<turnstile_shared::SessionId>,
    watchers: Vec<turnstile_shared::SessionId>,
}

async fn place(ctx: &Ctx, identity: Identity, scope: Scope) -> Result<Placement, ApiError> {
    match identity {
        Identity::Session(session) => {
            let turn = registry::lane_occupant(ctx, &session.id)
                .await
                .map_err(ApiError::from)?
                .ok_or_else(|| no_turn(&session.id))?;
            let record = ctx
                .buckets
                .turns
                .get::<TurnRecord>(turn.as_str())
                .await
                .map_err(ApiError::from)?
                .map(|(r, _)| r)
                .filter(|r| r.session == session.id && matches!(r.state, TurnState::Running { .. }))
                .ok_or_else(|| no_turn(&session.id))?;
            let parent = registry::mirror_turn(ctx, &record)
                .await
                .map_err(ApiError::from)?
                .ok_or_else(|| no_turn(&session.id))?;
            let (owner, watchers) = match scope {
                Scope::Detached => (None, vec![session.id.clone()]),
                _ => (Some(session.id.clone()), Vec::new()),
            };
            Ok(Placement {
                parent,
                session: *session,
                owner,
                watchers,
            })
        }
        Identity::Step(parent) => {
            if parent.status.is_terminal() {
                return Err(ApiError::new(
                    ErrorCode::ParentEnded,
                    format!("step {} has ended; it cannot start steps", parent.id),
                ));
            }
            let session = ctx
                .buckets
                .sessions
                .get::<SessionRecord>(parent.session.as_str())
                .await
                .map_err(ApiError::from)?
                .map(|(r, _)| r)
                .ok_or_else(|| ApiError::not_found(format!("no session {}", parent.session)))?;
            let (owner, watchers) = match scope {
                Scope::Detached => (None, parent.targets()),
                _ => (parent.owner.clone(), parent.watchers.clone()),
            };
            Ok(Placement {
                parent: *parent,
                session,
                owner,
                watchers,
            })
        }
    }
}

/// The session a caller acts for: its own, or its parent step's.
fn caller_session(identity: &Identity) -> &turnstile_shared::SessionId {
    match identity {
        Identity::Session(session) => &session.id,
        Identity::Step(parent) => &parent.session,
    }
}

fn no_turn(session: &turnstile_shared::SessionId) -> ApiError {
    ApiError::new(
        ErrorCode::NoTurn,
        format!("session {session} holds no running turn: steps start from inside a turn"),
    )
}

fn validate(req: &StartStep) -> Result<(), ApiError> {
    if req.name.trim().is_empty() || req.name.len() > MAX_NAME {
        return Err(ApiError::bad_request(format!(
            "step name must be 1-{MAX_NAME} bytes"
        )));
    }
    match &req.work {
        StepKind::Command { argv } => {
            if argv.is_empty() || argv[0].is_empty() {
                return Err(ApiError::bad_request("command step needs a program to run"));
            }
            if argv.iter().map(String::len).sum::<usize>() > MAX_ARGV {
                return Err(ApiError::bad_request("command line too long"));
            }
        }
        StepKind::External { queue, .. } => {
            if !is_token(queue) {
                return Err(ApiError::bad_request(format!(
                    "external queue {queue:?} must be letters, digits, '-' or '_'"
                )));
            }
        }
        StepKind::Agent { prompt } => {
            if prompt.trim().is_empty() || prompt.len() > MAX_ARGV {
                return Err(ApiError::bad_request(format!(
                    "an agent step needs a prompt of 1-{MAX_ARGV} bytes"
                )));
            }
        }
    }
    Ok(())
}

pub(super) async fn start(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: StartStep,
) -> Result<ExecutionRecord, ApiError> {
    validate(&req)?;
    let identity = authenticate(&ctx, &principal, &req.caller, "start step").await?;
    let step = req.id.clone().unwrap_or_default();
    let exec_id = ExecutionId::from(&step);
    // A retry is recognised before the step is placed: the turn that started it may have
    // ended since (its first attempt registered the step, its answer was lost), and a retry
    // must get that step back, not `no_turn`.
    if let Some(existing) = registry::get(&ctx, &exec_id)
        .await
        .map_err(ApiError::from)?
    {
        // A retry of the same start returns it (and hands its work out again while nobody
        // has taken it: the first attempt may have been cut off between its record and its
        // work item; the item's id makes a repeat within the duplicate window a no-op, and a
        // later one is refused at take); anything else is re-registration (R8).
        if &existing.session == caller_session(&identity) && existing.name == req.name.trim() {
            if existing.status == ExecStatus::Queued {
                if let Some(work) = existing.work.clone() {
                    // Unless the first attempt stopped before its orphan check and the
                    // parent has ended since (see below).
                    let orphaned = owned::cancel_if_abandoned(&ctx, &existing)
                        .await
                        .map_err(ApiError::from)?;
                    if !orphaned {
                        dispatch(&ctx, &existing, step.clone(), work).await?;
                    }
                }
            }
            return Ok(existing.redacted());
        }
        return Err(ApiError::new(
            ErrorCode::ForeignExecution,
            format!("execution {exec_id} is already registered elsewhere"),
        ));
    }
    let placement = place(&ctx, identity, req.scope).await?;
    let work = match &req.work {
        StepKind::Command { argv } => StepWork::Command {
            argv: argv.clone(),
            host: placement.session.host.clone(),
            cwd: placement.session.cwd.clone(),
        },
        StepKind::External { queue, input } => StepWork::External {
            queue: queue.clone(),
            input: input.clone(),
        },
        StepKind::Agent { prompt } => StepWork::Agent {
            prompt: prompt.clone(),
            host: placement.session.host.clone(),
        },
    };
    let record = ExecutionRecord {
        id: exec_id.clone(),
        kind: ExecKind::Step,
        name: req.name.trim().to_string(),
        parent: Some(placement.parent.id.clone()),
        scope: req.scope,
        session: placement.session.id.clone(),
        owner: placement.owner,
        watchers: placement.watchers,
        created_at: chrono::Utc::now(),
        work: Some(work.clone()),
        token: Some(new_secret()),
        children: Vec::new(),
        handed_over: Vec::new(),
        status: ExecStatus::Queued,
    };
    // Index first, then the record: a crash between leaves a dangling index entry (skipped
    // by the tree walk), never a child its parent does not know. A parent that ended since it
    // was placed takes no child (its end's cancellation would miss it, R7).
    // Work that outlives its turn is noted under its owner beside, so the owner's stop finds
    // it (`owned`).
    let note = async {
        match owned::noted(&record) {
            Some(owner) => owned::note(&ctx, owner, &exec_id).await,
            None => Ok(()),
        }
    };
    let (live, noted) = tokio::join!(
        registry::add_live_child(&ctx, &placement.parent.id, &exec_id),
        note
    );
    noted.map_err(ApiError::from)?;
    if !live.map_err(ApiError::from)? {
        return Err(parent_ended(&placement.parent));
    }
    let created = ctx
        .buckets
        .executions
        .create(exec_id.as_str(), &record)
        .await
        .map_err(ApiError::from)?;
    if created.is_none() {
        return Err(ApiError::new(
            ErrorCode::ForeignExecution,
            format!("execution {exec_id} was registered concurrently"),
        ));
    }
    if owned::cancel_if_abandoned(&ctx, &record)
        .await
        .map_err(ApiError::from)?
    {
        // Its parent ended, or its owner stopped, while it was registered: cancelled, its
        // work not handed out.
        tracing::info!(step = %record.id, "started as its parent ended or its session stopped; cancelled");
        return Ok(record.redacted());
    }
    dispatch(&ctx, &record, step, work).await?;
    Ok(record.redacted())
}

/// The refusal of a start whose parent ended after it was placed: for a turn, what a start
/// outside any turn gets.
fn parent_ended(parent: &ExecutionRecord) -> ApiError {
    match parent.kind {
        ExecKind::Step => ApiError::new(
            ErrorCode::ParentEnded,
            format!("step {} has ended; it cannot start steps", parent.id),
        ),
        _ => no_turn(&parent.session),
    }
}

/// Hands a registered step's work to whoever runs it (its host's transport, a worker queue,
/// the agent-step queue) and says so (`step.queued`).
async fn dispatch(
    ctx: &Ctx,
    record: &ExecutionRecord,
    step: StepId,
    work: StepWork,
) -> Result<(), ApiError> {
    let item = StepWorkItem::of(record, step, work.clone());
    let (subject, _) = work.queue();
    let env = item.envelope().map_err(ApiError::internal)?;
    // Unavailable, not internal: the caller retries with the same step id, and the retry
    // hands the work out again (see `start`).
    events::publish_durable(&ctx.js, subject, &env, None)
        .await
        .map_err(|e| ApiError::new(ErrorCode::Unavailable, e.to_string()))?;
    step_event(ctx, record, EventKind::StepQueued).await;
    Ok(())
}

pub(super) async fn status(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: StepStatus,
) -> Result<ExecutionRecord, ApiError> {
    let identity = authenticate(&ctx, &principal, &req.caller, "step status").await?;
    let record = registry::get(&ctx, &ExecutionId::from(&req.step))
        .await
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found(format!("no step {}", req.step)))?;
    let visible = match &identity {
        Identity::Session(s) => record.session == s.id || record.may_receive(&s.id),
        Identity::Step(p) => record.session == p.session,
    };
    if !visible {
        return Err(ApiError::not_found(format!("no step {}", req.step)));
    }
    Ok(record.redacted())
}

/// The caller session's steps, newest first (a scan of the registry; bounded).
pub(super) async fn list(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: ListSteps,
) -> Result<turnstile_shared::page::Page<ExecutionRecord>, ApiError> {
    let identity = authenticate(&ctx, &principal, &req.caller, "list steps").await?;
    let session = match &identity {
        Identity::Session(s) => s.id.clone(),
        Identity::Step(p) => p.session.clone(),
    };
    // One page, most recently written first (see `page`): the session's steps are picked
    // out of the window read.
    let mine = |_, r: ExecutionRecord| {
        (r.kind == ExecKind::Step && (r.session == session || r.may_receive(&session)))
            .then(|| r.redacted())
    };
    turnstile_shared::page::newest(&ctx.buckets.executions, ">", &req.page, mine).await
}
