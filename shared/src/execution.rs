//! The execution registry's records: every turn and step with its exact parent, scope, owner
//! and watchers (R6, R7, R8). States carry their own data, so a record cannot claim an outcome
//! it has no evidence for.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::{ExecutionId, HostName, SessionId, StepId};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecKind {
    /// A message typed into a session's agent.
    Turn,
    /// A turn that handed pending completions to the agent (R3).
    Delivery,
    /// Work started through the step API.
    Step,
    /// A run (R5): its messages are its children.
    Run,
    /// One message of a run: its turns (the message, then each hand-over) are its children.
    Message,
}

/// Who may end an execution besides itself (R7).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
    strum::VariantNames,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case", parse_err_ty = String, parse_err_fn = unknown_scope)]
pub enum Scope {
    /// Dies with the turn that started it, however that turn ends: work that is part of the
    /// turn itself, asked for explicitly.
    Turn,
    /// The default: outlives the turn that started it, and lives until it ends, it is
    /// cancelled, the run it was started in fails, or its owner session stops. Spelled `run`
    /// by older builds and clients, which is still read as this.
    #[default]
    #[serde(alias = "run")]
    #[strum(to_string = "session", serialize = "run")]
    Session,
    /// Independent; its launcher only watches it and receives its completion.
    Detached,
}

fn unknown_scope(s: &str) -> String {
    crate::names::unknown::<Scope>("scope", s)
}

/// What a step does and who runs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepWork {
    /// Run by the transport agent of the session's host, in the session's cwd.
    Command {
        argv: Vec<String>,
        host: HostName,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cwd: Option<String>,
    },
    /// Published on `ts.step.external.<queue>`; any worker serving that queue may take it.
    External {
        queue: String,
        #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
        input: serde_json::Value,
    },
    /// A background agent on `host`: its own session (id derived from the step) runs `prompt`
    /// as a run (id derived from the step).
    Agent { prompt: String, host: HostName },
}

impl StepWork {
    /// The kind's name, as metrics and logs label it: `command`, `external` or `agent`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Command { .. } => "command",
            Self::External { .. } => "external",
            Self::Agent { .. } => "agent",
        }
    }

    /// Where the work is queued: its subject on the step stream, and the durable consumer
    /// its workers take it from.
    pub fn queue(&self) -> (String, String) {
        use crate::subjects;
        match self {
            Self::Command { host, .. } => (
                subjects::step_command(host),
                subjects::step_command_consumer(host),
            ),
            Self::External { queue, .. } => (
                subjects::step_external(queue),
                subjects::step_external_consumer(queue),
            ),
            Self::Agent { .. } => (
                subjects::STEP_AGENT.to_string(),
                subjects::BROKER_AGENTS_CONSUMER.to_string(),
            ),
        }
    }
}

/// What a finished step produced: exit status (commands) and the tail of its output.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// One line for the agent's delivery message.
    #[serde(default)]
    pub summary: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub output: Vec<String>,
}

/// Queued until it holds its worker (R2); then Running; then one terminal state, never left.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(tag = "status", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum ExecStatus {
    Queued,
    Running {
        started_at: DateTime<Utc>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        worker: Option<String>,
        /// Last sign of life from the worker (R10 progress).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        heartbeat_at: Option<DateTime<Utc>>,
    },
    Completed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<DateTime<Utc>>,
        ended_at: DateTime<Utc>,
        result: StepResult,
    },
    Failed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<DateTime<Utc>>,
        ended_at: DateTime<Utc>,
        reason: String,
        result: StepResult,
    },
    Cancelled {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<DateTime<Utc>>,
        ended_at: DateTime<Utc>,
        reason: String,
    },
}

