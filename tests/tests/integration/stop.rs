//! R13: stopping a session ends its terminal and fails its queued turns and runs with a named
//! reason; its lane and consumer are removed, so nothing keeps waiting on it.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::api::{self, SessionRef};
use turnstile_shared::records::{reason, SessionRecord, TurnRecord, TurnState};
use turnstile_shared::runs::{run_reason, RunState};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::{ExecutionId, SessionId};

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
    // A run queued behind them, which never starts.
    let run = stack.start_run(&s, &["never typed"], None).await?;
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
    // The queued run ends too, failed with the same reason, never having started (it used to
    // stay `queued` for ever once its item was purged with the lane).
    let ended = stack.wait_run(&run.id, Duration::from_secs(8)).await?;
    match &ended.state {
        RunState::Failed {
            reason: r,
            started_at: None,
            ..
        } if r == run_reason::SESSION_STOPPED => {}
        other => anyhow::bail!(
            "queued run ended {other:?}, expected {} before it started",
            run_reason::SESSION_STOPPED
        ),
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

/// R7: work a session started without naming a scope outlives the turn that started it, but
/// not its session: the stop cancels it (`session_stopped`), whichever replica answers the
/// stop, and detached work goes on to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_cancels_the_work_its_session_owns_but_not_detached_work() -> Result<()> {
    let mut stack = Stack::start(&["a", "b"], &["h1"]).await?;
    let r = stop_owned_work(&mut stack).await;
    report(&stack, r)
}

async fn stop_owned_work(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::execution::{exec_reason, ExecStatus, Scope};
    let s = stack.create_session("owner", None).await?;
    let t = stack
        .send(
            &s,
            "start work\n!step owned 60s\n!step free 3s --scope detached",
        )
        .await?;
    stack.all_complete(std::slice::from_ref(&t)).await?;
    let tree = crate::stack::wait_until_tree(
        stack,
        &ExecutionId::from(&t),
        Duration::from_secs(10),
        |tree| tree.nodes.len() == 2,
    )
    .await?;
    let step = |name: &str| {
        tree.nodes
            .iter()
            .find(|n| n.record.name == name)
            .map(|n| n.record.clone())
            .with_context(|| format!("step {name} under the turn"))
    };
    let (owned, free) = (step("owned")?, step("free")?);
    ensure!(owned.scope == Scope::Session, "{:?}", owned.scope);
    // The turn has ended; the work it started without a scope still runs.
    let running = stack
        .wait_exec(&owned.id, Duration::from_secs(10), |r| {
            matches!(r.status, ExecStatus::Running { .. })
        })
        .await?;
    ensure!(!running.status.is_terminal());
    let _: SessionRecord = api::call(
        &stack.client,
        subj::SESSION_STOP,
        &SessionRef { session: s.clone() },
        API,
    )
    .await?;
    // Cancelled by the stop, long before its 60 s.
    let ended = stack
        .wait_exec(&owned.id, Duration::from_secs(10), |r| {
            r.status.is_terminal()
        })
        .await?;
    match &ended.status {
        ExecStatus::Cancelled { reason, .. } if reason == exec_reason::SESSION_STOPPED => {}
        other => anyhow::bail!("the session's own work ended {other:?}"),
    }
    let free = stack
        .wait_exec(&free.id, Duration::from_secs(20), |r| {
            r.status.is_terminal()
        })
        .await?;
    ensure!(
        matches!(free.status, ExecStatus::Completed { .. }),
        "detached work ended {:?}",
        free.status
    );
    // A repeated stop finds nothing more to cancel and still answers.
    let again: SessionRecord = api::call(
        &stack.client,
        subj::SESSION_STOP,
        &SessionRef { session: s.clone() },
        API,
    )
    .await?;
    ensure!(!again.is_active());
    Ok(())
}

/// R13: 1,000 sessions created, given a turn each and stopped, on two session-lane replicas
/// (each stop answered by either): neither replica nor the transport keeps anything of them
/// in memory afterwards (their per-session maps, read from `/metrics`, are empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_stopped_sessions_leave_no_state_in_any_replica() -> Result<()> {
    let mut stack = Stack::start(&["a", "b"], &["h1"]).await?;
    let r = thousand_stopped(&mut stack).await;
    report(&stack, r)
}

/// The services whose per-session maps are read.
const HOLDERS: [&str; 3] = ["lane-a", "lane-b", "transport-h1"];

