//! The `mock` adapter: `turnstile mock-agent` in a tmux pane. Readiness is "the cursor sits on
//! a bare `❯` prompt line"; a turn has ended when the cursor has moved past the line it was
//! typed on and sits on a bare prompt again.

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;
use turnstile_shared::records::reason;
use turnstile_shared::retry::Backoff;
use turnstile_shared::ConversationId;

use super::credentials::SessionFiles;
use crate::adapters::{Adapter, Adopted, Ready, SessionSpec, TurnEnd, Unavailable};
use crate::tmux::{PaneState, Tmux};

const PROMPT: &str = "❯";
const EVIDENCE_LINES: usize = 20;
/// How long a re-adopted turn's terminal must sit unchanged at its mark before the turn counts
/// as never typed.
const ADOPT_GRACE: Duration = Duration::from_secs(2);
/// Pane poll delays: quick at first (most turns of a fast agent end in milliseconds), then
/// relaxed.
const PANE_POLL: Backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(100));

pub struct MockAdapter {
    pub tmux: Tmux,
    /// The `turnstile` binary whose `mock-agent` subcommand is launched.
    pub agent_bin: PathBuf,
    pub state_dir: PathBuf,
    pub default_cwd: PathBuf,
    /// Holds the sessions' credential files (`sessions/<id>.env`, `.mcp.json`).
    pub data_dir: PathBuf,
    pub nats_url: String,
}

fn is_ready(state: &PaneState) -> bool {
    !state.dead && state.cursor_text().trim_end() == PROMPT
}

impl MockAdapter {
    fn launch_argv(&self, spec: &SessionSpec) -> Vec<String> {
        let mut argv = vec![
            self.agent_bin.to_string_lossy().into_owned(),
            "mock-agent".to_string(),
            "--state-dir".to_string(),
            self.state_dir.to_string_lossy().into_owned(),
        ];
        if let Some(c) = &spec.conversation {
            argv.push("--resume".to_string());
            argv.push(c.to_string());
        }
        argv
    }

    async fn launch(&self, spec: &SessionSpec) -> Result<(), Unavailable> {
        let name = spec.id.as_str();
        if self.tmux.has_session(name).await {
            let _ = self.tmux.kill_session(name).await;
        }
        // Credentials reach the agent through private files, never the command line.
        let files = SessionFiles::at(&self.data_dir, spec);
        files
            .write(spec, &self.nats_url, &self.agent_bin)
            .map_err(|e| Unavailable {
                detail: format!("write credentials for {name}: {e}"),
                last_lines: Vec::new(),
            })?;
        let argv = files.wrap(self.launch_argv(spec));
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let cwd = spec.cwd.clone().unwrap_or_else(|| self.default_cwd.clone());
        self.tmux
            .new_session(name, &cwd, &[], &argv)
            .await
            .map_err(|e| Unavailable {
                detail: format!("launch `{}`: {e}", argv.join(" ")),
                last_lines: Vec::new(),
            })
    }

    /// Polls until the prompt shows, the pane dies, or the deadline passes.
    async fn wait_ready(&self, name: &str, deadline: Instant) -> Result<PaneState, Unavailable> {
        let mut delays = PANE_POLL.delays();
        loop {
            let state = self.tmux.pane_state(name).await.map_err(|e| Unavailable {
                detail: format!("terminal {name}: {e}"),
                last_lines: Vec::new(),
            })?;
            if is_ready(&state) {
                return Ok(state);
            }
            if state.dead {
                return Err(Unavailable {
                    detail: format!(
                        "agent in terminal {name} exited (status {})",
                        state.exit_text()
                    ),
                    last_lines: state.last_lines(EVIDENCE_LINES),
                });
            }
            if Instant::now() >= deadline {
                return Err(Unavailable {
                    detail: format!("terminal {name} not at a ready prompt in time"),
                    last_lines: state.last_lines(EVIDENCE_LINES),
                });
            }
            delays.wait().await;
        }
    }

    /// Waits for the end of a turn typed at absolute line `typed_line` (None: any prompt).
    async fn wait_turn_end(
        &self,
        name: &str,
        typed_line: Option<i64>,
        timeout: Duration,
    ) -> TurnEnd {
        let deadline = Instant::now() + timeout;
        let mut delays = PANE_POLL.delays();
        loop {
            let state = match self.tmux.pane_state(name).await {
                Ok(s) => s,
                Err(e) => {
                    return TurnEnd::Failed {
                        reason: reason::AGENT_EXITED,
                        detail: format!("terminal {name} is gone: {e}"),
                        output: Vec::new(),
                    }
                }
            };
            if state.dead {
                return TurnEnd::Failed {
                    reason: reason::AGENT_EXITED,
                    detail: format!(
                        "agent exited during the turn (status {})",
                        state.exit_text()
                    ),
                    output: state.last_lines(EVIDENCE_LINES),
                };
            }
            let moved = typed_line.is_none_or(|l| state.cursor_line() > l);
            if moved && is_ready(&state) {
                let from = typed_line.unwrap_or(state.cursor_line() - EVIDENCE_LINES as i64);
                let output = self
                    .tmux
                    .capture_lines(name, &state, from, state.cursor_line() - 1)
                    .await
                    .unwrap_or_else(|_| state.last_lines(EVIDENCE_LINES));
                let skip = output.len().saturating_sub(EVIDENCE_LINES);
                return TurnEnd::Completed {
                    output: output.into_iter().skip(skip).collect(),
                };
            }
            if Instant::now() >= deadline {
                return TurnEnd::Failed {
                    reason: reason::TURN_TIMEOUT,
                    detail: format!("no ready prompt within {timeout:?}"),
                    output: state.last_lines(EVIDENCE_LINES),
                };
            }
            delays.wait().await;
        }
    }
}

