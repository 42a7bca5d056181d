//! Request and reply types of the broker's `ts.api.steps.*` and `ts.api.exec.*` services,
//! and of the step work and end messages on `TS_STEP`. Shared by the broker, the transport
//! agent (a `command` step worker), the CLI, `turnstile mcp` and external workers.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::envelope::{Envelope, EnvelopeError};
use crate::execution::{ExecStatus, ExecutionRecord, Scope, StepResult};
use crate::ids::{ExecutionId, SessionId, StepId};

/// Who a call acts for. A session presents its token (from `TURNSTILE_SESSION` and
/// `TURNSTILE_TOKEN`); a step presents its own (`TURNSTILE_STEP`, `TURNSTILE_STEP_TOKEN`).
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Caller {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepId>,
    #[serde(default)]
    pub token: String,
}

impl std::fmt::Debug for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caller")
            .field("session", &self.session)
            .field("step", &self.step)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl Caller {
    /// The credentials an agent's process (or a step's) was launched with.
    pub fn from_env() -> Option<Self> {
        let get = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let (Some(step), Some(token)) = (get("TURNSTILE_STEP"), get("TURNSTILE_STEP_TOKEN")) {
            return Some(Self {
                session: None,
                step: step.parse().ok(),
                token,
            });
        }
        let session = get("TURNSTILE_SESSION")?.parse().ok()?;
        Some(Self {
            session: Some(session),
            step: None,
            token: get("TURNSTILE_TOKEN")?,
        })
    }
}

/// What kind of work a new step is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepKind {
    /// Run `argv` on the session's host, in the session's cwd.
    Command { argv: Vec<String> },
    /// Published for any worker serving `queue`.
    External {
        queue: String,
        #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
        input: serde_json::Value,
    },
    /// A background agent: a new session on the caller's host runs `prompt` as a run (R5);
    /// the step completes with its final reply once everything it started is handed back.
    Agent { prompt: String },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartStep {
    pub caller: Caller,
    pub name: String,
    #[serde(default)]
    pub scope: Scope,
    pub work: StepKind,
    /// Chosen by a client that wants to retry safely; a retry returns the same step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<StepId>,
}

/// What a worker reports about a step it holds, with the step's own token.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    pub step: StepId,
    pub token: String,
    pub report: Report,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "report", rename_all = "snake_case")]
pub enum Report {
    /// The worker took the step and is starting it (refused if another attempt already did).
    Started {
        worker: String,
    },
    /// Progress: the worker is alive (R10).
    Heartbeat,
    Completed {
        result: StepResult,
    },
    Failed {
        reason: String,
        result: StepResult,
    },
}

/// The broker's answer to a report: the step's status now, so a worker learns of a cancel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReportAck {
    pub status: String,
    /// True when the worker must stop (the step is cancelled or already ended).
    pub stop: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepStatus {
    pub caller: Caller,
    pub step: StepId,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListSteps {
    pub caller: Caller,
    #[serde(flatten)]
    pub page: crate::page::PageRequest,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecRef {
    pub id: ExecutionId,
}

/// One node of `turnstile tree`: the record, its children, and whether the whole subtree is
/// terminal (a run or message is finished only then, R6).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TreeNode {
    #[serde(flatten)]
    pub record: ExecutionRecord,
    pub settled: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<TreeNode>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cancelled {
    /// Every execution this call cancelled (the target and what it owns).
    pub cancelled: Vec<ExecutionId>,
}

/// Envelope types on `TS_STEP`.
pub mod step_kind {
    pub const WORK: &str = "step.work";
    pub const ENDED: &str = "step.ended";
}

/// Step work for a worker (`ts.step.command.<host>` or `ts.step.external.<queue>`).
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct StepWorkItem {
    pub step: StepId,
    pub token: String,
    pub session: SessionId,
    pub name: String,
    #[serde(flatten)]
    pub work: crate::execution::StepWork,
}

impl std::fmt::Debug for StepWorkItem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepWorkItem")
            .field("step", &self.step)
            .field("session", &self.session)
            .field("name", &self.name)
            .field("work", &self.work)
            .finish()
    }
}

impl StepWorkItem {
    /// The work item of a step as its registry record holds it (the start publishes it; the
    /// broker's backstop publishes it again if it is lost).
    pub fn of(record: &ExecutionRecord, step: StepId, work: crate::execution::StepWork) -> Self {
        Self {
            step,
            token: record.token.clone().unwrap_or_default(),
            session: record.session.clone(),
            name: record.name.clone(),
            work,
        }
    }

    pub fn envelope(&self) -> Result<Envelope, EnvelopeError> {
        Ok(Envelope::new(step_kind::WORK, self)?
            .with_session(&self.session)
            .with_id(format!("{}:work", self.step)))
    }
}

/// The end of an execution, queued for the broker to record and route. The first end of an
/// execution wins; the message id makes a repeat a no-op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ended {
    pub execution: ExecutionId,
    pub status: ExecStatus,
    /// The record as the reporter read it, and its revision: the broker records the end by
    /// compare-and-set from it without reading the record again (re-read on a conflict).
    /// Absent from ends that did not read it (cancellations), and from older publishers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub known: Option<KnownRecord>,
}

/// An execution record and the revision it was read at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KnownRecord {
    pub revision: u64,
    pub record: crate::execution::ExecutionRecord,
}

impl Ended {
    pub fn envelope(&self) -> Result<Envelope, EnvelopeError> {
        Ok(Envelope::new(step_kind::ENDED, self)?.with_id(format!("{}:ended", self.execution)))
    }

    pub fn cancelled(
        execution: ExecutionId,
        reason: &str,
        started_at: Option<DateTime<Utc>>,
    ) -> Self {
        Self {
            execution,
            status: ExecStatus::Cancelled {
                started_at,
                ended_at: Utc::now(),
                reason: reason.to_string(),
            },
            known: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_show_in_debug() {
        let c = Caller {
            session: Some(SessionId::new()),
            step: None,
            token: "s3cret".into(),
        };
        assert!(!format!("{c:?}").contains("s3cret"));
        let w = StepWorkItem {
            step: StepId::new(),
            token: "s3cret".into(),
            session: SessionId::new(),
            name: "n".into(),
            work: crate::execution::StepWork::External {
                queue: "q".into(),
                input: serde_json::Value::Null,
            },
        };
        assert!(!format!("{w:?}").contains("s3cret"));
        let back: StepWorkItem = w.envelope().expect("env").data_as().expect("data");
        assert_eq!(back, w);
    }
}