/// Each `(service, map)` entry count, from `turnstile_session_state_entries`.
async fn session_state(stack: &Stack) -> Result<Vec<(String, String, f64)>> {
    let mut out = Vec::new();
    for service in HOLDERS {
        let samples = crate::metrics::scrape(stack, service).await?;
        let series = samples
            .get("turnstile_session_state_entries")
            .with_context(|| format!("{service} exposes no session state"))?;
        for (labels, value) in series {
            let map = labels
                .iter()
                .find(|(k, _)| k == "map")
                .map(|(_, v)| v.clone())
                .unwrap_or_default();
            out.push((service.to_string(), map, *value));
        }
    }
    Ok(out)
}

async fn thousand_stopped(stack: &mut Stack) -> Result<()> {
    use futures::StreamExt;
    use turnstile_shared::records::AgentKind;
    const N: usize = 1_000;
    // A few sessions whose step results were handed back (completion consumers, standbys).
    let mut sessions = Vec::new();
    for i in 0..4 {
        let s = stack.create_session(&format!("handed-{i}"), None).await?;
        stack.turn_with_a_step_handed_back(&s).await?;
        sessions.push(s);
    }
    let stack_ref = &*stack;
    let created: Vec<Result<SessionId>> = futures::stream::iter(0..N)
        .map(|i| async move {
            stack_ref
                .create_session_of(AgentKind::Instant, &format!("many-{i}"), None)
                .await
        })
        .buffer_unordered(32)
        .collect()
        .await;
    for s in created {
        sessions.push(s?);
    }
    let turns: Vec<Result<turnstile_shared::TurnId>> = futures::stream::iter(&sessions[4..])
        .map(|s| async move { stack_ref.send(s, "hello").await })
        .buffer_unordered(32)
        .collect()
        .await;
    let turns = turns.into_iter().collect::<Result<Vec<_>>>()?;
    // Read, not watched: a watch per turn would pass the server's 1,000 consumers a stream.
    turnstile_tests::wait_until("every turn completed", Duration::from_secs(120), || async {
        let states: Vec<Result<Option<TurnRecord>>> = futures::stream::iter(&turns)
            .map(|t| stack_ref.turn(t))
            .buffer_unordered(64)
            .collect()
            .await;
        let mut done = 0;
        for s in states {
            match s?.map(|r| r.state) {
                Some(TurnState::Completed { .. }) => done += 1,
                Some(other) if other.is_terminal() => anyhow::bail!("a turn ended {other:?}"),
                _ => {}
            }
        }
        Ok((done == turns.len()).then_some(()))
    })
    .await?;
    // Before the stops, the maps hold the sessions: the test reads what it means to.
    let before = session_state(stack).await?;
    let placed = |service: &str| {
        before
            .iter()
            .find(|(s, m, _)| s == service && m == "placed_sessions")
            .map_or(0.0, |(_, _, v)| *v)
    };
    ensure!(
        placed("lane-a") >= N as f64 && placed("lane-b") >= N as f64,
        "both replicas know the sessions: {before:?}"
    );
    ensure!(
        before
            .iter()
            .any(|(s, m, v)| s == "transport-h1" && m == "session_specs" && *v >= N as f64),
        "the transport holds the sessions' specs: {before:?}"
    );
    ensure!(
        before
            .iter()
            .any(|(s, m, v)| s.starts_with("lane-") && m == "completion_consumers" && *v > 0.0),
        "a replica holds completion consumers: {before:?}"
    );
    let stopped: Vec<Result<SessionRecord>> = futures::stream::iter(&sessions)
        .map(|s| async move {
            let r: SessionRecord = api::call(
                &stack_ref.client,
                subj::SESSION_STOP,
                &SessionRef { session: s.clone() },
                API,
            )
            .await?;
            Ok(r)
        })
        .buffer_unordered(32)
        .collect()
        .await;
    for r in stopped {
        ensure!(!r?.is_active(), "stop returned an active record");
    }
    let last = std::sync::Mutex::new(Vec::new());
    let emptied = turnstile_tests::wait_until(
        "every per-session map to empty",
        Duration::from_secs(30),
        || async {
            let now = session_state(stack_ref).await?;
            let empty = now.iter().all(|(_, _, v)| *v == 0.0);
            if let Ok(mut l) = last.lock() {
                *l = now;
            }
            Ok(empty.then_some(()))
        },
    )
    .await;
    let left: Vec<_> = last
        .lock()
        .map(|l| l.iter().filter(|(_, _, v)| *v != 0.0).cloned().collect())
        .unwrap_or_default();
    emptied.with_context(|| format!("left behind: {left:?}"))?;
    Ok(())
}
