//! Agent adapters against a fake CLI that speaks the real protocol (issue 5, acceptance 6;
//! Codex's, until its adapter is proven against the real binary; Claude's is in `claude.rs`):
//! a turn, an error result, a mid-turn crash, and a resume in the same conversation.

use std::time::Duration;
use turnstile_shared::api::ErrorCode;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::{AgentKind, TurnState};

use crate::stack::{report, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_adapter_runs_turns_survives_a_crash_and_resumes() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = scenario(&mut stack, AgentKind::Codex, "fake-codex").await;
    report(&stack, r)
}

/// The same four turns against either CLI. `fake_dir` is where its fake keeps conversations
/// (one `<conversation>.jsonl` each).
async fn scenario(stack: &mut Stack, agent: AgentKind, fake_dir: &str) -> Result<()> {
    let s = stack
        .create_session_of(agent, &agent.to_string(), None)
        .await?;
    // A turn: one message in, ends at the CLI's own end-of-turn event.
    let t1 = stack.send(&s, "hello agent").await?;
    let r1 = stack.wait_turn(&t1, Duration::from_secs(20)).await?;
    match &r1.state {
        TurnState::Completed { output, .. } => {
            ensure!(output.iter().any(|l| l == "ok: hello agent"), "{output:?}")
        }
        other => anyhow::bail!("first turn: {other:?}"),
    }
    // An error result fails the turn with a named reason.
    let t2 = stack.send(&s, "please !fail").await?;
    let r2 = stack.wait_turn(&t2, Duration::from_secs(20)).await?;
    ensure!(
        matches!(&r2.state, TurnState::Failed { reason, .. } if reason == "agent_error"),
        "{:?}",
        r2.state
    );
    // A crash mid-turn: `agent_exited`, with the exit status and stderr as evidence.
    let t3 = stack.send(&s, "now !crash").await?;
    let r3 = stack.wait_turn(&t3, Duration::from_secs(20)).await?;
    match &r3.state {
        TurnState::Failed {
            reason,
            detail,
            output,
            ..
        } => {
            ensure!(reason == "agent_exited", "{reason}");
            ensure!(detail.contains("exit"), "{detail}");
            ensure!(
                output.iter().any(|l| l.contains("crashed on purpose")),
                "stderr is the evidence: {output:?}"
            );
        }
        other => anyhow::bail!("crash turn: {other:?}"),
    }
    // The next turn resumes the same conversation.
    let t4 = stack.send(&s, "are you back").await?;
    let r4 = stack.wait_turn(&t4, Duration::from_secs(20)).await?;
    ensure!(
        matches!(r4.state, TurnState::Completed { .. }),
        "{:?}",
        r4.state
    );
    let conversation = stack
        .session_record(&s)
        .await?
        .conversation
        .context("the conversation id was learnt from the CLI's events")?;
    let dir = stack.dir.path().join(fake_dir);
    let file = dir.join(format!("{conversation}.jsonl"));
    let messages: Vec<String> = std::fs::read_to_string(&file)
        .with_context(|| format!("read {file:?}"))?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["message"].as_str().map(str::to_string))
        .collect();
    ensure!(
        messages == ["hello agent", "please !fail", "now !crash", "are you back"],
        "one conversation across the crash: {messages:?}"
    );
    Ok(())
}

/// The generic `tmux` adapter runs any interactive CLI from the session's `launch` (here the
/// bundled mock agent, recognised only by its prompt text and its busy text): turns go in
/// by paste then Enter and end when the prompt is back; a dead pane is relaunched once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_tmux_adapter_drives_any_cli_by_its_prompt() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = generic(&mut stack).await;
    report(&stack, r)
}

