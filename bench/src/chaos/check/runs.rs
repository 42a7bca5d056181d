//! R12, R11 and liveness for runs and slots: a run recorded completed ran every message and
//! its finalizer to completion with all it started ended; a failed run names why; no run is
//! left going; between a schedule's first and last slot record every slot has one.

use turnstile_scheduler::cron::CronSpec;
use turnstile_shared::execution::ExecKind;
use turnstile_shared::records::TurnState;
use turnstile_shared::runs::RunState;

use super::super::history::{starting_turn, History};
use super::violation::Violation;

pub(super) fn check(history: &History, out: &mut Vec<Violation>) {
    for run in history.runs.values() {
        let untrue = |why: String| Violation::RunUntrue {
            run: run.id.clone(),
            why,
        };
        match &run.state {
            RunState::Completed { .. } => {
                let expected = run.messages.len() + usize::from(run.finalizer.is_some());
                if run.progress.len() != expected || run.progress.iter().any(|m| !m.done) {
                    out.push(untrue(format!(
                        "completed with {} of {expected} messages done",
                        run.progress.iter().filter(|m| m.done).count()
                    )));
                }
                for turn in run.progress.iter().flat_map(|m| m.turns.iter()) {
                    match history.turns.get(turn).map(|t| &t.state) {
                        Some(TurnState::Completed { .. }) => {}
                        other => out.push(untrue(format!(
                            "completed, but its turn {turn} is {}",
                            other.map_or("missing", |s| s.into())
                        ))),
                    }
                }
                for e in history.executions.values() {
                    let mine = e.kind == ExecKind::Step
                        && starting_turn(history, &e.id)
                            .is_some_and(|t| run.progress.iter().any(|m| m.turns.contains(&t)));
                    if mine && !e.status.is_terminal() {
                        out.push(untrue(format!(
                            "completed, but its step {} still runs",
                            e.id
                        )));
                    }
                }
            }
            RunState::Failed { reason, .. } if reason.trim().is_empty() => {
                out.push(untrue("failed without a reason".to_string()))
            }
            RunState::Failed { .. } => {}
            other => out.push(Violation::RunNotEnded {
                run: run.id.clone(),
                state: serde_json::to_value(other)
                    .ok()
                    .and_then(|v| v["status"].as_str().map(str::to_string))
                    .unwrap_or_default(),
            }),
        }
    }
    slots(history, out);
}

/// R11: consecutive slot records of a schedule leave no slot of its cron between them.
fn slots(history: &History, out: &mut Vec<Violation>) {
    for schedule in &history.schedules {
        let Ok(cron) = CronSpec::parse(&schedule.cron, &schedule.zone) else {
            continue;
        };
        let mut times: Vec<_> = history
            .slots
            .iter()
            .filter(|s| s.schedule == schedule.name)
            .map(|s| s.slot)
            .collect();
        times.sort();
        times.dedup();
        for pair in times.windows(2) {
            let mut at = pair[0];
            while let Some(next) = cron.next_after(at) {
                if next >= pair[1] {
                    break;
                }
                out.push(Violation::SlotUnaccounted {
                    schedule: schedule.name.clone(),
                    slot: next.to_rfc3339(),
                });
                at = next;
            }
        }
    }
}
