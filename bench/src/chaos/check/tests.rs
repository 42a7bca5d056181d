//! The checker is able to fail: a clean history passes, and each kind of violation planted in
//! it is reported, with its ids.

use chrono::{DateTime, Duration, Utc};
use turnstile_shared::execution::{
    exec_reason, ExecKind, ExecStatus, ExecutionRecord, Scope, StepResult,
};
use turnstile_shared::records::{
    AgentKind, Carried, CarriedCompletion, SessionRecord, SessionState, TurnRecord, TurnState,
};
use turnstile_shared::runs::{MessageProgress, RunRecord, RunState};
use turnstile_shared::schedules::{SlotOutcome, SlotRecord};
use turnstile_shared::{DeliveryId, ExecutionId, RunId, SessionId, StepId, TurnId};

use super::super::history::{History, ScheduleCron};
use super::{check, Violation};

fn at(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default() + Duration::seconds(secs)
}

fn completed(typed: i64, ended: i64) -> TurnState {
    TurnState::Completed {
        host: "h1".parse().expect("host"),
        typed_at: at(typed),
        ended_at: at(ended),
        output: vec![],
    }
}

/// A clean history: one session whose turn (typed once) started a step, whose completion the
/// next turn carried; a completed run of one message; a schedule with two consecutive slots.
struct Clean {
    h: History,
    session: SessionId,
    turn: TurnId,
    step: ExecutionId,
    delivery: TurnId,
    run: RunId,
}

fn clean() -> Clean {
    let mut h = History::default();
    let session = SessionId::new();
    h.sessions.insert(
        session.clone(),
        SessionRecord {
            id: session.clone(),
            name: "s".into(),
            agent: AgentKind::Mock,
            host: "h1".parse().expect("host"),
            cwd: None,
            token: "t".into(),
            created_at: at(0),
            conversation: None,
            launch: None,
            ready_timeout_ms: None,
            policy: Default::default(),
            state: SessionState::Active,
        },
    );
    let turn = TurnId::new();
    let add_turn = |h: &mut History, id: &TurnId, text: &str, state, delivery| {
        h.turns.insert(
            id.clone(),
            TurnRecord {
                id: id.clone(),
                session: session.clone(),
                text: text.into(),
                queued_at: at(0),
                delivery,
                parent: None,
                state,
            },
        );
    };
    add_turn(&mut h, &turn, "start [m-1]", completed(1, 2), None);
    let step_id = StepId::new();
    let step = ExecutionId::from(&step_id);
    h.executions.insert(
        step.clone(),
        ExecutionRecord {
            id: step.clone(),
            kind: ExecKind::Step,
            name: "job".into(),
            parent: Some(ExecutionId::from(&turn)),
            scope: Scope::Session,
            session: session.clone(),
            owner: Some(session.clone()),
            watchers: vec![],
            created_at: at(1),
            work: None,
            token: None,
            children: vec![],
            handed_over: Vec::new(),
            status: ExecStatus::Completed {
                started_at: Some(at(1)),
                ended_at: at(3),
                result: StepResult {
                    exit_code: Some(0),
                    summary: "exit 0".into(),
                    output: vec![],
                },
            },
        },
    );
    h.step_starts.insert(step_id, 1);
    let delivery = TurnId::new();
    let carried = Carried {
        delivery: DeliveryId::new(),
        completions: vec![CarriedCompletion {
            execution: step.clone(),
            seq: 1,
        }],
    };
    add_turn(
        &mut h,
        &delivery,
        "[turnstile] 1 background execution finished: job",
        completed(4, 5),
        Some(carried),
    );
    h.transcripts.insert(
        session.clone(),
        vec![
            "start [m-1]".into(),
            "[turnstile] 1 background execution finished: job".into(),
        ],
    );
    let run = RunId::new();
    let run_turn = run.turn(0, 0);
    add_turn(&mut h, &run_turn, "run [m-2]", completed(6, 7), None);
    h.transcripts
        .get_mut(&session)
        .expect("transcript")
        .push("run [m-2]".into());
    h.runs.insert(
        run.clone(),
        RunRecord {
            id: run.clone(),
            session: session.clone(),
            schedule: None,
            created_at: at(5),
            messages: vec!["run [m-2]".into()],
            finalizer: None,
            limits: Default::default(),
            progress: vec![MessageProgress {
                turns: vec![run_turn],
                done: true,
            }],
            cancel: None,
            attempt: 0,
            driver: None,
            state: RunState::Completed {
                started_at: at(6),
                ended_at: at(7),
            },
        },
    );
    h.schedules.push(ScheduleCron {
        name: "tick".into(),
        cron: "*/2 * * * * *".into(),
        zone: "UTC".into(),
    });
    for secs in [10, 12] {
        h.slots.push(SlotRecord {
            schedule: "tick".into(),
            slot: at(secs),
            recorded_at: at(secs),
            outcome: SlotOutcome::Skipped {
                reason: "busy".into(),
                yielded_to: None,
            },
        });
    }
    Clean {
        h,
        session,
        turn,
        step,
        delivery,
        run,
    }
}

