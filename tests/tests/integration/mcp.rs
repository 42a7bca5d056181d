//! `turnstile mcp` against a real MCP client, the official Python SDK (tests/mcp_client.py,
//! installed by scripts/install-python-tools.sh): a tool call made while a turn runs starts a
//! step under that turn (R6), and the step's result comes back to the agent afterwards.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use turnstile_shared::records::TurnState;
use turnstile_shared::{ExecutionId, SessionId, TurnId};
use turnstile_tests::{bin_path, workspace_root};

use crate::stack::{listed_steps, report, wait_deliveries, Stack};

const RESULT: &str = "mcp-result-42";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_mcp_client_starts_a_step_whose_result_reaches_the_agent() -> Result<()> {
    let python = python()?;
    let mut stack = Stack::start(&["a"], &["h1"]).await?;
    let r = through_mcp(&mut stack, &python).await;
    report(&stack, r)
}

/// The interpreter of the venv holding the pinned `mcp` package; never skipped silently.
pub(crate) fn python() -> Result<String> {
    match std::env::var("TURNSTILE_PYTHON") {
        Ok(p) if !p.is_empty() => Ok(p),
        _ => bail!(
            "TURNSTILE_PYTHON is not set: run scripts/install-python-tools.sh and set \
             TURNSTILE_PYTHON=$PWD/.tools/venv/bin/python (scripts/test.sh does both)"
        ),
    }
}

async fn through_mcp(stack: &mut Stack, python: &str) -> Result<()> {
    let s = stack.create_session("mcp", None).await?;
    let turn = stack
        .send(&s, "start the job through MCP\n!sleep 6s")
        .await?;
    stack.wait_running(&turn).await?;

    // While the turn runs, the agent's MCP client calls start_step.
    let args = json!({"name": "mcp-job", "command": ["sh", "-c", format!("echo {RESULT}")]});
    let out = run_client(stack, &s, python, &args).await?;
    let tools = out["tools"].as_array().context("tools")?;
    for (name, required) in [
        ("start_step", json!(["name"])),
        ("start_agent", json!(["name", "prompt"])),
        ("step_status", json!(["id"])),
        ("list_steps", Value::Null),
    ] {
        let tool = tools
            .iter()
            .find(|t| t["name"] == name)
            .with_context(|| format!("tool {name} advertised: {tools:?}"))?;
        let schema = &tool["inputSchema"];
        ensure!(
            schema["type"] == "object" && schema["required"] == required,
            "{name}: input schema {schema}"
        );
        ensure!(
            tool["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{name} has a description"
        );
    }
    let call = &out["start_step"];
    ensure!(call["isError"] == false, "start_step failed: {call}");
    let text = call["content"][0]["text"].as_str().context("result text")?;
    let step: ExecutionId = text
        .strip_prefix("started step ")
        .and_then(|t| t.split_whitespace().next())
        .with_context(|| format!("no step id in {text:?}"))?
        .parse()
        .map_err(|e| anyhow::anyhow!("step id in {text:?}: {e}"))?;

    // R6: the step's parent is the turn the lane held when the tool was called.
    let turn_x = ExecutionId::from(&turn);
    let rec = stack.exec(&step).await?.context("the step's record")?;
    ensure!(
        rec.parent.as_ref() == Some(&turn_x),
        "the step's parent is the running turn {turn_x}: {:?}",
        rec.parent
    );
    ensure!(rec.owner.as_ref() == Some(&s), "the session owns the step");
    let done = stack
        .wait_exec(&step, Duration::from_secs(30), |r| r.status.is_terminal())
        .await?;
    ensure!(
        done.status.name() == "completed" && done.status.summary().contains(RESULT),
        "{:?}",
        done.status
    );

    // After the turn, a delivery turn hands the result to the agent.
    ensure_turn_completed(stack, &turn).await?;
    let deliveries = wait_deliveries(stack, &s, 1, Duration::from_secs(40)).await?;
    let d = deliveries
        .iter()
        .find(|d| listed_steps(&d.text).contains(&step.to_string()))
        .with_context(|| format!("a delivery lists {step}: {deliveries:?}"))?;
    ensure!(
        matches!(d.state, TurnState::Completed { .. }) && d.text.contains(RESULT),
        "delivery {:?}: {}",
        d.state,
        d.text
    );
    let transcript = stack.transcript(&s).await?;
    let first = transcript
        .iter()
        .position(|m| m.contains("start the job through MCP"));
    let result = transcript.iter().position(|m| m.contains(RESULT));
    ensure!(
        matches!((first, result), (Some(f), Some(r)) if r > f),
        "the agent got the result after its turn: {transcript:?}"
    );
    Ok(())
}

/// Runs tests/mcp_client.py with the session's credentials; its stdout's JSON.
async fn run_client(stack: &Stack, s: &SessionId, python: &str, args: &Value) -> Result<Value> {
    let caller = stack.caller(s).await?;
    let script = workspace_root().join("tests").join("mcp_client.py");
    let turnstile = bin_path("turnstile")?;
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(&script)
        .arg(&turnstile)
        .arg(args.to_string())
        .env_remove("TURNSTILE_STEP")
        .env_remove("TURNSTILE_STEP_TOKEN")
        .env("TURNSTILE_SESSION", s.as_str())
        .env("TURNSTILE_TOKEN", &caller.token)
        .env("TURNSTILE_NATS_URL", stack.nats.url());
    json_output(cmd, "the MCP client").await
}

/// Runs a test client (a Python script) to its end, within 60 s, and reads the one JSON
/// document it prints; its stderr is in any error.
pub(crate) async fn json_output(mut cmd: tokio::process::Command, what: &str) -> Result<Value> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("run {what}: {cmd:?}"))?;
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .with_context(|| format!("{what} did not finish within 60 s"))??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "{what} failed ({}): {stderr}",
        out.status
    );
    serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "{what}'s output: {}; stderr: {stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

async fn ensure_turn_completed(stack: &Stack, turn: &TurnId) -> Result<()> {
    let ended = stack.wait_turn(turn, Duration::from_secs(30)).await?;
    ensure!(
        matches!(ended.state, TurnState::Completed { .. }),
        "{:?}",
        ended.state
    );
    Ok(())
}
