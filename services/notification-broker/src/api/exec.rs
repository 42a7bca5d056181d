//! The `ts.api.exec.*` handlers: the execution tree of any execution (R6) and cancellation by
//! ownership (R7). They act on executions of every kind (turns, deliveries, runs, steps), so
//! they sit apart from the step handlers; the work itself is the registry's.

use std::sync::Arc;

use turnstile_shared::api::ApiError;
use turnstile_shared::execution::{exec_reason, ExecKind};
use turnstile_shared::step_api::{Cancelled, Ended, ExecRef, TreeNode};

use crate::registry::{self, Reach};
use crate::Ctx;

/// The execution and everything under it, as a tree.
pub(super) async fn tree(ctx: Arc<Ctx>, req: ExecRef) -> Result<TreeNode, ApiError> {
    registry::tree(&ctx, &req.id)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| ApiError::not_found(format!("no execution {}", req.id)))
}

/// Cancels an execution and everything it owns (R7). A turn itself is not interrupted (its
/// agent finishes typing its reply); what the turn owns is cancelled.
pub(super) async fn cancel(ctx: Arc<Ctx>, req: ExecRef) -> Result<Cancelled, ApiError> {
    let record = registry::get(&ctx, &req.id)
        .await
        .map_err(ApiError::internal)?
        .ok_or_else(|| ApiError::not_found(format!("no execution {}", req.id)))?;
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
                    .map_err(ApiError::internal)?;
                cancelled.push(record.id.clone());
            }
        }
        ExecKind::Turn | ExecKind::Delivery | ExecKind::Run | ExecKind::Message => {
            cancelled = registry::cancel_under(&ctx, &record, Reach::Owned, exec_reason::CANCELLED)
                .await
                .map_err(ApiError::internal)?;
        }
    }
    Ok(Cancelled { cancelled })
}
