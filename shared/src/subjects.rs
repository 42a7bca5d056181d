//! Every stream, bucket, consumer and subject name in Turnstile. Nothing else spells them, so
//! the topology in `docs/topology.md` can be checked against one file.

use crate::ids::{ExecutionId, HostName, SessionId, StepId, TurnId};

/// Every session's lane items (limits retention: each item is removed once its lane is done
/// with it, see `lane_retention`).
pub const LANE_STREAM: &str = "TS_LANES";
/// The lane stream of builds before 0.2 (work-queue retention). `turnstile admin provision`
/// moves what it holds onto [`LANE_STREAM`] and deletes it (`lane_migration`).
pub const LEGACY_LANE_STREAM: &str = "TS_LANE";
/// Where a lane's done item is removed by its sequence (`STREAM.MSG.DELETE`). Not a purge by
/// subject: the server visits every consumer of the stream on a purge (10.5 ms at 10,000 lane
/// consumers against 0.58 ms for a delete, nats-server 2.15).
pub fn lane_item_delete() -> String {
    format!("$JS.API.STREAM.MSG.DELETE.{LANE_STREAM}")
}
/// The JetStream API request listing the lane stream's consumers with their states (paged by
/// `offset`).
pub fn lane_consumer_list() -> String {
    format!("CONSUMER.LIST.{LANE_STREAM}")
}
/// What the legacy lane stream listens on while its items are moved: a subject nothing
/// publishes, so the new stream may take the lane subjects.
pub const LEGACY_LANE_RETIRED: &str = "ts.retired.lane.>";
pub const TRANSPORT_STREAM: &str = "TS_TRANSPORT";
pub const COMPLETION_STREAM: &str = "TS_COMPLETION";
pub const STEP_STREAM: &str = "TS_STEP";
pub const EVENTS_STREAM: &str = "TS_EVENTS";
pub const DEADLETTER_STREAM: &str = "TS_DEADLETTER";

pub const SESSIONS_BUCKET: &str = "ts_sessions";
pub const TURNS_BUCKET: &str = "ts_turns";
pub const HOSTS_BUCKET: &str = "ts_hosts";
/// The execution registry: every turn and step with its exact parent (R6).
pub const EXECUTIONS_BUCKET: &str = "ts_executions";
/// One marker per session while a `delivery` lane item is waiting (never more than one).
pub const DELIVERIES_BUCKET: &str = "ts_deliveries";
/// Runs and their progress (R5, R12): a run resumed by another replica continues from here.
pub const RUNS_BUCKET: &str = "ts_runs";
/// Schedules (key: name) and their slot records (key: `<name>.<secs>.<nanos>`, R11).
pub const SCHEDULES_BUCKET: &str = "ts_schedules";
pub const SLOTS_BUCKET: &str = "ts_slots";
/// Session-lane replicas' liveness (`live.<replica>`, renewed every few hundred ms) and the lane
/// pins each holds (`pin.<replica>.<session>`): how a survivor finds a dead replica's lanes.
pub const REPLICAS_BUCKET: &str = "ts_replicas";
/// The live `session`-scoped work each session owns (key `<session>.<execution>`): what a
/// stopped session's work is found by, so its stop cancels it (R7). An entry is removed once
/// its execution ended, and all of a session's once it stopped.
pub const OWNED_BUCKET: &str = "ts_owned";

/// Every stream `turnstile admin provision` creates.
pub const ALL_STREAMS: [&str; 6] = [
    LANE_STREAM,
    TRANSPORT_STREAM,
    COMPLETION_STREAM,
    STEP_STREAM,
    EVENTS_STREAM,
    DEADLETTER_STREAM,
];

/// Every KV bucket `turnstile admin provision` creates.
pub const ALL_BUCKETS: [&str; 10] = [
    SESSIONS_BUCKET,
    TURNS_BUCKET,
    HOSTS_BUCKET,
    EXECUTIONS_BUCKET,
    DELIVERIES_BUCKET,
    RUNS_BUCKET,
    SCHEDULES_BUCKET,
    SLOTS_BUCKET,
    REPLICAS_BUCKET,
    OWNED_BUCKET,
];

