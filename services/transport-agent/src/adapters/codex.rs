//! The `codex` adapter: Codex CLI, one `codex exec --json … -- -` process per turn (the
//! message on its stdin), and `codex exec --json … resume <thread_id> -- -` once the thread is
//! known (from its `thread.started` event). A turn ends at `turn.completed` (its last `agent_message` is
//! the reply) or `turn.failed`; a process that exits after `turn.started` without either has
//! crashed (`agent_exited`), one that exits before it never started (R9:
//! `parent_transport_unavailable`, or `mcp_unavailable` when its own error names the MCP
//! server), with its stderr as the evidence.
//!
//! Unattended: `exec` never asks for approval. The session's policy picks the sandbox
//! (`read-only` without edits or shell, else `workspace-write`, with network only when the
//! policy allows it); a command the sandbox refused (`Read-only file system`, `Operation not
//! permitted`) or an escalation codex rejected fails the turn `permission_denied`. A refused
//! command is seen in its `command_execution` item or, when codex printed none (a command
//! that ends the instant it starts), in the thread's rollout file (`codex_rollout`). The
//! Turnstile MCP server is given with `-c mcp_servers.turnstile.*`: `required` (codex will not
//! start without it), its tools approved, and the session's credentials passed by name from
//! this process's environment (`env_vars`), never on the command line. The message goes on
//! stdin, so it may start with `-` and be as long as a message may be;
//! `--skip-git-repo-check`, so any directory works.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use turnstile_shared::records::reason;
use turnstile_shared::{ConversationId, SessionId};

use crate::adapters::{Adapter, Adopted, Ready, SessionSpec, TurnEnd, Unavailable};
use crate::tail::{exit_status, Tail};

const TAIL: usize = 20;
/// What a sandboxed command prints when the sandbox refused it.
const SANDBOX_REFUSALS: [&str; 2] = ["Read-only file system", "Operation not permitted"];
/// What codex logs when it refuses a command outright (an escalation under `exec`).
const REJECTED: &str = "reject command";

/// Codex's own `exec --json` line types (its protocol, not Turnstile events).
mod codex_line {
    pub const THREAD_STARTED: &str = "thread.started";
    pub const ITEM_COMPLETED: &str = "item.completed";
    pub const TURN_STARTED: &str = "turn.started";
    pub const TURN_COMPLETED: &str = "turn.completed";
    pub const TURN_FAILED: &str = "turn.failed";
}

pub struct CodexAdapter {
    pub bin: PathBuf,
    pub data_dir: PathBuf,
    pub nats_url: String,
    /// The `turnstile` binary whose `mcp` subcommand codex runs as its MCP server.
    pub turnstile_bin: PathBuf,
    /// Threads learnt this process's lifetime (the transport also records them as the
    /// session's conversation, which is what a restarted transport resumes).
    threads: Mutex<HashMap<SessionId, ConversationId>>,
    /// Each thread's rollout file, once found (see `codex_rollout`).
    rollouts: Mutex<HashMap<ConversationId, PathBuf>>,
}

impl CodexAdapter {
    pub fn new(bin: PathBuf, data_dir: PathBuf, nats_url: String, turnstile_bin: PathBuf) -> Self {
        Self {
            bin,
            data_dir,
            nats_url,
            turnstile_bin,
            threads: Mutex::default(),
            rollouts: Mutex::default(),
        }
    }

    /// The thread's rollout file: remembered, else searched for (off the async threads).
    async fn rollout(&self, thread: &ConversationId) -> Option<PathBuf> {
        if let Some(p) = self
            .rollouts
            .lock()
            .ok()
            .and_then(|m| m.get(thread).cloned())
        {
            return Some(p);
        }
        let home = super::codex_rollout::codex_home()?;
        let t = thread.clone();
        let found = tokio::task::spawn_blocking(move || super::codex_rollout::find(&home, &t))
            .await
            .ok()
            .flatten()?;
        if let Ok(mut m) = self.rollouts.lock() {
            m.insert(thread.clone(), found.clone());
        }
        Some(found)
    }

