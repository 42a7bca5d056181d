//! Request and reply types of the `ts.api.*` services, and a small typed client that the CLI,
//! tests and other services share. Replies are `{"ok": ...}` or `{"error": {...}}`.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::ids::{HostName, SessionId, TurnId};
use crate::records::{AgentKind, SessionRecord, TurnRecord};

/// The most bytes one message (a turn's text, a run's message) may hold.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

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
    /// What the agent may do without asking; the default policy (edits and shell, no
    /// network) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<crate::policy::Policy>,
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
pub struct ListSessions {
    #[serde(flatten)]
    pub page: crate::page::PageRequest,
}

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
    /// Completions stored for the session and not yet handed over (R3), those a delivery is
    /// carrying now included: its backlog on `TS_COMPLETION` (0 when it could not be read).
    /// Absent from replies of builds before it was added.
    #[serde(default)]
    pub pending: u64,
    /// `up` while the session's host heartbeats, else `transport_unavailable`.
    pub transport: String,
}

/// Every code an API error can carry: the one registry of them, used by every service and the
/// CLI. Serialised snake_case (`"not_found"`). A code this build does not know (sent by a newer
/// service) is kept as [`ErrorCode::Other`] with its text, so an old client still shows it.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, strum::Display, strum::EnumString, strum::VariantNames,
)]
#[strum(serialize_all = "snake_case")]
pub enum ErrorCode {
    /// The request could not be read or breaks a rule of its API (R15).
    BadRequest,
    /// The session, turn, run, step or schedule named does not exist.
    NotFound,
    /// A create named an id or name that is taken by something different.
    Exists,
    /// The session is stopped: it takes no new turns or runs.
    Stopped,
    /// The session of the caller's credentials is stopped.
    SessionStopped,
    /// No transport host is heartbeating (or not the one asked for).
    NoHost,
    /// A step call came from a session whose lane holds no running turn (R6).
    NoTurn,
    /// A step was asked to start a child after it ended.
    ParentEnded,
    /// The execution id is registered to another parent or session (R8).
    ForeignExecution,
    /// Only a failed run can be retried.
    NotFailed,
    /// Missing, wrong or foreign credentials.
    Unauthorized,
    /// No reply within the client's timeout: the service may not be running.
    Timeout,
    /// The request could not be sent (NATS unreachable).
    Unavailable,
    /// The service failed while serving the request; retrying may help.
    Internal,
    /// A code this build does not know, kept as sent.
    #[strum(default)]
    Other(String),
}

impl ErrorCode {
    /// Whether a caller may retry the same request later: the service was not reached or
    /// answered nothing.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Timeout | Self::Unavailable)
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        // Infallible: an unknown code becomes `Other`.
        Ok(text.parse().unwrap_or(Self::Other(text)))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }
    /// A failure inside the service, from any error it met (`.map_err(ApiError::internal)`).
    pub fn internal(error: impl std::fmt::Display) -> Self {
        Self::new(ErrorCode::Internal, error.to_string())
    }
    /// A call to the server that failed (a stream read, a purge), by its kind: `unavailable`
    /// when another try may succeed (`js_codes::failure_kind`), `internal` otherwise.
    pub fn failure(error: impl std::error::Error + 'static) -> Self {
        Self::new(failure_code(&error), error.to_string())
    }
    /// [`ApiError::failure`] for an untyped `async_nats::Error`.
    pub fn failure_boxed(error: async_nats::Error) -> Self {
        Self::new(failure_code(&*error), error.to_string())
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
                ErrorCode::Timeout,
                format!("no reply on {subject} within {timeout:?}: is the service running?"),
            )
        })?
        .map_err(|e| ApiError::new(ErrorCode::Unavailable, format!("request {subject}: {e}")))?;
    match serde_json::from_slice::<Reply<Resp>>(&reply.payload) {
        Ok(Reply::Ok(v)) => Ok(v),
        Ok(Reply::Error(e)) => Err(e),
        Err(e) => Err(ApiError::internal(format!(
            "unreadable reply on {subject}: {e}"
        ))),
    }
}

/// A store error as an API error: the store being unreachable or contended is `unavailable`
/// (a caller retries, e.g. right after a partition healed, when a rejoined node does not map
/// the bucket's subjects yet); a record this build cannot read or write is `internal`.
impl From<crate::kv::KvError> for ApiError {
    fn from(e: crate::kv::KvError) -> Self {
        ApiError::new(e.api_code(), e.to_string())
    }
}

