//! What the tests of the real agent CLIs (`claude.rs`, `codex.rs`) share: sessions in a
//! directory of their own, turn outcomes, and SIGKILLing the CLI process of a session.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use turnstile_shared::api::CreateSession;
use turnstile_shared::policy::Policy;
use turnstile_shared::records::{AgentKind, TurnRecord, TurnState};
use turnstile_shared::SessionId;

use crate::stack::Stack;

/// How long one turn of a real CLI (against the local scripted model) may take.
pub const TURN: Duration = Duration::from_secs(60);

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