/// The priority group every lane consumer pins one session-lane replica to.
pub const LANE_GROUP: &str = "lane";
/// The header carrying the pin the server gave the replica an item was delivered to.
pub const PIN_ID_HEADER: &str = "Nats-Pin-Id";

pub const LANE_ALL: &str = "ts.lane.*";
pub const TRANSPORT_ALL: &str = "ts.transport.>";
pub const COMPLETION_ALL: &str = "ts.completion.>";
pub const STEP_ALL: &str = "ts.step.>";
pub const EVENTS_ALL: &str = "ts.events.>";
pub const DEADLETTER_ALL: &str = "ts.dlq.>";

const LANE_PREFIX: &str = "ts.lane.";

/// A session's lane: its turns and other lane items, in order.
pub fn lane(session: &SessionId) -> String {
    format!("{LANE_PREFIX}{session}")
}

pub fn lane_consumer(session: &SessionId) -> String {
    format!("{LANE_CONSUMER_PREFIX}{session}")
}

const LANE_CONSUMER_PREFIX: &str = "lane_";

/// The session whose lane consumer this is (the inverse of [`lane_consumer`]).
pub fn lane_consumer_session(name: &str) -> Option<SessionId> {
    name.strip_prefix(LANE_CONSUMER_PREFIX)?.parse().ok()
}

/// The session a lane subject belongs to (`ts.lane.<session>` gives `<session>`).
pub fn lane_session(subject: &str) -> Option<&str> {
    subject
        .strip_prefix(LANE_PREFIX)
        .filter(|s| !s.is_empty() && !s.contains('.'))
}

/// Where a session's lane consumer takes pull requests (JetStream's `CONSUMER.MSG.NEXT`).
pub fn lane_pull(session: &SessionId) -> String {
    format!(
        "$JS.API.CONSUMER.MSG.NEXT.{LANE_STREAM}.{}",
        lane_consumer(session)
    )
}

/// The acknowledgement subject of the item a lane consumer delivered last, as the server
/// writes it (`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.
/// <pending>`): how a survivor gives back the item a dead replica held. The server reads only
/// the sequences of a nak.
pub fn lane_ack_subject(consumer: &str, stream_seq: u64, consumer_seq: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("$JS.ACK.{LANE_STREAM}.{consumer}.1.{stream_seq}.{consumer_seq}.{now}.0")
}

/// A replica's name as one subject token: anything but `[A-Za-z0-9_-]` becomes `_`.
pub fn replica_token(replica: &str) -> String {
    let t: String = replica
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if t.is_empty() {
        "_".into()
    } else {
        t
    }
}

/// A session-lane replica's liveness key in [`REPLICAS_BUCKET`].
pub fn replica_live_key(replica: &str) -> String {
    format!("live.{}", replica_token(replica))
}

/// The key recording which lane pin a replica holds, in [`REPLICAS_BUCKET`].
pub fn replica_pin_key(replica: &str, session: &SessionId) -> String {
    format!("pin.{}.{session}", replica_token(replica))
}

/// Every pin key of one replica (a KV key filter).
pub fn replica_pins(replica: &str) -> String {
    format!("pin.{}.*", replica_token(replica))
}

/// Every replica's pin key for one session's lane (a KV key filter).
pub fn replica_pins_of(session: &SessionId) -> String {
    format!("pin.*.{session}")
}

/// Every liveness key (a KV key filter).
pub const REPLICA_LIVE_ALL: &str = "live.*";

/// Where a session-lane replica instance answers its peers' liveness pings (core NATS): while
/// its connection lives the server has a subscriber here; once it is gone, a ping gets *no
/// responders* at once.
pub fn replica_ping(instance: &str) -> String {
    format!("ts.replica.{}.ping", replica_token(instance))
}

/// Every replica's ping subject (for permissions).
pub const REPLICA_PING_ALL: &str = "ts.replica.*.ping";

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
fn event(entity: &str, id: &str, kind: &str) -> String {
    format!("ts.events.{entity}.{id}.{kind}")
}

/// An event about a session (its turns, runs, steps, deliveries).
pub fn session_event(session: &str, kind: &str) -> String {
    event("session", session, kind)
}

