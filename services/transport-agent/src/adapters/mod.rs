//! The agent adapters, and the one trait every adapter implements: how to bring a session's
//! agent to a ready prompt (launching or resuming it), type a turn and recognise its end, and
//! stop it. One file per adapter; they call down into `credentials` (a session's env file, MCP
//! config and launcher) and the host's infrastructure (`crate::tmux`, `crate::tail`), never
//! into each other or up into the commands that drive them.
//!
//! - `mock`, `generic`: agents in tmux panes (the bundled mock agent; any CLI with a prompt);
//! - `claude`: Claude Code, one headless process per session;
//! - `codex`: Codex CLI, one headless process per turn (`codex_rollout`: its session files);
//! - [`InstantAdapter`] (here): completes every turn at once, for benchmarks.

pub(crate) mod claude;
pub(crate) mod codex;
mod codex_rollout;
mod credentials;
pub(crate) mod generic;
pub(crate) mod mock;

use std::path::PathBuf;
use std::time::Duration;

use futures::future::BoxFuture;
use turnstile_shared::records::AgentKind;
use turnstile_shared::{ConversationId, SessionId};

/// What an adapter needs to know about a session.
#[derive(Debug, Clone)]
pub struct SessionSpec {
    pub id: SessionId,
    pub agent: AgentKind,
    pub cwd: Option<PathBuf>,
    pub conversation: Option<ConversationId>,
    pub token: String,
    /// For the generic `tmux` adapter: what to run and its ready/busy text.
    pub launch: Option<turnstile_shared::records::LaunchSpec>,
    /// The session's own ready timeout (R9), if it set one.
    pub ready_timeout: Option<Duration>,
    /// What the agent may do without asking, mapped onto each CLI's flags.
    pub policy: turnstile_shared::policy::Policy,
}

/// The agent is at its ready prompt.
#[derive(Debug, Clone)]
pub struct Ready {
    pub conversation: Option<ConversationId>,
    /// True when this call had to launch or resume the agent.
    pub launched: bool,
}

/// Why the agent could not be brought to a ready prompt, with the evidence (R9).
#[derive(Debug, Clone)]
pub struct Unavailable {
    pub detail: String,
    pub last_lines: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TurnEnd {
    Completed {
        output: Vec<String>,
    },
    Failed {
        reason: &'static str,
        detail: String,
        output: Vec<String>,
    },
}

/// What a restarted transport finds of a turn an earlier run recorded as `running`.
#[derive(Debug, Clone, PartialEq)]
pub enum Adopted {
    /// The turn went in and has ended.
    Ended(TurnEnd),
    /// The terminal is still where it was before typing: the text never went in.
    NotTyped,
}

pub trait Adapter: Send + Sync {
    /// Brings the agent to its ready prompt within `timeout`, launching it (resuming the
    /// session's conversation when known) if its terminal is missing or dead.
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>>;

    /// The position to record before typing (see `TurnState::Running::mark`); the agent must
    /// be at its ready prompt.
    fn mark<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, Result<Option<i64>, TurnEnd>>;

    /// Types `text` as one message at `mark` and waits for the agent to be back at its prompt.
    fn run_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        text: &'a str,
        mark: Option<i64>,
        timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd>;

    /// Re-adopts a turn an earlier run of this transport recorded as `running` at `mark`:
    /// waits for its end, or reports that it was never typed (so it is typed now, once).
    fn await_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        mark: Option<i64>,
        timeout: Duration,
    ) -> BoxFuture<'a, Adopted>;

    /// Ends the agent and its terminal.
    fn stop<'a>(&'a self, spec: &'a SessionSpec) -> BoxFuture<'a, ()>;
}

/// Completes every turn at once, in process: measures the lane, not an agent.
pub struct InstantAdapter;

impl Adapter for InstantAdapter {
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>> {
        Box::pin(async move {
            Ok(Ready {
                conversation: spec.conversation.clone(),
                launched: false,
            })
        })
    }

    fn mark<'a>(&'a self, _spec: &'a SessionSpec) -> BoxFuture<'a, Result<Option<i64>, TurnEnd>> {
        Box::pin(async { Ok(None) })
    }

    fn run_turn<'a>(
        &'a self,
        _spec: &'a SessionSpec,
        text: &'a str,
        _mark: Option<i64>,
        _timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd> {
        let first = text.lines().next().unwrap_or_default().to_string();
        // `!sleep DUR` lines hold the turn, so a benchmark can act while it runs.
        let hold: Duration = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("!sleep "))
            .filter_map(|d| turnstile_shared::duration::parse(d).ok())
            .sum();
        Box::pin(async move {
            if !hold.is_zero() {
                tokio::time::sleep(hold).await;
            }
            TurnEnd::Completed {
                output: vec![format!("ok: {first}")],
            }
        })
    }

    fn await_turn<'a>(
        &'a self,
        _spec: &'a SessionSpec,
        _mark: Option<i64>,
        _timeout: Duration,
    ) -> BoxFuture<'a, Adopted> {
        Box::pin(async move { Adopted::NotTyped })
    }

    fn stop<'a>(&'a self, _spec: &'a SessionSpec) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}
