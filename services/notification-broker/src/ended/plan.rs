//! What routing an end does for one target session, decided apart from doing it.
//!
//! [`super::route`] gathers what it knows of a target (whether this end wrote the end, whether
//! its marker create succeeded, whether an item naming the execution is out, whether the
//! session is active, whether the completion's store came late) and then carries out the one
//! [`TargetPlan`] that [`plan`] makes of it. The decision is a pure function, so every case of
//! it is tested on its own; the executor only does I/O. An end routed ahead ([`super::Early`])
//! and one routed from the queue go through the same decision: "ahead" only changes what is
//! known (the item may be out already).

use turnstile_shared::arming::Trust;

/// What is known of one target once its completion is stored and its session read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Known {
    /// This call wrote the end (rather than finding it recorded: a repeat).
    pub wrote: bool,
    /// This end created the target's delivery marker.
    pub created: bool,
    /// A lane item naming the execution is out for that marker.
    pub published: bool,
    /// The target session is active (a stopped one hands nothing over).
    pub active: bool,
    /// The completion's store took at least half the delivery's first wait.
    pub stored_late: bool,
}

/// The one thing routing does for a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TargetPlan {
    /// The session is stopped: the completion stays on the stream for operators, every item
    /// this end put out is taken back, and the delivery marker is removed: this end's own, or
    /// one claimed trusting only the lane.
    Stopped { claim: Option<Trust> },
    /// This end armed the delivery and its item, naming the execution, is out. A store that
    /// came late arms again: the delivery may have stopped waiting for it.
    First { arm_again: bool },
    /// This end created the marker but wrote nothing (a repeat): its item goes out now, after
    /// the store, naming nothing (the completion may be handed over already).
    Repeat,
    /// A delivery was armed already: it is claimed (see [`Trust`]) and, if claimed, an item
    /// naming nothing goes out for it, the completion being stored.
    Claim(Trust),
}

/// Whether the item naming the execution goes out as soon as the marker create succeeds (before
/// the session is read): only for an end this call wrote, whose item did not go out ahead.
pub(super) fn publishes_first(wrote: bool, created: bool, published_ahead: bool) -> bool {
    wrote && created && !published_ahead
}

/// The plan for one target.
pub(super) fn plan(k: Known) -> TargetPlan {
    if !k.active {
        return TargetPlan::Stopped {
            claim: (!k.created).then_some(Trust::OnlyTheLane),
        };
    }
    match (k.created, k.published) {
        (true, true) => TargetPlan::First {
            arm_again: k.stored_late,
        },
        (true, false) => TargetPlan::Repeat,
        // A first recording trusts a young marker's router; a repeat trusts only the lane (it
        // may be the last one able to publish that marker's item).
        (false, _) => TargetPlan::Claim(if k.wrote {
            Trust::YoungMarkers
        } else {
            Trust::OnlyTheLane
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(wrote: bool, created: bool, published: bool, active: bool) -> Known {
        Known {
            wrote,
            created,
            published,
            active,
            stored_late: false,
        }
    }

    #[test]
    fn a_stopped_session_gets_nothing_and_its_marker_is_removed() {
        for wrote in [true, false] {
            for published in [true, false] {
                assert_eq!(
                    plan(known(wrote, true, published, false)),
                    TargetPlan::Stopped { claim: None },
                    "its own marker, no claim"
                );
                assert_eq!(
                    plan(known(wrote, false, published, false)),
                    TargetPlan::Stopped {
                        claim: Some(Trust::OnlyTheLane)
                    },
                    "another router's marker: trusted to the lane only"
                );
            }
        }
    }

    #[test]
    fn a_first_recording_arms_again_only_when_its_store_came_late() {
        assert_eq!(
            plan(known(true, true, true, true)),
            TargetPlan::First { arm_again: false }
        );
        let late = Known {
            stored_late: true,
            ..known(true, true, true, true)
        };
        assert_eq!(plan(late), TargetPlan::First { arm_again: true });
    }

    #[test]
    fn a_repeat_with_its_own_marker_sends_an_item_naming_nothing() {
        assert_eq!(plan(known(false, true, false, true)), TargetPlan::Repeat);
    }

    #[test]
    fn an_armed_delivery_is_claimed_trusting_young_markers_only_on_a_first_recording() {
        assert_eq!(
            plan(known(true, false, false, true)),
            TargetPlan::Claim(Trust::YoungMarkers)
        );
        assert_eq!(
            plan(known(false, false, false, true)),
            TargetPlan::Claim(Trust::OnlyTheLane)
        );
    }

    #[test]
    fn the_item_naming_the_execution_goes_out_early_only_for_an_end_this_call_wrote() {
        assert!(publishes_first(true, true, false));
        assert!(!publishes_first(false, true, false), "a repeat");
        assert!(!publishes_first(true, false, false), "no marker of its own");
        assert!(!publishes_first(true, true, true), "out ahead already");
    }
}
