//! What the tests of the real agent CLIs (`claude.rs`, `codex.rs`) share: sessions in a
//! directory of their own, turn outcomes, and SIGKILLing the CLI process of a session; and the
//! cases both CLIs must handle alike: a Turnstile MCP server that cannot start, and exact turn
//! boundaries across a timed-out turn.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use turnstile_shared::api::CreateSession;
use turnstile_shared::policy::Policy;
use turnstile_shared::records::{AgentKind, TurnRecord, TurnState};
use turnstile_shared::{ExecutionId, SessionId};
use turnstile_tests::model::{self, Api, ModelServer, Reply};

use crate::stack::{report, Stack};

/// How long one turn of a real CLI (against the local scripted model) may take.
pub const TURN: Duration = Duration::from_secs(60);

/// A message that starts with `-` and holds quotes and a newline reaches the model verbatim,
/// and a 200 KB one (the most a message may be is 256 KiB) reaches it whole.
pub async fn messages_reach_the_model(
    stack: &Stack,
    model: &ModelServer,
    s: &SessionId,
) -> Result<()> {
    let text = "-v --help \"quoted\" 'single'\nsecond line";
    let long: String = (0..4000)
        .map(|i| format!("line {i:05} of a long message, with \"quotes\" and -dashes-\n"))
        .collect();
    for (message, reply) in [
        (text.to_string(), "hello from the model"),
        (long, "read it all"),
    ] {
        model.push(Reply::text(reply));
        let t = stack.send(s, &message).await?;
        let r = stack.wait_turn(&t, TURN).await?;
        ensure!(completed(&r)?.iter().any(|l| l == reply), "{:?}", r.state);
        let sent = model
            .requests()
            .last()
            .cloned()
            .context("a model request")?;
        ensure!(
            model::user_texts(&sent)
                .iter()
                .any(|t| t.trim_end() == message.trim_end()),
            "the message ({} bytes) reached the model as it was sent",
            message.len()
        );
    }
    Ok(())
}

/// The model calls the Turnstile `start_step` tool (`call`, in the CLI's own form): the step
/// runs on the host, and its result is handed over in a later turn of the same conversation,
/// where the model sees it (R3, R4).
pub async fn a_step_is_handed_over(
    stack: &Stack,
    model: &ModelServer,
    s: &SessionId,
    call: Reply,
) -> Result<()> {
    model.push(call);
    model.push(Reply::text("started it"));
    let t = stack.send(s, "start a background build").await?;
    completed(&stack.wait_turn(&t, TURN).await?)?;
    let started = model
        .requests()
        .iter()
        .flat_map(model::tool_results)
        .find(|r| r.contains("started step"))
        .context("start_step answered the model")?;
    ensure!(started.contains("bg-build"), "{started}");
    // No scope was asked for: the step outlives the turn that started it (R7), which ended
    // while it still slept.
    ensure!(started.contains("scope session"), "{started}");
    // Each CLI wraps the tool's text its own way: the id is the word that starts `stp_`.
    let step: ExecutionId = started
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| w.starts_with("stp_"))
        .context("the step id in the tool result")?
        .parse()?;
    let live = stack.exec(&step).await?.context("the step's record")?;
    ensure!(
        !live.status.is_terminal(),
        "the step ended with its turn: {:?}",
        live.status
    );
    model.push(Reply::text("noted the build"));
    turnstile_tests::wait_until("the step's result reaches the model", TURN, || async {
        Ok(model
            .requests()
            .iter()
            .flat_map(model::user_texts)
            .find(|t| t.contains("bg-build") && t.contains(STEP_MARKER))
            .map(|t| (t.contains("completed") && !t.contains("cancelled")).then_some(t)))
    })
    .await?
    .context("the step's result is its completion, not a cancellation")?;
    Ok(())
}

/// What the background step prints once its sleep is over.
const STEP_MARKER: &str = "built-after-the-turn";

/// The `start_step` arguments both CLIs' tool calls carry: only a name and a command, which
/// sleeps past the end of the turn that started it, then prints a marker.
pub fn step_arguments() -> serde_json::Value {
    serde_json::json!({
        "name": "bg-build",
        "command": ["sh", "-c", format!("sleep 3; echo {STEP_MARKER}")],
    })
}

