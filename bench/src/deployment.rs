//! The benchmark's nats-server and who connects to it as what: open (every client on the bare
//! URL), or with a deployment's accounts (`--auth`: the config `turnstile admin nats-config`
//! writes, every service on its own user, the broker answering the auth callout, the floor's
//! client on a user of its own), so both can be measured side by side.

use anyhow::Result;
use turnstile_notification_broker::CalloutConfig;
use turnstile_shared::ids::{new_secret, HostName};
use turnstile_shared::permissions::{Grant, Role, ACCOUNT};
use turnstile_shared::server_config::{render_with, ExtraUser, ServerSettings};

/// The benchmark's transport host.
pub const HOST: &str = "bench";
/// The raw JetStream floor's stream and subject (created by the floor's own client).
pub const FLOOR_STREAM: &str = "BENCH_FLOOR";
pub const FLOOR_SUBJECT: &str = "bench.floor";

pub struct Deployment {
    /// The server (or a cluster's nodes), kept running for the whole benchmark.
    _nats: Vec<turnstile_tests::NatsServer>,
    /// Copies of every stream (3 on a cluster).
    pub replicas: usize,
    pub accounts: bool,
    pub lane: String,
    pub transport: String,
    pub broker: String,
    pub callout: Option<CalloutConfig>,
    /// The operator's identity: creates sessions, queues turns, starts steps.
    pub operator: String,
    pub admin: String,
    /// The floor's client: a stream of its own, publish, pull, ack.
    pub floor: String,
    _dir: tempfile::TempDir,
}

impl Deployment {
    pub async fn start(accounts: bool) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        if !accounts {
            let nats = turnstile_tests::NatsServer::start().await?;
            return Ok(Self::open(vec![nats], dir));
        }
        let hosts: Vec<HostName> = vec![HOST.parse()?];
        let floor = ExtraUser {
            user: "bench-floor".into(),
            password_var: "TS_BENCH_FLOOR_PASSWORD".into(),
            purpose: "the benchmark's raw JetStream floor: a stream of its own".into(),
            grant: Grant {
                publish: vec![
                    format!("$JS.API.STREAM.CREATE.{FLOOR_STREAM}"),
                    format!("$JS.API.STREAM.INFO.{FLOOR_STREAM}"),
                    format!("$JS.API.CONSUMER.CREATE.{FLOOR_STREAM}.>"),
                    format!("$JS.API.CONSUMER.MSG.NEXT.{FLOOR_STREAM}.>"),
                    format!("$JS.ACK.{FLOOR_STREAM}.>"),
                    "$JS.API.INFO".into(),
                    FLOOR_SUBJECT.into(),
                ],
                publish_deny: Vec::new(),
                subscribe: vec!["_INBOX.>".into()],
            },
        };
        let settings = ServerSettings {
            name: "turnstile-bench".into(),
            listen: "127.0.0.1:4222".into(),
            http: None,
            cluster: None,
        };
        let config = dir.path().join("nats-server.conf");
        std::fs::write(&config, render_with(&settings, &hosts, &[floor]))?;
        let issuer = nkeys::KeyPair::new_account();
        let mut users: Vec<(String, String)> = Role::all(&hosts)
            .iter()
            .map(|r| (r.user(), r.password_var()))
            .collect();
        users.push(("bench-floor".into(), "TS_BENCH_FLOOR_PASSWORD".into()));
        let passwords: Vec<(String, String, String)> = users
            .into_iter()
            .map(|(user, var)| (user, var, new_secret()))
            .collect();
        let mut env: Vec<(String, String)> = passwords
            .iter()
            .map(|(_, var, pw)| (var.clone(), pw.clone()))
            .collect();
        env.push(("TS_AUTH_ISSUER".into(), issuer.public_key()));
        let pw = |user: &str| -> String {
            passwords
                .iter()
                .find(|(u, _, _)| u == user)
                .map(|(_, _, p)| p.clone())
                .unwrap_or_default()
        };
        let nats = turnstile_tests::NatsServer::start_with_config(
            &config,
            env,
            Some(("cli".into(), pw("cli"))),
            Vec::new(),
        )
        .await?;
        let url = |role: &Role| nats.url_as(&role.user(), &pw(&role.user()));
        let transport = url(&Role::Transport(HOST.parse()?));
        Ok(Self {
            accounts,
            lane: url(&Role::SessionLane),
            transport,
            broker: url(&Role::Broker),
            callout: Some(CalloutConfig {
                issuer_seed: issuer.seed()?,
                account: ACCOUNT.into(),
                ttl: std::time::Duration::from_secs(3600),
                system_url: Some(url(&Role::Revoker)),
            }),
            operator: url(&Role::Cli),
            admin: url(&Role::Admin),
            floor: nats.url_as("bench-floor", &pw("bench-floor")),
            _nats: vec![nats],
            replicas: 1,
            _dir: dir,
        })
    }

    /// An open three-node cluster (see `cluster.rs`); every client connects to the first node.
    pub async fn start_cluster(sync: crate::cluster::Sync) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let nodes = crate::cluster::start(dir.path(), sync).await?;
        Ok(Self::open(nodes, dir))
    }

    /// An open server (or cluster, one copy per node): every client on the first node's bare URL.
    fn open(nodes: Vec<turnstile_tests::NatsServer>, dir: tempfile::TempDir) -> Self {
        let url = nodes.first().map(|n| n.url()).unwrap_or_default();
        Self {
            replicas: nodes.len(),
            _nats: nodes,
            accounts: false,
            lane: url.clone(),
            transport: url.clone(),
            broker: url.clone(),
            callout: None,
            operator: url.clone(),
            admin: url.clone(),
            floor: url,
            _dir: dir,
        }
    }

    /// The (first) nats-server's process id.
    pub fn server_pid(&self) -> Option<u32> {
        self._nats.first().and_then(|n| n.pid())
    }

    pub async fn connect(url: &str) -> Result<async_nats::Client> {
        Ok(turnstile_shared::config::connect_once(url, "turnstile-bench").await?)
    }
}
