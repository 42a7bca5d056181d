//! The one trait every agent adapter implements: how to bring a session's agent to a ready
//! prompt (launching or resuming it), type a turn and recognise its end, and stop it.

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

pub trait Adapter: Send + Sync {
    /// Brings the agent to its ready prompt within `timeout`, launching it (resuming the
    /// session's conversation when known) if its terminal is missing or dead.
    fn ensure_ready<'a>(
        &'a self,
        spec: &'a SessionSpec,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Ready, Unavailable>>;

    /// Types `text` as one message and waits for the agent to be back at its prompt.
    fn run_turn<'a>(
        &'a self,
        spec: &'a SessionSpec,
        text: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd>;

    /// Waits for a turn typed by an earlier run of this transport to end (re-adoption).
    fn await_turn<'a>(&'a self, spec: &'a SessionSpec, timeout: Duration)
        -> BoxFuture<'a, TurnEnd>;

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

    fn run_turn<'a>(
        &'a self,
        _spec: &'a SessionSpec,
        text: &'a str,
        _timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd> {
        let first = text.lines().next().unwrap_or_default().to_string();
        Box::pin(async move {
            TurnEnd::Completed {
                output: vec![format!("ok: {first}")],
            }
        })
    }

    fn await_turn<'a>(
        &'a self,
        _spec: &'a SessionSpec,
        _timeout: Duration,
    ) -> BoxFuture<'a, TurnEnd> {
        Box::pin(async move { TurnEnd::Completed { output: Vec::new() } })
    }

    fn stop<'a>(&'a self, _spec: &'a SessionSpec) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}
