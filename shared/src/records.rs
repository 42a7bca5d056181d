//! Records kept in KV and the payloads of transport commands. States are enums
//! that carry their own data, so a record cannot claim an outcome it has no evidence for.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::{ConversationId, DeliveryId, ExecutionId, HostName, SessionId, TurnId};

/// Which adapter drives a session's agent.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", parse_err_ty = String, parse_err_fn = unknown_agent_kind)]
pub enum AgentKind {
    /// The bundled `turnstile mock-agent` in a tmux pane.
    Mock,
    /// Completes every turn at once, in process; for benchmarks of the lane itself.
    Instant,
    /// Claude Code headless (`claude -p` with stream-json input and output).
    Claude,
    /// Codex CLI (`codex exec --json`, one process per turn).
    Codex,
    /// Any interactive CLI in a tmux pane, described by the session's `launch`.
    Tmux,
}

fn unknown_agent_kind(s: &str) -> String {
    crate::names::unknown::<AgentKind>("agent kind", s)
}

/// How the generic `tmux` adapter runs a session's CLI.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchSpec {
    /// The command and its arguments (no shell).
    pub argv: Vec<String>,
    /// The text the cursor line ends with when the CLI waits for input (its prompt).
    pub ready: String,
    /// Text shown somewhere on screen while the CLI works (a spinner's label); while it is
    /// on screen the CLI is not ready, whatever the cursor line says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub id: SessionId,
    pub name: String,
    pub agent: AgentKind,
    pub host: HostName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Secret the agent presents on tool calls; never printed by the CLI.
    pub token: String,
    pub created_at: DateTime<Utc>,
    /// The agent's own conversation id, learnt by the transport after launch (for resume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<ConversationId>,
    /// For `tmux` sessions: what to run and how to tell it is ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<LaunchSpec>,
    /// This session's R9 ready timeout, overriding the transport's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_ms: Option<u64>,
    /// What the agent may do without asking (`policy.rs`); records written before it existed
    /// read as the default.
    #[serde(default)]
    pub policy: crate::policy::Policy,
    #[serde(flatten)]
    pub state: SessionState,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum SessionState {
    Active,
    Stopped { stopped_at: DateTime<Utc> },
}

impl SessionRecord {
    pub fn is_active(&self) -> bool {
        matches!(self.state, SessionState::Active)
    }

    /// The record as shown to operators: the token is replaced.
    pub fn redacted(&self) -> Self {
        Self {
            token: "<redacted>".to_string(),
            ..self.clone()
        }
    }
}

/// Named reasons a turn fails with; stable strings, documented in docs/events.md.
pub mod reason {
    pub const SESSION_STOPPED: &str = "session_stopped";
    pub const AGENT_EXITED: &str = "agent_exited";
    pub const TURN_TIMEOUT: &str = "turn_timeout";
    pub const PARENT_TRANSPORT_UNAVAILABLE: &str = "parent_transport_unavailable";
    /// The session's host stopped heartbeating while the turn waited on it.
    pub const TRANSPORT_UNAVAILABLE: &str = "transport_unavailable";
    pub const TRANSPORT_ERROR: &str = "transport_error";
    /// The agent answered the turn with an error result (e.g. Claude's `is_error`).
    pub const AGENT_ERROR: &str = "agent_error";
    /// The CLI refused a tool call the session's permission policy does not allow; the turn's
    /// detail lists what was refused.
    pub const PERMISSION_DENIED: &str = "permission_denied";
    /// The agent's CLI reported the Turnstile MCP server as not connected: its tools (steps,
    /// runs) were unavailable to the turn.
    pub const MCP_UNAVAILABLE: &str = "mcp_unavailable";
    /// A delivery turn whose lane replica died before it was recorded, and whose redelivery
    /// found nothing left to carry (what it took was still held by the dead replica): recorded
    /// failed so the earlier attempt's command is never typed; what it carried is delivered
    /// again once released.
    pub const DELIVERY_SUPERSEDED: &str = "delivery_superseded";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub id: TurnId,
    pub session: SessionId,
    pub text: String,
    pub queued_at: DateTime<Utc>,
    /// Set on a delivery's turn: the completions it carries, recorded before it is typed so
    /// a crash between its end and their acks never hands one over twice (R3, R14).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Carried>,
    /// The run message this turn belongs to, when a run typed it (R6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ExecutionId>,
    #[serde(flatten)]
    pub state: TurnState,
}

impl TurnRecord {
    /// A turn queued now, typed by nobody yet: the one shape every writer of a fresh record
    /// starts from (the API, a lane item, a delivery, a run, the transport).
    pub fn queued(id: TurnId, session: SessionId, text: String) -> Self {
        Self {
            id,
            session,
            text,
            queued_at: Utc::now(),
            delivery: None,
            parent: None,
            state: TurnState::Queued,
        }
    }

