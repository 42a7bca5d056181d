//! What becomes of each due slot (R11), decided without I/O so every rule is unit-tested:
//! paused schedules skip, slots outside the catch-up window are missed, the catch-up policy
//! picks which missed slots fire, and the overlap policy decides against a run still going.

use chrono::{DateTime, Utc};
use turnstile_shared::schedules::{Catchup, Overlap, ScheduleRecord, ScheduleSpec};
use turnstile_shared::RunId;

/// Named reasons on `skipped` and `missed` slot records; documented in docs/runs-and-schedules.md.
pub mod slot_reason {
    pub const PAUSED: &str = "paused";
    pub const OVERLAP: &str = "overlap";
    pub const BUFFER_FULL: &str = "buffer_full";
    pub const OUTSIDE_CATCHUP_WINDOW: &str = "outside_catchup_window";
    pub const CATCHUP_LATEST: &str = "catchup_latest";
    pub const CATCHUP_NONE: &str = "catchup_none";
    /// A slot before the cursor found with no record (a store fault lost what decided it;
    /// `audit`): it did not fire.
    pub const RECORD_LOST: &str = "record_lost";
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    Fire,
    /// `cancel_other`: cancel the running run, then fire.
    CancelAndFire {
        cancel: RunId,
    },
    /// `buffer_one`: held until the running run ends, then fired (and recorded then).
    Buffer,
    Skip {
        reason: &'static str,
        yielded_to: Option<RunId>,
    },
    Miss {
        reason: &'static str,
    },
}

/// The state the decision depends on.
pub struct Situation<'a> {
    pub now: DateTime<Utc>,
    pub paused: bool,
    /// The schedule's run that still goes, if any.
    pub running: Option<&'a RunId>,
    /// A slot is already buffered.
    pub buffered: bool,
}

/// Decides every due slot, in order. `fired_run` names the run a fired slot starts, so a
/// later slot of the same batch is judged against it.
pub fn decide(
    spec: &ScheduleSpec,
    due: &[DateTime<Utc>],
    at: &Situation<'_>,
    fired_run: impl Fn(DateTime<Utc>) -> Option<RunId>,
) -> Vec<Decision> {
    if at.paused {
        return due
            .iter()
            .map(|_| Decision::Skip {
                reason: slot_reason::PAUSED,
                yielded_to: None,
            })
            .collect();
    }
    let age = |slot: &DateTime<Utc>| (at.now - *slot).to_std().unwrap_or_default();
    let in_window: Vec<bool> = due.iter().map(|s| age(s) <= spec.catchup_window).collect();
    let candidates: Vec<usize> = (0..due.len()).filter(|i| in_window[*i]).collect();
    // On time: the one due slot, within the late threshold. Anything else is catching up.
    let catching_up = candidates.len() > 1
        || candidates
            .iter()
            .any(|i| age(&due[*i]) > spec.late_threshold);
    let mut out = Vec::with_capacity(due.len());
    let mut running = at.running.cloned();
    let mut buffered = at.buffered;
    for (i, slot) in due.iter().enumerate() {
        if !in_window[i] {
            out.push(Decision::Miss {
                reason: slot_reason::OUTSIDE_CATCHUP_WINDOW,
            });
            continue;
        }
        if catching_up {
            let last = candidates.last() == Some(&i);
            match spec.catchup {
                Catchup::None => {
                    out.push(Decision::Miss {
                        reason: slot_reason::CATCHUP_NONE,
                    });
                    continue;
                }
                Catchup::Latest if !last => {
                    out.push(Decision::Miss {
                        reason: slot_reason::CATCHUP_LATEST,
                    });
                    continue;
                }
                Catchup::Latest | Catchup::All => {}
            }
        }
        let decision = match (&running, spec.overlap) {
            (None, _) | (Some(_), Overlap::AllowAll) => Decision::Fire,
            (Some(r), Overlap::Skip) => Decision::Skip {
                reason: slot_reason::OVERLAP,
                yielded_to: Some(r.clone()),
            },
            (Some(_), Overlap::BufferOne) if !buffered => Decision::Buffer,
            (Some(r), Overlap::BufferOne) => Decision::Skip {
                reason: slot_reason::BUFFER_FULL,
                yielded_to: Some(r.clone()),
            },
            (Some(r), Overlap::CancelOther) => Decision::CancelAndFire { cancel: r.clone() },
        };
        match &decision {
            Decision::Fire | Decision::CancelAndFire { .. } => {
                running = fired_run(*slot).or(running)
            }
            Decision::Buffer => buffered = true,
            _ => {}
        }
        out.push(decision);
    }
    out
}