fn kinds(h: &History) -> Vec<&'static str> {
    let mut k: Vec<_> = check(h).iter().map(Violation::kind).collect();
    k.sort();
    k
}

#[test]
fn a_clean_history_has_no_violation() {
    let c = clean();
    assert_eq!(check(&c.h), vec![]);
}

#[test]
fn a_message_typed_twice_is_reported() {
    let mut c = clean();
    let tx = c.h.transcripts.get_mut(&c.session).expect("transcript");
    tx.push("start [m-1]".into());
    assert_eq!(
        check(&c.h),
        vec![Violation::TypedTwice {
            session: c.session.clone(),
            turn: c.turn.clone(),
            times: 2
        }]
    );
}

#[test]
fn a_completed_turn_never_typed_is_reported() {
    let mut c = clean();
    c.h.transcripts
        .get_mut(&c.session)
        .expect("transcript")
        .retain(|m| m != "start [m-1]");
    assert_eq!(kinds(&c.h), ["completed_untyped"]);
}

#[test]
fn a_failed_turn_without_a_reason_and_a_turn_left_running_are_reported() {
    let mut c = clean();
    let t = c.h.turns.get_mut(&c.turn).expect("turn");
    t.state = TurnState::Failed {
        ended_at: at(2),
        reason: " ".into(),
        detail: String::new(),
        output: vec![],
    };
    assert_eq!(kinds(&c.h), ["failed_unnamed"]);
    let t = c.h.turns.get_mut(&c.turn).expect("turn");
    t.state = TurnState::Running {
        host: "h1".parse().expect("host"),
        typed_at: at(1),
        mark: None,
    };
    // Its step's completion was then typed before the turn ended: not checkable, not flagged.
    assert_eq!(kinds(&c.h), ["turn_not_ended"]);
}

#[test]
fn a_completion_handed_over_twice_is_reported() {
    let mut c = clean();
    let mut again = c.h.turns[&c.delivery].clone();
    again.id = TurnId::new();
    again.text = "[turnstile] again".into();
    c.h.turns.insert(again.id.clone(), again.clone());
    c.h.transcripts
        .get_mut(&c.session)
        .expect("transcript")
        .push(again.text.clone());
    let found = check(&c.h);
    let mut turns = vec![c.delivery.clone(), again.id.clone()];
    turns.sort();
    assert_eq!(
        found,
        vec![Violation::HandedOverTwice {
            session: c.session.clone(),
            execution: c.step.clone(),
            turns
        }]
    );
}

#[test]
fn a_completion_never_handed_over_is_reported_unless_its_target_stopped() {
    let mut c = clean();
    c.h.turns.get_mut(&c.delivery).expect("turn").delivery = None;
    assert_eq!(
        check(&c.h),
        vec![Violation::NotHandedOver {
            session: c.session.clone(),
            execution: c.step.clone()
        }]
    );
    c.h.sessions.get_mut(&c.session).expect("session").state =
        SessionState::Stopped { stopped_at: at(9) };
    assert_eq!(check(&c.h), vec![]);
}

