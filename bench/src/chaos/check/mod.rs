//! The history checker: what a campaign's history must show, whatever faults it met. Each
//! family of promises reads the [`History`] and reports what broke it as a [`Violation`] that
//! names the ids involved; an empty list is a clean history.
//!
//! - `turns`: every accepted message typed exactly once, or its turn failed with a named
//!   reason (R9, R14); every turn ended (liveness).
//! - `completions`: every completion handed over exactly once, only to its owner or a
//!   watcher (R8), in a turn after the one that started it (R3, R4).
//! - `steps`: no step's command started twice (R14); every cancellation ended only work its
//!   reason owns (R7).
//! - `runs`: a run's status is true to what happened (R12); every slot between a schedule's
//!   first and last record has one (R11).

mod completions;
mod runs;
mod steps;
#[cfg(test)]
mod tests;
mod turns;

use serde::Serialize;
use turnstile_shared::{ExecutionId, RunId, SessionId, StepId, TurnId};

use super::history::History;

/// One broken promise, with the ids a reader needs to look it up.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Violation {
    /// A message reached the agent more than once (R14).
    TypedTwice {
        session: SessionId,
        turn: TurnId,
        times: usize,
    },
    /// A turn recorded completed that its agent was never typed.
    CompletedUntyped { session: SessionId, turn: TurnId },
    /// A failed turn without a reason (R9).
    FailedUnnamed { turn: TurnId },
    /// A turn still queued or running after the stack went quiet (liveness).
    TurnNotEnded { turn: TurnId, state: String },
    /// A completion carried by more than one completed turn of a session (R3, R14).
    HandedOverTwice {
        session: SessionId,
        execution: ExecutionId,
        turns: Vec<TurnId>,
    },
    /// An ended execution's completion never handed to a target that is still active (R3).
    NotHandedOver {
        session: SessionId,
        execution: ExecutionId,
    },
    /// A completion handed to a session that neither owns nor watches it (R8).
    HandedToStranger {
        session: SessionId,
        execution: ExecutionId,
        turn: TurnId,
    },
    /// A completion typed before the turn that started its execution had ended (R3, R4).
    HandedTooEarly {
        execution: ExecutionId,
        turn: TurnId,
        started_by: TurnId,
    },
    /// A step's command started more than once (R14).
    StepRanTwice { step: StepId, times: u32 },
    /// A cancellation whose reason does not own what it ended (R7).
    CancelledUnowned {
        execution: ExecutionId,
        reason: String,
        why: String,
    },
    /// A run whose recorded status is not what happened (R12).
    RunUntrue { run: RunId, why: String },
    /// A run still going after the stack went quiet (liveness).
    RunNotEnded { run: RunId, state: String },
    /// A slot of a schedule with no record between two that have one (R11).
    SlotUnaccounted { schedule: String, slot: String },
}

impl Violation {
    /// The kind's name, as counted in the campaign's figures.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TypedTwice { .. } => "typed_twice",
            Self::CompletedUntyped { .. } => "completed_untyped",
            Self::FailedUnnamed { .. } => "failed_unnamed",
            Self::TurnNotEnded { .. } => "turn_not_ended",
            Self::HandedOverTwice { .. } => "handed_over_twice",
            Self::NotHandedOver { .. } => "not_handed_over",
            Self::HandedToStranger { .. } => "handed_to_stranger",
            Self::HandedTooEarly { .. } => "handed_too_early",
            Self::StepRanTwice { .. } => "step_ran_twice",
            Self::CancelledUnowned { .. } => "cancelled_unowned",
            Self::RunUntrue { .. } => "run_untrue",
            Self::RunNotEnded { .. } => "run_not_ended",
            Self::SlotUnaccounted { .. } => "slot_unaccounted",
        }
    }
}

/// Every violation in `history`, family by family (an empty list: the history is clean).
pub fn check(history: &History) -> Vec<Violation> {
    let mut out = Vec::new();
    turns::check(history, &mut out);
    completions::check(history, &mut out);
    steps::check(history, &mut out);
    runs::check(history, &mut out);
    out
}

/// The turn (or delivery turn) that started `execution`: the first turn up its parents.
fn starting_turn(history: &History, execution: &ExecutionId) -> Option<TurnId> {
    let mut at = history.executions.get(execution)?.parent.clone();
    for _ in 0..64 {
        let id = at?;
        if let Some(turn) = id.as_turn() {
            return Some(turn);
        }
        at = history.executions.get(&id)?.parent.clone();
    }
    None
}
