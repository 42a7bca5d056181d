//! Schedules and their slots (R11): what fires when, on which session, what happens when a
//! slot comes while the previous run still goes, and the one record every slot yields.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::ids::{RunId, SessionId};
use crate::runs::RunLimits;

/// What a slot does while the schedule's previous run still goes (R11).
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
#[strum(serialize_all = "snake_case", parse_err_ty = String, parse_err_fn = unknown_overlap)]
pub enum Overlap {
    /// Record the slot `skipped`, naming the run it yielded to.
    #[default]
    Skip,
    /// Keep one slot; it fires when the running run ends. Further slots are skipped.
    BufferOne,
    /// Fire anyway; the lane still runs one item at a time.
    AllowAll,
    /// Cancel the running run (it stops at its next boundary, `failed: cancelled`), then fire.
    CancelOther,
}

/// Which missed slots fire when the scheduler comes back (within the catch-up window).
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
#[strum(serialize_all = "snake_case", parse_err_ty = String, parse_err_fn = unknown_catchup)]
pub enum Catchup {
    /// Only the most recent missed slot fires; the others are recorded `missed`.
    #[default]
    Latest,
    /// Every missed slot in the window fires, in order (the overlap policy still applies).
    All,
    /// None fires; all are recorded `missed`.
    None,
}

fn unknown_overlap(s: &str) -> String {
    crate::names::unknown::<Overlap>("overlap policy", s)
}

fn unknown_catchup(s: &str) -> String {
    crate::names::unknown::<Catchup>("catch-up policy", s)
}

mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        if !(0.0..=1e10).contains(&v) {
            return Err(serde::de::Error::custom(format!("{v} s is out of range")));
        }
        Ok(Duration::from_secs_f64(v))
    }
}

fn default_window() -> Duration {
    Duration::from_secs(3600)
}
fn default_late() -> Duration {
    Duration::from_secs(60)
}

/// `ts.api.schedules.add`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleSpec {
    /// Letters, digits, `-`, `_`; at most 40.
    pub name: String,
    pub cron: String,
    /// IANA zone, e.g. `Asia/Kolkata`.
    pub tz: String,
    pub session: SessionId,
    pub messages: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalizer: Option<String>,
    #[serde(default)]
    pub overlap: Overlap,
    #[serde(default = "default_window", with = "secs")]
    pub catchup_window: Duration,
    #[serde(default)]
    pub catchup: Catchup,
    #[serde(default = "default_late", with = "secs")]
    pub late_threshold: Duration,
    #[serde(default)]
    pub limits: RunLimits,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Paused {
    pub at: DateTime<Utc>,
    #[serde(default)]
    pub note: String,
}

/// A schedule in `ts_schedules` (key: name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleRecord {
    #[serde(flatten)]
    pub spec: ScheduleSpec,
    pub created_at: DateTime<Utc>,
    /// Every slot at or before this instant has its record.
    pub cursor: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<Paused>,
    /// The run the schedule fired last (the one overlap is judged against).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_run: Option<RunId>,
    /// `buffer_one`: the slot waiting for the running run to end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffered: Option<DateTime<Utc>>,
}

/// What became of one slot (R11): exactly one per slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, strum::IntoStaticStr)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum SlotOutcome {
    Fired {
        fired_at: DateTime<Utc>,
        /// Fire time minus slot time.
        drift_ms: i64,
        late: bool,
        run: RunId,
    },
    Skipped {
        reason: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        yielded_to: Option<RunId>,
    },
    Missed {
        reason: String,
    },
}

impl SlotOutcome {
    /// The event a slot's record is announced with (R11).
    pub fn event_kind(&self) -> crate::events::EventKind {
        use crate::events::EventKind;
        match self {
            Self::Fired { .. } => EventKind::SlotFired,
            Self::Skipped { .. } => EventKind::SlotSkipped,
            Self::Missed { .. } => EventKind::SlotMissed,
        }
    }

    /// The state's name, as serialised in its `outcome` tag.
    pub fn name(&self) -> &'static str {
        self.into()
    }
}

/// A slot's record in `ts_slots` (key: `<schedule>.<slot unix seconds>.<nanos>`), created
/// once: the create is the claim that makes a slot fire once across replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotRecord {
    pub schedule: String,
    pub slot: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
    #[serde(flatten)]
    pub outcome: SlotOutcome,
}

pub fn slot_key(schedule: &str, slot: DateTime<Utc>) -> String {
    format!(
        "{schedule}.{}.{}",
        slot.timestamp(),
        slot.timestamp_subsec_nanos()
    )
}

/// The run a slot fires: derived, so a replica that retries a fired slot starts the same run.
pub fn slot_run(schedule: &str, slot: DateTime<Utc>) -> Option<RunId> {
    format!("{}{schedule}-{}", RunId::PREFIX, slot.timestamp_millis())
        .parse()
        .ok()
}

/// Schedule names: subject tokens, short enough to go into run ids.
pub fn valid_name(name: &str) -> bool {
    crate::ids::is_token(name) && name.len() <= 40
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScheduleRef {
    pub name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PauseSchedule {
    pub name: String,
    #[serde(default)]
    pub note: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Backfill {
    pub name: String,
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ListSchedules {
    #[serde(flatten)]
    pub page: crate::page::PageRequest,
}

/// `schedule show`: the record, the next five fire times in its zone, the latest slots.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScheduleView {
    pub schedule: ScheduleRecord,
    /// Next fire times as RFC 3339 in the schedule's zone.
    pub next: Vec<String>,
    pub slots: Vec<SlotRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListRuns {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    #[serde(flatten)]
    pub page: crate::page::PageRequest,
}

/// A schedule stays until it is deleted.
impl crate::retention::Retained for ScheduleRecord {
    fn finished(&self) -> bool {
        false
    }
}

/// A slot's record is written once, decided: history from the start.
impl crate::retention::Retained for SlotRecord {
    fn finished(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_runs_are_stable_run_ids() {
        let t = DateTime::from_timestamp(1_790_000_000, 0).unwrap_or_default();
        let a = slot_run("daily-report", t).expect("id");
        assert_eq!(Some(a.clone()), slot_run("daily-report", t));
        assert!(a.as_str().starts_with("run_daily-report-"));
        assert!(valid_name("daily-report") && !valid_name("a.b") && !valid_name(&"x".repeat(41)));
        assert_eq!("cancel_other".parse::<Overlap>(), Ok(Overlap::CancelOther));
        assert!("cancel".parse::<Overlap>().is_err());
        let spec: ScheduleSpec = serde_json::from_value(serde_json::json!({
            "name": "n", "cron": "0 * * * *", "tz": "UTC",
            "session": crate::ids::SessionId::new(), "messages": ["hi"]
        }))
        .expect("defaults");
        assert_eq!(spec.overlap, Overlap::Skip);
        assert_eq!(spec.catchup, Catchup::Latest);
        assert_eq!(spec.catchup_window, Duration::from_secs(3600));
    }
}
