//! Request and reply types of the `ts.api.*` services, and a small typed client that the CLI,
//! tests and other services share. Replies are `{"ok": ...}` or `{"error": {...}}`.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::{HostName, SessionId, TurnId};
use crate::records::{AgentKind, SessionRecord, TurnRecord};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreateSession {
    pub agent: AgentKind,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostName>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Chosen by a client that wants to retry safely: a second create with the same id and
    /// name returns the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<SessionId>,
    /// Required for agent `tmux`: the CLI to run and its ready (and busy) text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<crate::records::LaunchSpec>,
    /// How long a launch or resume of this session's agent may take to reach a ready prompt
    /// (R9); the transport's `--ready-timeout` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_timeout_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendTurn {
    pub session: SessionId,
    pub text: String,
    /// Supplied by a client that wants to retry safely or watch the turn before sending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnId>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRef {
    pub session: SessionId,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListSessions {}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListHosts {}

/// A live host (its heartbeat key has not lapsed) and the active sessions placed on it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostView {
    pub host: crate::records::HostRecord,
    pub sessions: Vec<SessionId>,
}

/// A session as operators see it; `busy` and `queued` come from the lane itself (R1).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionView {
    pub session: SessionRecord,
    pub busy: bool,
    /// The lane item in flight, when busy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<TurnRecord>,
    pub queued: u64,
    /// `up` while the session's host heartbeats, else `transport_unavailable`.
    pub transport: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub code: String,
    pub message: String,
}

impl ApiError {
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        Self {
            code: code.to_string(),
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new("bad_request", message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new("not_found", message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new("internal", message)
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply<T> {
    Ok(T),
    Error(ApiError),
}

/// Calls one API subject and decodes its reply.
pub async fn call<Req: Serialize, Resp: DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    request: &Req,
    timeout: Duration,
) -> Result<Resp, ApiError> {
    let body = serde_json::to_vec(request)
        .map_err(|e| ApiError::bad_request(format!("encode request: {e}")))?;
    let reply = tokio::time::timeout(timeout, client.request(subject.to_string(), body.into()))
        .await
        .map_err(|_| {
            ApiError::new(
                "timeout",
                format!("no reply on {subject} within {timeout:?}: is the service running?"),
            )
        })?
        .map_err(|e| ApiError::new("unavailable", format!("request {subject}: {e}")))?;
    match serde_json::from_slice::<Reply<Resp>>(&reply.payload) {
        Ok(Reply::Ok(v)) => Ok(v),
        Ok(Reply::Error(e)) => Err(e),
        Err(e) => Err(ApiError::internal(format!(
            "unreadable reply on {subject}: {e}"
        ))),
    }
}
