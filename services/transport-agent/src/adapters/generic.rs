//! The generic `tmux` adapter: any interactive CLI in a tmux pane, described by the session's
//! `launch` (argv, a regular expression its prompt line matches, and one a screen line
//! matches while it is busy). The text
//! goes in by load-buffer/paste-buffer and Enter is sent separately; the pane is checked with
//! `#{pane_dead}` before anything is typed (R9). A turn has ended when the cursor has moved
//! past the line it was typed on and the prompt is back with no busy text on screen.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use regex::Regex;
use tokio::time::Instant;
use turnstile_shared::records::{reason, LaunchSpec};

use super::credentials::SessionFiles;
use crate::adapters::{Adapter, Adopted, Ready, SessionSpec, TurnEnd, Unavailable};
use crate::tmux::{PaneState, Tmux};

const EVIDENCE_LINES: usize = 20;
const POLL: Duration = Duration::from_millis(50);

pub struct GenericAdapter {
    pub tmux: Tmux,
    pub data_dir: PathBuf,
    pub nats_url: String,
    pub turnstile_bin: PathBuf,
    /// The sessions' ready and busy patterns, compiled once each.
    pub patterns: Mutex<HashMap<String, Option<Regex>>>,
}

impl GenericAdapter {
    /// Whether `text` matches `pattern` (a regular expression, checked when the session was
    /// created; one that does not compile never matches).
    fn matches(&self, pattern: &str, text: &str) -> bool {
        let Ok(mut cache) = self.patterns.lock() else {
            return false;
        };
        cache
            .entry(pattern.to_string())
            .or_insert_with(|| Regex::new(pattern).ok())
            .as_ref()
            .is_some_and(|r| r.is_match(text))
    }

    /// At its prompt: the cursor line (without trailing blanks) matches `ready`, and no screen
    /// line matches `busy`.
    fn ready(&self, launch: &LaunchSpec, state: &PaneState) -> bool {
        !state.dead
            && self.matches(&launch.ready, state.cursor_text().trim_end())
            && !launch
                .busy
                .as_ref()
                .is_some_and(|b| state.screen.iter().any(|l| self.matches(b, l)))
    }
}

fn no_launch(spec: &SessionSpec) -> Unavailable {
    Unavailable {
        detail: format!(
            "session {} has no launch spec for the tmux adapter",
            spec.id
        ),
        last_lines: Vec::new(),
    }
}