impl ExecStatus {
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Self::Queued | Self::Running { .. })
    }

    /// The state's name, as serialised in its `status` tag.
    pub fn name(&self) -> &'static str {
        self.into()
    }

    /// Whether a stored record (`value`, an [`ExecutionRecord`]'s JSON) has ended, told from
    /// its `status` tag without decoding the rest: most writes to the registry are a running
    /// step's (its start, its heartbeats), which a reader of ends can skip for the price of
    /// one field. `None` when the tag cannot be read.
    pub fn stored_has_ended(value: &[u8]) -> Option<bool> {
        #[derive(Deserialize)]
        struct Tag<'a> {
            #[serde(borrow)]
            status: std::borrow::Cow<'a, str>,
        }
        let Tag { status } = serde_json::from_slice(value).ok()?;
        Some(!matches!(status.as_ref(), "queued" | "running"))
    }

    pub fn started_at(&self) -> Option<DateTime<Utc>> {
        match self {
            Self::Queued => None,
            Self::Running { started_at, .. } => Some(*started_at),
            Self::Completed { started_at, .. }
            | Self::Failed { started_at, .. }
            | Self::Cancelled { started_at, .. } => *started_at,
        }
    }

    pub fn ended_at(&self) -> Option<DateTime<Utc>> {
        match self {
            Self::Queued | Self::Running { .. } => None,
            Self::Completed { ended_at, .. }
            | Self::Failed { ended_at, .. }
            | Self::Cancelled { ended_at, .. } => Some(*ended_at),
        }
    }

    /// One line for a delivery message or a tree listing.
    pub fn summary(&self) -> String {
        match self {
            Self::Completed { result, .. } => result.summary.clone(),
            Self::Failed { reason, result, .. } if result.summary.is_empty() => reason.clone(),
            Self::Failed { reason, result, .. } => format!("{reason}: {}", result.summary),
            Self::Cancelled { reason, .. } => reason.clone(),
            other => other.name().to_string(),
        }
    }
}

/// Named reasons an execution fails or is cancelled with; documented in docs/events.md.
pub mod exec_reason {
    pub const TURN_ENDED: &str = "turn_ended";
    pub const PARENT_CANCELLED: &str = "parent_cancelled";
    pub const CANCELLED: &str = "cancelled";
    pub const EXIT_STATUS: &str = "exit_status";
    pub const SPAWN_FAILED: &str = "spawn_failed";
    /// The worker that held a step died with it; it is never run a second time (R14).
    pub const WORKER_LOST: &str = "worker_lost";
    /// Its owner session was stopped (`session`-scoped work, R7).
    pub const SESSION_STOPPED: &str = "session_stopped";
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecutionRecord {
    pub id: ExecutionId,
    pub kind: ExecKind,
    pub name: String,
    /// The exact parent (R6); `None` only for a turn sent from outside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ExecutionId>,
    #[serde(default)]
    pub scope: Scope,
    /// The session that started it (whose host and cwd a command step uses).
    pub session: SessionId,
    /// The session that owns it and receives its completion; `None` for detached work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<SessionId>,
    /// Sessions told of its end without owning it (R7, R8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub watchers: Vec<SessionId>,
    pub created_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<StepWork>,
    /// The step's own secret (reports and child steps); never shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Direct children, in start order (an index; each child also names its parent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ExecutionId>,
    /// The turns that handed its completion back, one per target session (R3, R14): written
    /// by the session's lane once such a turn completed and before its completion is removed,
    /// so a copy that comes back (a removal the store lost, an end routed again) is dropped
    /// by whichever replica meets it, not typed a second time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_over: Vec<HandedOver>,
    #[serde(flatten)]
    pub status: ExecStatus,
}

/// A completed turn that carried an execution's completion to one of its target sessions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandedOver {
    pub session: SessionId,
    pub turn: crate::ids::TurnId,
    pub at: DateTime<Utc>,
}

/// A background agent's session and run, derived from its step so every retry finds them.
pub fn agent_session(step: &crate::ids::StepId) -> Option<SessionId> {
    format!(
        "{}{}",
        SessionId::PREFIX,
        &step.as_str()[crate::ids::StepId::PREFIX.len()..]
    )
    .parse()
    .ok()
}

pub fn agent_run(step: &crate::ids::StepId) -> Option<crate::ids::RunId> {
    format!(
        "{}{}",
        crate::ids::RunId::PREFIX,
        &step.as_str()[crate::ids::StepId::PREFIX.len()..]
    )
    .parse()
    .ok()
}

/// The step a background agent's run belongs to, if the run is one.
pub fn agent_step_of(run: &crate::ids::RunId) -> Option<crate::ids::StepId> {
    format!(
        "{}{}",
        crate::ids::StepId::PREFIX,
        &run.as_str()[crate::ids::RunId::PREFIX.len()..]
    )
    .parse()
    .ok()
}

impl ExecutionRecord {
    /// The sessions a completion of this execution goes to (R8): the owner, then watchers.
    pub fn targets(&self) -> Vec<SessionId> {
        let mut out: Vec<SessionId> = self.owner.iter().cloned().collect();
        for w in &self.watchers {
            if !out.contains(w) {
                out.push(w.clone());
            }
        }
        out
    }

    pub fn may_receive(&self, session: &SessionId) -> bool {
        self.owner.as_ref() == Some(session) || self.watchers.contains(session)
    }

    /// The completed turn that handed this execution's completion to `session`, if one did.
    pub fn handed_to(&self, session: &SessionId) -> Option<&crate::ids::TurnId> {
        self.handed_over
            .iter()
            .find(|h| &h.session == session)
            .map(|h| &h.turn)
    }