impl crate::kv::KvError {
    /// The code a caller is answered with for this store error (see `From<KvError>`), for
    /// errors that wrap one and keep their own context in the message.
    pub fn api_code(&self) -> ErrorCode {
        match self {
            crate::kv::KvError::Nats { .. } | crate::kv::KvError::Contended { .. } => {
                ErrorCode::Unavailable
            }
            crate::kv::KvError::Decode { .. } | crate::kv::KvError::Encode { .. } => {
                ErrorCode::Internal
            }
        }
    }
}

impl crate::events::PublishError {
    /// The code a caller is answered with for this publish error (see `From<PublishError>`).
    pub fn api_code(&self) -> ErrorCode {
        match self {
            crate::events::PublishError::Nats { source, .. } => failure_code(&**source),
            crate::events::PublishError::Envelope(_) => ErrorCode::Internal,
        }
    }
}

/// The code of a failure met on the way to the server, by its kind
/// (`js_codes::failure_kind`): `unavailable` when another try may succeed, else `internal`.
pub fn failure_code(e: &(dyn std::error::Error + 'static)) -> ErrorCode {
    match crate::js_codes::failure_kind(e) {
        crate::js_codes::FailureKind::Unavailable => ErrorCode::Unavailable,
        crate::js_codes::FailureKind::Internal => ErrorCode::Internal,
    }
}

/// A publish that failed: by its kind (a stream without a leader is `unavailable`); an
/// envelope this build cannot write is `internal`. The message keeps the context.
impl From<crate::events::PublishError> for ApiError {
    fn from(e: crate::events::PublishError) -> Self {
        ApiError::new(e.api_code(), e.to_string())
    }
}

/// Provisioning a stream, bucket or consumer that failed, by its kind.
impl From<crate::topology::TopologyError> for ApiError {
    fn from(e: crate::topology::TopologyError) -> Self {
        use crate::topology::TopologyError as T;
        let code = match &e {
            T::Stream { source, .. }
            | T::Bucket { source, .. }
            | T::Bind { source, .. }
            | T::Consumer { source, .. } => failure_code(&**source),
            T::LaneMigration(_) => ErrorCode::Internal,
        };
        ApiError::new(code, e.to_string())
    }
}

/// How an idempotent call is retried: a fresh attempt soon after a transient failure.
const IDEMPOTENT_RETRY: crate::retry::Backoff =
    crate::retry::Backoff::new(Duration::from_millis(250), Duration::from_secs(2));

/// Calls a subject whose request is idempotent (it carries the id of what it creates, so a
/// repeat returns the first attempt's result), retrying transient failures until `deadline`:
/// each attempt waits at most `attempt` for its reply. A request lost with a server that was
/// cut off, or sent to a service replica that died, is sent again instead of failing the
/// caller; a refusal (bad request, not found, ...) is returned at once.
pub async fn call_idempotent<Req: Serialize, Resp: DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    request: &Req,
    attempt: Duration,
    deadline: Duration,
) -> Result<Resp, ApiError> {
    let until = tokio::time::Instant::now() + deadline;
    let mut delays = IDEMPOTENT_RETRY.delays();
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let wait = attempt.min(left).max(Duration::from_millis(100));
        match call(client, subject, request, wait).await {
            Err(e) if e.code.is_transient() && tokio::time::Instant::now() < until => {
                tracing::debug!(subject, error = %e, "idempotent call; retrying");
                delays.wait().await;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_snake_case_and_unknown_ones_survive() {
        let e = ApiError::new(ErrorCode::NoTurn, "x");
        let v = serde_json::to_value(&e).expect("json");
        assert_eq!(v["code"], "no_turn");
        assert_eq!(e.to_string(), "no_turn: x");
        let back: ApiError = serde_json::from_value(v).expect("back");
        assert_eq!(back, e);
        let newer: ApiError =
            serde_json::from_str(r#"{"code":"quota_exceeded","message":"m"}"#).expect("newer");
        assert_eq!(newer.code, ErrorCode::Other("quota_exceeded".into()));
        assert_eq!(newer.to_string(), "quota_exceeded: m");
        assert_eq!(
            serde_json::to_value(&newer).expect("json")["code"],
            "quota_exceeded"
        );
        assert!(ErrorCode::Timeout.is_transient() && !ErrorCode::NotFound.is_transient());
    }
}
