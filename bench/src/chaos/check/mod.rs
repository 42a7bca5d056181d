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
mod violation;

use super::history::History;
pub use violation::Violation;

/// Every violation in `history`, family by family (an empty list: the history is clean).
pub fn check(history: &History) -> Vec<Violation> {
    let mut out = Vec::new();
    turns::check(history, &mut out);
    completions::check(history, &mut out);
    steps::check(history, &mut out);
    runs::check(history, &mut out);
    out
}
