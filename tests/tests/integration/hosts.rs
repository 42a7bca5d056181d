//! Many hosts: sessions spread over live hosts, and a host whose heartbeat
//! lapses fails only its own sessions' turns, with a named error instead of a wait (R9).

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::TurnState;

use crate::stack::{listed_steps, report, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_host_fails_only_its_own_turns_and_its_sessions_resume() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1", "h2", "h3"]).await?;
    let r = dead_host(&mut stack).await;
    report(&stack, r)
}

async fn dead_host(stack: &mut Stack) -> Result<()> {
    // Wait for all three hosts so placement sees them.
    turnstile_tests::wait_until("three live hosts", Duration::from_secs(20), || async {
        let kv = stack
            .js
            .get_key_value(turnstile_shared::subjects::HOSTS_BUCKET)
            .await?;
        let keys: Vec<String> = futures::TryStreamExt::try_collect(kv.keys().await?).await?;
        Ok((keys.len() == 3).then_some(()))
    })
    .await?;
    let mut sessions = Vec::new();
    for i in 0..3 {
        let s = stack.create_session(&format!("s{i}"), None).await?;
        let host = stack.session_record(&s).await?.host;
        sessions.push((s, host));
    }
    let hosts: HashSet<_> = sessions.iter().map(|(_, h)| h.to_string()).collect();
    ensure!(hosts.len() == 3, "one session per host: {sessions:?}");
    let list = host_list(stack).await?;
    ensure!(
        list.len() == 3 && list.iter().all(|h| h.sessions.len() == 1),
        "host list: {list:?}"
    );
    let mut turns = Vec::new();
    for (s, _) in &sessions {
        turns.push(stack.send(s, "a long one\n!sleep 5s").await?);
    }
    for t in &turns {
        stack.wait_running(t).await?;
    }
    let victim = sessions
        .iter()
        .position(|(_, h)| h.as_str() == "h2")
        .context("a session on h2")?;
    stack.transports.get_mut("h2").context("h2")?.kill().await?;
    for (i, t) in turns.iter().enumerate() {
        let rec = stack.wait_turn(t, Duration::from_secs(30)).await?;
        if i == victim {
            match &rec.state {
                TurnState::Failed { reason, detail, .. } => {
                    ensure!(reason == "transport_unavailable", "{reason}");
                    ensure!(detail.contains("h2"), "{detail}");
                }
                other => anyhow::bail!("the dead host's turn: {other:?}"),
            }
        } else {
            ensure!(
                matches!(rec.state, TurnState::Completed { .. }),
                "another host's turn was touched: {:?}",
                rec.state
            );
        }
    }
    let view = stack.show(&sessions[victim].0).await?;
    ensure!(
        view.transport == "transport_unavailable",
        "{}",
        view.transport
    );
    // The host comes back: its session resumes (the agent was re-adopted, not relaunched).
    stack.spawn_transport("h2")?;
    let again = stack.send(&sessions[victim].0, "welcome back").await?;
    stack.all_complete(&[again]).await?;
    let transcript = stack.transcript(&sessions[victim].0).await?;
    ensure!(
        transcript.last().map(String::as_str) == Some("welcome back"),
        "{transcript:?}"
    );
    Ok(())
}

async fn host_list(stack: &Stack) -> Result<Vec<turnstile_shared::api::HostView>> {
    Ok(turnstile_shared::api::call(
        &stack.client,
        turnstile_shared::subjects::api::SESSION_HOSTS,
        &turnstile_shared::api::ListHosts {},
        crate::stack::API,
    )
    .await?)
}

/// R9: the agent exits while idle. An event with evidence comes within 2 s;
/// the next turn goes to the resumed agent, in the same conversation, never into the dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_dying_while_idle_is_reported_with_evidence() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = idle_death(&mut stack).await;
    report(&stack, r)
}