/// Applies a pass's result (`before` -> `after`) to the record as it is now, when another
/// writer (the other scheduler replica's pass, an API call) changed it during the pass. The
/// cursor only moves forward; a buffered slot is cleared only if it is the one this pass
/// fired: another replica's pass may have buffered a later slot meanwhile, and that slot has
/// no record of its own yet, so clearing it would lose it (R11: the campaign found a
/// `buffer_one` slot with no record, between two that had one).
pub fn merge_pass(current: &mut ScheduleRecord, before: &ScheduleRecord, after: &ScheduleRecord) {
    current.cursor = current.cursor.max(after.cursor);
    if before.buffered.is_some()
        && after.buffered != before.buffered
        && current.buffered == before.buffered
    {
        current.buffered = after.buffered;
    }
    if let (None, Some(b)) = (before.buffered, after.buffered) {
        current.buffered.get_or_insert(b);
    }
    if after.last_run != before.last_run {
        current.last_run = after.last_run.clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use turnstile_shared::schedules::slot_run;

    fn spec(overlap: Overlap, catchup: Catchup) -> ScheduleSpec {
        ScheduleSpec {
            name: "s".into(),
            cron: "* * * * *".into(),
            tz: "UTC".into(),
            session: turnstile_shared::SessionId::new(),
            messages: vec!["m".into()],
            finalizer: None,
            overlap,
            catchup_window: Duration::from_secs(600),
            catchup,
            late_threshold: Duration::from_secs(30),
            limits: Default::default(),
        }
    }

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    fn at(now: i64, running: Option<&RunId>) -> Situation<'_> {
        Situation {
            now: t(now),
            paused: false,
            running,
            buffered: false,
        }
    }

    fn run_of(s: DateTime<Utc>) -> Option<RunId> {
        slot_run("s", s)
    }

    #[test]
    fn an_on_time_slot_fires_and_a_paused_one_skips() {
        let s = spec(Overlap::Skip, Catchup::Latest);
        assert_eq!(
            decide(&s, &[t(0)], &at(1, None), run_of),
            vec![Decision::Fire]
        );
        let paused = Situation {
            paused: true,
            ..at(1, None)
        };
        assert!(matches!(
            decide(&s, &[t(0)], &paused, run_of)[0],
            Decision::Skip {
                reason: slot_reason::PAUSED,
                ..
            }
        ));
    }

    #[test]
    fn overlap_skip_names_the_running_run_and_buffer_one_keeps_one() {
        let other = RunId::new();
        let s = spec(Overlap::Skip, Catchup::All);
        assert_eq!(
            decide(&s, &[t(0)], &at(1, Some(&other)), run_of),
            vec![Decision::Skip {
                reason: slot_reason::OVERLAP,
                yielded_to: Some(other.clone())
            }]
        );
        let b = spec(Overlap::BufferOne, Catchup::All);
        let d = decide(&b, &[t(0), t(60)], &at(61, Some(&other)), run_of);
        assert_eq!(d[0], Decision::Buffer);
        assert!(
            matches!(&d[1], Decision::Skip { reason: slot_reason::BUFFER_FULL, yielded_to: Some(r) } if *r == other)
        );
        let c = spec(Overlap::CancelOther, Catchup::All);
        let d = decide(&c, &[t(0), t(60)], &at(61, Some(&other)), run_of);
        assert_eq!(
            d[0],
            Decision::CancelAndFire {
                cancel: other.clone()
            }
        );
        // The next slot's overlap is with the run the first one fired.
        assert_eq!(
            d[1],
            Decision::CancelAndFire {
                cancel: run_of(t(0)).expect("id")
            }
        );
        let a = spec(Overlap::AllowAll, Catchup::All);
        assert_eq!(
            decide(&a, &[t(0)], &at(1, Some(&other)), run_of),
            vec![Decision::Fire]
        );
    }

    #[test]
    fn catch_up_follows_window_and_policy() {
        // Down from t(0) to t(1000): slots every 100 s; window 600 s.
        let due: Vec<_> = (0..10).map(|i| t(i * 100)).collect();
        let latest = decide(
            &spec(Overlap::AllowAll, Catchup::Latest),
            &due,
            &at(1000, None),
            run_of,
        );
        assert!(matches!(
            latest[3],
            Decision::Miss {
                reason: slot_reason::OUTSIDE_CATCHUP_WINDOW
            }
        ));
        assert!(matches!(
            latest[4],
            Decision::Miss {
                reason: slot_reason::CATCHUP_LATEST
            }
        ));
        assert_eq!(latest[9], Decision::Fire);
        assert_eq!(latest.iter().filter(|d| **d == Decision::Fire).count(), 1);
        let all = decide(
            &spec(Overlap::AllowAll, Catchup::All),
            &due,
            &at(1000, None),
            run_of,
        );
        assert_eq!(all.iter().filter(|d| **d == Decision::Fire).count(), 6);
        let none = decide(
            &spec(Overlap::AllowAll, Catchup::None),
            &due,
            &at(1000, None),
            run_of,
        );
        assert!(none.iter().all(|d| matches!(d, Decision::Miss { .. })));
        // With skip, catching up "all" fires the first and skips the rest for it.
        let skip = decide(
            &spec(Overlap::Skip, Catchup::All),
            &due,
            &at(1000, None),
            run_of,
        );
        assert_eq!(skip[4], Decision::Fire);
        assert!(
            matches!(&skip[5], Decision::Skip { yielded_to: Some(r), .. } if Some(r.clone()) == run_of(t(400)))
        );
        // A single slot merely late beyond the threshold is catching up too.
        let late = decide(
            &spec(Overlap::Skip, Catchup::None),
            &[t(0)],
            &at(45, None),
            run_of,
        );
        assert!(matches!(
            late[0],
            Decision::Miss {
                reason: slot_reason::CATCHUP_NONE
            }
        ));
    }

    fn record(cursor: i64, buffered: Option<i64>) -> ScheduleRecord {
        ScheduleRecord {
            spec: spec(Overlap::BufferOne, Catchup::Latest),
            created_at: t(0),
            cursor: t(cursor),
            paused: None,
            last_run: None,
            buffered: buffered.map(t),
        }
    }

    #[test]
    fn a_slot_another_pass_buffered_meanwhile_survives_this_pass_firing_the_earlier_one() {
        // This pass fired the slot buffered at 60 and moved the cursor to 120; meanwhile the
        // other replica's pass buffered the slot at 180 (cursor 180).
        let before = record(60, Some(60));
        let after = record(120, None);
        let mut current = record(180, Some(180));
        merge_pass(&mut current, &before, &after);
        assert_eq!(
            current.buffered,
            Some(t(180)),
            "the later buffered slot was dropped"
        );
        assert_eq!(current.cursor, t(180));
        // Nobody changed it meanwhile: the fired slot is no longer buffered.
        let mut current = record(60, Some(60));
        merge_pass(&mut current, &before, &after);
        assert_eq!(current.buffered, None);
        assert_eq!(current.cursor, t(120));
        // This pass fired the buffered slot and buffered a later one itself.
        let after = record(180, Some(180));
        let mut current = record(60, Some(60));
        merge_pass(&mut current, &before, &after);
        assert_eq!(current.buffered, Some(t(180)));
    }
}