    /// Commands the sandbox refused in the turn just ended, as the thread's rollout recorded
    /// them.
    async fn rollout_refusals(&self, spec: &SessionSpec) -> Vec<String> {
        let Some(thread) = self.thread(spec) else {
            return Vec::new();
        };
        let Some(path) = self.rollout(&thread).await else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || super::codex_rollout::refused(&path, &SANDBOX_REFUSALS))
            .await
            .unwrap_or_default()
    }

    fn thread(&self, spec: &SessionSpec) -> Option<ConversationId> {
        self.threads
            .lock()
            .ok()
            .and_then(|m| m.get(&spec.id).cloned())
            .or_else(|| spec.conversation.clone())
    }

    /// The arguments of one turn's `codex exec`; the message itself goes on stdin (`-`), so
    /// it may be as long as a message may be (an argument is limited to 128 KiB) and start
    /// with anything.
    fn argv(&self, spec: &SessionSpec, cwd: &std::path::Path) -> Vec<String> {
        let mut argv: Vec<String> = ["exec", "--json", "--skip-git-repo-check", "-C"]
            .map(String::from)
            .to_vec();
        argv.push(cwd.to_string_lossy().into_owned());
        let policy = &spec.policy;
        let sandbox = if policy.edits || policy.shell {
            "workspace-write"
        } else {
            "read-only"
        };
        argv.extend(["-s".to_string(), sandbox.to_string()]);
        let mut config = vec![format!(
            "sandbox_workspace_write.network_access={}",
            policy.network
        )];
        // TOML values: a JSON string or array of strings is one too.
        let names: Vec<String> = ["TURNSTILE_SESSION", "TURNSTILE_TOKEN", "TURNSTILE_NATS_URL"]
            .into_iter()
            .map(String::from)
            .chain(
                turnstile_shared::config::tls_env()
                    .into_iter()
                    .map(|(k, _)| k.to_string()),
            )
            .collect();
        let server = "mcp_servers.turnstile";
        config.extend([
            format!(
                "{server}.command={}",
                serde_json::Value::from(self.turnstile_bin.to_string_lossy())
            ),
            format!("{server}.args=[\"mcp\"]"),
            format!("{server}.env_vars={}", serde_json::Value::from(names)),
            format!("{server}.required=true"),
            format!("{server}.default_tools_approval_mode=\"approve\""),
        ]);
        for c in config {
            argv.extend(["-c".to_string(), c]);
        }
        if let Some(t) = self.thread(spec) {
            argv.push("resume".into());
            argv.push(t.to_string());
        }
        argv.push("--".into());
        argv.push("-".into());
        argv
    }

    async fn turn(&self, spec: &SessionSpec, text: &str, timeout: Duration) -> TurnEnd {
        let cwd = spec.cwd.clone().unwrap_or_else(|| self.data_dir.clone());
        let argv = self.argv(spec, &cwd);
        let shown = format!("{} {}", self.bin.display(), argv.join(" "));
        let mut child = match tokio::process::Command::new(&self.bin)
            .args(&argv)
            .current_dir(&cwd)
            .env("TURNSTILE_SESSION", spec.id.as_str())
            .env("TURNSTILE_TOKEN", &spec.token)
            .env("TURNSTILE_NATS_URL", &self.nats_url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                return TurnEnd::Failed {
                    reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
                    detail: format!("start `{shown}`: {e}"),
                    output: Vec::new(),
                }
            }
        };
        let mut tail = Tail::new(TAIL);
        if let Some(err) = child.stderr.take() {
            tail.follow(err);
        }
        // The message, then end of input (codex reads its prompt to EOF before it starts).
        if let Some(mut stdin) = child.stdin.take() {
            let text = text.to_string();
            tokio::spawn(async move {
                if let Err(e) = stdin.write_all(text.as_bytes()).await {
                    tracing::debug!(error = %e, "write the message to codex");
                }
            });
        }
        let Some(out) = child.stdout.take() else {
            return TurnEnd::Failed {
                reason: reason::TRANSPORT_ERROR,
                detail: format!("`{shown}` has no stdout"),
                output: Vec::new(),
            };
        };
        let mut lines = BufReader::new(out).lines();
        let mut said: Vec<String> = Vec::new();
        let mut started = false;
        let mut refused: Vec<String> = Vec::new();
        let read = async {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(event) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                match event.get("type").and_then(Value::as_str) {
                    Some(codex_line::THREAD_STARTED) => {
                        let id = event
                            .get("thread_id")
                            .and_then(Value::as_str)
                            .and_then(|t| t.parse::<ConversationId>().ok());
                        if let (Some(id), Ok(mut m)) = (id, self.threads.lock()) {
                            m.insert(spec.id.clone(), id);
                        }
                    }
                    Some(codex_line::TURN_STARTED) => started = true,
                    Some(codex_line::ITEM_COMPLETED) => {
                        match event.pointer("/item/type").and_then(Value::as_str) {
                            Some("agent_message") => {
                                if let Some(t) = event.pointer("/item/text").and_then(Value::as_str)
                                {
                                    said.extend(t.lines().map(str::to_string));
                                }
                            }
                            Some("command_execution") => refused.extend(sandbox_refusal(&event)),
                            _ => {}
                        }
                    }
                    Some(codex_line::TURN_COMPLETED) => return Some(Ok(())),
                    Some(codex_line::TURN_FAILED) => {
                        let msg = event
                            .pointer("/error/message")
                            .and_then(Value::as_str)
                            .unwrap_or(codex_line::TURN_FAILED)
                            .to_string();
                        return Some(Err(msg));
                    }
                    _ => {}
                }
            }
            None
        };
        let outcome = match tokio::time::timeout(timeout, read).await {
            Err(_) => {
                let _ = child.kill().await;
                return TurnEnd::Failed {
                    reason: reason::TURN_TIMEOUT,
                    detail: format!("`{shown}`: no turn end within {timeout:?}"),
                    output: said,
                };
            }
            Ok(o) => o,
        };
        let status = exit_status(&mut child).await;
        let skip = said.len().saturating_sub(TAIL);
        let said: Vec<String> = said.into_iter().skip(skip).collect();
        let stderr = tail.lines().await;
        refused.extend(
            stderr
                .iter()
                .filter(|l| l.contains(REJECTED))
                .map(|l| l.trim().to_string()),
        );
        if matches!(outcome, Some(Ok(()))) {
            for r in self.rollout_refusals(spec).await {
                if !refused.contains(&r) {
                    refused.push(r);
                }
            }
        }
        match outcome {
            Some(Ok(())) if !refused.is_empty() => TurnEnd::Failed {
                reason: reason::PERMISSION_DENIED,
                detail: format!(
                    "codex refused {} call(s) the session's policy does not allow: {}",
                    refused.len(),
                    refused.join("; ")
                ),
                output: said,
            },
            Some(Ok(())) => TurnEnd::Completed { output: said },
            Some(Err(msg)) => TurnEnd::Failed {
                reason: reason::AGENT_ERROR,
                detail: format!("codex turn.failed: {msg}"),
                output: said,
            },
            // It never started the turn: its own error says why (R9).
            None if !started => {
                let first = stderr
                    .iter()
                    .find(|l| l.contains("Error"))
                    .or_else(|| stderr.last())
                    .cloned()
                    .unwrap_or_default();
                let reason = if first.contains("MCP server") {
                    reason::MCP_UNAVAILABLE
                } else {
                    reason::PARENT_TRANSPORT_UNAVAILABLE
                };
                TurnEnd::Failed {
                    reason,
                    detail: format!("`{shown}` did not start the turn ({status}): {first}"),
                    output: stderr,
                }
            }
            None => TurnEnd::Failed {
                reason: reason::AGENT_EXITED,
                detail: format!("`{shown}` exited before the turn ended (exit {status})"),
                output: stderr,
            },
        }
    }
}

