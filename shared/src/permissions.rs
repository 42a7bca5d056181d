//! Who may use which subjects on the NATS server: one grant per role, spelled with the names in
//! [`crate::subjects`]. `turnstile admin nats-config` writes the server's configuration from
//! this table (`deploy/nats-server.conf` is its output, checked by a test), and every
//! integration test runs each service on the identity it gives, so a service that starts
//! using a subject without its grant fails a test. Agents are not here: their identities are
//! issued per session by the auth callout (`subjects::api::agent_publish`).

use crate::ids::HostName;
use crate::subjects::{self, api as subj};

/// The account every service, operator and agent identity lives in.
pub const ACCOUNT: &str = "TURNSTILE";
/// The system account, where the broker's revoker ends stopped sessions' connections.
pub const SYSTEM_ACCOUNT: &str = "SYS";

/// One identity of the server's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    SessionLane,
    /// One per host: it may take only its own host's commands and step work.
    Transport(HostName),
    Broker,
    Scheduler,
    /// Runs `turnstile admin provision`.
    Admin,
    /// Follows events, discovers services and calls the read-only APIs; changes nothing.
    Observer,
    /// The operator's CLI.
    Cli,
    /// The broker's system identity: lists and ends connections.
    Revoker,
}

/// What a role may publish and subscribe to. Everything else is refused by the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    pub publish: Vec<String>,
    pub publish_deny: Vec<String>,
    pub subscribe: Vec<String>,
}

/// The streams behind every KV bucket (`KV_<bucket>`): watches and scans are consumers on them.
fn kv_streams() -> Vec<String> {
    subjects::ALL_BUCKETS
        .iter()
        .map(|b| format!("KV_{b}"))
        .collect()
}

