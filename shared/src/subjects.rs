//! Every stream, bucket, consumer and subject name in Turnstile. Nothing else spells them, so
//! the topology in `docs/topology.md` can be checked against one file.

use crate::ids::{HostName, SessionId};

pub const LANE_STREAM: &str = "TS_LANE";
pub const TRANSPORT_STREAM: &str = "TS_TRANSPORT";
pub const COMPLETION_STREAM: &str = "TS_COMPLETION";
pub const STEP_STREAM: &str = "TS_STEP";
pub const EVENTS_STREAM: &str = "TS_EVENTS";
pub const DEADLETTER_STREAM: &str = "TS_DEADLETTER";

pub const SESSIONS_BUCKET: &str = "ts_sessions";
pub const TURNS_BUCKET: &str = "ts_turns";
pub const HOSTS_BUCKET: &str = "ts_hosts";

/// The priority group every lane consumer pins one session-lane replica to.
pub const LANE_GROUP: &str = "lane";

pub const LANE_ALL: &str = "ts.lane.*";
pub const TRANSPORT_ALL: &str = "ts.transport.>";
pub const COMPLETION_ALL: &str = "ts.completion.>";
pub const STEP_ALL: &str = "ts.step.>";
pub const EVENTS_ALL: &str = "ts.events.>";
pub const DEADLETTER_ALL: &str = "ts.dlq.>";

/// A session's lane: its turns and other lane items, in order.
pub fn lane(session: &SessionId) -> String {
    format!("ts.lane.{session}")
}

pub fn lane_consumer(session: &SessionId) -> String {
    format!("lane_{session}")
}

/// Commands for one host's transport agent, `verb` being `start`, `turn` or `stop`.
pub fn transport(host: &HostName, verb: &str) -> String {
    format!("ts.transport.{host}.{verb}")
}

pub fn transport_host_all(host: &HostName) -> String {
    format!("ts.transport.{host}.>")
}

pub fn transport_consumer(host: &HostName) -> String {
    format!("transport_{host}")
}

/// A lifecycle event: `ts.events.<entity>.<id>.<type>`, where `type` may itself hold dots
/// (`turn.completed`), so `ts.events.session.<id>.>` is everything about one session.
pub fn event(entity: &str, id: &str, kind: &str) -> String {
    format!("ts.events.{entity}.{id}.{kind}")
}

pub fn session_events(session: &SessionId) -> String {
    format!("ts.events.session.{session}.>")
}

/// Where a refused lane item is kept, with the reason in a header.
pub fn lane_deadletter(session: &SessionId) -> String {
    format!("ts.dlq.lane.{session}")
}

/// Where a refused transport command is kept, with the reason in a header.
pub fn transport_deadletter(host: &HostName) -> String {
    format!("ts.dlq.transport.{host}")
}

/// Request/reply APIs (NATS services), `ts.api.<area>.<verb>`.
pub mod api {
    pub const SESSION_SERVICE: &str = "turnstile-session-lane";
    pub const SESSION_GROUP: &str = "ts.api.session";
    pub const SESSION_CREATE: &str = "ts.api.session.create";
    pub const SESSION_SEND: &str = "ts.api.session.send";
    pub const SESSION_STOP: &str = "ts.api.session.stop";
    pub const SESSION_LIST: &str = "ts.api.session.list";
    pub const SESSION_SHOW: &str = "ts.api.session.show";
}

/// Header on dead-lettered messages naming why they were refused.
pub const REASON_HEADER: &str = "Turnstile-Reason";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_session_subjects_do_not_overlap() {
        let a = SessionId::new();
        assert_eq!(lane(&a), format!("ts.lane.{a}"));
        assert!(event("session", a.as_str(), "turn.completed").starts_with("ts.events.session."));
        assert_eq!(session_events(&a), format!("ts.events.session.{a}.>"));
    }
}
