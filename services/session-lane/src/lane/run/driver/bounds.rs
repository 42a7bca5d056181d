//! A run's bounds (`max_duration`, cancel) met at a boundary of its drive: never while its
//! latest turn is typed and not ended (R1, R3); a latest turn that ended is settled first, one
//! recorded but untyped is failed with the run's reason (R13), and a failed run's owned work
//! is cancelled (R7).

use chrono::Utc;
use turnstile_shared::api::{self, ErrorCode};
use turnstile_shared::kv::Change;
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{TurnRecord, TurnState};
use turnstile_shared::runs::{RunRecord, RunState};
use turnstile_shared::step_api::ExecRef;
use turnstile_shared::subjects;
use turnstile_shared::{ExecutionId, TurnId};

use crate::handoff::settle;

use super::{DriveError, Driver, End, API};

impl Driver<'_> {
    /// A bound met at a boundary: the run's time spent, or a cancel recorded. Never while the
    /// run's latest turn is typed and has not ended: the run waits for it (a turn in flight
    /// is not interrupted), or the lane's next item would be typed into an agent still at
    /// work on it (R1) and what that turn started handed to a turn begun before it ended
    /// (R3). A run resumed mid-turn (a retry after a store error, a replica that took the
    /// lane over) meets its bounds here first. A latest turn recorded but not yet typed fails
    /// with the run's reason, so no record waits for a lane that will never type it (R13);
    /// what it carried was given back, and the session's next delivery hands it over.
    pub(super) async fn bound(&mut self, index: usize) -> Result<Option<End>, DriveError> {
        let end = match self.over_time(index) {
            Some(end) => end,
            None => match self.cancelled(index).await? {
                Some(end) => end,
                None => return Ok(None),
            },
        };
        match self.latest_turn(index) {
            Some(turn) if !self.claim_untyped(&turn, &end).await? => Ok(None),
            _ => Ok(Some(end)),
        }
    }

    /// Settles the message's latest turn if it ended and this driver has not settled it: a
    /// run resumed (a retry, a take-over) after its hand-over turn ended, and ended at once
    /// by a bound, still acks what that turn carried and records it handed over (R3), or
    /// the next run or delivery of the session would carry it a second time. A turn the
    /// bound failed untyped leaves what it carried pending, armed for the next turn end.
    pub(super) async fn settle_latest(&mut self, index: usize) -> Result<(), DriveError> {
        let Some(turn) = self.latest_turn(index) else {
            return Ok(());
        };
        if self.settled.as_ref() == Some(&turn) {
            return Ok(());
        }
        if let Some(record) = self.turn_record(&turn).await? {
            if record.state.is_terminal() {
                settle(self.ctx, self.session, &record, &[]).await?;
                self.settled = Some(turn);
            }
        }
        Ok(())
    }

    /// The message's latest turn, as the run record names it.
    pub(super) fn latest_turn(&self, index: usize) -> Option<TurnId> {
        self.run
            .progress
            .get(index)
            .and_then(|m| m.turns.last())
            .cloned()
    }

    /// Fails the run's latest turn if it is still untyped; `false` if it is typed and has
    /// not ended (the run must wait for it). A transport taking the command meanwhile writes
    /// `running` against the same revision, so exactly one of the two wins.
    async fn claim_untyped(&self, turn: &TurnId, end: &End) -> Result<bool, DriveError> {
        let RunState::Failed { reason, .. } = &end.state else {
            return Ok(true);
        };
        let ended_at = Utc::now();
        let wrote = std::sync::atomic::AtomicBool::new(false);
        let rec = self
            .ctx
            .buckets
            .turns
            .modify::<TurnRecord, _>(turn.as_str(), |cur| {
                wrote.store(false, std::sync::atomic::Ordering::Relaxed);
                match cur {
                    Some(r) if r.state == TurnState::Queued => {
                        wrote.store(true, std::sync::atomic::Ordering::Relaxed);
                        Change::Write(TurnRecord {
                            state: TurnState::Failed {
                                ended_at,
                                reason: reason.clone(),
                                detail: format!(
                                    "the run ended ({reason}) before this turn was typed"
                                ),
                                output: Vec::new(),
                            },
                            ..r.clone()
                        })
                    }
                    _ => Change::Keep,
                }
            })
            .await?;
        let Some(rec) = rec else {
            return Ok(true);
        };
        if wrote.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(ev) = crate::handoff::outcome_event(&rec) {
                if let Err(e) = turnstile_shared::events::publish(&self.ctx.js, &ev).await {
                    tracing::warn!(%turn, error = %e, "publish the untyped turn's end");
                }
            }
        }
        Ok(rec.state.is_terminal())
    }

    pub(super) async fn cancel_owned_work(&self, run: &RunRecord) {
        for turn in run.progress.iter().flat_map(|m| m.turns.iter()) {
            let req = ExecRef {
                id: ExecutionId::from(turn),
            };
            let r: Result<turnstile_shared::step_api::Cancelled, _> = api::call(
                &self.ctx.client,
                &Principal::Operator.exec(subjects::api::CANCEL),
                &req,
                API,
            )
            .await;
            match r {
                Ok(c) if !c.cancelled.is_empty() => {
                    tracing::info!(run = %run.id, %turn, count = c.cancelled.len(), "cancelled the ended run's work")
                }
                Ok(_) => {}
                Err(e) if e.code == ErrorCode::NotFound => {}
                Err(e) => {
                    tracing::warn!(run = %run.id, %turn, error = %e, "cancel the ended run's work")
                }
            }
        }
    }
}
