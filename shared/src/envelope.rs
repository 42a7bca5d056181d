//! The versioned JSON envelope around every message and event on the wire. Decoding checks the
//! version before anything else, so a message from a future (or foreign) writer is refused with
//! a clear error instead of being half-understood (R15).

use chrono::{DateTime, SecondsFormat, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::ids::{HostName, SessionId, TurnId};

/// The only envelope version this build reads and writes.
pub const WIRE_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    pub v: u32,
    /// Unique per message; events use it as the JetStream de-duplication id.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(serialize_with = "ser_millis", deserialize_with = "de_time")]
    pub at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostName>,
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
}

#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    #[error("payload is not a JSON object: {0}")]
    NotJson(serde_json::Error),
    #[error("envelope has no numeric \"v\" field")]
    MissingVersion,
    #[error("envelope version {found} is not supported (this build reads version {WIRE_VERSION})")]
    UnknownVersion { found: u64 },
    #[error("malformed envelope: {0}")]
    Malformed(serde_json::Error),
    #[error("malformed data of a {kind:?} message: {source}")]
    Data {
        kind: String,
        source: serde_json::Error,
    },
    #[error("unexpected message type {found:?} (expected {expected})")]
    UnexpectedType { found: String, expected: String },
    #[error("encode {kind:?}: {source}")]
    Encode {
        kind: String,
        source: serde_json::Error,
    },
}

impl Envelope {
    /// A new envelope of `kind` stamped now, with `data` serialized from `payload`.
    pub fn new<T: Serialize>(kind: &str, payload: &T) -> Result<Self, EnvelopeError> {
        let data = serde_json::to_value(payload).map_err(|source| EnvelopeError::Encode {
            kind: kind.to_string(),
            source,
        })?;
        Ok(Self {
            v: WIRE_VERSION,
            id: uuid::Uuid::now_v7().simple().to_string(),
            kind: kind.to_string(),
            at: Utc::now(),
            session: None,
            turn: None,
            host: None,
            data,
        })
    }

    pub fn with_session(mut self, session: &SessionId) -> Self {
        self.session = Some(session.clone());
        self
    }

    pub fn with_turn(mut self, turn: &TurnId) -> Self {
        self.turn = Some(turn.clone());
        self
    }

    pub fn with_host(mut self, host: &HostName) -> Self {
        self.host = Some(host.clone());
        self
    }

    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// Checks the version first, then the shape.
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(EnvelopeError::NotJson)?;
        let v = value
            .get("v")
            .and_then(serde_json::Value::as_u64)
            .ok_or(EnvelopeError::MissingVersion)?;
        if v != u64::from(WIRE_VERSION) {
            return Err(EnvelopeError::UnknownVersion { found: v });
        }
        serde_json::from_value(value).map_err(EnvelopeError::Malformed)
    }

    pub fn encode(&self) -> Result<bytes::Bytes, EnvelopeError> {
        serde_json::to_vec(self)
            .map(bytes::Bytes::from)
            .map_err(|source| EnvelopeError::Encode {
                kind: self.kind.clone(),
                source,
            })
    }

    /// The typed payload.
    pub fn data_as<T: DeserializeOwned>(&self) -> Result<T, EnvelopeError> {
        serde_json::from_value(self.data.clone()).map_err(|source| EnvelopeError::Data {
            kind: self.kind.clone(),
            source,
        })
    }

    pub fn expect_kind(&self, expected: &str) -> Result<(), EnvelopeError> {
        if self.kind == expected {
            Ok(())
        } else {
            Err(EnvelopeError::UnexpectedType {
                found: self.kind.clone(),
                expected: expected.to_string(),
            })
        }
    }
}

fn ser_millis<S: Serializer>(at: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&at.to_rfc3339_opts(SecondsFormat::Millis, true))
}

fn de_time<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
    let s = String::deserialize(d)?;
    DateTime::parse_from_rfc3339(&s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(serde::de::Error::custom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_millisecond_time() {
        let s = SessionId::new();
        let env = Envelope::new("turn.queued", &serde_json::json!({"text": "hi"}))
            .expect("new")
            .with_session(&s);
        let bytes = env.encode().expect("encode");
        let text = std::str::from_utf8(&bytes).expect("utf8");
        assert!(text.contains("\"v\":1"), "{text}");
        let at = serde_json::from_slice::<serde_json::Value>(&bytes).expect("json")["at"]
            .as_str()
            .expect("at")
            .to_string();
        assert_eq!(at.len(), "2026-01-01T00:00:00.000Z".len(), "{at}");
        let back = Envelope::decode(&bytes).expect("decode");
        assert_eq!(back.session, Some(s));
        assert_eq!(back.kind, "turn.queued");
    }

    #[test]
    fn refuses_unknown_version_and_garbage_with_reasons() {
        let err = Envelope::decode(br#"{"v":7,"id":"x","type":"t","at":"2026-01-01T00:00:00Z"}"#)
            .expect_err("v7");
        assert!(
            err.to_string().contains("version 7 is not supported"),
            "{err}"
        );
        let err = Envelope::decode(b"{not json").expect_err("garbage");
        assert!(matches!(err, EnvelopeError::NotJson(_)));
        let err = Envelope::decode(br#"{"id":"x"}"#).expect_err("no v");
        assert!(matches!(err, EnvelopeError::MissingVersion));
        let err = Envelope::decode(br#"{"v":1,"id":"x"}"#).expect_err("no type");
        assert!(matches!(err, EnvelopeError::Malformed(_)));
    }
}
