//! The R5 drive loop of a run: for each message, its turn, then round after round: wait until
//! everything that turn started is terminal, hand the completions over as the next turn, and
//! stop when a turn started nothing new. Bounds (`max_rounds`, `max_duration`, cancel) end the
//! run `failed` with a named reason; `completed` only when every message completed (R12).
//! Progress is kept in the run record, so a replica that takes the lane over resumes here.
//! How a bound ends a run (its turn in flight waited for, its ended turn settled, an untyped
//! one failed, its owned work cancelled) is in `driver/bounds.rs`.

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use turnstile_shared::delivery::{self, Completion};
use turnstile_shared::events::EventKind;
use turnstile_shared::kv::Change;
use turnstile_shared::records::{
    Carried, KnownTurn, SessionRecord, TurnCommand, TurnRecord, TurnState,
};
use turnstile_shared::runs::{run_reason, DriverClaim, MessageProgress, RunRecord, RunState};
use turnstile_shared::{DeliveryId, ExecutionId, TurnId};

use super::events::event;
use crate::ctx::Ctx;
use crate::handoff::{dispatch, settle, tell_end, wait_terminal, DeliveryError, Watch};
use turnstile_shared::metrics::item_kind;

mod bounds;

/// How long a call to the broker's exec API may take.
pub(super) const API: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub(super) enum DriveError {
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    #[error("dispatch: {0}")]
    Dispatch(async_nats::Error),
    #[error("run record disappeared")]
    Gone,
    /// The run ended elsewhere while this driver ran: its item is settled as an ended run's.
    #[error("the run has ended")]
    Ended,
    /// A later delivery of the run's item claimed the run (`DriverClaim`): this driver stops.
    #[error("a later delivery of the run's item drives it")]
    Superseded,
    #[error(transparent)]
    Fenced(#[from] crate::liveness::Fenced),
}

/// How a run ended.
pub(super) struct End {
    state: RunState,
}

pub(super) struct Driver<'a> {
    pub(super) ctx: &'a Ctx,
    pub(super) session: &'a SessionRecord,
    pub(super) msg: &'a jetstream::Message,
    pub(super) cancel: &'a CancellationToken,
    pub(super) run: RunRecord,
    /// This driver's claim on the run: it writes only while the stored claim is this one.
    pub(super) claim: DriverClaim,
    /// The last turn this driver settled: a bound met after it does not settle it twice.
    pub(super) settled: Option<TurnId>,
    /// Whether it gave completions it had taken back to the session's consumer: a run that
    /// ends then leaves them to the session's next delivery, which its end arms.
    pub(super) gave_back: bool,
}