#[test]
fn a_completion_handed_to_a_stranger_is_reported() {
    let mut c = clean();
    let step = c.h.executions.get_mut(&c.step).expect("step");
    let stranger = SessionId::new();
    step.owner = Some(stranger.clone());
    let mut found = kinds(&c.h);
    found.dedup();
    // The stranger is not a session of the history: only the wrong hand-over is reported.
    assert_eq!(found, ["handed_to_stranger"]);
}

#[test]
fn a_completion_typed_before_its_starting_turn_ended_is_reported() {
    let mut c = clean();
    c.h.turns.get_mut(&c.delivery).expect("turn").state = completed(1, 5);
    assert_eq!(
        check(&c.h),
        vec![Violation::HandedTooEarly {
            execution: c.step.clone(),
            turn: c.delivery.clone(),
            started_by: c.turn.clone()
        }]
    );
}

#[test]
fn a_step_run_twice_is_reported() {
    let mut c = clean();
    let step = c.step.as_step().expect("step");
    c.h.step_starts.insert(step.clone(), 2);
    assert_eq!(
        check(&c.h),
        vec![Violation::StepRanTwice { step, times: 2 }]
    );
}

#[test]
fn cancellations_of_work_their_reason_does_not_own_are_reported() {
    for (scope, reason, owner_stopped) in [
        (Scope::Session, exec_reason::TURN_ENDED, false),
        (Scope::Session, exec_reason::SESSION_STOPPED, false),
        (Scope::Turn, exec_reason::PARENT_CANCELLED, false),
        (Scope::Detached, exec_reason::TURN_ENDED, false),
    ] {
        let mut c = clean();
        if owner_stopped {
            c.h.sessions.get_mut(&c.session).expect("session").state =
                SessionState::Stopped { stopped_at: at(9) };
        }
        let step = c.h.executions.get_mut(&c.step).expect("step");
        step.scope = scope;
        step.status = ExecStatus::Cancelled {
            started_at: None,
            ended_at: at(3),
            reason: reason.into(),
        };
        assert_eq!(kinds(&c.h), ["cancelled_unowned"], "{scope} {reason}");
    }
    // What the reasons do own passes.
    let mut c = clean();
    c.h.sessions.get_mut(&c.session).expect("session").state =
        SessionState::Stopped { stopped_at: at(9) };
    let step = c.h.executions.get_mut(&c.step).expect("step");
    step.status = ExecStatus::Cancelled {
        started_at: None,
        ended_at: at(3),
        reason: exec_reason::SESSION_STOPPED.into(),
    };
    assert_eq!(check(&c.h), vec![]);
}

#[test]
fn an_untrue_or_unended_run_is_reported() {
    let mut c = clean();
    let run = c.h.runs.get_mut(&c.run).expect("run");
    run.messages.push("never ran".into());
    assert_eq!(kinds(&c.h), ["run_untrue"]);
    let mut c = clean();
    let run = c.h.runs.get_mut(&c.run).expect("run");
    run.state = RunState::Running { started_at: at(6) };
    assert_eq!(kinds(&c.h), ["run_not_ended"]);
    let mut c = clean();
    let turn = c.h.runs[&c.run].progress[0].turns[0].clone();
    c.h.turns.get_mut(&turn).expect("turn").state = TurnState::Failed {
        ended_at: at(7),
        reason: "agent_exited".into(),
        detail: String::new(),
        output: vec![],
    };
    assert_eq!(kinds(&c.h), ["run_untrue"]);
}

#[test]
fn a_slot_without_a_record_is_reported() {
    let mut c = clean();
    let last = c.h.slots.pop().expect("slot");
    c.h.slots.push(SlotRecord {
        slot: at(16),
        ..last
    });
    let found = check(&c.h);
    assert_eq!(
        found,
        vec![
            Violation::SlotUnaccounted {
                schedule: "tick".into(),
                slot: at(12).to_rfc3339()
            },
            Violation::SlotUnaccounted {
                schedule: "tick".into(),
                slot: at(14).to_rfc3339()
            },
        ]
    );
}
