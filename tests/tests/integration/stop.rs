//! R13: stopping a session ends its terminal and fails its queued turns with a named reason;
//! its lane and consumer are removed, so nothing keeps waiting on it.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::api::{self, SessionRef};
use turnstile_shared::records::{reason, SessionRecord, TurnState};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::ExecutionId;

use crate::stack::{report, Stack, API};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_fails_queued_turns_and_leaves_nothing_waiting() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = stop(&mut stack).await;
    report(&stack, r)
}

async fn stop(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("short-lived", None).await?;
    let keep = stack.create_session("neighbour", None).await?;
    let turns = stack
        .send_all(
            &s,
            &[
                "working\n!step outlives 2s --scope detached\n!sleep 10s",
                "queued one",
                "queued two",
            ],
        )
        .await?;
    stack.wait_running(&turns[0]).await?;
    // The detached step it started, which outlives the session.
    let started = ExecutionId::from(&turns[0]);
    let outlives =
        turnstile_tests::wait_until("the step to start", Duration::from_secs(10), || async {
            Ok(stack
                .tree(&started)
                .await?
                .nodes
                .first()
                .map(|n| n.record.id.clone()))
        })
        .await?;
    let stopped: SessionRecord = api::call(
        &stack.client,
        subj::SESSION_STOP,
        &SessionRef { session: s.clone() },
        API,
    )
    .await?;
    ensure!(!stopped.is_active(), "stop returned an active record");
    // Every turn ends, long before the running one's 10 s, each with the named reason.
    for t in &turns {
        let rec = stack.wait_turn(t, Duration::from_secs(8)).await?;
        match &rec.state {
            TurnState::Failed { reason: r, .. } if r == reason::SESSION_STOPPED => {}
            other => anyhow::bail!(
                "turn {t} ended {other:?}, expected {}",
                reason::SESSION_STOPPED
            ),
        }
    }
    // The step ends after the stop. Its completion is kept for operators, but no delivery is
    // armed on the stopped session's lane (an item its router published before it read the
    // session's state is taken back).
    stack
        .wait_exec(&outlives, Duration::from_secs(20), |r| {
            r.status.is_terminal()
        })
        .await?;
    let steps = stack.js.get_stream(subjects::STEP_STREAM).await?;
    turnstile_tests::wait_until("the step's end routed", Duration::from_secs(20), || async {
        let info = steps.consumer_info(subjects::BROKER_ENDED_CONSUMER).await?;
        Ok((info.num_pending == 0 && info.num_ack_pending == 0).then_some(()))
    })
    .await?;
    ensure!(
        crate::stack::completion_backlog(stack, &s).await? == 1,
        "the stopped session's completion is kept"
    );
    let markers = stack.js.get_key_value(subjects::DELIVERIES_BUCKET).await?;
    ensure!(
        markers.get(s.as_str()).await?.is_none(),
        "a delivery is armed on a stopped session"
    );
    // Nothing is left on the lane, and its consumer is gone.
    let lane = stack.js.get_stream(subjects::LANE_STREAM).await?;
    ensure!(
        lane.consumer_info(subjects::lane_consumer(&s))
            .await
            .is_err(),
        "lane consumer of a stopped session still exists"
    );
    let left = lane.direct_get_first_for_subject(subjects::lane(&s)).await;
    ensure!(left.is_err(), "items left on a stopped session's lane");
    let view = stack.show(&s).await?;
    ensure!(
        !view.busy && view.queued == 0,
        "stopped session shown occupied: {view:?}"
    );
    // New messages are refused with a clear error.
    let refused = stack
        .send(&s, "too late")
        .await
        .expect_err("send to a stopped session");
    ensure!(refused.to_string().contains("stopped"), "error: {refused}");
    // The agent's terminal is gone; the neighbour on the same host is untouched.
    let sock = stack.dir.path().join("host-h1").join("tmux.sock");
    let alive = std::process::Command::new("tmux")
        .arg("-S")
        .arg(&sock)
        .args(["has-session", "-t", &format!("={s}")])
        .stderr(std::process::Stdio::null())
        .status()
        .context("run tmux")?;
    ensure!(
        !alive.success(),
        "terminal of a stopped session still exists"
    );
    let t = stack.send(&keep, "still here").await?;
    stack.all_complete(&[t]).await?;
    let events = stack.events().await?;
    ensure!(
        events
            .iter()
            .any(|e| e.kind == "session.stopped" && e.session.as_ref() == Some(&s)),
        "no session.stopped event"
    );
    Ok(())
}
