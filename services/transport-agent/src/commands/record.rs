//! A turn's outcome written to its record, unless another writer already ended it.

use chrono::Utc;
use turnstile_shared::kv::Change;
use turnstile_shared::records::{TurnRecord, TurnState};

use crate::adapters::TurnEnd;
use crate::ctx::Ctx;

/// Writes the outcome unless another writer already ended the turn.
pub(super) async fn record_end(
    ctx: &Ctx,
    record: &TurnRecord,
    end: TurnEnd,
) -> Result<(), turnstile_shared::kv::KvError> {
    record_end_from(ctx, record, None, end).await
}

/// `known`: the record as this process last wrote it, with its revision (saves a read).
pub(super) async fn record_end_from(
    ctx: &Ctx,
    record: &TurnRecord,
    known: Option<(TurnRecord, u64)>,
    end: TurnEnd,
) -> Result<(), turnstile_shared::kv::KvError> {
    let ended_at = Utc::now();
    let host = ctx.config.host.clone();
    ctx.buckets
        .turns
        .modify_from::<TurnRecord, _>(record.id.as_str(), known, |cur| {
            let base = cur.unwrap_or(record);
            if base.state.is_terminal() {
                return Change::Keep;
            }
            let typed_at = match &base.state {
                TurnState::Running { typed_at, .. } => *typed_at,
                _ => ended_at,
            };
            let state = match &end {
                TurnEnd::Completed { output } => TurnState::Completed {
                    host: host.clone(),
                    typed_at,
                    ended_at,
                    output: output.clone(),
                },
                TurnEnd::Failed {
                    reason,
                    detail,
                    output,
                } => TurnState::Failed {
                    ended_at,
                    reason: reason.to_string(),
                    detail: detail.clone(),
                    output: output.clone(),
                },
            };
            Change::Write(TurnRecord {
                state,
                ..base.clone()
            })
        })
        .await
        .map(|_| ())
}