async fn generic(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::api::{self, CreateSession};
    use turnstile_shared::records::{LaunchSpec, SessionRecord};
    let state = stack.dir.path().join("generic-cli");
    let launch = LaunchSpec {
        argv: vec![
            turnstile_tests::bin_path("turnstile")?
                .to_string_lossy()
                .into_owned(),
            "mock-agent".into(),
            "--state-dir".into(),
            state.to_string_lossy().into_owned(),
        ],
        ready: "❯".into(),
        busy: Some("working…".into()),
    };
    let req = CreateSession {
        agent: AgentKind::Tmux,
        name: "any-cli".into(),
        host: None,
        cwd: None,
        id: None,
        launch: Some(launch),
        ready_timeout_ms: None,
        policy: None,
    };
    let client = stack.client.clone();
    let s = turnstile_tests::wait_until("create", Duration::from_secs(20), || {
        let req = req.clone();
        let client = client.clone();
        async move {
            match api::call::<_, SessionRecord>(
                &client,
                turnstile_shared::subjects::api::SESSION_CREATE,
                &req,
                crate::stack::API,
            )
            .await
            {
                Ok(r) => Ok(Some(r.id)),
                Err(e) if e.code == ErrorCode::NoHost => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
    })
    .await?;
    let t1 = stack
        .send(&s, "hello generic\n!sleep 700ms\n!reply two\n!reply lines")
        .await?;
    let r1 = stack.wait_turn(&t1, Duration::from_secs(20)).await?;
    match &r1.state {
        TurnState::Completed { output, .. } => {
            ensure!(output.iter().any(|l| l.contains("two")), "{output:?}");
            ensure!(output.iter().any(|l| l.contains("lines")), "{output:?}");
        }
        other => anyhow::bail!("first turn: {other:?}"),
    }
    // The CLI exits mid-turn: `agent_exited`, naming the exit.
    let t2 = stack.send(&s, "!exit 4").await?;
    let r2 = stack.wait_turn(&t2, Duration::from_secs(20)).await?;
    ensure!(
        matches!(&r2.state, TurnState::Failed { reason, detail, .. } if reason == "agent_exited" && detail.contains("exited")),
        "{:?}",
        r2.state
    );
    // The next turn relaunches it once and goes through.
    let t3 = stack.send(&s, "again").await?;
    let r3 = stack.wait_turn(&t3, Duration::from_secs(20)).await?;
    ensure!(
        matches!(r3.state, TurnState::Completed { .. }),
        "{:?}",
        r3.state
    );
    Ok(())
}

/// R9: a session's own `ready_timeout` bounds the launch: a CLI that never shows its prompt
/// fails the turn `parent_transport_unavailable` after that long, not after the host's default
/// (20 s in these tests), with the terminal's last lines as evidence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_ready_timeout_bounds_its_launch() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = ready_timeout(&mut stack).await;
    report(&stack, r)
}

async fn ready_timeout(stack: &mut Stack) -> Result<()> {
    use turnstile_shared::api::{self, CreateSession};
    use turnstile_shared::records::{LaunchSpec, SessionRecord};
    let req = CreateSession {
        agent: AgentKind::Tmux,
        name: "never-ready".into(),
        host: None,
        cwd: None,
        id: None,
        launch: Some(LaunchSpec {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo starting up; sleep 60".into(),
            ],
            ready: "READY>".into(),
            busy: None,
        }),
        ready_timeout_ms: Some(1500),
        policy: None,
    };
    let client = stack.client.clone();
    let s = turnstile_tests::wait_until("create", Duration::from_secs(20), || {
        let (req, client) = (req.clone(), client.clone());
        async move {
            match api::call::<_, SessionRecord>(
                &client,
                turnstile_shared::subjects::api::SESSION_CREATE,
                &req,
                crate::stack::API,
            )
            .await
            {
                Ok(r) => Ok(Some(r.id)),
                Err(e) if e.code == ErrorCode::NoHost => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
    })
    .await?;
    let sent = std::time::Instant::now();
    let t = stack.send(&s, "hello?").await?;
    let r = stack.wait_turn(&t, Duration::from_secs(30)).await?;
    let took = sent.elapsed();
    match &r.state {
        TurnState::Failed { reason, output, .. } => {
            ensure!(reason == "parent_transport_unavailable", "{reason}");
            ensure!(
                output.iter().any(|l| l.contains("starting up")),
                "{output:?}"
            );
        }
        other => anyhow::bail!("expected a failed launch, got {other:?}"),
    }
    ensure!(
        took < Duration::from_secs(10),
        "bounded by the session's 1.5 s, took {took:?}"
    );
    Ok(())
}
