//! Regression tests of the bugs the fault campaign (`turnstile-bench chaos`) found, one each,
//! each listed in docs/reliability.md with the seed that found it.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::execution::ExecStatus;
use turnstile_shared::ExecutionId;
use turnstile_tests::wait_until;

use crate::stack::{report, signal, Stack};

/// R14: a step whose end report waits on a broker that does not answer (frozen), past the
/// 2 s ack wait of its work, runs once. Its transport used to let the step go as soon as the
/// command exited: the work came back meanwhile (no progress was shown on it), the same
/// process took it again and the broker, seeing the start from the worker that held the step,
/// let it run a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_report_waits_on_a_frozen_broker_runs_once() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = report_waits(&mut stack).await;
    report(&stack, r)
}

async fn report_waits(stack: &mut Stack) -> Result<()> {
    let trace = stack.dir.path().join("step-starts.log");
    let s = stack.create_session("report-waits", None).await?;
    let t = stack
        .send(
            &s,
            &format!("!step once 1s --trace {}\n!sleep 200ms", trace.display()),
        )
        .await?;
    let starts = || {
        std::fs::read_to_string(&trace)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    wait_until("the step's command to start", Duration::from_secs(20), || async {
        Ok((starts() > 0).then_some(()))
    })
    .await?;
    // The only broker freezes while the command sleeps; the command exits after 1 s and its
    // report then waits. The fault is held for three times the work's ack wait.
    let broker = stack.freeze_broker("b1")?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    signal(broker, rustix::process::Signal::CONT)?;
    let tree = crate::stack::wait_until_tree(
        stack,
        &ExecutionId::from(&t),
        Duration::from_secs(30),
        |t| t.nodes.len() == 1 && t.nodes[0].record.status.is_terminal(),
    )
    .await?;
    let step = &tree.nodes[0].record;
    ensure!(
        matches!(step.status, ExecStatus::Completed { .. }),
        "the step ended {:?}",
        step.status
    );
    // Long enough for a second run to have logged its start (it would start at once).
    stack.wait_ended_drained().await?;
    let n = starts();
    ensure!(n == 1, "the step's command started {n} times");
    let _ = step.id.as_step().context("a step")?;
    Ok(())
}
