//! The `codex` adapter: Codex CLI, one `codex exec --json <message>` process per turn, and
//! `codex exec --json resume <thread_id> <message>` once the thread is known (from its
//! `thread.started` event). A turn ends at `turn.completed` (its last `agent_message` is the
//! reply) or `turn.failed`; a process that exits before either has crashed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use turnstile_shared::records::reason;
use turnstile_shared::{ConversationId, SessionId};

use crate::adapter::{Adapter, Adopted, Ready, SessionSpec, TurnEnd, Unavailable};
use crate::tail::{exit_status, Tail};

const TAIL: usize = 20;

/// Codex's own `exec --json` line types (its protocol, not Turnstile events).
mod codex_line {
    pub const THREAD_STARTED: &str = "thread.started";
    pub const ITEM_COMPLETED: &str = "item.completed";
    pub const TURN_COMPLETED: &str = "turn.completed";
    pub const TURN_FAILED: &str = "turn.failed";
}

pub struct CodexAdapter {
    pub bin: PathBuf,
    pub data_dir: PathBuf,
    pub nats_url: String,
    /// Threads learnt this process's lifetime (the transport also records them as the
    /// session's conversation, which is what a restarted transport resumes).
    threads: Mutex<HashMap<SessionId, ConversationId>>,
}

impl CodexAdapter {
    pub fn new(bin: PathBuf, data_dir: PathBuf, nats_url: String) -> Self {
        Self {
            bin,
            data_dir,
            nats_url,
            threads: Mutex::default(),
        }
    }

    fn thread(&self, spec: &SessionSpec) -> Option<ConversationId> {
        self.threads
            .lock()
            .ok()
            .and_then(|m| m.get(&spec.id).cloned())
            .or_else(|| spec.conversation.clone())
    }

    async fn turn(&self, spec: &SessionSpec, text: &str, timeout: Duration) -> TurnEnd {
        let mut argv = vec!["exec".to_string(), "--json".to_string()];
        if let Some(t) = self.thread(spec) {
            argv.push("resume".into());
            argv.push(t.to_string());
        }
        argv.push(text.to_string());
        let shown = format!(
            "{} {}",
            self.bin.display(),
            argv[..argv.len() - 1].join(" ")
        );
        let cwd = spec.cwd.clone().unwrap_or_else(|| self.data_dir.clone());
        let mut child = match tokio::process::Command::new(&self.bin)
            .args(&argv)
            .current_dir(&cwd)
            .env("TURNSTILE_SESSION", spec.id.as_str())
            .env("TURNSTILE_TOKEN", &spec.token)
            .env("TURNSTILE_NATS_URL", &self.nats_url)
            .stdin(Stdio::null())
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
        let Some(out) = child.stdout.take() else {
            return TurnEnd::Failed {
                reason: reason::TRANSPORT_ERROR,
                detail: format!("`{shown}` has no stdout"),
                output: Vec::new(),
            };
        };
        let mut lines = BufReader::new(out).lines();
        let mut said: Vec<String> = Vec::new();
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
                    Some(codex_line::ITEM_COMPLETED)
                        if event.pointer("/item/type").and_then(Value::as_str)
                            == Some("agent_message") =>
                    {
                        if let Some(t) = event.pointer("/item/text").and_then(Value::as_str) {
                            said.extend(t.lines().map(str::to_string));
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
        match outcome {
            Some(Ok(())) => TurnEnd::Completed { output: said },
            Some(Err(msg)) => TurnEnd::Failed {
                reason: reason::AGENT_ERROR,
                detail: format!("codex turn.failed: {msg}"),
                output: said,
            },
            None => TurnEnd::Failed {
                reason: reason::AGENT_EXITED,
                detail: format!("`{shown}` exited before the turn ended (exit {status})"),
                output: tail.lines().await,
            },
        }
    }
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
            if let Ok(mut m) = self.threads.lock() {
                m.remove(&spec.id);
            }
        })
    }
}