async fn idle_death(stack: &mut Stack) -> Result<()> {
    let s = stack.create_session("fragile", None).await?;
    let first = stack.send(&s, "hello").await?;
    stack.all_complete(&[first]).await?;
    let sock = stack.dir.path().join("host-h1").join("tmux.sock");
    let out = std::process::Command::new("tmux")
        .arg("-S")
        .arg(&sock)
        .args(["list-panes", "-t", s.as_str(), "-F", "#{pane_pid}"])
        .output()?;
    let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
    let killed_at = chrono::Utc::now();
    crate::stack::signal(pid, rustix::process::Signal::KILL)?;
    let died = stack
        .wait_events("terminal.died", Duration::from_secs(10), |ev| {
            ev.iter()
                .find(|e| e.kind == "terminal.died" && e.session.as_ref() == Some(&s))
                .cloned()
        })
        .await?;
    let after = (died.at - killed_at).num_milliseconds();
    ensure!(after < 2_000, "reported {after} ms after the exit");
    ensure!(died.data["host"] == "h1", "{:?}", died.data);
    ensure!(died.data["terminal"] == s.as_str(), "{:?}", died.data);
    ensure!(
        died.data["last_lines"]
            .as_array()
            .is_some_and(|l| !l.is_empty()),
        "the last lines are the evidence: {:?}",
        died.data
    );
    let next = stack.send(&s, "are you back?").await?;
    stack.all_complete(&[next]).await?;
    let transcript = stack.transcript(&s).await?;
    ensure!(
        transcript == ["hello", "are you back?"],
        "one conversation: {transcript:?}"
    );
    Ok(())
}

/// R9, R12: a run's background step completes while the session's
/// tmux server is dead, and the resume is made to fail. The run ends `failed` with
/// `parent_transport_unavailable` and evidence, within the ready timeout; the step's result
/// stays pending; a retry once the terminal can come back hands it over without re-running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_terminal_fails_the_run_with_evidence_and_a_retry_delivers() -> Result<()> {
    let flag = std::env::temp_dir().join(format!(
        "ts-fail-resume-{}",
        turnstile_shared::SessionId::new()
    ));
    let flag_s = flag.to_string_lossy().into_owned();
    let mut stack = Stack::start_with(
        &["a"],
        &["h1"],
        &[("TURNSTILE_MOCK_FAIL_RESUME_FILE", &flag_s)],
    )
    .await?;
    let r = dead_terminal_under_a_run(&mut stack, Some(&flag)).await;
    let _ = std::fs::remove_file(&flag);
    report(&stack, r)
}

/// R9: the same with a resume that succeeds: the run goes on in the same
/// conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_terminal_is_resumed_once_and_the_run_goes_on() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = dead_terminal_under_a_run(&mut stack, None).await;
    report(&stack, r)
}

