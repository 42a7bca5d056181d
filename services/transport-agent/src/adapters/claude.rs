//! The `claude` adapter: Claude Code headless, one long-lived
//! `claude -p --input-format stream-json --output-format stream-json --verbose` process per
//! session. A turn is one user message written as a JSON line; it ends at the `result` event.
//! The conversation id is read from the latest `system/init` or `result` event and given back
//! with `--resume` when the process has to be started again (R9). The agent reaches Turnstile
//! through `--mcp-config` (the session's `turnstile mcp` config, credentials included).
//!
//! Unattended: `--permission-mode dontAsk` with `--allowedTools` from the session's policy
//! (the Turnstile MCP tools always), so a tool call outside the policy is refused at once,
//! never left waiting; the result's `permission_denials` fail the turn `permission_denied`.
//! No bypass mode is used, so running as root needs nothing special. Each turn's
//! `system/init` reports the MCP servers' status: a `turnstile` server that is not
//! `connected` fails the turn `mcp_unavailable`. A process that ends before it ever sent a
//! `system/init` never started (a `--resume` of an unknown conversation reports so in its
//! result's `errors`): `parent_transport_unavailable`, with the CLI's own text (R9). A turn
//! that times out takes the process with it, so nothing of it can be read as the next
//! turn's; the next turn resumes the conversation.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::sync::{mpsc, Mutex as AsyncMutex};
use turnstile_shared::policy::Policy;
use turnstile_shared::records::reason;
use turnstile_shared::{ConversationId, SessionId};

use super::credentials::SessionFiles;
use crate::adapters::{Adapter, Adopted, Ready, SessionSpec, TurnEnd, Unavailable};
use crate::tail::{exit_status, Tail};

/// Lines of stderr kept as evidence.
const TAIL: usize = 20;
/// The MCP server name the session's config gives Turnstile (`credentials.rs`).
const MCP_SERVER: &str = "turnstile";

pub struct ClaudeAdapter {
    pub bin: PathBuf,
    pub data_dir: PathBuf,
    pub nats_url: String,
    pub turnstile_bin: PathBuf,
    procs: Mutex<HashMap<SessionId, Arc<AsyncMutex<Proc>>>>,
}

struct Proc {
    child: Child,
    stdin: ChildStdin,
    events: mpsc::UnboundedReceiver<Value>,
    stderr: Tail,
    conversation: Option<ConversationId>,
    argv: Vec<String>,
    /// The process has started a turn (sent a `system/init`) at least once: it is up. An
    /// exit before that is a start-up failure; after it, a crash.
    started: bool,
}

impl ClaudeAdapter {
    pub fn new(bin: PathBuf, data_dir: PathBuf, nats_url: String, turnstile_bin: PathBuf) -> Self {
        Self {
            bin,
            data_dir,
            nats_url,
            turnstile_bin,
            procs: Mutex::default(),
        }
    }

    fn get(&self, id: &SessionId) -> Option<Arc<AsyncMutex<Proc>>> {
        self.procs.lock().ok().and_then(|m| m.get(id).cloned())
    }

    fn argv(&self, spec: &SessionSpec, files: &SessionFiles) -> Vec<String> {
        let mut argv: Vec<String> = [
            "-p",
            "--input-format",
            "stream-json",
            "--output-format",
            "stream-json",
            "--verbose",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(c) = &spec.conversation {
            argv.push("--resume".into());
            argv.push(c.to_string());
        }
        // `=` keeps each list one argument: the CLI's list flags take every following word.
        argv.push("--permission-mode=dontAsk".into());
        argv.push(format!(
            "--allowedTools={}",
            allowed_tools(&spec.policy).join(",")
        ));
        argv.push(format!("--mcp-config={}", files.mcp.to_string_lossy()));
        argv
    }

    async fn launch(&self, spec: &SessionSpec) -> Result<Arc<AsyncMutex<Proc>>, Unavailable> {
        let files = SessionFiles::at(&self.data_dir, spec);
        files
            .write(spec, &self.nats_url, &self.turnstile_bin)
            .map_err(|e| unavailable(format!("write credentials: {e}"), Vec::new()))?;
        let argv = self.argv(spec, &files);
        let cwd = spec.cwd.clone().unwrap_or_else(|| self.data_dir.clone());
        let command_line = format!("{} {}", self.bin.display(), argv.join(" "));
        let mut child = tokio::process::Command::new(&self.bin)
            .args(&argv)
            .current_dir(&cwd)
            // Credentials in the environment, never on the command line.
            .env("TURNSTILE_SESSION", spec.id.as_str())
            .env("TURNSTILE_TOKEN", &spec.token)
            .env("TURNSTILE_NATS_URL", &self.nats_url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| unavailable(format!("start `{command_line}`: {e}"), Vec::new()))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(unavailable(
                format!("`{command_line}` has no pipes"),
                Vec::new(),
            ));
        };
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
            }
        });
        let mut tail = Tail::new(TAIL);
        tail.follow(stderr);
        // No wait here for it to prove itself: a process that ends before it ever starts a
        // turn (a bad `--resume` exits within a second) is told apart by the turn itself.
        let proc = Arc::new(AsyncMutex::new(Proc {
            child,
            stdin,
            events,
            stderr: tail,
            conversation: spec.conversation.clone(),
            started: false,
            argv: std::iter::once(self.bin.to_string_lossy().into_owned())
                .chain(argv)
                .collect(),
        }));
        if let Ok(mut m) = self.procs.lock() {
            m.insert(spec.id.clone(), proc.clone());
        }
        Ok(proc)
    }
}