/// `<command>: <refusal>` when a command's output shows the sandbox refused it.
fn sandbox_refusal(event: &Value) -> Option<String> {
    let failed = event.pointer("/item/exit_code").and_then(Value::as_i64) != Some(0);
    let output = event
        .pointer("/item/aggregated_output")
        .and_then(Value::as_str)
        .unwrap_or("");
    let hit = SANDBOX_REFUSALS.iter().find(|r| output.contains(*r))?;
    let command = event
        .pointer("/item/command")
        .and_then(Value::as_str)
        .unwrap_or("?");
    failed.then(|| format!("{command}: {hit}"))
}

impl Adapter for CodexAdapter {
    /// Nothing runs between turns: ready whenever the CLI can be started (checked per turn).
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>> {
        Box::pin(async move {
            Ok(Ready {
                conversation: self.thread(spec),
                launched: false,
            })
        })
    }

    fn mark<'a>(&'a self, _spec: &'a SessionSpec) -> BoxFuture<'a, Result<Option<i64>, TurnEnd>> {
        Box::pin(async { Ok(None) })
    }

    fn run_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        text: &'a str,
        _mark: Option<i64>,
        timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd> {
        Box::pin(self.turn(spec, text, timeout))
    }

    /// The turn's process went with the transport that ran it: never run it again (R14).
    fn await_turn<'a>(
        &'a self,
        _spec: &'a SessionSpec,
        _mark: Option<i64>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Adopted> {
        Box::pin(async {
            Adopted::Ended(TurnEnd::Failed {
                reason: reason::AGENT_EXITED,
                detail: "the transport restarted mid-turn and its codex process went with it"
                    .to_string(),
                output: Vec::new(),
            })
        })
    }

    fn stop<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let thread = self
                .threads
                .lock()
                .ok()
                .and_then(|mut m| m.remove(&spec.id));
            if let (Some(thread), Ok(mut rollouts)) = (thread, self.rollouts.lock()) {
                rollouts.remove(&thread);
            }
        })
    }
}
