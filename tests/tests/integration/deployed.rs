//! The shipped `deploy/nats-server.conf` runs a whole deployment: provisioning with the admin
//! user, and every service, the agents and the test's own CLI client on their own users with
//! the permissions the file gives them. A service that starts using a subject its user may not
//! use fails here, so the file cannot go stale unnoticed.

use std::time::Duration;

use anyhow::{ensure, Result};
use turnstile_shared::records::TurnState;
use turnstile_shared::runs::RunState;
use turnstile_shared::schedules::SlotOutcome;

use crate::stack::{report, schedule, wait_deliveries, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_server_config_serves_every_service_on_its_own_user() -> Result<()> {
    let mut stack = Stack::start_deployed(&["a"], &["h1"]).await?;
    let r = whole_deployment(&mut stack).await;
    report(&stack, r)
}

async fn whole_deployment(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("deployed", None).await?;
    // A turn whose agent starts a step (with the credentials its terminal got), and the
    // step's result handed back in a delivery turn.
    let turn = stack
        .send(&s, "start the build\n!step build 500ms\n!sleep 1s")
        .await?;
    let rec = stack.wait_turn(&turn, Duration::from_secs(30)).await?;
    ensure!(
        matches!(rec.state, TurnState::Completed { .. }),
        "turn: {:?}",
        rec.state
    );
    let deliveries = wait_deliveries(stack, &s, 1, Duration::from_secs(30)).await?;
    ensure!(
        deliveries
            .iter()
            .any(|d| matches!(d.state, TurnState::Completed { .. }) && d.text.contains("build")),
        "the step's result was not handed over: {deliveries:?}"
    );
    // A run (session-lane, with the broker's tree) and a schedule (the scheduler fires runs).
    let run = stack.start_run(&s, &["!reply in a run"], None).await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(30)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run: {:?}",
        done.state
    );
    stack
        .add_schedule(&schedule(
            "deployed-2s",
            "*/2 * * * * *",
            &s,
            &["!reply tick"],
        ))
        .await?;
    let slots = stack
        .wait_slots("deployed-2s", 1, Duration::from_secs(30))
        .await?;
    let SlotOutcome::Fired { run, .. } = &slots[0].outcome else {
        anyhow::bail!("first slot: {:?}", slots[0].outcome);
    };
    let fired = stack.wait_run(run, Duration::from_secs(30)).await?;
    ensure!(
        matches!(fired.state, RunState::Completed { .. }),
        "scheduled run: {:?}",
        fired.state
    );
    // Nothing was refused on the way: a refusal a service survives is still a stale file.
    let log = stack.nats.log_tail(100_000);
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("Violation")).collect();
    ensure!(
        refused.is_empty(),
        "the server refused:\n{}",
        refused.join("\n")
    );
    Ok(())
}