    pub fn step_id(&self) -> Option<StepId> {
        self.id.as_step()
    }

    /// The record as shown to callers: the token is dropped.
    pub fn redacted(&self) -> Self {
        Self {
            token: None,
            ..self.clone()
        }
    }
}

impl crate::retention::Retained for ExecutionRecord {
    fn finished(&self) -> bool {
        self.status.is_terminal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detached_work_goes_to_watchers_only() {
        let launcher = SessionId::new();
        let rec = ExecutionRecord {
            id: StepId::new().into(),
            kind: ExecKind::Step,
            name: "x".into(),
            parent: None,
            scope: Scope::Detached,
            session: launcher.clone(),
            owner: None,
            watchers: vec![launcher.clone()],
            created_at: Utc::now(),
            work: None,
            token: Some("secret".into()),
            children: vec![],
            handed_over: Vec::new(),
            status: ExecStatus::Queued,
        };
        assert_eq!(rec.targets(), vec![launcher.clone()]);
        assert!(rec.may_receive(&launcher));
        assert!(!rec.may_receive(&SessionId::new()));
        let json = serde_json::to_value(rec.redacted()).expect("json");
        assert!(json.get("token").is_none());
        assert_eq!(json["status"], "queued");
        assert_eq!(json["scope"], "detached");
    }

    #[test]
    fn an_end_is_told_from_the_stored_status_tag_alone() {
        let at = Utc::now();
        let result = StepResult {
            exit_code: Some(0),
            summary: "ok".into(),
            output: vec![],
        };
        let states = [
            ExecStatus::Queued,
            ExecStatus::Running {
                started_at: at,
                worker: Some("w".into()),
                heartbeat_at: Some(at),
            },
            ExecStatus::Completed {
                started_at: Some(at),
                ended_at: at,
                result: result.clone(),
            },
            ExecStatus::Failed {
                started_at: None,
                ended_at: at,
                reason: exec_reason::EXIT_STATUS.into(),
                result,
            },
            ExecStatus::Cancelled {
                started_at: None,
                ended_at: at,
                reason: "by hand".into(),
            },
        ];
        for status in states {
            let rec = ExecutionRecord {
                id: StepId::new().into(),
                kind: ExecKind::Step,
                name: "x".into(),
                parent: None,
                scope: Scope::Session,
                session: SessionId::new(),
                owner: None,
                watchers: vec![],
                created_at: at,
                work: None,
                token: None,
                children: vec![],
                handed_over: Vec::new(),
                status,
            };
            let stored = serde_json::to_vec(&rec).expect("json");
            assert_eq!(
                ExecStatus::stored_has_ended(&stored),
                Some(rec.status.is_terminal()),
                "{}",
                rec.status.name()
            );
        }
        assert_eq!(ExecStatus::stored_has_ended(b"not json"), None);
    }

    #[test]
    fn statuses_round_trip_and_summarise() {
        let s = ExecStatus::Failed {
            started_at: None,
            ended_at: Utc::now(),
            reason: exec_reason::EXIT_STATUS.into(),
            result: StepResult {
                exit_code: Some(1),
                summary: "exit 1".into(),
                output: vec![],
            },
        };
        assert!(s.is_terminal());
        assert_eq!(s.summary(), "exit_status: exit 1");
        let back: ExecStatus =
            serde_json::from_value(serde_json::to_value(&s).expect("json")).expect("back");
        assert_eq!(back, s);
        assert!("bogus".parse::<Scope>().is_err());
        assert_eq!("detached".parse::<Scope>(), Ok(Scope::Detached));
    }

    #[test]
    fn scope_defaults_to_session_and_reads_the_older_run() {
        assert_eq!(Scope::default(), Scope::Session);
        assert_eq!(Scope::Session.to_string(), "session");
        assert_eq!("run".parse::<Scope>(), Ok(Scope::Session));
        assert_eq!("session".parse::<Scope>(), Ok(Scope::Session));
        let json = serde_json::to_value(Scope::Session).expect("json");
        assert_eq!(json, "session");
        let older: Scope = serde_json::from_value(serde_json::json!("run")).expect("older");
        assert_eq!(older, Scope::Session);
        let start: crate::step_api::StartStep = serde_json::from_value(serde_json::json!({
            "caller": {"session": crate::SessionId::new(), "token": "t"},
            "name": "n",
            "work": {"kind": "command", "argv": ["true"]},
        }))
        .expect("a start without a scope");
        assert_eq!(start.scope, Scope::Session);
    }
}
