//! Lanes serve each session one turn at a time, in send order (R1, R2), and occupancy shown
//! to operators is read off the lane itself.

use std::time::Duration;

use anyhow::{ensure, Result};
use turnstile_shared::records::TurnState;

use crate::stack::{report, serial_turns, Stack};

/// R1: three sessions, five messages each, sent at once; each runs one turn at a time, in the
/// order sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sessions_run_their_turns_one_at_a_time_in_send_order() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = three_sessions(&mut stack).await;
    report(&stack, r)
}

async fn three_sessions(stack: &mut Stack) -> Result<()> {
    let mut sessions = Vec::new();
    for i in 0..3 {
        sessions.push(stack.create_session(&format!("s{i}"), None).await?);
    }
    // The three sessions' messages go out concurrently; within a session, in order.
    let sends = sessions.iter().enumerate().map(|(i, s)| {
        let stack = &*stack;
        async move {
            let mut turns = Vec::new();
            for j in 0..5 {
                let text = format!("session {i} message {j}\n!sleep 150ms\n!reply done {i}.{j}");
                turns.push((stack.send(s, &text).await?, text));
            }
            Ok::<_, anyhow::Error>(turns)
        }
    });
    let sent: Vec<_> = futures::future::try_join_all(sends).await?;
    for turns in &sent {
        for (t, _) in turns {
            let rec = stack.wait_turn(t, Duration::from_secs(60)).await?;
            ensure!(
                matches!(rec.state, TurnState::Completed { .. }),
                "turn {t} did not complete: {:?}",
                rec.state
            );
        }
    }
    let events = stack.events().await?;
    for (s, turns) in sessions.iter().zip(&sent) {
        let order = serial_turns(&events, s)?;
        let sent_order: Vec<_> = turns.iter().map(|(t, _)| t.clone()).collect();
        ensure!(
            order == sent_order,
            "session {s} ran {order:?}, sent {sent_order:?}"
        );
        let texts: Vec<&str> = turns.iter().map(|(_, t)| t.as_str()).collect();
        stack.typed_exactly_once(s, &texts).await?;
    }
    Ok(())
}

/// R1/R2: `busy`, the item in flight and the queued count come from the lane consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_show_reads_occupancy_off_the_lane() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = occupancy(&mut stack).await;
    report(&stack, r)
}

async fn occupancy(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("busy", None).await?;
    let idle = stack.show(&s).await?;
    ensure!(
        !idle.busy && idle.queued == 0,
        "fresh session not idle: {idle:?}"
    );
    let long = stack.send(&s, "long one\n!sleep 3s").await?;
    let q1 = stack.send(&s, "queued one").await?;
    let q2 = stack.send(&s, "queued two").await?;
    stack
        .wait_turn_state(&long, Duration::from_secs(20), |r| {
            matches!(r.state, TurnState::Running { .. })
        })
        .await?;
    let view = stack.show(&s).await?;
    ensure!(
        view.busy,
        "session with a turn in flight shown idle: {view:?}"
    );
    ensure!(view.queued == 2, "expected 2 queued, got {}", view.queued);
    ensure!(
        view.in_flight.as_ref().map(|t| &t.id) == Some(&long),
        "in-flight item should be {long}: {:?}",
        view.in_flight
    );
    // Waiting items are queued, never running (R2).
    for q in [&q1, &q2] {
        let rec = stack.turn(q).await?;
        ensure!(
            matches!(rec.as_ref().map(|r| &r.state), Some(TurnState::Queued)),
            "{q} should be queued: {rec:?}"
        );
    }
    stack.wait_turn(&q2, Duration::from_secs(30)).await?;
    // The lane acks the last item a moment after its turn's record ends.
    stack.wait_idle(&s).await?;
    Ok(())
}

/// The lane tells the transport the revision a queued turn's record was written at, and the
/// transport records the turn running over it without reading first (one round trip off the
/// hand-off). A record that moved on since is never written over: the transport drives the
/// turn from a read, typing a still-queued turn once and an ended one never (R14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_told_a_stale_revision_reads_the_record_and_types_at_most_once() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = stale_revision(&mut stack).await;
    report(&stack, r)
}

async fn stale_revision(stack: &mut Stack) -> Result<()> {
    use anyhow::Context;
    use turnstile_shared::records::{KnownTurn, TurnCommand, TurnRecord};
    use turnstile_shared::{subjects, TurnId};
    let s = stack.create_session("stale", None).await?;
    // The session's agent is up (its first turn launched it).
    let first = stack.send(&s, "first").await?;
    stack.all_complete(&[first]).await?;
    let host = stack.session_record(&s).await?.host;
    let lane = stack.js_as("session-lane").await?;
    let turns = lane.get_key_value(subjects::TURNS_BUCKET).await?;
    let queued = |turn: &TurnId, text: &str| TurnRecord {
        id: turn.clone(),
        session: s.clone(),
        text: text.into(),
        queued_at: chrono::Utc::now(),
        delivery: None,
        parent: None,
        state: TurnState::Queued,
    };
    let command = |record: &TurnRecord, revision: u64| TurnCommand {
        session: s.clone(),
        turn: record.id.clone(),
        text: record.text.clone(),
        delivery: None,
        known: Some(KnownTurn {
            revision,
            record: record.clone(),
        }),
        unrecorded: false,
    };

    // Still queued, written again since the revision the command names.
    let moved = TurnId::new();
    let record = queued(&moved, "written twice, typed once");
    let old = turns
        .create(moved.as_str(), serde_json::to_vec(&record)?.into())
        .await?;
    turns
        .put(moved.as_str(), serde_json::to_vec(&record)?.into())
        .await?;
    // Ended before its command came.
    let ended = TurnId::new();
    let mut gone = queued(&ended, "ended before it was typed");
    let at = turns
        .create(ended.as_str(), serde_json::to_vec(&gone)?.into())
        .await?;
    gone.state = TurnState::Failed {
        ended_at: chrono::Utc::now(),
        reason: "session_stopped".into(),
        detail: "failed before its command came".into(),
        output: Vec::new(),
    };
    turns
        .update(ended.as_str(), serde_json::to_vec(&gone)?.into(), at)
        .await?;
    for c in [
        command(&record, old),
        command(&queued(&ended, &gone.text), at),
    ] {
        stack.send_command(&host, &c).await?;
    }
    let done = stack.wait_turn(&moved, Duration::from_secs(30)).await?;
    ensure!(
        matches!(done.state, TurnState::Completed { .. }),
        "{:?}",
        done.state
    );
    // Both commands handled (acked): the transport has nothing left of them.
    stack.wait_commands_handled(&host).await?;
    let transcript = stack.transcript(&s).await?;
    ensure!(
        crate::stack::count(&transcript, &record.text) == 1,
        "the moved turn typed once: {transcript:?}"
    );
    ensure!(
        crate::stack::count(&transcript, &gone.text) == 0,
        "the ended turn typed: {transcript:?}"
    );
    let after = stack
        .turn(&ended)
        .await?
        .context("the ended turn's record")?;
    ensure!(after.state == gone.state, "rewritten: {:?}", after.state);
    Ok(())
}
