//! Many hosts (issue 5, started): sessions spread over live hosts, and a host whose heartbeat
//! lapses fails only its own sessions' turns, with a named error instead of a wait (R9).

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::TurnState;

use crate::stack::{report, Stack};

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

/// Issue 5, acceptance 3: the agent exits while idle. An event with evidence comes within 2 s;
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
