//! R14 and R7 for steps: no step's command started twice, and every cancellation ended only
//! what its reason owns: `turn_ended` only `turn`-scoped work, `session_stopped` only work of
//! a session that stopped, `parent_cancelled` only work under a cancelled parent, and nothing
//! `detached` but by an operator's own cancel.

use turnstile_shared::execution::{exec_reason, ExecKind, ExecStatus, Scope};

use super::super::history::History;
use super::violation::Violation;

pub(super) fn check(history: &History, out: &mut Vec<Violation>) {
    for (step, times) in &history.step_starts {
        if *times > 1 {
            out.push(Violation::StepRanTwice {
                step: step.clone(),
                times: *times,
            });
        }
    }
    for e in history.executions.values() {
        let ExecStatus::Cancelled { reason, .. } = &e.status else {
            continue;
        };
        if e.kind != ExecKind::Step {
            continue;
        }
        let why = match reason.as_str() {
            exec_reason::TURN_ENDED if e.scope != Scope::Turn => {
                Some(format!("a {} step ended with its turn", e.scope))
            }
            exec_reason::SESSION_STOPPED => {
                let stopped = e
                    .owner
                    .as_ref()
                    .and_then(|o| history.sessions.get(o))
                    .is_some_and(|s| !s.is_active());
                (!stopped).then(|| "its owner session did not stop".to_string())
            }
            exec_reason::PARENT_CANCELLED => {
                let parent_cancelled = e
                    .parent
                    .as_ref()
                    .and_then(|p| history.executions.get(p))
                    .is_some_and(|p| matches!(p.status, ExecStatus::Cancelled { .. }));
                (!parent_cancelled).then(|| "its parent was not cancelled".to_string())
            }
            exec_reason::CANCELLED => None,
            _ if e.scope == Scope::Detached => {
                Some("detached work cancelled by something it does not belong to".to_string())
            }
            _ => None,
        };
        if let Some(why) = why {
            out.push(Violation::CancelledUnowned {
                execution: e.id.clone(),
                reason: reason.clone(),
                why,
            });
        }
    }
}