impl GenericAdapter {
    async fn wait_ready(
        &self,
        name: &str,
        launch: &LaunchSpec,
        deadline: Instant,
    ) -> Result<PaneState, Unavailable> {
        loop {
            let state = self.tmux.pane_state(name).await.map_err(|e| Unavailable {
                detail: format!("terminal {name}: {e}"),
                last_lines: Vec::new(),
            })?;
            if self.ready(launch, &state) {
                return Ok(state);
            }
            if state.dead || Instant::now() >= deadline {
                let why = if state.dead {
                    format!(
                        "the CLI in terminal {name} exited (status {})",
                        state.exit_text()
                    )
                } else {
                    format!(
                        "terminal {name} shows no prompt matching `{}` in time",
                        launch.ready
                    )
                };
                return Err(Unavailable {
                    detail: format!("{why} (after `{}`)", launch.argv.join(" ")),
                    last_lines: state.last_lines(EVIDENCE_LINES),
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits for the end of a turn typed at absolute line `mark`.
    async fn wait_end(
        &self,
        name: &str,
        launch: &LaunchSpec,
        mark: i64,
        timeout: Duration,
    ) -> TurnEnd {
        let deadline = Instant::now() + timeout;
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
                        "the CLI in terminal {name} exited mid-turn (status {})",
                        state.exit_text()
                    ),
                    output: state.last_lines(EVIDENCE_LINES),
                };
            }
            if state.cursor_line() > mark && self.ready(launch, &state) {
                let mut output = state.last_lines(EVIDENCE_LINES);
                output.pop(); // the prompt line
                return TurnEnd::Completed { output };
            }
            if Instant::now() >= deadline {
                return TurnEnd::Failed {
                    reason: reason::TURN_TIMEOUT,
                    detail: format!("terminal {name} not back at its prompt within {timeout:?}"),
                    output: state.last_lines(EVIDENCE_LINES),
                };
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Adapter for GenericAdapter {
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>> {
        Box::pin(async move {
            let launch = spec.launch.as_ref().ok_or_else(|| no_launch(spec))?;
            let name = spec.id.as_str();
            let deadline = Instant::now() + timeout;
            let alive = matches!(self.tmux.pane_state(name).await, Ok(s) if !s.dead);
            if alive {
                self.wait_ready(name, launch, deadline).await?;
                return Ok(Ready {
                    conversation: None,
                    launched: false,
                });
            }
            // Missing or dead: one launch, bounded by the ready timeout (R9).
            if self.tmux.has_session(name).await {
                let _ = self.tmux.kill_session(name).await;
            }
            let files = SessionFiles::at(&self.data_dir, spec);
            files
                .write(spec, &self.nats_url, &self.turnstile_bin)
                .map_err(|e| Unavailable {
                    detail: format!("write credentials for {name}: {e}"),
                    last_lines: Vec::new(),
                })?;
            let argv = files.wrap(launch.argv.clone());
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            let cwd = spec.cwd.clone().unwrap_or_else(|| self.data_dir.clone());
            self.tmux
                .new_session(name, &cwd, &[], &argv)
                .await
                .map_err(|e| Unavailable {
                    detail: format!("launch `{}`: {e}", launch.argv.join(" ")),
                    last_lines: Vec::new(),
                })?;
            self.wait_ready(name, launch, deadline).await?;
            Ok(Ready {
                conversation: None,
                launched: true,
            })
        })
    }

    fn mark<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, Result<Option<i64>, TurnEnd>> {
        Box::pin(async move {
            let state =
                self.tmux
                    .pane_state(spec.id.as_str())
                    .await
                    .map_err(|e| TurnEnd::Failed {
                        reason: reason::PARENT_TRANSPORT_UNAVAILABLE,
                        detail: format!("terminal {}: {e}", spec.id),
                        output: Vec::new(),
                    })?;
            Ok(Some(state.cursor_line()))
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
            let Some(launch) = spec.launch.as_ref() else {
                return TurnEnd::Failed {
                    reason: reason::TRANSPORT_ERROR,
                    detail: no_launch(spec).detail,
                    output: Vec::new(),
                };
            };
            let name = spec.id.as_str();
            let typed = async {
                self.tmux.paste(name, name, text).await?;
                self.tmux.press_enter(name).await
            };
            if let Err(e) = typed.await {
                return TurnEnd::Failed {
                    reason: reason::TRANSPORT_ERROR,
                    detail: format!("type into terminal {name}: {e}"),
                    output: Vec::new(),
                };
            }
            self.wait_end(name, launch, mark.unwrap_or(0), timeout)
                .await
        })
    }

    /// The pane outlives the transport: a turn that went in (the cursor moved) is watched to
    /// its end; one still at its mark on a ready prompt never went in.
    fn await_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        mark: Option<i64>,
        timeout: Duration,
    ) -> BoxFuture<'a, Adopted> {
        Box::pin(async move {
            let (Some(launch), Some(mark)) = (spec.launch.as_ref(), mark) else {
                return Adopted::NotTyped;
            };
            let name = spec.id.as_str();
            match self.tmux.pane_state(name).await {
                Ok(s) if !s.dead && s.cursor_line() == mark && self.ready(launch, &s) => {
                    Adopted::NotTyped
                }
                _ => Adopted::Ended(self.wait_end(name, launch, mark, timeout).await),
            }
        })
    }

    fn stop<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let _ = self.tmux.kill_session(spec.id.as_str()).await;
            SessionFiles::at(&self.data_dir, spec).remove();
        })
    }
}
