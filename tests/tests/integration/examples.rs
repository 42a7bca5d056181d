//! The shipped examples, run against a live stack: `examples/follow_session.py` (the NATS
//! Python client on the observer's identity) follows a session through a run whose turn
//! starts a step, and prints the run, its turns (each started and completed) and the step as
//! they happen.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader};
use turnstile_shared::runs::RunState;
use turnstile_tests::workspace_root;

use crate::stack::{report, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_follower_prints_a_runs_turns_and_steps() -> Result<()> {
    let python = crate::mcp::python()?;
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = follow(&mut stack, &python).await;
    report(&stack, r)
}

async fn follow(stack: &mut Stack, python: &str) -> Result<()> {
    let url = stack.nats.url_as("observer", &stack.password("observer")?);
    let s = stack.create_session("followed", None).await?;
    let script = workspace_root().join("examples").join("follow_session.py");
    let mut child = tokio::process::Command::new(python)
        .arg(&script)
        .arg(s.as_str())
        .args(["--until", "run.completed", "--timeout", "90"])
        .env("TURNSTILE_NATS_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("run {python} {}", script.display()))?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    // Subscribed before anything happens on the session.
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("the follower did not start within 30 s")??
        .unwrap_or_default();
    ensure!(first.starts_with("following "), "first line: {first:?}");

    let run = stack
        .start_run(&s, &["build it\n!step build 300ms\n!sleep 1s"], None)
        .await?;
    let done = stack.wait_run(&run.id, Duration::from_secs(90)).await?;
    ensure!(
        matches!(done.state, RunState::Completed { .. }),
        "run: {:?}",
        done.state
    );
    let mut out = Vec::new();
    let read = async {
        while let Some(l) = lines.next_line().await? {
            out.push(l);
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .context("the follower did not stop after run.completed")??;
    let status = child.wait().await?;
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use tokio::io::AsyncReadExt;
        e.read_to_string(&mut stderr).await?;
    }
    ensure!(status.success(), "follower: {status}; {stderr}");
    let text = out.join("\n");
    let run_id = run.id.to_string();
    for want in [
        format!("run  {run_id} started"),
        format!("run  {run_id} completed"),
        " completed build".to_string(),
    ] {
        ensure!(
            text.contains(&want),
            "no {want:?} in the follower's output:\n{text}"
        );
    }
    // The run's own turn, and the round that handed the step's result back to the agent:
    // each starts and completes (a run's turns end with an event of their own).
    for what in [" started", " completed"] {
        ensure!(
            out.iter()
                .filter(|l| l.contains(" turn trn_") && l.ends_with(what))
                .count()
                >= 2,
            "two turns of the run{what}:\n{text}"
        );
    }
    ensure!(
        out.iter()
            .any(|l| l.contains(" step ") && l.contains(" running build")),
        "the step running:\n{text}"
    );
    Ok(())
}