/// An event about a host (its heartbeat).
pub fn host_event(host: &str, kind: &str) -> String {
    event("host", host, kind)
}

/// An event about a schedule (changes and slots).
pub fn schedule_event(schedule: &str, kind: &str) -> String {
    event("schedule", schedule, kind)
}

/// An event about nothing narrower (e.g. a refused call without a session).
pub fn system_event(kind: &str) -> String {
    event("system", "-", kind)
}

/// Every step event of one session (`step.queued`, ..., `step.cancelled`).
pub fn session_step_events(session: &SessionId) -> String {
    event("session", session.as_str(), "step.>")
}

/// What the broker follows (with the sessions' stops) to tell which sessions have a delivery
/// armed or a run holding them: every session's delivery and run events.
pub fn arming_events() -> [String; 2] {
    [
        event("session", "*", "delivery.>"),
        event("session", "*", "run.>"),
    ]
}

/// Every run event of every session (the scheduler follows run ends).
pub const ALL_RUN_EVENTS: &str = "ts.events.session.*.run.>";

pub fn session_events(session: &SessionId) -> String {
    format!("ts.events.session.{session}.>")
}

/// Where a refused lane item is kept, with the reason in a header.
pub fn lane_deadletter(session: &SessionId) -> String {
    format!("ts.dlq.lane.{session}")
}

/// Where a completion refused by a session's delivery is kept (R8).
pub fn completion_deadletter(session: &SessionId) -> String {
    format!("ts.dlq.completion.{session}")
}

/// Where a refused transport command is kept, with the reason in a header.
pub fn transport_deadletter(host: &HostName) -> String {
    format!("ts.dlq.transport.{host}")
}

/// A completion of `execution` addressed to `session` (its owner or a watcher, R8).
pub fn completion(session: &SessionId, execution: &ExecutionId) -> String {
    format!("ts.completion.{session}.{execution}")
}