/// The JetStream API a service needs, and no more: account and stream info, and on the streams
/// it `reads` (its consumers' and buckets' streams) consumer operations, direct and message
/// gets, acks. Never stream create, update, delete or purge, message delete, snapshots or
/// restores: only `admin` manages streams.
fn jetstream(reads: &[String]) -> Vec<String> {
    let mut out = vec![
        "$JS.API.INFO".to_string(),
        "$JS.API.STREAM.INFO.*".to_string(),
        "$JS.API.STREAM.NAMES".to_string(),
        "$JS.FC.>".to_string(),
        "_INBOX.>".to_string(),
    ];
    for s in reads {
        out.extend([
            format!("$JS.API.CONSUMER.*.{s}"),
            format!("$JS.API.CONSUMER.*.{s}.>"),
            format!("$JS.API.CONSUMER.DURABLE.CREATE.{s}.>"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{s}.>"),
            format!("$JS.API.DIRECT.GET.{s}"),
            format!("$JS.API.DIRECT.GET.{s}.>"),
            format!("$JS.API.STREAM.MSG.GET.{s}"),
            format!("$JS.ACK.{s}.>"),
        ]);
    }
    out
}

/// The principal part of the observer's reply inbox (`_INBOX.observer.>`): a client on the
/// observer identity must set this prefix (async-nats `custom_inbox_prefix`).
pub const OBSERVER_INBOX: &str = "observer";

/// The observer's requests: the APIs that only read (what `turnstile dashboard` shows), and
/// service discovery. No API that changes anything, no JetStream API, no lane or event.
pub fn observer_reads() -> Vec<String> {
    vec![
        subj::SESSION_LIST.into(),
        subj::SESSION_SHOW.into(),
        subj::SESSION_HOSTS.into(),
        subj::RUNS_LIST.into(),
        subj::RUNS_SHOW.into(),
        subj::SCHEDULES_LIST.into(),
        subj::SCHEDULES_SHOW.into(),
        subj::exec(subj::OPERATOR, subj::TREE),
        "$SRV.>".into(),
    ]
}

fn owned(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

impl Role {
    /// Every role of a deployment whose transport agents run on `hosts`.
    pub fn all(hosts: &[HostName]) -> Vec<Role> {
        let mut roles = vec![Role::SessionLane];
        roles.extend(hosts.iter().cloned().map(Role::Transport));
        roles.extend([
            Role::Broker,
            Role::Scheduler,
            Role::Admin,
            Role::Observer,
            Role::Cli,
            Role::Revoker,
        ]);
        roles
    }

    /// The user name in the server's config.
    pub fn user(&self) -> String {
        match self {
            Role::SessionLane => "session-lane".into(),
            Role::Transport(h) => format!("transport-{h}"),
            Role::Broker => "notification-broker".into(),
            Role::Scheduler => "scheduler".into(),
            Role::Admin => "admin".into(),
            Role::Observer => "observer".into(),
            Role::Cli => "cli".into(),
            Role::Revoker => "revoker".into(),
        }
    }

    /// The environment variable of the nats-server process that holds its password.
    pub fn password_var(&self) -> String {
        let name = match self {
            Role::SessionLane => "LANE".to_string(),
            Role::Transport(h) => format!("TRANSPORT_{h}"),
            Role::Broker => "BROKER".into(),
            other => other.user(),
        };
        let name: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect();
        format!("TS_{name}_PASSWORD")
    }

    pub fn account(&self) -> &'static str {
        match self {
            Role::Revoker => SYSTEM_ACCOUNT,
            _ => ACCOUNT,
        }
    }

    /// What this role is for, as the config's comment says it.
    pub fn purpose(&self) -> String {
        match self {
            Role::SessionLane => "the session and runs APIs, lanes, turn dispatch, runs".into(),
            Role::Transport(h) => format!(
                "the transport agent of host {h}: its own commands and command steps, turn \
                 records, its heartbeat, step reports"
            ),
            Role::Broker => "the steps and exec APIs, the execution tree, completion \
                 routing, background agents, and agents' identities (auth callout)"
                .into(),
            Role::Scheduler => "the schedules API, slot claims, runs fired".into(),
            Role::Admin => "`turnstile admin provision`: creates and updates streams and \
                 buckets, and moves an older build's lane items onto the current lane stream; \
                 nothing else"
                .into(),
            Role::Observer => "follows lifecycle events, discovers services and calls the \
                 read-only APIs (list, show, hosts, tree); changes nothing"
                .into(),
            Role::Cli => "the operator's `turnstile` CLI (and the `nats` CLI)".into(),
            Role::Revoker => "the broker's system identity: lists a stopped session's \
                 connections and ends them"
                .into(),
        }
    }

    pub fn grant(&self) -> Grant {
        // A service: the JetStream API on the streams it reads, KV writes, its own subjects.
        let service = |reads: &[&str], own: &[String], subscribe: &[String]| {
            let mut streams: Vec<String> = reads.iter().map(|s| s.to_string()).collect();
            streams.extend(kv_streams());
            Grant {
                publish: jetstream(&streams)
                    .into_iter()
                    .chain(std::iter::once("$KV.>".to_string()))
                    .chain(own.iter().cloned())
                    .collect(),
                publish_deny: Vec::new(),
                subscribe: std::iter::once("_INBOX.>".to_string())
                    .chain(subscribe.iter().cloned())
                    .collect(),
            }
        };
        let op_exec = subj::exec(subj::OPERATOR, "*");
        match self {
            Role::SessionLane => service(
                &[subjects::LANE_STREAM, subjects::COMPLETION_STREAM],
                &[
                    // A stopped session's lane is purged, a lane's done item deleted; a
                    // handed-over completion deleted.
                    format!("$JS.API.STREAM.PURGE.{}", subjects::LANE_STREAM),
                    subjects::lane_item_delete(),
                    // A departed replica's liveness and pin keys are purged, markers and all.
                    format!("$JS.API.STREAM.PURGE.{}", subjects::REPLICAS_KV_STREAM),
                    format!("$JS.API.STREAM.MSG.DELETE.{}", subjects::COMPLETION_STREAM),
                    // A delivery's marker is removed by sequence.
                    format!(
                        "$JS.API.STREAM.MSG.DELETE.{}",
                        subjects::DELIVERIES_KV_STREAM
                    ),
                    "ts.lane.>".into(),
                    subjects::TRANSPORT_ALL.into(),
                    // A turn untaken this long: is its command still stored for its host
                    // (`handoff::lost_command`)?
                    format!("$JS.API.CONSUMER.INFO.{}.*", subjects::TRANSPORT_STREAM),
                    format!("$JS.API.DIRECT.GET.{}", subjects::TRANSPORT_STREAM),
                    subjects::EVENTS_ALL.into(),
                    subjects::DEADLETTER_ALL.into(),
                    op_exec,
                    "ts.control.run.>".into(),
                    // Peers ping each other: no responders means a peer's connection is gone.
                    subjects::REPLICA_PING_ALL.into(),
                ],
                &[
                    format!("{}.>", subj::SESSION_GROUP),
                    format!("{}.>", subj::RUNS_GROUP),
                    "$SRV.>".into(),
                    subjects::session_event("*", "step.>"),
                    "ts.control.run.>".into(),
                    "ts.control.progress.>".into(),
                    subjects::REPLICA_PING_ALL.into(),
                ],
            ),
            Role::Transport(host) => transport(host),
            Role::Broker => {
                let mut g = service(
                    // Its durable queues, and the lanes' consumers (who holds a lane).
                    &[
                        subjects::STEP_STREAM,
                        subjects::EVENTS_STREAM,
                        subjects::LANE_STREAM,
                    ],
                    &[
                        // A stopped target's delivery marker and lane item are removed by
                        // sequence.
                        format!(
                            "$JS.API.STREAM.MSG.DELETE.{}",
                            subjects::DELIVERIES_KV_STREAM
                        ),
                        format!("$JS.API.STREAM.MSG.DELETE.{}", subjects::LANE_STREAM),
                        // A report's end, once recorded by the replica that took the report,
                        // is removed from the ended queue before another replica records it
                        // again.
                        format!("$JS.API.STREAM.MSG.DELETE.{}", subjects::STEP_STREAM),
                        // An ended execution's owned-work entry, and a stopped session's, are
                        // purged by subject.
                        format!("$JS.API.STREAM.PURGE.{}", subjects::OWNED_KV_STREAM),
                        subjects::COMPLETION_ALL.into(),
                        subjects::STEP_ALL.into(),
                        "ts.lane.>".into(),
                        subjects::EVENTS_ALL.into(),
                        subjects::DEADLETTER_ALL.into(),
                        format!("{}.>", subj::SESSION_GROUP),
                        format!("{}.>", subj::RUNS_GROUP),
                        "ts.control.step.>".into(),
                        "ts.control.progress.>".into(),
                        // Answers to auth callouts go to the server's own reply inbox.
                        "$SYS._INBOX.>".into(),
                    ],
                    &[
                        format!("{}.>", subj::STEPS_GROUP),
                        format!("{}.>", subj::EXEC_GROUP),
                        "$SRV.>".into(),
                        subj::AUTH_CALLOUT.into(),
                        subjects::session_event(
                            "*",
                            crate::events::EventKind::SessionStopped.as_str(),
                        ),
                    ]
                    .into_iter()
                    .chain(subjects::arming_events())
                    .collect::<Vec<_>>(),
                );
                g.subscribe.sort();
                g
            }
            Role::Scheduler => service(
                &[],
                &[
                    subjects::EVENTS_ALL.into(),
                    format!("{}.>", subj::RUNS_GROUP),
                ],
                &[
                    format!("{}.>", subj::SCHEDULES_GROUP),
                    "$SRV.>".into(),
                    subjects::ALL_RUN_EVENTS.into(),
                ],
            ),
            Role::Admin => Grant {
                // The lane subjects: provisioning moves the items of an older build's lane
                // stream onto the current one (`lane_migration`).
                publish: owned(&["$JS.API.>", "_INBOX.>", "ts.lane.>"]),
                publish_deny: Vec::new(),
                subscribe: owned(&["_INBOX.>"]),
            },
            Role::Observer => Grant {
                publish: observer_reads(),
                publish_deny: Vec::new(),
                // Replies only to its own inbox: `_INBOX.>` would show it every reply in the
                // account (KV reads of records among them).
                subscribe: vec![
                    subjects::EVENTS_ALL.into(),
                    "$SRV.>".into(),
                    format!("{}.>", subj::inbox(OBSERVER_INBOX)),
                ],
            },
            Role::Cli => service(
                &subjects::ALL_STREAMS,
                &["ts.api.>".into(), "ts.lane.>".into(), "$SRV.>".into()],
                &[subjects::EVENTS_ALL.into()],
            ),
            Role::Revoker => Grant {
                publish: vec![subj::SERVER_CONNZ.into(), subj::server_kick("*")],
                publish_deny: Vec::new(),
                subscribe: owned(&["_INBOX.>"]),
            },
        }
    }
}

/// A transport agent: the JetStream API only for its own host's consumers (so it cannot read
/// another host's commands or step work), stream and bucket info, reads and writes of turn
/// records and its own heartbeat.
fn transport(host: &HostName) -> Grant {
    let mut publish = vec![
        "$JS.API.INFO".to_string(),
        "$JS.API.STREAM.INFO.*".to_string(),
    ];
    for (stream, consumer) in [
        (
            subjects::TRANSPORT_STREAM,
            subjects::transport_consumer(host),
        ),
        (subjects::STEP_STREAM, subjects::step_command_consumer(host)),
    ] {
        publish.extend([
            format!("$JS.API.CONSUMER.CREATE.{stream}.{consumer}"),
            format!("$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>"),
            format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}"),
            format!("$JS.API.CONSUMER.INFO.{stream}.{consumer}"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            format!("$JS.ACK.{stream}.{consumer}.>"),
        ]);
    }
    for bucket in [
        subjects::TURNS_BUCKET,
        subjects::SESSIONS_BUCKET,
        subjects::HOSTS_BUCKET,
    ] {
        publish.push(format!("$JS.API.DIRECT.GET.KV_{bucket}.>"));
        // Reads of a replicated bucket go to its leader (`kv::Bucket::get`).
        publish.push(format!("$JS.API.STREAM.MSG.GET.KV_{bucket}"));
    }
    publish.extend([
        format!("$KV.{}.>", subjects::TURNS_BUCKET),
        // The conversation id a launch learns is kept on the session's record.
        format!("$KV.{}.>", subjects::SESSIONS_BUCKET),
        format!("$KV.{}.{host}", subjects::HOSTS_BUCKET),
        subjects::EVENTS_ALL.to_string(),
        subjects::transport_deadletter(host),
        subj::steps("*", subj::REPORT),
    ]);
    Grant {
        publish,
        publish_deny: Vec::new(),
        subscribe: vec!["_INBOX.>".into(), "ts.control.step.>".into()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_host_has_its_own_user_and_only_its_own_consumers() {
        let a: HostName = "build-a".parse().expect("host");
        let b: HostName = "other".parse().expect("host");
        let roles = Role::all(&[a.clone(), b.clone()]);
        let users: Vec<String> = roles.iter().map(Role::user).collect();
        assert!(users.contains(&"transport-build-a".to_string()));
        assert_eq!(
            Role::Transport(a.clone()).password_var(),
            "TS_TRANSPORT_BUILD_A_PASSWORD"
        );
        let grant = Role::Transport(a).grant();
        let all = grant.publish.join(" ");
        assert!(all.contains("transport_build-a"));
        assert!(!all.contains("transport_other"), "{all}");
        assert!(!grant.publish.iter().any(|p| p == "$JS.API.>"));
    }

    #[test]
    fn the_observer_only_reads() {
        let grant = Role::Observer.grant();
        for p in &grant.publish {
            let read_only = p.ends_with(".list")
                || p.ends_with(".show")
                || p.ends_with(".hosts")
                || p.ends_with(".tree")
                || p == "$SRV.>";
            assert!(read_only, "the observer may publish {p}");
        }
        assert!(!grant
            .publish
            .iter()
            .any(|p| p.starts_with("$JS.") || p.contains('*')));
        assert!(
            !grant.subscribe.iter().any(|s| s == "_INBOX.>"),
            "the observer would see every reply"
        );
    }

    #[test]
    fn no_identity_but_admin_manages_streams() {
        let hosts: Vec<HostName> = vec!["h".parse().expect("host")];
        for role in Role::all(&hosts) {
            let publish = role.grant().publish;
            let wide = publish.iter().any(|p| {
                p == ">"
                    || p == "$JS.API.>"
                    || p.starts_with("$JS.API.STREAM.CREATE")
                    || p.starts_with("$JS.API.STREAM.UPDATE")
                    || p.starts_with("$JS.API.STREAM.DELETE")
            });
            assert_eq!(wide, role == Role::Admin, "{role:?}");
            // Purging is the session-lane's, and only of the lanes and of its replicas' keys,
            // and the broker's of the owned-work notes.
            let purges: Vec<&String> = publish
                .iter()
                .filter(|p| p.starts_with("$JS.API.STREAM.PURGE"))
                .collect();
            match role {
                Role::SessionLane => assert_eq!(
                    purges,
                    [
                        "$JS.API.STREAM.PURGE.TS_LANES",
                        "$JS.API.STREAM.PURGE.KV_ts_replicas"
                    ]
                ),
                Role::Broker => assert_eq!(purges, ["$JS.API.STREAM.PURGE.KV_ts_owned"]),
                Role::Admin => {}
                _ => assert!(purges.is_empty(), "{role:?}: {purges:?}"),
            }
        }
    }
}
