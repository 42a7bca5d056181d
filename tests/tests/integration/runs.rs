//! Runs finish what they start (R5, R12): a run's message is done only when everything its
//! turns started is terminal and handed back, and a turn started nothing new.

use std::time::Duration;

use anyhow::{ensure, Result};
use turnstile_shared::runs::RunState;

use crate::stack::{listed_steps, report, Stack};

/// Issue 4, acceptance 1 (seed 004 / PLAT-361): the agent is asked to work through 12 groups,
/// starting one step per turn and ending the turn. The run drives all 12 (one results turn per
/// group) and completes only when a turn starts nothing: 13 rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_drives_twelve_groups_to_the_end_in_thirteen_rounds() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = twelve_groups(&mut stack).await;
    report(&stack, r)
}

async fn twelve_groups(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("plat-361", None).await?;
    let run = stack
        .start_run(
            &s,
            &["work through the 12 groups, one per turn\n!groups 12 300ms"],
            None,
        )
        .await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(120)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run ended {:?}",
        done.state
    );
    ensure!(
        done.rounds() == 13,
        "13 rounds, got {}: {:?}",
        done.rounds(),
        done.progress
    );
    // The agent saw the message and twelve hand-overs, each naming one group, in order.
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript.len() == 13,
        "{} messages: {transcript:?}",
        transcript.len()
    );
    let mut handed = Vec::new();
    for m in &transcript[1..] {
        let steps = listed_steps(m);
        ensure!(steps.len() == 1, "one result per hand-over: {m}");
        handed.extend(steps);
        ensure!(
            m.contains(&format!("group-{} [completed]", handed.len())),
            "{m}"
        );
    }
    handed.sort();
    handed.dedup();
    ensure!(handed.len() == 12, "twelve distinct groups handed over");
    // Nothing lingers: the session is idle and no delivery is left to run.
    let view = stack.show(&s).await?;
    ensure!(
        !view.busy && view.queued == 0,
        "idle after the run: {view:?}"
    );
    Ok(())
}