/// Claude Code's tool rules for a policy: the Turnstile MCP server's tools always; reading
/// (Read, Glob, Grep) is allowed by the CLI itself in the session's directory.
pub(crate) fn allowed_tools(policy: &Policy) -> Vec<String> {
    let mut tools = vec![format!("mcp__{MCP_SERVER}")];
    if policy.edits {
        tools.extend(["Edit", "MultiEdit", "Write", "NotebookEdit"].map(String::from));
    }
    if policy.shell {
        tools.push("Bash".into());
    }
    if policy.network {
        tools.extend(["WebFetch", "WebSearch"].map(String::from));
    }
    tools.extend(policy.tools.iter().cloned());
    tools
}

fn unavailable(detail: String, last_lines: Vec<String>) -> Unavailable {
    Unavailable { detail, last_lines }
}

/// The session id an event carries (`system/init` and `result` do).
fn session_of(v: &Value) -> Option<ConversationId> {
    v.get("session_id")?.as_str()?.parse().ok()
}

async fn turn(proc: &mut Proc, text: &str, timeout: Duration) -> TurnEnd {
    let line = json!({
        "type": "user",
        "message": {"role": "user", "content": [{"type": "text", "text": text}]},
    });
    let write = async {
        proc.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        proc.stdin.flush().await
    };
    if let Err(e) = write.await {
        if !proc.started {
            return not_started(proc, Vec::new()).await;
        }
        return exited(proc, format!("write the message: {e}")).await;
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut said: Vec<String> = Vec::new();
    let mut mcp_trouble: Option<String> = None;
    loop {
        let event = match tokio::time::timeout_at(deadline, proc.events.recv()).await {
            Err(_) => {
                // The process goes with the turn (waited for, so the next turn finds it
                // gone): nothing it says later can pass for the next turn's; the next turn
                // resumes the conversation.
                let _ = tokio::time::timeout(Duration::from_secs(5), proc.child.kill()).await;
                return TurnEnd::Failed {
                    reason: reason::TURN_TIMEOUT,
                    detail: format!("no result within {timeout:?}; the claude process was stopped"),
                    output: said,
                };
            }
            // (Its stdout is a pipe, so a process killed mid-turn may never flush this turn's
            // `system/init`: whether it ever started one tells a crash from a failed start.)
            Ok(None) if !proc.started => return not_started(proc, Vec::new()).await,
            Ok(None) => {
                return exited(proc, "its output ended before the turn's result".into()).await
            }
            Ok(Some(v)) => v,
        };
        if let Some(c) = session_of(&event) {
            proc.conversation = Some(c);
        }
        match event.get("type").and_then(Value::as_str) {
            Some("system") if event.get("subtype").and_then(Value::as_str) == Some("init") => {
                proc.started = true;
                mcp_trouble = mcp_status(&event);
            }
            Some("assistant") => said.extend(text_of(&event)),
            Some("result") if !proc.started => {
                return not_started(proc, strings(event.get("errors"))).await;
            }
            Some("result") => return outcome(&event, said, mcp_trouble),
            _ => {}
        }
    }
}

/// The turn's end from its `result` event: an error result, then refused tool calls, then an
/// unavailable Turnstile MCP server fail it; otherwise it completed.
fn outcome(event: &Value, said: Vec<String>, mcp_trouble: Option<String>) -> TurnEnd {
    let is_error = event
        .get("is_error")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let subtype = event
        .get("subtype")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let mut output = said;
    if let Some(r) = event.get("result").and_then(Value::as_str) {
        output.extend(r.lines().map(str::to_string));
    }
    output.extend(strings(event.get("errors")));
    let skip = output.len().saturating_sub(TAIL);
    let output: Vec<String> = output.into_iter().skip(skip).collect();
    if is_error || subtype != "success" {
        return TurnEnd::Failed {
            reason: reason::AGENT_ERROR,
            detail: format!("claude result {subtype:?} (is_error: {is_error})"),
            output,
        };
    }
    let denied = denials(event);
    if !denied.is_empty() {
        return TurnEnd::Failed {
            reason: reason::PERMISSION_DENIED,
            detail: format!(
                "claude refused {} tool call(s) the session's policy does not allow: {}",
                denied.len(),
                denied.join("; ")
            ),
            output,
        };
    }
    if let Some(status) = mcp_trouble {
        return TurnEnd::Failed {
            reason: reason::MCP_UNAVAILABLE,
            detail: format!(
                "claude reported the {MCP_SERVER} MCP server {status}: its tools were unavailable to this turn"
            ),
            output,
        };
    }
    TurnEnd::Completed { output }
}

/// The Turnstile server's status in a `system/init` event when it is not `connected`.
fn mcp_status(init: &Value) -> Option<String> {
    let servers = init.get("mcp_servers").and_then(Value::as_array);
    let status = servers
        .and_then(|list| {
            list.iter()
                .find(|s| s.get("name").and_then(Value::as_str) == Some(MCP_SERVER))
        })
        .map(|s| {
            s.get("status")
                .and_then(Value::as_str)
                .unwrap_or("unknown")
                .to_string()
        });
    match status {
        Some(s) if s == "connected" => None,
        Some(s) => Some(format!("as {s:?}")),
        None => Some("missing".to_string()),
    }
}

/// `tool (input)` for each of a result's `permission_denials`.
fn denials(result: &Value) -> Vec<String> {
    result
        .get("permission_denials")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .map(|d| {
                    let tool = d.get("tool_name").and_then(Value::as_str).unwrap_or("?");
                    let input = d
                        .get("tool_input")
                        .map(Value::to_string)
                        .unwrap_or_default();
                    let input: String = input.chars().take(200).collect();
                    format!("{tool} {input}")
                })
                .collect()
        })
        .unwrap_or_default()
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(Value::as_str)
                .flat_map(|s| s.lines().map(str::to_string).collect::<Vec<_>>())
                .collect()
        })
        .unwrap_or_default()
}