fn conversation_from(state: &PaneState) -> Option<ConversationId> {
    state.screen.iter().find_map(|l| {
        l.strip_prefix("conversation: ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|id| id.parse().ok())
    })
}

impl Adapter for MockAdapter {
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>> {
        Box::pin(async move {
            let name = spec.id.as_str();
            let deadline = Instant::now() + timeout;
            let alive = match self.tmux.pane_state(name).await {
                Ok(s) if is_ready(&s) => {
                    return Ok(Ready {
                        conversation: conversation_from(&s).or_else(|| spec.conversation.clone()),
                        launched: false,
                    })
                }
                Ok(s) => !s.dead,
                Err(_) => false,
            };
            if alive {
                // Still busy with something: give it until the deadline, never type over it.
                let state = self.wait_ready(name, deadline).await?;
                return Ok(Ready {
                    conversation: conversation_from(&state).or_else(|| spec.conversation.clone()),
                    launched: false,
                });
            }
            self.launch(spec).await?;
            // One launch (a same-conversation resume when the conversation is known), bounded
            // by the deadline; its failure names the command (R9 evidence).
            let state = self
                .wait_ready(name, deadline)
                .await
                .map_err(|u| Unavailable {
                    detail: format!(
                        "{} (after `{}`)",
                        u.detail,
                        self.launch_argv(spec).join(" ")
                    ),
                    last_lines: u.last_lines,
                })?;
            Ok(Ready {
                conversation: conversation_from(&state).or_else(|| spec.conversation.clone()),
                launched: true,
            })
        })
    }

    fn mark<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, Result<Option<i64>, TurnEnd>> {
        Box::pin(async move {
            let name = spec.id.as_str();
            match self.tmux.pane_state(name).await {
                Ok(s) if is_ready(&s) => Ok(Some(s.cursor_line())),
                Ok(s) => Err(TurnEnd::Failed {
                    reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
                    detail: format!("terminal {name} is not at a ready prompt"),
                    output: s.last_lines(EVIDENCE_LINES),
                }),
                Err(e) => Err(TurnEnd::Failed {
                    reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
                    detail: format!("terminal {name}: {e}"),
                    output: Vec::new(),
                }),
            }
        })
    }

    fn run_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        text: &'a str,
        mark: Option<i64>,
        timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd> {
        Box::pin(async move {
            let name = spec.id.as_str();
            let typed_line = match mark {
                Some(m) => m,
                None => match self.mark(spec).await {
                    Ok(m) => m.unwrap_or_default(),
                    Err(end) => return end,
                },
            };
            let buffer = format!("turn-{}", uuid::Uuid::new_v4().simple());
            if let Err(e) = self.tmux.type_message(name, &buffer, text).await {
                return TurnEnd::Failed {
                    reason: reason::TRANSPORT_ERROR,
                    detail: format!("type into terminal {name}: {e}"),
                    output: Vec::new(),
                };
            }
            self.wait_turn_end(name, Some(typed_line), timeout).await
        })
    }

    fn await_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        mark: Option<i64>,
        timeout: Duration,
    ) -> BoxFuture<'a, Adopted> {
        Box::pin(async move {
            let name = spec.id.as_str();
            let Some(mark) = mark else {
                return Adopted::Ended(self.wait_turn_end(name, None, timeout).await);
            };
            // Paste and Enter go to tmux as one command list, so the message either went in
            // whole or not at all. If it went in, the agent moves its cursor off the marked
            // line promptly; a terminal still on a bare prompt at the mark after the grace
            // period never received it.
            let deadline = Instant::now() + ADOPT_GRACE;
            let mut delays = PANE_POLL.delays();
            loop {
                match self.tmux.pane_state(name).await {
                    Ok(s) if s.dead || s.cursor_line() > mark => break,
                    Ok(s) if is_ready(&s) && Instant::now() >= deadline => {
                        return Adopted::NotTyped
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
                delays.wait().await;
            }
            Adopted::Ended(self.wait_turn_end(name, Some(mark), timeout).await)
        })
    }

    fn stop<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = self.tmux.kill_session(spec.id.as_str()).await {
                tracing::debug!(session = %spec.id, error = %e, "kill terminal");
            }
            SessionFiles::at(&self.data_dir, spec).remove();
        })
    }
}