async fn dead_terminal_under_a_run(
    stack: &mut Stack,
    fail_resume: Option<&std::path::Path>,
) -> Result<()> {
    use turnstile_shared::runs::RunState;
    use turnstile_shared::ExecutionId;
    let s = stack.create_session("plat-067", None).await?;
    let first = "start the long job\n!step bg 3s --scope run\n!sleep 1s";
    let run = stack.start_run(&s, &[first, "second"], None).await?;
    let turn0 = run.id.turn(0, 0);
    stack.wait_turn(&turn0, Duration::from_secs(20)).await?;
    // The run now waits for `bg`. The terminal dies with the whole tmux server.
    if let Some(flag) = fail_resume {
        std::fs::write(flag, b"")?;
    }
    let sock = stack.dir.path().join("host-h1").join("tmux.sock");
    let killed = std::process::Command::new("tmux")
        .arg("-S")
        .arg(&sock)
        .arg("kill-server")
        .status()?;
    ensure!(killed.success(), "kill the tmux server");
    let killed_at = std::time::Instant::now();
    let step = crate::stack::wait_until_tree(
        stack,
        &ExecutionId::from(&turn0),
        Duration::from_secs(20),
        |t| t.nodes.len() == 1 && t.nodes[0].record.status.is_terminal(),
    )
    .await?
    .nodes[0]
        .record
        .clone();
    ensure!(step.status.name() == "completed", "{:?}", step.status);

    let Some(flag) = fail_resume else {
        // The resume succeeds: the hand-over goes into the same conversation, the run goes on.
        let done = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
        ensure!(
            matches!(done.state, RunState::Completed { .. }),
            "{:?}",
            done.state
        );
        let transcript = stack.transcript(&s).await?;
        ensure!(transcript.len() == 3, "one conversation: {transcript:?}");
        ensure!(listed_steps(&transcript[1]) == vec![step.id.to_string()]);
        return Ok(());
    };
    let failed = stack.wait_run(&run.id, Duration::from_secs(60)).await?;
    let RunState::Failed {
        reason,
        detail,
        execution,
        ..
    } = &failed.state
    else {
        anyhow::bail!("run: {:?}", failed.state)
    };
    ensure!(
        reason == "parent_transport_unavailable",
        "{reason}: {detail}"
    );
    ensure!(
        detail.contains("host h1") && detail.contains(s.as_str()) && detail.contains("--resume"),
        "evidence names host, terminal and the resume command: {detail}"
    );
    ensure!(
        killed_at.elapsed() < Duration::from_secs(20 + 5),
        "failed within the ready timeout"
    );
    let turn = stack
        .turn(
            &execution
                .as_ref()
                .and_then(|e| e.as_turn())
                .context("failed turn")?,
        )
        .await?
        .context("failed turn record")?;
    ensure!(
        matches!(&turn.state, TurnState::Failed { output, .. } if !output.is_empty()),
        "the last lines of the terminal are kept: {:?}",
        turn.state
    );
    // The result is still pending (a delivery may try and fail too, it stays pending).
    ensure!(
        crate::stack::completion_backlog(stack, &s).await? >= 1,
        "the step's completion is still pending"
    );
    // And the session says so (R3): what operators and the dashboard read.
    let view = stack.show(&s).await?;
    ensure!(view.pending >= 1, "session show: {} pending", view.pending);
    // The terminal can come back: a retry continues the run and hands the result over.
    std::fs::remove_file(flag)?;
    stack.retry_run(&run.id).await?;
    let done = stack
        .wait_run_state(&run.id, Duration::from_secs(60), |r| {
            matches!(r.state, RunState::Completed { .. })
        })
        .await?;
    ensure!(done.attempt == 1);
    let transcript = stack.transcript(&s).await?;
    let handed: Vec<String> = transcript.iter().flat_map(|m| listed_steps(m)).collect();
    ensure!(
        handed == vec![step.id.to_string()],
        "handed over once: {transcript:?}"
    );
    ensure!(
        transcript.iter().filter(|m| m.as_str() == first).count() == 1,
        "the message was not typed again: {transcript:?}"
    );
    ensure!(
        transcript.last().map(String::as_str) == Some("second"),
        "{transcript:?}"
    );
    // Not re-run: the turn still has its one step, completed once.
    let tree = stack.tree(&ExecutionId::from(&turn0)).await?;
    ensure!(tree.nodes.len() == 1 && tree.nodes[0].record.status.name() == "completed");
    Ok(())
}

/// R14: the transport agent is SIGKILLed and restarted while its agents sit
/// idle. It re-adopts their panes on its private tmux socket (no relaunch), and the next turns
/// go into the same conversations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_transport_readopts_idle_agents() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = readopt(&mut stack).await;
    report(&stack, r)
}

async fn readopt(stack: &mut Stack) -> Result<()> {
    let mut sessions = Vec::new();
    for i in 0..2 {
        let s = stack.create_session(&format!("idle-{i}"), None).await?;
        let t = stack.send(&s, "first").await?;
        stack.all_complete(&[t]).await?;
        sessions.push(s);
    }
    let launches_before = count_ready(stack).await?;
    stack.transports.get_mut("h1").context("h1")?.kill().await?;
    stack.spawn_transport("h1")?;
    for s in &sessions {
        let t = stack.send(s, "second").await?;
        stack.all_complete(&[t]).await?;
        let transcript = stack.transcript(s).await?;
        ensure!(
            transcript == ["first", "second"],
            "same conversation: {transcript:?}"
        );
    }
    ensure!(
        count_ready(stack).await? == launches_before,
        "the agents were re-adopted, not launched again"
    );
    Ok(())
}

async fn count_ready(stack: &Stack) -> Result<usize> {
    Ok(stack
        .events()
        .await?
        .iter()
        .filter(|e| e.kind == "terminal.ready")
        .count())
}
