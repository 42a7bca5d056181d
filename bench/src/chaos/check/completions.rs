//! R3, R4, R8 for completions: each ended step's completion is carried by exactly one
//! completed turn of each target session still active (owner or watcher, never anyone else),
//! and that turn was typed after the turn that started the step had ended.

use std::collections::HashMap;

use turnstile_shared::delivery::routes_completions;
use turnstile_shared::records::TurnState;
use turnstile_shared::{ExecutionId, SessionId, TurnId};

use super::super::history::{starting_turn, History};
use super::violation::Violation;

pub(super) fn check(history: &History, out: &mut Vec<Violation>) {
    let mut carried: HashMap<(SessionId, ExecutionId), Vec<TurnId>> = HashMap::new();
    for t in history.turns.values() {
        let (TurnState::Completed { typed_at, .. }, Some(delivery)) = (&t.state, &t.delivery)
        else {
            continue;
        };
        for c in &delivery.completions {
            carried
                .entry((t.session.clone(), c.execution.clone()))
                .or_default()
                .push(t.id.clone());
            if let Some(e) = history.executions.get(&c.execution) {
                if !e.may_receive(&t.session) {
                    out.push(Violation::HandedToStranger {
                        session: t.session.clone(),
                        execution: c.execution.clone(),
                        turn: t.id.clone(),
                    });
                }
            }
            let started_by = starting_turn(history, &c.execution);
            let start_end = started_by
                .as_ref()
                .and_then(|s| history.turns.get(s))
                .and_then(|s| match &s.state {
                    TurnState::Completed { ended_at, .. } | TurnState::Failed { ended_at, .. } => {
                        Some(*ended_at)
                    }
                    _ => None,
                });
            if let (Some(started_by), Some(end)) = (started_by, start_end) {
                if *typed_at < end {
                    out.push(Violation::HandedTooEarly {
                        execution: c.execution.clone(),
                        turn: t.id.clone(),
                        started_by,
                    });
                }
            }
        }
    }
    for ((session, execution), mut turns) in carried.clone() {
        if turns.len() > 1 {
            turns.sort();
            out.push(Violation::HandedOverTwice {
                session,
                execution,
                turns,
            });
        }
    }
    for e in history.executions.values() {
        if !routes_completions(e) {
            continue;
        }
        for target in e.targets() {
            let active = history.sessions.get(&target).is_some_and(|s| s.is_active());
            if active && !carried.contains_key(&(target.clone(), e.id.clone())) {
                out.push(Violation::NotHandedOver {
                    session: target,
                    execution: e.id.clone(),
                });
            }
        }
    }
}