/// The model API refuses the request: the turn fails `agent_error`, with the API's words.
pub async fn an_api_refusal_is_an_agent_error(
    stack: &Stack,
    model: &ModelServer,
    agent: AgentKind,
) -> Result<()> {
    let cwd = workdir(stack, "api-error")?;
    let s = session(stack, agent, "api-error", &cwd, None).await?;
    model.push(Reply::Refuse("scripted refusal: prompt too long".into()));
    let t = stack.send(&s, "anything").await?;
    let r = stack.wait_turn(&t, TURN).await?;
    let (reason, detail, output) = failed(&r)?;
    ensure!(reason == "agent_error", "{reason}: {detail}");
    let evidence = format!("{detail}\n{}", output.join("\n"));
    ensure!(evidence.contains("scripted refusal"), "{evidence}");
    Ok(())
}

/// The CLI process (found by `marks` on its command line) is SIGKILLed while its model is
/// still thinking: the turn fails `agent_exited`; the next turn resumes the conversation,
/// which still holds the message before. Returns the conversation id.
pub async fn a_killed_cli_ends_its_turn_and_the_next_resumes(
    stack: &Stack,
    model: &ModelServer,
    s: &SessionId,
    marks: &[&str],
) -> Result<String> {
    model.push(Reply::text("first"));
    let t = stack.send(s, "hello").await?;
    completed(&stack.wait_turn(&t, TURN).await?)?;
    let before = model.requests().len();
    model.push(Reply::Stall);
    let t = stack.send(s, "think hard").await?;
    turnstile_tests::wait_until("the stalled model request", TURN, || async {
        Ok((model.requests().len() > before).then_some(()))
    })
    .await?;
    kill(marks).await?;
    let r = stack.wait_turn(&t, TURN).await?;
    let (reason, detail, _) = failed(&r)?;
    ensure!(reason == "agent_exited", "{reason}: {detail}");
    ensure!(detail.contains("exit"), "{detail}");
    model.push(Reply::text("back again"));
    let t = stack.send(s, "still there?").await?;
    let out = stack.wait_turn(&t, TURN).await?;
    ensure!(
        completed(&out)?.iter().any(|l| l == "back again"),
        "{:?}",
        out.state
    );
    let resumed = model
        .requests()
        .last()
        .map(model::user_texts)
        .unwrap_or_default();
    ensure!(
        resumed.iter().any(|t| t == "hello"),
        "the resumed conversation holds the first message: {resumed:?}"
    );
    Ok(stack
        .session_record(s)
        .await?
        .conversation
        .context("the conversation id")?
        .to_string())
}

/// A stack (one lane replica, host `h1`) whose services run with `env` added.
pub async fn stack_with(env: &[(String, String)]) -> Result<Stack> {
    // The real CLIs are heavy to start (two at once on two cores stalled a test's transport
    // agent past the stack's 3 s host TTL in `scripts/test.sh`): nothing here tests host
    // loss, so hosts get the production TTL unless a test sets one.
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    if !env.iter().any(|(k, _)| *k == "TURNSTILE_HOST_TTL") {
        env.push(("TURNSTILE_HOST_TTL", "15s"));
    }
    Stack::start_with(&["a"], &["h1"], &env).await
}

/// A session of `agent` working in `cwd`, with `policy` (the default when `None`).
pub async fn session(
    stack: &Stack,
    agent: AgentKind,
    name: &str,
    cwd: &Path,
    policy: Option<Policy>,
) -> Result<SessionId> {
    stack
        .create_session_with(CreateSession {
            agent,
            name: name.to_string(),
            host: None,
            cwd: Some(cwd.to_string_lossy().into_owned()),
            id: None,
            launch: None,
            ready_timeout_ms: None,
            policy,
        })
        .await
}

pub fn completed(r: &TurnRecord) -> Result<&[String]> {
    match &r.state {
        TurnState::Completed { output, .. } => Ok(output),
        other => bail!("turn {} did not complete: {other:?}", r.id),
    }
}

/// `(reason, detail, output)` of a failed turn.
pub fn failed(r: &TurnRecord) -> Result<(&str, &str, &[String])> {
    match &r.state {
        TurnState::Failed {
            reason,
            detail,
            output,
            ..
        } => Ok((reason, detail, output)),
        other => bail!("turn {} did not fail: {other:?}", r.id),
    }
}

/// A fresh working directory that is not a git repository.
pub fn workdir(stack: &Stack, name: &str) -> Result<PathBuf> {
    let dir = stack.dir.path().join(name);
    std::fs::create_dir_all(&dir)?;
    ensure!(!dir.join(".git").exists());
    Ok(dir)
}

