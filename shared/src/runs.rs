//! Runs: a message sequence driven to completion on one session's lane (R5), with its bounds
//! (R10) and an honest outcome (R12). The record holds the progress, so a replica that takes
//! the lane over continues the same run where it was.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::{ExecutionId, RunId, SessionId, TurnId};

/// Named reasons a run fails with (besides a failed turn's own reason, which the run takes
/// over); documented in docs/runs-and-schedules.md.
pub mod run_reason {
    pub const MAX_ROUNDS: &str = "max_rounds";
    pub const MAX_DURATION: &str = "max_duration";
    pub const IDLE_TIMEOUT: &str = "idle_timeout";
    pub const SESSION_STOPPED: &str = "session_stopped";
    /// `turnstile run cancel`, or a schedule's `cancel_other` overlap policy.
    pub const CANCELLED: &str = "cancelled";
}

/// Ceilings of one run (R5, R10). Durations are whole seconds on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RunLimits {
    #[serde(default = "default_max_rounds")]
    pub max_rounds: u32,
    #[serde(default = "default_max_duration", with = "secs")]
    pub max_duration: Duration,
    #[serde(default = "default_idle_timeout", with = "secs")]
    pub idle_timeout: Duration,
}

fn default_max_rounds() -> u32 {
    100
}
fn default_max_duration() -> Duration {
    Duration::from_secs(3 * 3600)
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(600)
}

impl Default for RunLimits {
    fn default() -> Self {
        Self {
            max_rounds: default_max_rounds(),
            max_duration: default_max_duration(),
            idle_timeout: default_idle_timeout(),
        }
    }
}

mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        if !(0.0..=1e9).contains(&v) {
            return Err(serde::de::Error::custom(format!(
                "duration {v} s is out of range"
            )));
        }
        Ok(Duration::from_secs_f64(v))
    }
}

/// One message of a run (the finalizer is the last, flagged) and the rounds it took.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MessageProgress {
    /// The turns of its rounds, in order: the message itself, then each hand-over.
    pub turns: Vec<TurnId>,
    #[serde(default)]
    pub done: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: RunId,
    pub session: SessionId,
    /// The schedule that fired it, if any (manual runs have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    pub created_at: DateTime<Utc>,
    pub messages: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalizer: Option<String>,
    #[serde(default)]
    pub limits: RunLimits,
    /// One entry per message begun (the finalizer last).
    #[serde(default)]
    pub progress: Vec<MessageProgress>,
    /// Set by a cancel: the run stops at its next boundary (a turn is not interrupted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<CancelRequest>,
    /// How often it was retried (`turnstile run retry`); turns of a retry get fresh ids.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt: u32,
    /// The delivery of the run's lane item that drives it (R1): the one that claimed it last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverClaim>,
    #[serde(flatten)]
    pub state: RunState,
}

/// Which delivery of a run's lane item drives the run. The lane's consumer hands an unacked
/// item out again once its ack wait ran out (a stall of NATS or of the holder longer than
/// that): the earlier holder may still be driving, unaware. Each driver claims the run when it
/// starts and writes the run's progress and end only while its claim is the stored one, so
/// of two drivers at once only the later writes: the earlier stops at its next write,
/// touching neither the item nor the run again. A delivery numbered below the stored claim
/// (a server that lost its last delivery counts in a crash) stops at once too; the item
/// comes back after each ack wait, one count higher, until it passes the claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverClaim {
    /// The run item's sequence on the lane stream (a retry's item is a later one).
    pub item: u64,
    /// How often the lane's consumer has handed that item out, this delivery included.
    pub delivery: u64,
    /// Tells apart two deliveries numbered alike: a consumer leader that died before its count
    /// was replicated has the next leader number the next delivery the same.
    pub token: String,
}

