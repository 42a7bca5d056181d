//! Child results come back to the conversation that owns them, once, in one batch (R2, R3,
//! R6): completions wait while the lane is held, then one delivery turn hands them all over.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::TurnState;
use turnstile_shared::ExecutionId;

use crate::stack::{listed_steps, report, Stack};

/// Acceptance 1 and 2 (PLAT-113): a 60 s turn starts 10 steps that all finish within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_steps_in_a_long_turn_come_back_in_one_delivery_after_it() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = ten_steps(&mut stack, 60).await;
    report(&stack, r)
}

async fn ten_steps(stack: &mut Stack, turn_secs: u64) -> Result<()> {
    let s = stack.create_session("plat-113", None).await?;
    let mut text = String::from("work through ten jobs in the background\n");
    for i in 1..=10 {
        text.push_str(&format!("!step job-{i} {}ms\n", 300 * i));
    }
    text.push_str(&format!("!sleep {turn_secs}s\n!reply all started"));
    let turn = stack.send(&s, &text).await?;
    let turn_exec = ExecutionId::from(&turn);

    // All ten finish while the turn still holds the lane.
    let tree = crate::stack::wait_until_tree(stack, &turn_exec, Duration::from_secs(45), |t| {
        t.nodes.len() == 10 && t.nodes.iter().all(|n| n.record.status.is_terminal())
    })
    .await?;
    let steps: Vec<String> = tree.nodes.iter().map(|n| n.record.id.to_string()).collect();
    ensure!(
        !stack.turn(&turn).await?.context("turn")?.state.is_terminal(),
        "the turn ended before its steps did; lengthen it"
    );
    // A delivery waits on the lane, queued, and is nobody's running child (R2).
    let delivery_queued = stack
        .wait_events("delivery.queued", Duration::from_secs(20), |ev| {
            ev.iter()
                .any(|e| e.kind == "delivery.queued" && e.session.as_ref() == Some(&s))
                .then_some(())
        })
        .await;
    delivery_queued?;
    let view = stack.show(&s).await?;
    ensure!(view.busy, "the long turn holds the lane");
    ensure!(
        view.in_flight.as_ref().map(|t| &t.id) == Some(&turn),
        "the turn in flight is the long turn, not a delivery: {:?}",
        view.in_flight
    );
    ensure!(view.queued == 1, "one delivery waits, queued: {}", view.queued);
    let tree = stack.tree(&turn_exec).await?;
    ensure!(
        tree.nodes.len() == 10 && tree.nodes.iter().all(|n| n.record.kind == turnstile_shared::execution::ExecKind::Step),
        "the turn's children are its ten steps only: {:?}",
        tree.nodes.iter().map(|n| (&n.record.id, n.record.kind)).collect::<Vec<_>>()
    );
    let events = stack.events().await?;
    ensure!(
        events.iter().filter(|e| e.kind == "turn.started" && e.session.as_ref() == Some(&s)).count() == 1,
        "no delivery started during the turn"
    );

    // After the turn: exactly one delivery turn, carrying all ten.
    let done = stack.wait_turn(&turn, Duration::from_secs(turn_secs + 30)).await?;
    ensure!(matches!(done.state, TurnState::Completed { .. }), "{:?}", done.state);
    let deliveries = crate::stack::wait_deliveries(stack, &s, 1, Duration::from_secs(30)).await?;
    let d = &deliveries[0];
    ensure!(matches!(d.state, TurnState::Completed { .. }), "delivery: {:?}", d.state);
    let mut listed = listed_steps(&d.text);
    listed.sort();
    let mut expected = steps.clone();
    expected.sort();
    ensure!(listed == expected, "delivery lists {listed:?}, steps were {expected:?}");
    // Nothing more is delivered, and the agent got exactly two messages.
    let transcript = stack.transcript(&s).await?;
    ensure!(transcript.len() == 2, "messages: {transcript:?}");
    ensure!(transcript[1] == d.text, "the agent got the delivery message as typed");
    ensure!(
        stack.delivery_turns(&s).await?.len() == 1,
        "exactly one delivery turn"
    );
    Ok(())
}
