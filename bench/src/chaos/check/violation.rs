//! What the checker reports: one broken promise with the ids a reader needs. Apart from
//! `mod.rs`, which runs the families of checks, because each family's file builds these.

use serde::Serialize;
use turnstile_shared::{ExecutionId, RunId, SessionId, StepId, TurnId};

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