/// The session a completion's subject is for (`ts.completion.<session>.<execution>`).
pub fn completion_session(subject: &str) -> Option<SessionId> {
    subject
        .strip_prefix("ts.completion.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

pub fn completion_session_all(session: &SessionId) -> String {
    format!("ts.completion.{session}.*")
}

pub fn completion_consumer(session: &SessionId) -> String {
    format!("completion_{session}")
}

/// `command` step work for one host's transport agent.
pub fn step_command(host: &HostName) -> String {
    format!("ts.step.command.{host}")
}

pub fn step_command_consumer(host: &HostName) -> String {
    format!("steps_{host}")
}

/// `external` step work; any worker serving `name` may take it.
pub fn step_external(name: &str) -> String {
    format!("ts.step.external.{name}")
}

pub fn step_external_consumer(name: &str) -> String {
    format!("external_{name}")
}

/// The end of an execution (a report or a cancellation), consumed durably by the broker,
/// which records it and routes its completions.
pub fn step_ended(execution: &ExecutionId) -> String {
    format!("ts.step.ended.{execution}")
}

pub const STEP_ENDED_ALL: &str = "ts.step.ended.*";

/// Background-agent steps, for the broker to launch (a session and a run each).
pub const STEP_AGENT: &str = "ts.step.agent";
pub const BROKER_AGENTS_CONSUMER: &str = "broker_agents";
/// The broker follows run ends to finish background-agent steps.
pub const RUN_ENDS: [&str; 2] = [
    "ts.events.session.*.run.completed",
    "ts.events.session.*.run.failed",
];
pub const BROKER_RUN_ENDS_CONSUMER: &str = "broker_run_ends";
pub const BROKER_ENDED_CONSUMER: &str = "broker_ended";

/// Core NATS (not captured by any stream): tells a step's worker to stop now. Workers also
/// learn it from their heartbeat replies, so a missed message costs one heartbeat period.
pub fn step_cancel(step: &StepId) -> String {
    format!("ts.control.step.{step}.cancel")
}

/// The stream behind the turns bucket, which the broker follows durably to mirror turns
/// into the execution tree and end their `turn`-scoped work (R7).
pub const TURNS_KV_STREAM: &str = "KV_ts_turns";
pub const TURNS_KV_ALL: &str = "$KV.ts_turns.>";
pub const BROKER_TURNS_CONSUMER: &str = "broker_turns";

/// The subject a turn's record is written on (a writer pipelining creates, as the benchmark
/// does).
pub fn turn_kv_subject(turn: &TurnId) -> String {
    format!("$KV.{TURNS_BUCKET}.{turn}")
}

/// The stream behind the runs bucket: the broker mirrors runs and their messages into the
/// execution tree from it.
pub const RUNS_KV_STREAM: &str = "KV_ts_runs";
pub const RUNS_KV_ALL: &str = "$KV.ts_runs.>";
pub const BROKER_RUNS_CONSUMER: &str = "broker_runs";

/// The stream behind the deliveries bucket: a delivery's marker is removed from it by
/// sequence, leaving no removal behind (see `kv::Bucket::remove_revision`).
pub const DELIVERIES_KV_STREAM: &str = "KV_ts_deliveries";

/// The stream behind the replicas bucket: a departed replica's keys are purged from it.
pub const REPLICAS_KV_STREAM: &str = "KV_ts_replicas";

/// The subjects of the replicas bucket's keys matching `key_filter`.
pub fn replicas_kv_subjects(key_filter: &str) -> String {
    format!("$KV.{REPLICAS_BUCKET}.{key_filter}")
}

/// The stream behind the owned-work bucket: an entry is purged from it (leaving no marker
/// behind) once its execution ended or its session stopped.
pub const OWNED_KV_STREAM: &str = "KV_ts_owned";

/// The key of `execution` in [`OWNED_BUCKET`], owned by `session`.
pub fn owned_key(session: &SessionId, execution: &ExecutionId) -> String {
    format!("{session}.{execution}")
}

/// The key pattern of everything `session` owns in [`OWNED_BUCKET`].
pub fn owned_by(session: &SessionId) -> String {
    format!("{session}.*")
}

/// The subjects of the owned-work bucket's keys matching `key_filter`.
pub fn owned_kv_subjects(key_filter: &str) -> String {
    format!("$KV.{OWNED_BUCKET}.{key_filter}")
}

/// Where the broker keeps an unreadable execution end.
pub const BROKER_DEADLETTER: &str = "ts.dlq.broker.ended";

/// Core NATS (no stream): a sign of life of work owned by or watched from `session` (a step
/// heartbeat). Runs count it as progress (R10); nothing keeps it.
pub fn progress(session: &SessionId) -> String {
    format!("ts.control.progress.{session}")
}

/// Core NATS: tells the replica driving `run` that it was cancelled (it also sees it in the
/// record at its next boundary).
pub fn run_cancel(run: &crate::ids::RunId) -> String {
    format!("ts.control.run.{run}.cancel")
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
    pub const SESSION_HOSTS: &str = "ts.api.session.hosts";

    /// Runs, served by session-lane: start one now, show one.
    pub const RUNS_GROUP: &str = "ts.api.runs";
    pub const RUNS_START: &str = "ts.api.runs.start";
    pub const RUNS_SHOW: &str = "ts.api.runs.show";
    pub const RUNS_LIST: &str = "ts.api.runs.list";
    pub const RUNS_CANCEL: &str = "ts.api.runs.cancel";
    pub const RUNS_RETRY: &str = "ts.api.runs.retry";

    /// Schedules, served by the scheduler.
    pub const SCHEDULER_SERVICE: &str = "turnstile-scheduler";
    pub const SCHEDULES_GROUP: &str = "ts.api.schedules";
    pub const SCHEDULES_ADD: &str = "ts.api.schedules.add";
    pub const SCHEDULES_LIST: &str = "ts.api.schedules.list";
    pub const SCHEDULES_SHOW: &str = "ts.api.schedules.show";
    pub const SCHEDULES_PAUSE: &str = "ts.api.schedules.pause";
    pub const SCHEDULES_RESUME: &str = "ts.api.schedules.resume";
    pub const SCHEDULES_TRIGGER: &str = "ts.api.schedules.trigger";
    pub const SCHEDULES_BACKFILL: &str = "ts.api.schedules.backfill";
    pub const SCHEDULES_DELETE: &str = "ts.api.schedules.delete";

    pub const BROKER_SERVICE: &str = "turnstile-notification-broker";
    /// The broker's agent-facing APIs carry the principal a call acts for after the area,
    /// `ts.api.steps.<principal>.<verb>` and `ts.api.exec.<principal>.<verb>`, so the NATS
    /// server can allow an agent its own session's subjects and nothing else. The principal
    /// is a session id, a step id, or [`OPERATOR`] for operators and services.
    pub const STEPS_GROUP: &str = "ts.api.steps";
    pub const EXEC_GROUP: &str = "ts.api.exec";
    /// The principal token of calls by operators and services (never an agent's).
    pub const OPERATOR: &str = "op";
    /// Start a child execution (session or step credentials).
    pub const START: &str = "start";
    /// A worker reports running / heartbeat / result with the step's own token.
    pub const REPORT: &str = "report";
    pub const STATUS: &str = "status";
    pub const LIST: &str = "list";
    /// The subtree under any execution.
    pub const TREE: &str = "tree";
    /// Cancel an execution and everything it owns (R7).
    pub const CANCEL: &str = "cancel";
    /// Cancel the `session`-scoped work a stopped session owns (R7); operator only, called by
    /// the session stop.
    pub const CANCEL_SESSION: &str = "cancel_session";
    pub const STEP_VERBS: [&str; 4] = [START, REPORT, STATUS, LIST];
    pub const EXEC_VERBS: [&str; 3] = [TREE, CANCEL, CANCEL_SESSION];

    /// `ts.api.steps.<principal>.<verb>`.
    pub fn steps(principal: &str, verb: &str) -> String {
        format!("{STEPS_GROUP}.{principal}.{verb}")
    }

    /// `ts.api.exec.<principal>.<verb>`.
    pub fn exec(principal: &str, verb: &str) -> String {
        format!("{EXEC_GROUP}.{principal}.{verb}")
    }

    /// An endpoint's subject inside its group: any principal, one verb.
    pub fn any_principal(verb: &str) -> String {
        format!("*.{verb}")
    }

    /// Where replies to a principal's requests arrive: its own inbox prefix, so it may
    /// subscribe to its replies and nobody else's.
    pub fn inbox(principal: &str) -> String {
        format!("_INBOX.{principal}")
    }

    /// What an agent's (or a step's) NATS identity may publish: requests on its own
    /// principal's step and exec subjects.
    pub fn agent_publish(principal: &str) -> Vec<String> {
        vec![steps(principal, "*"), exec(principal, "*")]
    }

    /// What it may subscribe to: the replies to its own requests.
    pub fn agent_subscribe(principal: &str) -> Vec<String> {
        vec![format!("{}.>", inbox(principal))]
    }

    /// The subject the NATS server sends auth callout requests on (nats-server 2.10+).
    pub const AUTH_CALLOUT: &str = "$SYS.REQ.USER.AUTH";
    /// The queue group of the broker replicas answering them.
    pub const AUTH_CALLOUT_GROUP: &str = "turnstile-auth";
    /// System-account requests: every server's connections, and ending one of them.
    pub const SERVER_CONNZ: &str = "$SYS.REQ.SERVER.PING.CONNZ";
    pub fn server_kick(server_id: &str) -> String {
        format!("$SYS.REQ.SERVER.{server_id}.KICK")
    }
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
        assert_eq!(
            session_event(a.as_str(), "turn.completed"),
            format!("ts.events.session.{a}.turn.completed")
        );
        assert!(session_step_events(&a).starts_with(&format!("ts.events.session.{a}.")));
        assert_eq!(session_events(&a), format!("ts.events.session.{a}.>"));
    }

    #[test]
    fn a_completion_subject_names_its_session_and_nothing_else_does() {
        let s = SessionId::new();
        let e = ExecutionId::from(&crate::StepId::new());
        assert_eq!(completion_session(&completion(&s, &e)), Some(s.clone()));
        assert_eq!(completion_session(&lane(&s)), None);
        assert_eq!(completion_session("ts.completion.not-a-session.x"), None);
    }
}
