//! Typed identifiers. Each id has a prefix (`ses_`, `trn_`, ...) so a stray string can never
//! stand in for the wrong kind of id, and every id is a valid single NATS subject token.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{kind} id {value:?} must start with {prefix:?}")]
    Prefix {
        kind: &'static str,
        prefix: &'static str,
        value: String,
    },
    #[error("{kind} id {value:?} may hold only ASCII letters, digits, '-' and '_' (1-64 after the prefix)")]
    Chars { kind: &'static str, value: String },
}

/// True when `s` can be used as one NATS subject token and a KV key part.
pub fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A fresh secret for a session or step (two v4 uuids: 244 random bits). Never logged.
pub fn new_secret() -> String {
    format!(
        "tok_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

macro_rules! prefixed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// A fresh id; uuid v7 keeps ids of one kind roughly ordered by creation time.
            pub fn new() -> Self {
                Self(format!("{}{}", $prefix, uuid::Uuid::now_v7().simple()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                let rest = s.strip_prefix($prefix).ok_or_else(|| IdError::Prefix {
                    kind: $kind,
                    prefix: $prefix,
                    value: s.to_string(),
                })?;
                if !is_token(rest) {
                    return Err(IdError::Chars { kind: $kind, value: s.to_string() });
                }
                Ok(Self(s.to_string()))
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

prefixed_id!(
    /// One long-lived agent conversation in a terminal on a host.
    SessionId, "ses_", "session"
);
prefixed_id!(
    /// One message typed into a session's agent and its reply.
    TurnId, "trn_", "turn"
);
prefixed_id!(
    /// One lifecycle event on `TS_EVENTS`.
    EventId, "evt_", "event"
);
prefixed_id!(
    /// One child execution started through the step API (a command, external work, ...).
    StepId, "stp_", "step"
);
prefixed_id!(
    /// One run: a message sequence driven to completion on a session's lane (R5).
    RunId, "run_", "run"
);
prefixed_id!(
    /// One `delivery` lane item: pending completions handed to the agent as one turn.
    DeliveryId, "dlv_", "delivery"
);

/// Any node of the execution tree: a turn (`trn_`, delivery turns included) or a step
/// (`stp_`). Keeps its prefix, so the kind of node is visible in every id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ExecutionId(String);

impl ExecutionId {
    /// Turns, steps, runs and a run's messages (`msg_<run>-<index>`).
    const PREFIXES: [&'static str; 4] = [TurnId::PREFIX, StepId::PREFIX, RunId::PREFIX, "msg_"];

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn as_step(&self) -> Option<StepId> {
        self.0.parse().ok()
    }

    pub fn as_turn(&self) -> Option<TurnId> {
        self.0.parse().ok()
    }
}

impl fmt::Display for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for ExecutionId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let Some(rest) = Self::PREFIXES.iter().find_map(|p| s.strip_prefix(p)) else {
            return Err(IdError::Prefix {
                kind: "execution",
                prefix: "trn_, stp_, run_ or msg_",
                value: s.to_string(),
            });
        };
        if !is_token(rest) {
            return Err(IdError::Chars {
                kind: "execution",
                value: s.to_string(),
            });
        }
        Ok(Self(s.to_string()))
    }
}

impl TryFrom<String> for ExecutionId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<ExecutionId> for String {
    fn from(id: ExecutionId) -> String {
        id.0
    }
}

impl From<TurnId> for ExecutionId {
    fn from(id: TurnId) -> Self {
        Self(id.into())
    }
}

impl From<StepId> for ExecutionId {
    fn from(id: StepId) -> Self {
        Self(id.into())
    }
}

impl From<&TurnId> for ExecutionId {
    fn from(id: &TurnId) -> Self {
        Self(id.to_string())
    }
}

impl From<&RunId> for ExecutionId {
    fn from(id: &RunId) -> Self {
        Self(id.to_string())
    }
}

impl ExecutionId {
    /// Message `index` of a run, as a node of the tree (between the run and its turns).
    pub fn message(run: &RunId, index: usize) -> Self {
        Self(format!("msg_{}-{index}", &run.0[RunId::PREFIX.len()..]))
    }
}

impl From<&StepId> for ExecutionId {
    fn from(id: &StepId) -> Self {
        Self(id.to_string())
    }
}

impl RunId {
    /// The turn of round `round` of message `message` of this run: derived, so a run resumed
    /// after a crash finds the turns it already ran (R14).
    pub fn turn(&self, message: usize, round: u32) -> TurnId {
        TurnId(format!(
            "{}{}-{message}-{round}",
            TurnId::PREFIX,
            &self.0[RunId::PREFIX.len()..]
        ))
    }
}

impl DeliveryId {
    /// The turn a delivery becomes once it holds the lane: derived, so a redelivered item
    /// finds the turn its earlier attempt started (R14).
    pub fn turn(&self) -> TurnId {
        TurnId(format!(
            "{}{}",
            TurnId::PREFIX,
            &self.0[DeliveryId::PREFIX.len()..]
        ))
    }
}

/// A host's name, as given to its transport agent with `--host`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct HostName(String);

impl HostName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for HostName {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        if !is_token(s) {
            return Err(IdError::Chars {
                kind: "host",
                value: s.to_string(),
            });
        }
        Ok(Self(s.to_string()))
    }
}

impl TryFrom<String> for HostName {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<HostName> for String {
    fn from(h: HostName) -> String {
        h.0
    }
}

/// The agent CLI's own conversation id (what its resume flag takes). Chosen by the agent, so
/// only checked to be a safe token.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ConversationId(String);

impl ConversationId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConversationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for ConversationId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        if !is_token(s) {
            return Err(IdError::Chars {
                kind: "conversation",
                value: s.to_string(),
            });
        }
        Ok(Self(s.to_string()))
    }
}

impl TryFrom<String> for ConversationId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<ConversationId> for String {
    fn from(c: ConversationId) -> String {
        c.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_refuse_wrong_prefix() {
        let s = SessionId::new();
        assert!(s.as_str().starts_with("ses_"));
        assert_eq!(s.to_string().parse::<SessionId>(), Ok(s.clone()));
        assert!(matches!(
            s.as_str().parse::<TurnId>(),
            Err(IdError::Prefix { .. })
        ));
        assert!(matches!(
            "ses_a.b".parse::<SessionId>(),
            Err(IdError::Chars { .. })
        ));
        assert!("ses_".parse::<SessionId>().is_err());
        let json = serde_json::to_string(&s).expect("serialize");
        assert_eq!(serde_json::from_str::<SessionId>(&json).expect("parse"), s);
        assert!(serde_json::from_str::<SessionId>("\"trn_x\"").is_err());
    }

    #[test]
    fn execution_ids_take_turns_and_steps_only() {
        let t = TurnId::new();
        let e: ExecutionId = t.as_str().parse().expect("turn");
        assert_eq!(e.as_turn(), Some(t));
        let s = StepId::new();
        let e = ExecutionId::from(&s);
        assert_eq!(e.as_step(), Some(s));
        assert!("ses_x".parse::<ExecutionId>().is_err());
        let r = RunId::new();
        assert!(ExecutionId::message(&r, 3).as_str().starts_with("msg_"));
        assert_eq!(ExecutionId::from(&r).as_str(), r.as_str());
        assert!("stp_a.b".parse::<ExecutionId>().is_err());
        let d = DeliveryId::new();
        assert_eq!(d.turn().as_str()[4..], d.as_str()[4..]);
    }

    #[test]
    fn host_names_are_subject_tokens() {
        assert!("gpu-01".parse::<HostName>().is_ok());
        assert!("a.b".parse::<HostName>().is_err());
        assert!("*".parse::<HostName>().is_err());
        assert!("".parse::<HostName>().is_err());
    }
}
