//! The `claude` adapter against the real Claude Code CLI (installed by
//! `scripts/install-agent-clis.sh`), its model replaced by the scripted Messages API server:
//! text turns, a shell command that writes a file, the Turnstile `start_step` tool with the
//! step's result delivered in the next turn (R3, R4), a message that starts with `-`, a
//! directory that is not a git repository, a tool call the session's policy refuses, a resume
//! of an unknown conversation, and the CLI killed mid-turn.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde_json::json;
use turnstile_shared::policy::Policy;
use turnstile_shared::records::AgentKind;
use turnstile_tests::model::{Api, ModelServer, Reply};

use crate::real_cli::{
    a_killed_cli_ends_its_turn_and_the_next_resumes, a_step_is_handed_over,
    an_api_refusal_is_an_agent_error, completed, failed, kill, messages_reach_the_model, session,
    step_arguments, walk, workdir, TURN,
};
use crate::stack::{report, Stack};

/// The environment that runs the real `claude` against `model`, in a config directory of the
/// test's own under `dir` (no login, no updates, no telemetry).
pub fn env(model: &ModelServer, dir: &Path) -> Result<Vec<(String, String)>> {
    let claude = turnstile_tests::agent_cli("claude")?;
    let config = dir.join("claude-config");
    std::fs::create_dir_all(&config)?;
    Ok([
        (
            "TURNSTILE_CLAUDE_BIN",
            claude.to_string_lossy().into_owned(),
        ),
        ("ANTHROPIC_BASE_URL", model.url().to_string()),
        ("ANTHROPIC_API_KEY", "scripted".to_string()),
        ("CLAUDE_CONFIG_DIR", config.to_string_lossy().into_owned()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_string()),
        ("CLAUDE_CODE_MAX_RETRIES", "0".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect())
}

async fn stack_for(model: &ModelServer, dir: &Path) -> Result<Stack> {
    crate::real_cli::stack_with(&env(model, dir)?).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_runs_text_shell_and_step_turns_verbatim_in_any_directory() -> Result<()> {
    let model = ModelServer::start(Api::Messages).await?;
    let dir = tempfile::tempdir()?;
    let mut stack = stack_for(&model, dir.path()).await?;
    let r = turns(&mut stack, &model).await;
    report(&stack, r)
}

async fn turns(stack: &mut Stack, model: &ModelServer) -> Result<()> {
    let cwd = workdir(stack, "plain-dir")?;
    let s = session(stack, AgentKind::Claude, "claude-turns", &cwd, None).await?;

    messages_reach_the_model(stack, model, &s).await?;

    // A shell command that writes a file in the session's directory.
    model.push(Reply::tool(
        "Bash",
        json!({"command": "echo made-by-claude > made.txt", "description": "write a file"}),
    ));
    model.push(Reply::text("wrote it"));
    let t2 = stack.send(&s, "write the file").await?;
    completed(&stack.wait_turn(&t2, TURN).await?)?;
    let made = std::fs::read_to_string(cwd.join("made.txt")).context("made.txt")?;
    ensure!(made.trim() == "made-by-claude", "{made:?}");

    // The Turnstile start_step tool, by its MCP name.
    a_step_is_handed_over(
        stack,
        model,
        &s,
        Reply::tool("mcp__turnstile__start_step", step_arguments()),
    )
    .await?;
    // One conversation throughout, resumed by id.
    let record = stack.session_record(&s).await?;
    ensure!(
        record.conversation.is_some(),
        "the conversation id was learnt"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_refusals_bad_resumes_and_kills_end_turns_with_the_clis_own_evidence() -> Result<()>
{
    let model = ModelServer::start(Api::Messages).await?;
    let dir = tempfile::tempdir()?;
    let mut stack = stack_for(&model, dir.path()).await?;
    let r = failures(&mut stack, &model, dir.path()).await;
    report(&stack, r)
}

async fn failures(stack: &mut Stack, model: &ModelServer, dir: &Path) -> Result<()> {
    an_api_refusal_is_an_agent_error(stack, model, AgentKind::Claude).await?;

    // A tool call the policy does not allow: refused at once, and the turn says so.
    let cwd = workdir(stack, "no-shell")?;
    let s = session(
        stack,
        AgentKind::Claude,
        "claude-refused",
        &cwd,
        Some(Policy::none()),
    )
    .await?;
    model.push(Reply::tool(
        "Bash",
        json!({"command": "touch refused.txt", "description": "try"}),
    ));
    model.push(Reply::text("I could not"));
    let t = stack.send(&s, "try the shell").await?;
    let r = stack.wait_turn(&t, TURN).await?;
    let (reason, detail, _) = failed(&r)?;
    ensure!(reason == "permission_denied", "{reason}: {detail}");
    ensure!(
        detail.contains("Bash") && detail.contains("touch refused.txt"),
        "{detail}"
    );
    ensure!(!cwd.join("refused.txt").exists(), "the refused command ran");

    // The CLI killed mid-turn (its model still thinking): `agent_exited`, with its exit.
    let cwd = workdir(stack, "killed")?;
    let s = session(stack, AgentKind::Claude, "claude-killed", &cwd, None).await?;
    let marks = [&format!("{s}.mcp.json"), "stream-json"];
    let conversation =
        a_killed_cli_ends_its_turn_and_the_next_resumes(stack, model, &s, &marks).await?;

    // A resume of a conversation the CLI no longer knows (its state wiped while the process
    // was down): the turn fails as a start-up failure, with the CLI's own words. The process
    // is taken down mid-turn, so the transport has seen it end before the next turn.
    model.push(Reply::Stall);
    let before = model.requests().len();
    let t = stack.send(&s, "think again").await?;
    turnstile_tests::wait_until("the second stalled model request", TURN, || async {
        Ok((model.requests().len() > before).then_some(()))
    })
    .await?;
    kill(&marks).await?;
    failed(&stack.wait_turn(&t, TURN).await?)?;
    let projects = dir.join("claude-config").join("projects");
    for f in walk(&projects)? {
        if f.to_string_lossy().contains(conversation.as_str()) {
            std::fs::remove_file(&f)?;
        }
    }
    let t = stack.send(&s, "are you there").await?;
    let r = stack.wait_turn(&t, TURN).await?;
    let (reason, detail, output) = failed(&r)?;
    ensure!(
        reason == "parent_transport_unavailable",
        "{reason}: {detail}"
    );
    let evidence = format!("{detail}\n{}", output.join("\n"));
    ensure!(
        evidence.contains("No conversation found") && evidence.contains(conversation.as_str()),
        "{evidence}"
    );
    Ok(())
}
