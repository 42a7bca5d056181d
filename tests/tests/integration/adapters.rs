//! The generic `tmux` adapter (any interactive CLI, recognised by its prompt) and the ready
//! timeout of a launch. The `claude` and `codex` adapters are proven against the real CLIs in
//! `claude.rs` and `codex.rs`.

use std::time::Duration;
use turnstile_shared::api::ErrorCode;

use anyhow::{ensure, Result};
use turnstile_shared::records::{AgentKind, TurnState};
use turnstile_shared::SessionId;

use crate::stack::{report, Stack};

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
    // Created the way a user would: `turnstile session create --agent tmux --launch COMMAND
    // --ready REGEX --busy REGEX`.
    let state = stack.dir.path().join("generic cli");
    let turnstile = turnstile_tests::bin_path("turnstile")?;
    // One string, split like a shell's words: the quotes keep the path with a space whole.
    let launch = format!(
        "{} mock-agent --state-dir '{}'",
        turnstile.display(),
        state.display()
    );
    let create = |ready: &'static str| {
        let mut cmd = tokio::process::Command::new(&turnstile);
        cmd.args(["session", "create", "--agent", "tmux", "--name", "any-cli"])
            .args([
                "--ready",
                ready,
                "--busy",
                "work(ing|s)…",
                "--launch",
                &launch,
            ])
            .envs(stack.env_as("cli"));
        cmd
    };
    // A pattern that is not a regular expression is refused at create, saying why.
    let bad = create("(❯").output().await?;
    ensure!(
        !bad.status.success()
            && String::from_utf8_lossy(&bad.stderr).contains("not a regular expression"),
        "{bad:?}"
    );
    let s: SessionId = turnstile_tests::wait_until("create", Duration::from_secs(20), || async {
        let out = create("^❯$").output().await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            return Ok(Some(String::from_utf8(out.stdout)?.trim().parse()?));
        }
        ensure!(stderr.contains("no_host"), "session create: {stderr}");
        Ok(None)
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