    /// The same, carrying completions (a delivery's or a run's hand-over turn).
    pub fn carrying(self, delivery: Option<Carried>) -> Self {
        Self { delivery, ..self }
    }

    /// The same, typed by a run for one of its messages (R6).
    pub fn under(self, parent: ExecutionId) -> Self {
        Self {
            parent: Some(parent),
            ..self
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Carried {
    pub delivery: DeliveryId,
    pub completions: Vec<CarriedCompletion>,
}

/// One completion a delivery carries: its execution and its sequence in `TS_COMPLETION`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CarriedCompletion {
    pub execution: ExecutionId,
    pub seq: u64,
}

/// Queued until a transport types it; then Running; then one terminal state, never left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(tag = "status", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum TurnState {
    Queued,
    Running {
        host: HostName,
        typed_at: DateTime<Utc>,
        /// The adapter's position in the terminal just before typing (for the mock adapter,
        /// the cursor's absolute line), so a restarted transport can tell whether the text
        /// ever went in.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mark: Option<i64>,
    },
    Completed {
        host: HostName,
        typed_at: DateTime<Utc>,
        ended_at: DateTime<Utc>,
        /// The last lines the agent printed for this turn.
        output: Vec<String>,
    },
    Failed {
        ended_at: DateTime<Utc>,
        reason: String,
        detail: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        output: Vec<String>,
    },
}

impl TurnState {
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::Completed { .. } | Self::Failed { .. })
    }

    /// The state's name, as serialised in its `status` tag.
    pub fn name(&self) -> &'static str {
        self.into()
    }
}

/// Transport command types (the envelope's `type`), published on `ts.transport.<host>.<verb>`.
pub mod transport_kind {
    pub const START: &str = "transport.start";
    pub const TURN: &str = "transport.turn";
    pub const STOP: &str = "transport.stop";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartCommand {
    pub session: SessionId,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnCommand {
    pub session: SessionId,
    pub turn: TurnId,
    pub text: String,
    /// A delivery turn's carried completions. The transport records them in the turn's record
    /// before the text is typed (R14); the command, stored before that, holds them durably
    /// until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Carried>,
    /// The turn's record as the lane knows it stands, queued, and its revision: the transport
    /// records the turn `running` over that revision without reading it first. A record that
    /// moved on meanwhile makes that write lose, and the transport reads it then. Absent when
    /// the lane does not know the revision, and from older lanes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub known: Option<KnownTurn>,
    /// The lane wrote no record for this turn (a delivery turn's first attempt): the transport
    /// creates it, `running`, without reading first. A record there already (another
    /// attempt's, or the lane's failing of a lapsed host) makes that create lose before
    /// anything is typed, and the transport reads it then. False from older lanes, which
    /// write a delivery turn's record beside its command.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unrecorded: bool,
}

impl TurnCommand {
    /// The command as it goes to its host's transport: one envelope per turn, its id the
    /// turn's, so a repeat within the duplicate window is stored once.
    pub fn envelope(&self) -> Result<crate::envelope::Envelope, crate::EnvelopeError> {
        Ok(crate::envelope::Envelope::new(transport_kind::TURN, self)?
            .with_session(&self.session)
            .with_turn(&self.turn)
            .with_id(self.turn.to_string()))
    }
}

/// A turn record and the revision it was written at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KnownTurn {
    pub revision: u64,
    pub record: TurnRecord,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StopCommand {
    pub session: SessionId,
}

/// A host's heartbeat record in the hosts bucket (the bucket's TTL drops lapsed hosts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostRecord {
    pub name: HostName,
    pub started_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    pub version: String,
}

impl crate::retention::Retained for SessionRecord {
    fn finished(&self) -> bool {
        !self.is_active()
    }
}

impl crate::retention::Retained for TurnRecord {
    fn finished(&self) -> bool {
        self.state.is_terminal()
    }
}

/// Hosts drop out by the bucket's age limit (the host TTL), not by retention.
impl crate::retention::Retained for HostRecord {
    fn finished(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_states_serialize_with_status_tag() {
        let rec = TurnRecord {
            id: TurnId::new(),
            session: SessionId::new(),
            text: "x".into(),
            queued_at: Utc::now(),
            delivery: None,
            parent: None,
            state: TurnState::Failed {
                ended_at: Utc::now(),
                reason: reason::AGENT_EXITED.into(),
                detail: "exit 3".into(),
                output: vec![],
            },
        };
        let v = serde_json::to_value(&rec).expect("json");
        assert_eq!(v["status"], "failed");
        assert_eq!(v["reason"], "agent_exited");
        let back: TurnRecord = serde_json::from_value(v).expect("back");
        assert_eq!(back, rec);
    }
}
