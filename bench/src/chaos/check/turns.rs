//! R9, R14 and liveness for turns: every accepted message reached its agent exactly once if
//! its turn completed, at most once if it failed (with a named reason), and no turn is left
//! queued or running once the stack went quiet.

use std::collections::HashMap;

use turnstile_shared::records::TurnState;

use super::super::history::History;
use super::violation::Violation;

pub(super) fn check(history: &History, out: &mut Vec<Violation>) {
    // A message text typed by two turns of one session cannot be told apart: not counted.
    let mut texts: HashMap<(&str, &str), usize> = HashMap::new();
    for t in history.turns.values() {
        *texts
            .entry((t.session.as_str(), t.text.as_str()))
            .or_default() += 1;
    }
    for t in history.turns.values() {
        let typed = history.transcripts.get(&t.session).and_then(|tx| {
            (texts.get(&(t.session.as_str(), t.text.as_str())) == Some(&1))
                .then(|| tx.iter().filter(|m| **m == t.text).count())
        });
        match (&t.state, typed) {
            (TurnState::Completed { .. }, Some(0)) => out.push(Violation::CompletedUntyped {
                session: t.session.clone(),
                turn: t.id.clone(),
            }),
            (TurnState::Completed { .. } | TurnState::Failed { .. }, Some(n)) if n > 1 => {
                out.push(Violation::TypedTwice {
                    session: t.session.clone(),
                    turn: t.id.clone(),
                    times: n,
                })
            }
            _ => {}
        }
        match &t.state {
            TurnState::Failed { reason, .. } if reason.trim().is_empty() => {
                out.push(Violation::FailedUnnamed { turn: t.id.clone() })
            }
            TurnState::Queued | TurnState::Running { .. } => out.push(Violation::TurnNotEnded {
                turn: t.id.clone(),
                state: state_name(&t.state),
            }),
            _ => {}
        }
    }
}

fn state_name(state: &TurnState) -> String {
    let name: &'static str = state.into();
    name.to_string()
}
