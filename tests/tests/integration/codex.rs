//! The `codex` adapter against the real Codex CLI (installed by
//! `scripts/install-agent-clis.sh`), its model replaced by the scripted Responses API server:
//! text turns, a shell command that writes a file (in codex's own sandbox), the Turnstile
//! `start_step` MCP tool with the step's result delivered in the next turn (R3, R4), a
//! message that starts with `-`, a directory that is not a git repository, a command the
//! session's policy refuses, the CLI killed mid-turn, and a resume of a thread it lost.

use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde_json::json;
use turnstile_shared::policy::Policy;
use turnstile_shared::records::AgentKind;
use turnstile_tests::model::{Api, ModelServer, Reply};

use crate::real_cli::{
    a_killed_cli_ends_its_turn_and_the_next_resumes, a_step_is_handed_over,
    an_api_refusal_is_an_agent_error, completed, failed, messages_reach_the_model, session,
    step_arguments, walk, workdir, TURN,
};
use crate::stack::{report, Stack};

/// The environment that runs the real `codex` against `model`: a `CODEX_HOME` of the test's
/// own under `dir` whose config names the scripted provider, and a `TMPDIR` outside it (codex
/// will not put its sandbox helpers under the temporary directory).
pub fn env(model: &ModelServer, dir: &Path) -> Result<Vec<(String, String)>> {
    let codex = turnstile_tests::agent_cli("codex")?;
    let home = dir.join("codex-home");
    let tmp = dir.join("codex-tmp");
    std::fs::create_dir_all(&home)?;
    std::fs::create_dir_all(&tmp)?;
    std::fs::write(
        home.join("config.toml"),
        format!(
            "model = \"gpt-5.5\"\nmodel_provider = \"scripted\"\n\n\
             [model_providers.scripted]\nname = \"scripted\"\nbase_url = \"{}/v1\"\n\
             wire_api = \"responses\"\nstream_max_retries = 0\nrequest_max_retries = 0\n\n\
             [analytics]\nenabled = false\n",
            model.url()
        ),
    )?;
    Ok([
        ("TURNSTILE_CODEX_BIN", codex.to_string_lossy().into_owned()),
        ("CODEX_HOME", home.to_string_lossy().into_owned()),
        ("TMPDIR", tmp.to_string_lossy().into_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect())
}

async fn stack_for(model: &ModelServer, dir: &Path) -> Result<Stack> {
    crate::real_cli::stack_with(&env(model, dir)?).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_runs_text_shell_and_step_turns_verbatim_in_any_directory() -> Result<()> {
    let model = ModelServer::start(Api::Responses).await?;
    let dir = tempfile::tempdir()?;
    let mut stack = stack_for(&model, dir.path()).await?;
    let r = turns(&mut stack, &model).await;
    report(&stack, r)
}

async fn turns(stack: &mut Stack, model: &ModelServer) -> Result<()> {
    let cwd = workdir(stack, "plain-dir")?;
    let s = session(stack, AgentKind::Codex, "codex-turns", &cwd, None).await?;

    messages_reach_the_model(stack, model, &s).await?;

    // A shell command that writes a file in the session's directory (inside the sandbox).
    model.push(Reply::tool(
        "exec_command",
        json!({"cmd": "echo made-by-codex > made.txt"}),
    ));
    model.push(Reply::text("wrote it"));
    let t2 = stack.send(&s, "write the file").await?;
    completed(&stack.wait_turn(&t2, TURN).await?)?;
    let made = std::fs::read_to_string(cwd.join("made.txt")).context("made.txt")?;
    ensure!(made.trim() == "made-by-codex", "{made:?}");

    // The Turnstile start_step tool (an MCP tool: namespace `mcp__turnstile`).
    a_step_is_handed_over(
        stack,
        model,
        &s,
        Reply::namespaced("mcp__turnstile", "start_step", step_arguments()),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_refusals_kills_and_lost_threads_end_turns_with_the_clis_own_evidence() -> Result<()>
{
    let model = ModelServer::start(Api::Responses).await?;
    let dir = tempfile::tempdir()?;
    let mut stack = stack_for(&model, dir.path()).await?;
    let r = failures(&mut stack, &model, dir.path()).await;
    report(&stack, r)
}

async fn failures(stack: &mut Stack, model: &ModelServer, dir: &Path) -> Result<()> {
    an_api_refusal_is_an_agent_error(stack, model, AgentKind::Codex).await?;

    // A command the policy does not allow (no edits, no shell: a read-only sandbox).
    let cwd = workdir(stack, "read-only")?;
    let s = session(
        stack,
        AgentKind::Codex,
        "codex-refused",
        &cwd,
        Some(Policy::none()),
    )
    .await?;
    model.push(Reply::tool(
        "exec_command",
        json!({"cmd": "touch refused.txt"}),
    ));
    model.push(Reply::text("I could not"));
    let t = stack.send(&s, "try the shell").await?;
    let r = stack.wait_turn(&t, TURN).await?;
    let (reason, detail, _) = failed(&r)?;
    ensure!(reason == "permission_denied", "{reason}: {detail}");
    ensure!(detail.contains("touch refused.txt"), "{detail}");
    ensure!(!cwd.join("refused.txt").exists(), "the refused command ran");

    // The CLI killed mid-turn (its model still thinking): `agent_exited`.
    let cwd = workdir(stack, "killed")?;
    let s = session(stack, AgentKind::Codex, "codex-killed", &cwd, None).await?;
    let cwd_text = cwd.to_string_lossy();
    let thread = a_killed_cli_ends_its_turn_and_the_next_resumes(
        stack,
        model,
        &s,
        &["exec", "--json", &cwd_text],
    )
    .await?;

    // A resume of a thread codex no longer has (its state wiped): a start-up failure, with
    // codex's own words.
    for f in walk(&dir.join("codex-home").join("sessions"))? {
        if f.to_string_lossy().contains(&thread) {
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
        evidence.contains("thread/resume failed") && evidence.contains(&thread),
        "{evidence}"
    );
    Ok(())
}