/// The process ended before it started the turn: it never started (or resumed), whatever
/// it printed first (R9). Its own errors and stderr are the evidence.
async fn not_started(proc: &mut Proc, errors: Vec<String>) -> TurnEnd {
    let status = exit_status(&mut proc.child).await;
    let mut output = errors;
    output.extend(proc.stderr.lines().await);
    let skip = output.len().saturating_sub(TAIL);
    let output: Vec<String> = output.into_iter().skip(skip).collect();
    let first = output.first().cloned().unwrap_or_default();
    TurnEnd::Failed {
        reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
        detail: format!(
            "`{}` did not start the turn ({status}): {first}",
            proc.argv.join(" ")
        ),
        output,
    }
}

fn text_of(v: &Value) -> Vec<String> {
    v.pointer("/message/content")
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .flat_map(|t| t.lines().map(str::to_string).collect::<Vec<_>>())
                .collect()
        })
        .unwrap_or_default()
}

/// The process ended mid-turn: its exit status and the tail of its stderr are the evidence.
async fn exited(proc: &mut Proc, what: String) -> TurnEnd {
    let status = exit_status(&mut proc.child).await;
    let output = proc.stderr.lines().await;
    TurnEnd::Failed {
        reason: reason::AGENT_EXITED,
        detail: format!("`{}`: {what} (exit {status})", proc.argv.join(" ")),
        output,
    }
}

impl Adapter for ClaudeAdapter {
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>> {
        Box::pin(async move {
            if let Some(p) = self.get(&spec.id) {
                let mut proc = p.lock().await;
                // Alive: not reaped as exited, and its stdout still open (a process killed a
                // moment ago may not be waitable yet, but its pipe is closed at once).
                if matches!(proc.child.try_wait(), Ok(None)) && !proc.events.is_closed() {
                    return Ok(Ready {
                        conversation: proc
                            .conversation
                            .clone()
                            .or_else(|| spec.conversation.clone()),
                        launched: false,
                    });
                }
            }
            // Gone (or never started): one launch, resuming the conversation when known (R9).
            let p = self.launch(spec).await?;
            let proc = p.lock().await;
            Ok(Ready {
                conversation: proc.conversation.clone(),
                launched: true,
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
        Box::pin(async move {
            let Some(p) = self.get(&spec.id) else {
                return TurnEnd::Failed {
                    reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
                    detail: format!("no claude process for {}", spec.id),
                    output: Vec::new(),
                };
            };
            let mut proc = p.lock().await;
            turn(&mut proc, text, timeout).await
        })
    }

    /// The process went with the transport that ran it; whether the message was taken is not
    /// knowable, so the turn is never typed again (R14): it fails, and the conversation is
    /// resumed at the next turn.
    fn await_turn<'a>(
        &'a self,
        _spec: &'a SessionSpec,
        _mark: Option<i64>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Adopted> {
        Box::pin(async {
            Adopted::Ended(TurnEnd::Failed {
                reason: reason::AGENT_EXITED,
                detail: "the transport restarted mid-turn and its claude process went with it; \
                         the next turn resumes the conversation"
                    .to_string(),
                output: Vec::new(),
            })
        })
    }

    fn stop<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let p = self.procs.lock().ok().and_then(|mut m| m.remove(&spec.id));
            if let Some(p) = p {
                let mut proc = p.lock().await;
                let _ = proc.child.kill().await;
            }
            SessionFiles::at(&self.data_dir, spec).remove();
        })
    }
}