impl Driver<'_> {
    pub(super) fn started_at(&self) -> chrono::DateTime<Utc> {
        match &self.run.state {
            RunState::Running { started_at } => *started_at,
            _ => Utc::now(),
        }
    }

    fn failed(&self, reason: &str, detail: String, index: usize, exec: Option<ExecutionId>) -> End {
        End {
            state: RunState::Failed {
                started_at: Some(self.started_at()),
                ended_at: Utc::now(),
                reason: reason.to_string(),
                detail,
                message_index: index,
                execution: exec,
            },
        }
    }

    /// Gives back completions taken for a turn that will not carry them ([`nak_all`]).
    async fn give_back(&mut self, held: &[jetstream::Message]) {
        if !held.is_empty() {
            self.gave_back = true;
            nak_all(held).await;
        }
    }

    /// `Ok(None)` when cancelled.
    pub(super) async fn drive(&mut self) -> Result<Option<End>, DriveError> {
        let texts: Vec<String> = self.run.texts().into_iter().map(str::to_string).collect();
        let first = self.run.progress.iter().take_while(|m| m.done).count();
        for (index, text) in texts.iter().enumerate().skip(first) {
            // A cancel or the run's time is met at the top of `message`, at its boundary.
            match self.message(index, text).await? {
                Step::Next => {}
                Step::End(end) => return Ok(Some(end)),
                Step::Cancelled => return Ok(None),
            }
        }
        Ok(Some(End {
            state: RunState::Completed {
                started_at: self.started_at(),
                ended_at: Utc::now(),
            },
        }))
    }

    /// One message: its turn, then hand-over rounds until a turn starts nothing new.
    async fn message(&mut self, index: usize, text: &str) -> Result<Step, DriveError> {
        // Completions the next turn carries, held unacked until it completed (R3).
        let mut held: Vec<jetstream::Message> = Vec::new();
        loop {
            if let Some(end) = self.bound(index).await? {
                self.give_back(&held).await;
                self.settle_latest(index).await?;
                return Ok(Step::End(end));
            }
            let turn = match self.latest_turn(index) {
                None => {
                    if let Some(end) = self.over_rounds(index) {
                        return Ok(Step::End(end));
                    }
                    let t = self.run.turn_id(index, 0);
                    self.record_turn(index, &t, text.to_string(), None).await?;
                    t
                }
                // Resumed, or the hand-over recorded below: the latest turn.
                Some(t) if self.turn_record(&t).await?.is_some() => t,
                Some(_) => {
                    // Recorded in the run but its turn record was never written (a crash in
                    // between): drop it and hand over afresh.
                    self.forget_last_turn(index).await?;
                    continue;
                }
            };
            let this_round = std::mem::take(&mut held);
            let Some(record) = self.run_turn(&turn, &this_round).await? else {
                self.give_back(&this_round).await;
                return Ok(Step::Cancelled);
            };
            // Not recorded as handed over: nothing acked, the run's item is retried and
            // settles this ended turn again on its way through.
            settle(self.ctx, self.session, &record, &this_round).await?;
            self.settled = Some(turn.clone());
            tell_end(self.ctx, &record).await;
            if let TurnState::Failed { reason, detail, .. } = &record.state {
                // The run ends with its turn's reason (e.g. parent_transport_unavailable, R9).
                let why = format!("turn {} failed: {detail}", record.id);
                let exec = Some(record.id.clone().into());
                return Ok(Step::End(self.failed(reason, why, index, exec)));
            }
            self.event_round(index, &record).await;
            // Wait for everything this turn started, then take what came back.
            let started = match self.wait_children(index, &turn).await? {
                Wait::Settled(ids) => ids,
                Wait::Idle => {
                    let why = format!("no progress for {:?}", self.run.limits.idle_timeout);
                    let exec = Some(turn.into());
                    return Ok(Step::End(self.failed(
                        run_reason::IDLE_TIMEOUT,
                        why,
                        index,
                        exec,
                    )));
                }
                Wait::OverTime(end) => return Ok(Step::End(end)),
                Wait::Cancelled => return Ok(Step::Cancelled),
                Wait::RunCancelled => {
                    // Looked up again at the top of the loop, with the reason.
                    continue;
                }
            };
            let (carried, taken) = self.take_completions(&started).await?;
            if carried.is_empty() {
                // Nothing came back: the turn started nothing new (or only work whose
                // completions go elsewhere). The message is done.
                self.message_done(index).await?;
                return Ok(Step::Next);
            }
            if let Some(end) = self.over_rounds(index) {
                self.give_back(&taken).await;
                return Ok(Step::End(end));
            }
            let round = self.run.progress.get(index).map_or(0, |m| m.turns.len()) as u32;
            let next = self.run.turn_id(index, round);
            let completions: Vec<Completion> = carried.iter().map(|(c, _)| c.clone()).collect();
            let carried = delivery::carried(DeliveryId::new(), &carried);
            let text = delivery::render_batch(&completions);
            if let Err(e) = self.record_turn(index, &next, text, Some(carried)).await {
                self.give_back(&taken).await;
                return Err(e);
            }
            held = taken;
        }
    }

    /// A cancel recorded since the run last looked (R7: a cancelled run stops at a boundary).
    async fn cancelled(&mut self, index: usize) -> Result<Option<End>, DriveError> {
        if let Some((r, _)) = self
            .ctx
            .buckets
            .runs
            .get::<RunRecord>(self.run.id.as_str())
            .await?
        {
            self.run.cancel = r.cancel;
        }
        Ok(self.run.cancel.as_ref().map(|c| {
            let why = format!("cancelled by {} at {}", c.by, c.at);
            self.failed(run_reason::CANCELLED, why, index, None)
        }))
    }

    pub(super) fn over_time(&self, index: usize) -> Option<End> {
        let limit = self.run.limits.max_duration;
        let elapsed = (Utc::now() - self.started_at())
            .to_std()
            .unwrap_or_default();
        (elapsed > limit).then(|| {
            let why = format!("ran {elapsed:?}, over max_duration {limit:?}");
            self.failed(run_reason::MAX_DURATION, why, index, None)
        })
    }

    fn over_rounds(&self, index: usize) -> Option<End> {
        let limit = self.run.limits.max_rounds;
        (self.run.rounds() >= limit).then(|| {
            let why = format!("{} rounds reached max_rounds {limit}", self.run.rounds());
            self.failed(run_reason::MAX_ROUNDS, why, index, None)
        })
    }

    async fn turn_record(&self, turn: &TurnId) -> Result<Option<TurnRecord>, DriveError> {
        Ok(self
            .ctx
            .buckets
            .turns
            .get::<TurnRecord>(turn.as_str())
            .await?
            .map(|(r, _)| r))
    }

    /// Appends the turn to the run's progress (so a step started during it is parented to it,
    /// R6), then creates its record; both before it is typed (R14).
    async fn record_turn(
        &mut self,
        index: usize,
        turn: &TurnId,
        text: String,
        carried: Option<Carried>,
    ) -> Result<(), DriveError> {
        self.update(|r| {
            while r.progress.len() <= index {
                r.progress.push(MessageProgress::default());
            }
            if !r.progress[index].turns.contains(turn) {
                r.progress[index].turns.push(turn.clone());
            }
        })
        .await?;
        let record = TurnRecord::queued(turn.clone(), self.session.id.clone(), text)
            .carrying(carried)
            .under(ExecutionId::message(&self.run.id, index));
        self.ctx
            .buckets
            .turns
            .create(turn.as_str(), &record)
            .await?;
        Ok(())
    }

    async fn forget_last_turn(&mut self, index: usize) -> Result<(), DriveError> {
        self.update(|r| {
            if let Some(m) = r.progress.get_mut(index) {
                m.turns.pop();
            }
        })
        .await
    }

    async fn message_done(&mut self, index: usize) -> Result<(), DriveError> {
        self.update(|r| {
            while r.progress.len() <= index {
                r.progress.push(MessageProgress::default());
            }
            r.progress[index].done = true;
        })
        .await
    }

    /// Edits the run's progress, only while this driver's claim is the stored one. A run that
    /// has ended is never written again: its record is left as its end wrote it and this
    /// driver stops (`Ended`): another driver of the same run (its lane item handed out again,
    /// to this replica or another) got there first. A claim replaced by a later delivery's
    /// stops it too (`Superseded`), before it types or records anything more.
    async fn update(&mut self, f: impl Fn(&mut RunRecord)) -> Result<(), DriveError> {
        self.ctx.lease.hold().await?;
        let claim = &self.claim;
        let next = self
            .ctx
            .buckets
            .runs
            .edit::<RunRecord, _>(self.run.id.as_str(), |r| {
                if !r.state.is_terminal() && r.driver.as_ref() == Some(claim) {
                    f(r)
                }
            })
            .await?
            .ok_or(DriveError::Gone)?;
        self.check_claim(&next)?;
        self.run = next;
        Ok(())
    }

    /// `Ended` if the stored run has ended, `Superseded` if another claim replaced this one.
    fn check_claim(&self, stored: &RunRecord) -> Result<(), DriveError> {
        if stored.state.is_terminal() {
            return Err(DriveError::Ended);
        }
        if stored.driver.as_ref() != Some(&self.claim) {
            return Err(DriveError::Superseded);
        }
        Ok(())
    }

    /// Types the turn (unless it already ended) and waits for its outcome; `None` if cancelled.
    async fn run_turn(
        &self,
        turn: &TurnId,
        held: &[jetstream::Message],
    ) -> Result<Option<TurnRecord>, DriveError> {
        let waiter = self.ctx.turns.wait(turn);
        let (record, revision) = self
            .ctx
            .buckets
            .turns
            .get::<TurnRecord>(turn.as_str())
            .await?
            .ok_or(DriveError::Gone)?;
        if record.state.is_terminal() {
            return Ok(Some(record));
        }
        let command = TurnCommand {
            session: self.session.id.clone(),
            turn: turn.clone(),
            text: record.text.clone(),
            delivery: None,
            known: (record.state == TurnState::Queued).then_some(KnownTurn { revision, record }),
            unrecorded: false,
        };
        let sent = dispatch(self.ctx, self.session, self.msg, command, item_kind::RUN)
            .await
            .map_err(DriveError::Dispatch)?;
        Ok(wait_terminal(
            self.ctx,
            self.msg,
            Watch::recorded(&self.session.host, turn, &sent),
            waiter,
            self.cancel,
            held,
        )
        .await)
    }

    async fn event_round(&self, index: usize, record: &TurnRecord) {
        let data = json!({
            "message_index": index,
            "turn": record.id,
            "rounds": self.run.rounds(),
        });
        event(self.ctx, &self.run, EventKind::RunRound, data).await;
    }

    /// Records the end (R12) and emits `run.completed` or `run.failed`.
    pub(super) async fn end(&mut self, end: End) -> Result<(), DriveError> {
        self.ctx.lease.hold().await?;
        let state = end.state;
        let claim = &self.claim;
        let next = self
            .ctx
            .buckets
            .runs
            .modify::<RunRecord, _>(self.run.id.as_str(), |cur| match cur {
                Some(r) if !r.state.is_terminal() && r.driver.as_ref() == Some(claim) => {
                    Change::Write(RunRecord {
                        state: state.clone(),
                        ..r.clone()
                    })
                }
                _ => Change::Keep,
            })
            .await?
            .ok_or(DriveError::Gone)?;
        if !next.state.is_terminal() {
            return Err(DriveError::Superseded);
        }
        let k = if matches!(next.state, RunState::Completed { .. }) {
            EventKind::RunCompleted
        } else {
            // What the run started dies with it (R7): a completed run has none left (R5).
            self.cancel_owned_work(&next).await;
            EventKind::RunFailed
        };
        let data = json!({ "state": next.state, "rounds": next.rounds() });
        event(self.ctx, &next, k, data).await;
        self.run = next;
        Ok(())
    }
}

enum Step {
    Next,
    End(End),
    Cancelled,
}

pub(super) enum Wait {
    Settled(Vec<ExecutionId>),
    Idle,
    OverTime(End),
    /// This replica is stopping.
    Cancelled,
    /// The run itself was cancelled.
    RunCancelled,
}

/// Gives back what the run held, each nak confirmed by the server: the run's end rechecks
/// the session's pending completions next (`disarm_and_recheck`), and a nak still in flight
/// then would leave a completion counted as held, with no delivery armed for it.
pub(super) async fn nak_all(held: &[jetstream::Message]) {
    let naks = held.iter().map(|h| h.double_ack_with(AckKind::Nak(None)));
    for r in futures::future::join_all(naks).await {
        if let Err(e) = r {
            tracing::debug!(error = %e, "give back a held completion");
        }
    }
}
