//! Agent adapters against fake CLIs that speak the real protocols (issue 5, acceptance 6):
//! a turn, a resume, a mid-turn crash, an error result.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use turnstile_shared::records::{AgentKind, TurnState};

use crate::stack::{report, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_adapter_runs_turns_survives_a_crash_and_resumes() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = claude(&mut stack).await;
    report(&stack, r)
}

async fn claude(stack: &mut Stack) -> Result<()> {
    let s = stack
        .create_session_of(AgentKind::Claude, "claude", None)
        .await?;
    // A turn: one stream-json message in, ends at its `result`.
    let t1 = stack.send(&s, "hello claude").await?;
    let r1 = stack.wait_turn(&t1, Duration::from_secs(20)).await?;
    match &r1.state {
        TurnState::Completed { output, .. } => {
            ensure!(output.iter().any(|l| l == "ok: hello claude"), "{output:?}")
        }
        other => anyhow::bail!("first turn: {other:?}"),
    }
    // An error result fails the turn with a named reason; the process lives on.
    let t2 = stack.send(&s, "please !fail").await?;
    let r2 = stack.wait_turn(&t2, Duration::from_secs(20)).await?;
    ensure!(
        matches!(&r2.state, TurnState::Failed { reason, .. } if reason == "agent_error"),
        "{:?}",
        r2.state
    );
    // A crash mid-turn: the turn fails `agent_exited` with the exit status and stderr.
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
    // The next turn resumes the same conversation (`--resume <session_id>`).
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
        .context("the conversation id was learnt from the stream")?;
    let file = stack
        .dir
        .path()
        .join("fake-claude")
        .join(format!("{conversation}.jsonl"));
    let messages: Vec<String> = std::fs::read_to_string(&file)?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["message"].as_str().map(str::to_string))
        .collect();
    ensure!(
        messages == ["hello claude", "please !fail", "now !crash", "are you back"],
        "one conversation across the crash: {messages:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_adapter_runs_turns_survives_a_crash_and_resumes() -> Result<()> {
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = codex(&mut stack).await;
    report(&stack, r)
}

async fn codex(stack: &mut Stack) -> Result<()> {
    let s = stack
        .create_session_of(AgentKind::Codex, "codex", None)
        .await?;
    let t1 = stack.send(&s, "hello codex").await?;
    let r1 = stack.wait_turn(&t1, Duration::from_secs(20)).await?;
    match &r1.state {
        TurnState::Completed { output, .. } => {
            ensure!(output.iter().any(|l| l == "ok: hello codex"), "{output:?}")
        }
        other => anyhow::bail!("first turn: {other:?}"),
    }
    // `turn.failed` fails the turn with a named reason.
    let t2 = stack.send(&s, "please !fail").await?;
    let r2 = stack.wait_turn(&t2, Duration::from_secs(20)).await?;
    ensure!(
        matches!(&r2.state, TurnState::Failed { reason, detail, .. } if reason == "agent_error" && detail.contains("refused")),
        "{:?}",
        r2.state
    );
    // A process that dies mid-turn: `agent_exited` with its exit status and stderr.
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
                "{output:?}"
            );
        }
        other => anyhow::bail!("crash turn: {other:?}"),
    }
    // Every turn after the first resumes the thread: one conversation throughout.
    let t4 = stack.send(&s, "are you back").await?;
    let r4 = stack.wait_turn(&t4, Duration::from_secs(20)).await?;
    ensure!(
        matches!(r4.state, TurnState::Completed { .. }),
        "{:?}",
        r4.state
    );
    let thread = stack
        .session_record(&s)
        .await?
        .conversation
        .context("the thread id was learnt from thread.started")?;
    let file = stack
        .dir
        .path()
        .join("fake-codex")
        .join(format!("{thread}.jsonl"));
    let listing = || {
        std::fs::read_dir(stack.dir.path().join("fake-codex"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
            .unwrap_or_default()
    };
    let messages: Vec<String> = std::fs::read_to_string(&file)
        .with_context(|| format!("read {file:?}; the state dir holds {:?}", listing()))?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["message"].as_str().map(str::to_string))
        .collect();
    ensure!(
        messages == ["hello codex", "please !fail", "now !crash", "are you back"],
        "one thread: {messages:?}"
    );
    Ok(())
}
