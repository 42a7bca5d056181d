//! Who an agent-facing API call acts for. The broker's step and exec subjects carry it
//! (`ts.api.steps.<principal>.<verb>`), the NATS server lets an agent publish only on its own
//! (its credentials are issued for one principal by the auth callout), and the broker checks
//! that the credentials inside a request belong to the principal of the subject it came on.

use std::fmt;
use std::time::Duration;

use crate::api::ApiError;
use crate::ids::{IdError, SessionId, StepId};
use crate::step_api::Caller;
use crate::subjects::api as subj;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// An agent's terminal and tools (`TURNSTILE_SESSION` + `TURNSTILE_TOKEN`).
    Session(SessionId),
    /// A step's process (`TURNSTILE_STEP` + `TURNSTILE_STEP_TOKEN`), or a worker reporting it.
    Step(StepId),
    /// Operators and services, on identities of their own (never an agent's).
    Operator,
}

impl Principal {
    /// The principal of an agent's or step's credentials (a step's win, as in
    /// [`Caller::from_env`]).
    pub fn of(caller: &Caller) -> Self {
        match (&caller.step, &caller.session) {
            (Some(step), _) => Self::Step(step.clone()),
            (None, Some(session)) => Self::Session(session.clone()),
            (None, None) => Self::Operator,
        }
    }

    /// Reads the principal token of an agent-facing subject, `ts.api.<area>.<principal>.<verb>`.
    pub fn from_subject(subject: &str) -> Result<Self, ApiError> {
        let token = subject.split('.').nth(3).unwrap_or_default();
        token.parse().map_err(|e: IdError| {
            ApiError::bad_request(format!("subject {subject:?} names no principal: {e}"))
        })
    }

    /// Whether a request's credentials may be used on this principal's subjects: an agent
    /// presents its own, an operator's subjects take any (operators are trusted).
    pub fn admits(&self, caller: &Caller) -> bool {
        match self {
            Self::Operator => true,
            other => *other == Self::of(caller),
        }
    }

    /// `ts.api.steps.<principal>.<verb>`.
    pub fn steps(&self, verb: &str) -> String {
        subj::steps(&self.to_string(), verb)
    }

    /// `ts.api.exec.<principal>.<verb>`.
    pub fn exec(&self, verb: &str) -> String {
        subj::exec(&self.to_string(), verb)
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Session(s) => write!(f, "{s}"),
            Self::Step(s) => write!(f, "{s}"),
            Self::Operator => f.write_str(subj::OPERATOR),
        }
    }
}

impl std::str::FromStr for Principal {
    type Err = IdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == subj::OPERATOR {
            Ok(Self::Operator)
        } else if s.starts_with(StepId::PREFIX) {
            s.parse().map(Self::Step)
        } else {
            s.parse().map(Self::Session)
        }
    }
}

/// How long [`connect`] keeps trying a connect that may be refused only for the moment.
///
/// An agent's identity is checked by the deployment's auth callout, which reads the session's
/// record: while a NATS node dies and its streams elect new leaders (seconds on a cluster), or
/// while a broker replica reconnects, the check goes unanswered and the server refuses the
/// connection as an *authorization violation*, exactly as it refuses a wrong token. An agent's
/// step start must not fail on the first (it would lose the step), so the refusal is retried
/// this long; a wrong or revoked token is therefore reported after it.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(20);

/// Delays between connect attempts within [`CONNECT_PATIENCE`].
const CONNECT_RETRY: crate::retry::Backoff =
    crate::retry::Backoff::new(Duration::from_millis(250), Duration::from_secs(2));

/// Connects a one-shot client that acts for `caller`: with the URL's credentials when it has
/// them (an operator's or a worker's identity), else as the caller's own principal with its
/// token as the password, which the auth callout of a deployment with agent identities checks
/// (a server without authentication ignores both). Replies arrive under the principal's own
/// inbox prefix, the only one its identity may subscribe to. A refusal or a server not
/// answering is retried for [`CONNECT_PATIENCE`].
pub async fn connect(
    url: &str,
    name: &str,
    caller: Option<&Caller>,
) -> Result<async_nats::Client, crate::config::StartError> {
    connect_within(url, name, caller, CONNECT_PATIENCE).await
}

/// [`connect`] with its own patience.
pub async fn connect_within(
    url: &str,
    name: &str,
    caller: Option<&Caller>,
    patience: Duration,
) -> Result<async_nats::Client, crate::config::StartError> {
    let until = tokio::time::Instant::now() + patience;
    let mut delays = CONNECT_RETRY.delays();
    loop {
        match connect_once(url, name, caller).await {
            Err(crate::config::StartError::Connect { source, .. })
                if transient(source.kind()) && tokio::time::Instant::now() < until =>
            {
                tracing::debug!(error = %source, "connect as the caller; retrying");
                delays.wait().await;
            }
            other => return other,
        }
    }
}

/// A refusal that a NATS fail-over also causes (the auth callout unanswered, a node gone).
fn transient(kind: async_nats::ConnectErrorKind) -> bool {
    use async_nats::ConnectErrorKind as K;
    matches!(
        kind,
        K::AuthorizationViolation | K::TimedOut | K::Io | K::MaxReconnects
    )
}

async fn connect_once(
    url: &str,
    name: &str,
    caller: Option<&Caller>,
) -> Result<async_nats::Client, crate::config::StartError> {
    let principal = caller.map(Principal::of);
    let fallback = caller
        .zip(principal.as_ref())
        .map(|(c, p)| (p.to_string(), c.token.clone()));
    let (bare, mut opts) = crate::config::options_or(url, name, fallback);
    if let Some(p) = principal {
        opts = opts.custom_inbox_prefix(subj::inbox(&p.to_string()));
    }
    opts.connect(crate::config::seed_servers(&bare))
        .await
        .map_err(|source| crate::config::StartError::Connect { url: bare, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn principals_round_trip_through_their_subjects() {
        for p in [
            Principal::Session(SessionId::new()),
            Principal::Step(StepId::new()),
            Principal::Operator,
        ] {
            for subject in [p.steps(subj::START), p.exec(subj::TREE)] {
                assert_eq!(
                    Principal::from_subject(&subject),
                    Ok(p.clone()),
                    "{subject}"
                );
            }
        }
        assert!(Principal::from_subject("ts.api.steps.start").is_err());
        assert!(Principal::from_subject("ts.api.steps.nobody.start").is_err());
    }

    #[test]
    fn a_principal_admits_only_its_own_credentials() {
        let s = SessionId::new();
        let caller = |session: Option<SessionId>, step: Option<StepId>| Caller {
            session,
            step,
            token: "t".into(),
        };
        let own = Principal::Session(s.clone());
        assert!(own.admits(&caller(Some(s.clone()), None)));
        assert!(!own.admits(&caller(Some(SessionId::new()), None)));
        assert!(!own.admits(&caller(Some(s.clone()), Some(StepId::new()))));
        let step = StepId::new();
        assert!(Principal::Step(step.clone()).admits(&caller(None, Some(step))));
        assert!(Principal::Operator.admits(&caller(Some(s), None)));
    }
}
