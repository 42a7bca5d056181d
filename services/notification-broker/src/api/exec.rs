//! The `ts.api.exec.*` handlers: the execution tree of any execution (R6) and cancellation by
//! ownership (R7). They act on executions of every kind (turns, deliveries, runs, steps), so
//! they sit apart from the step handlers; the work itself is the registry's.

use std::sync::Arc;

use turnstile_shared::api::{ApiError, ErrorCode, SessionRef};
use turnstile_shared::execution::{exec_reason, ExecKind, ExecutionRecord};
use turnstile_shared::principal::Principal;
use turnstile_shared::step_api::{Cancelled, Ended, ExecRef, TreeNode};
use turnstile_shared::ExecutionId;

use crate::ctx::Ctx;
use crate::owned;
use crate::registry::{self, Reach};

/// Whether `principal` may see and cancel `record`: an operator any execution, a session its
/// own and those whose completions it receives, a step those of its session. An agent's NATS
/// identity may publish only on its own principal's subjects, so this scopes its tools.
async fn within_reach(
    ctx: &Ctx,
    principal: &Principal,
    record: &ExecutionRecord,
) -> Result<bool, ApiError> {
    Ok(match principal {
        Principal::Operator => true,
        Principal::Session(s) => record.session == *s || record.may_receive(s),
        Principal::Step(step) => registry::get(ctx, &ExecutionId::from(step))
            .await
            .map_err(ApiError::from)?
            .is_some_and(|own| own.session == record.session),
    })
}

/// The execution and its record, if `principal` may reach it (else "not found", as for an
/// execution that does not exist).
async fn reachable(
    ctx: &Ctx,
    principal: &Principal,
    id: &ExecutionId,
) -> Result<ExecutionRecord, ApiError> {
    let missing = || ApiError::not_found(format!("no execution {id}"));
    let record = registry::get(ctx, id)
        .await
        .map_err(ApiError::from)?
        .ok_or_else(missing)?;
    if within_reach(ctx, principal, &record).await? {
        Ok(record)
    } else {
        Err(missing())
    }
}

/// The execution and everything under it, as a tree.
pub(super) async fn tree(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: ExecRef,
) -> Result<TreeNode, ApiError> {
    reachable(&ctx, &principal, &req.id).await?;
    registry::tree(&ctx, &req.id)
        .await
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found(format!("no execution {}", req.id)))
}

/// Cancels an execution and everything it owns (R7). A turn itself is not interrupted (its
/// agent finishes typing its reply); what the turn owns is cancelled.
pub(super) async fn cancel(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: ExecRef,
) -> Result<Cancelled, ApiError> {
    let record = reachable(&ctx, &principal, &req.id).await?;
    let mut cancelled = Vec::new();
    match record.kind {
        ExecKind::Step => {
            if !record.status.is_terminal() {
                let ended = Ended::cancelled(
                    record.id.clone(),
                    exec_reason::CANCELLED,
                    record.status.started_at(),
                );
                registry::publish_end(&ctx, &ended)
                    .await
                    .map_err(ApiError::from)?;
                cancelled.push(record.id.clone());
            }
        }
        ExecKind::Turn | ExecKind::Delivery | ExecKind::Run | ExecKind::Message => {
            let walked =
                registry::cancel_under(&ctx, &record, Reach::Owned, exec_reason::CANCELLED)
                    .await
                    .map_err(ApiError::from)?;
            cancelled = walked.cancelled;
            // The second look goes on after the answer (a run's end cancels turn after turn).
            if !walked.unrecorded.is_empty() {
                let (ctx, root) = (ctx.clone(), record.id.clone());
                tokio::spawn(async move {
                    let unrecorded = walked.unrecorded;
                    registry::recheck_unrecorded(
                        &ctx,
                        &root,
                        unrecorded,
                        Reach::Owned,
                        exec_reason::CANCELLED,
                    )
                    .await;
                });
            }
        }
    }
    Ok(Cancelled { cancelled })
}

/// Cancels the `session`-scoped work a stopped session owns (R7): called by the session stop,
/// on the operator's subject only. Refused for an active session.
pub(super) async fn cancel_session(
    ctx: Arc<Ctx>,
    principal: Principal,
    req: SessionRef,
) -> Result<Cancelled, ApiError> {
    if principal != Principal::Operator {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "only the operator cancels a stopped session's work",
        ));
    }
    owned::cancel_stopped(&ctx, &req.session)
        .await
        .map(|cancelled| Cancelled { cancelled })
        .map_err(ApiError::from)
}