impl DriverClaim {
    /// Whether this claim may replace `current`: a later item, or the same or a later delivery
    /// of the same one (of two alike, the later claim wins). An earlier delivery never does:
    /// its holder is the one to stop.
    pub fn supersedes(&self, current: &DriverClaim) -> bool {
        (self.item, self.delivery) >= (current.item, current.delivery)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelRequest {
    pub at: DateTime<Utc>,
    pub by: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl RunRecord {
    /// The turn of round `round` of message `message` in this attempt (R14: derived).
    pub fn turn_id(&self, message: usize, round: u32) -> TurnId {
        let t = self.id.turn(message, round);
        if self.attempt == 0 {
            return t;
        }
        format!("{t}-a{}", self.attempt).parse().unwrap_or(t)
    }

    /// Every message in order, the finalizer last.
    pub fn texts(&self) -> Vec<&str> {
        self.messages
            .iter()
            .map(String::as_str)
            .chain(self.finalizer.as_deref())
            .collect()
    }

    pub fn rounds(&self) -> u32 {
        self.progress.iter().map(|m| m.turns.len() as u32).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(tag = "status", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum RunState {
    /// Waiting on the lane (R2: not running until it holds it).
    Queued,
    Running {
        started_at: DateTime<Utc>,
    },
    /// Every message and the finalizer completed (R12).
    Completed {
        started_at: DateTime<Utc>,
        ended_at: DateTime<Utc>,
    },
    Failed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<DateTime<Utc>>,
        ended_at: DateTime<Utc>,
        reason: String,
        detail: String,
        /// Which message (0-based; the finalizer is `messages.len()`).
        message_index: usize,
        /// The execution that failed, when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        execution: Option<ExecutionId>,
    },
}

impl RunState {
    pub fn is_terminal(&self) -> bool {
        matches!(self, Self::Completed { .. } | Self::Failed { .. })
    }

    /// The state's name, as serialised in its `status` tag.
    pub fn name(&self) -> &'static str {
        self.into()
    }
}

/// The `run` lane item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunItem {
    pub run: RunId,
    /// 0 for the first time; a retry queues the run again with the next attempt.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt: u32,
}

/// `ts.api.runs.start`: run these messages on the session now (queued on its lane).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartRun {
    pub session: SessionId,
    pub messages: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalizer: Option<String>,
    #[serde(default)]
    pub limits: RunLimits,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// Chosen by a client that wants to retry safely.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<RunId>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRef {
    pub run: RunId,
}

impl crate::retention::Retained for RunRecord {
    fn finished(&self) -> bool {
        self.state.is_terminal()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_default_and_round_trip() {
        let l: RunLimits = serde_json::from_str("{}").expect("defaults");
        assert_eq!(l, RunLimits::default());
        assert_eq!(l.max_rounds, 100);
        let l: RunLimits =
            serde_json::from_str(r#"{"max_rounds":5,"idle_timeout":1.5}"#).expect("json");
        assert_eq!(l.idle_timeout, Duration::from_millis(1500));
        assert!(serde_json::from_str::<RunLimits>(r#"{"max_duration":-1}"#).is_err());
    }

    #[test]
    fn run_turn_ids_are_derived_and_distinct() {
        let r = RunId::new();
        assert_eq!(r.turn(0, 0), r.turn(0, 0));
        assert_ne!(r.turn(0, 1), r.turn(1, 0));
        assert!(r.turn(12, 100).as_str().starts_with("trn_"));
    }

    #[test]
    fn a_later_delivery_or_item_supersedes_a_drivers_claim_and_an_earlier_never_does() {
        let claim = |item, delivery, token: &str| DriverClaim {
            item,
            delivery,
            token: token.into(),
        };
        let held = claim(7, 2, "a");
        assert!(claim(7, 3, "b").supersedes(&held));
        assert!(
            claim(7, 2, "b").supersedes(&held),
            "alike: the later claim wins"
        );
        assert!(
            claim(9, 1, "b").supersedes(&held),
            "a retry's item is a later one"
        );
        assert!(!claim(7, 1, "b").supersedes(&held));
        assert!(!claim(6, 5, "b").supersedes(&held));
    }
}