/// SIGKILLs the process whose command line holds every one of `marks`, and waits until it is
/// dead (a zombie or gone).
pub async fn kill(marks: &[&str]) -> Result<()> {
    let pid = pid_of(marks)?;
    rustix::process::kill_process(pid, rustix::process::Signal::KILL)?;
    let stat = format!("/proc/{}/stat", pid.as_raw_nonzero().get());
    turnstile_tests::wait_until("the killed CLI to die", TURN, || {
        let stat = stat.clone();
        async move {
            Ok(match std::fs::read_to_string(&stat) {
                // `pid (comm) STATE ...`: the state follows the last `)`.
                Ok(s) => s
                    .rsplit(')')
                    .next()
                    .and_then(|rest| rest.split_whitespace().next())
                    .filter(|state| *state == "Z" || *state == "X")
                    .map(|_| ()),
                Err(_) => Some(()),
            })
        }
    })
    .await
}

/// Every file under `dir`.
pub fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// The process whose command line holds every one of `marks`.
fn pid_of(marks: &[&str]) -> Result<rustix::process::Pid> {
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        if marks.iter().all(|m| cmdline.contains(m)) {
            return rustix::process::Pid::from_raw(pid).context("a pid");
        }
    }
    bail!("no process with {marks:?} on its command line")
}

/// Both CLIs against their scripted models on one stack, with `extra` added to its services'
/// environment.
async fn both(
    messages: &ModelServer,
    responses: &ModelServer,
    dir: &Path,
    extra: &[(&str, &str)],
) -> Result<Stack> {
    let mut env = crate::claude::env(messages, dir)?;
    env.extend(crate::codex::env(responses, dir)?);
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    stack_with(&env).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turnstile_mcp_server_that_cannot_start_is_said_by_both_clis() -> Result<()> {
    let messages = ModelServer::start(Api::Messages).await?;
    let responses = ModelServer::start(Api::Responses).await?;
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("no-such-turnstile");
    let missing = missing.to_string_lossy();
    let mut stack = both(
        &messages,
        &responses,
        dir.path(),
        &[("TURNSTILE_AGENT_BIN", &missing)],
    )
    .await?;
    let r = mcp_unavailable(&mut stack, &messages, &responses).await;
    report(&stack, r)
}

async fn mcp_unavailable(
    stack: &mut Stack,
    messages: &ModelServer,
    responses: &ModelServer,
) -> Result<()> {
    for (agent, model) in [(AgentKind::Claude, messages), (AgentKind::Codex, responses)] {
        let cwd = workdir(stack, &format!("no-mcp-{agent}"))?;
        let s = session(stack, agent, &format!("no-mcp-{agent}"), &cwd, None).await?;
        model.push(Reply::text("answered without tools"));
        let t = stack.send(&s, "start a step").await?;
        let r = stack.wait_turn(&t, TURN).await?;
        let (reason, detail, output) = failed(&r)?;
        ensure!(reason == "mcp_unavailable", "{agent}: {reason}: {detail}");
        let evidence = format!("{detail}\n{}", output.join("\n"));
        ensure!(evidence.contains("turnstile"), "{agent}: {evidence}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_turns_late_answer_is_never_the_next_turns() -> Result<()> {
    let messages = ModelServer::start(Api::Messages).await?;
    let responses = ModelServer::start(Api::Responses).await?;
    let dir = tempfile::tempdir()?;
    let mut stack = both(
        &messages,
        &responses,
        dir.path(),
        // Long enough for a CLI started under load to answer the second turn (4 s was not, in
        // `scripts/test.sh` beside another real-CLI test), short enough to wait out twice.
        &[("TURNSTILE_TURN_TIMEOUT", "10s")],
    )
    .await?;
    let r = boundaries(&mut stack, &messages, &responses).await;
    report(&stack, r)
}

async fn boundaries(
    stack: &mut Stack,
    messages: &ModelServer,
    responses: &ModelServer,
) -> Result<()> {
    for (agent, model) in [(AgentKind::Claude, messages), (AgentKind::Codex, responses)] {
        let cwd = workdir(stack, &format!("timeout-{agent}"))?;
        let s = session(stack, agent, &format!("timeout-{agent}"), &cwd, None).await?;
        // The model never answers the first turn: it times out.
        model.push(Reply::Stall);
        let t = stack.send(&s, "think forever").await?;
        let r = stack.wait_turn(&t, TURN).await?;
        let (reason, detail, _) = failed(&r)?;
        ensure!(reason == "turn_timeout", "{agent}: {reason}: {detail}");
        // The next turn gets its own answer, never anything of the timed-out one.
        model.push(Reply::text("the second answer"));
        let t = stack.send(&s, "second").await?;
        let r = stack.wait_turn(&t, TURN).await?;
        let out = completed(&r)?;
        ensure!(
            out.iter().any(|l| l == "the second answer"),
            "{agent}: {out:?}"
        );
    }
    Ok(())
}
