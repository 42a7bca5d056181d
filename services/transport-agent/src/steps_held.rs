//! The `command` steps this transport process has taken: the ones it runs now, and the last
//! ones it finished. A step's work message can come back to the same process (its ack wait
//! ran out while the process held it, or its ack was lost), and the broker takes a start from
//! the worker that holds a step as a retry of that start. So:
//! - a copy that comes while the step runs here is dropped (its first delivery acks);
//! - a copy that comes after the step ran here and its end was reported is acked and not run:
//!   the broker takes the report by storing the end and records it in the registry a moment
//!   later, and until then the step still reads `running` by this worker, which would start
//!   it again (R14; the fault campaign saw steps started twice across a NATS quorum loss).
//!
//! Finished steps are remembered up to [`KEPT`], the oldest forgotten first: a copy comes back
//! within an ack wait or a server restart, and the registry has long recorded the end by then.

use std::collections::{HashSet, VecDeque};

use turnstile_shared::StepId;

/// Finished steps remembered (about 40 bytes each).
const KEPT: usize = 4096;

/// What a delivery of a step's work is to this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Not seen here: run it (the broker decides whether it may start).
    Fresh,
    /// Running here now: a duplicate of the delivery being served.
    Running,
    /// Run here and reported: a copy that came back.
    Finished,
}

#[derive(Debug, Default)]
pub(crate) struct StepsHeld {
    running: HashSet<StepId>,
    finished: HashSet<StepId>,
    order: VecDeque<StepId>,
}

impl StepsHeld {
    /// Takes a delivery of `step`'s work: `Fresh` marks it running.
    pub(crate) fn claim(&mut self, step: &StepId) -> Claim {
        if self.finished.contains(step) {
            Claim::Finished
        } else if self.running.insert(step.clone()) {
            Claim::Fresh
        } else {
            Claim::Running
        }
    }

    /// The step's end was reported (or the broker refused its start): never run here again.
    pub(crate) fn finish(&mut self, step: &StepId) {
        self.running.remove(step);
        if self.finished.insert(step.clone()) {
            self.order.push_back(step.clone());
        }
        while self.order.len() > KEPT {
            if let Some(old) = self.order.pop_front() {
                self.finished.remove(&old);
            }
        }
    }

    /// The step was let go unreported (the process is stopping): another delivery may run it.
    pub(crate) fn release(&mut self, step: &StepId) {
        self.running.remove(step);
    }

    pub(crate) fn running(&self) -> usize {
        self.running.len()
    }

    /// Not a per-session map (bounded by [`KEPT`], kept after sessions stop): not exposed as
    /// `turnstile_session_state_entries`.
    #[cfg(test)]
    fn finished(&self) -> usize {
        self.finished.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_that_ran_here_is_never_run_here_again_and_memory_is_bounded() {
        let mut held = StepsHeld::default();
        let s = StepId::new();
        assert_eq!(held.claim(&s), Claim::Fresh);
        assert_eq!(held.claim(&s), Claim::Running, "a copy while it runs");
        held.finish(&s);
        assert_eq!(held.claim(&s), Claim::Finished, "a copy after its report");
        assert_eq!(held.running(), 0);
        // Let go unreported: the next delivery runs it.
        let t = StepId::new();
        assert_eq!(held.claim(&t), Claim::Fresh);
        held.release(&t);
        assert_eq!(held.claim(&t), Claim::Fresh);
        // Bounded: the oldest finished are forgotten.
        for _ in 0..KEPT + 10 {
            let id = StepId::new();
            held.claim(&id);
            held.finish(&id);
        }
        assert_eq!(held.finished(), KEPT);
        assert_eq!(held.claim(&s), Claim::Fresh, "the oldest was forgotten");
    }
}
