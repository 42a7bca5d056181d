//! A whole Turnstile deployment for one test: nats-server, session-lane replicas and transport
//! agents as child processes, plus typed helpers for the API, events and mock transcripts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use futures::StreamExt;
use turnstile_shared::api::ErrorCode;
use turnstile_shared::api::{self, CreateSession, SendTurn, SessionRef, SessionView};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::ids::HostName;
use turnstile_shared::permissions::Role;
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{AgentKind, SessionRecord, TurnRecord};
use turnstile_shared::step_api::{Caller, ExecRef, StartStep, TreeNode};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::{ExecutionId, SessionId, TurnId};
use turnstile_tests::{bin_path, wait_until, NatsServer, ServiceProcess};

pub const API: Duration = Duration::from_secs(10);

pub struct Stack {
    pub nats: NatsServer,
    pub dir: tempfile::TempDir,
    pub lanes: HashMap<String, ServiceProcess>,
    pub transports: HashMap<String, ServiceProcess>,
    pub brokers: HashMap<String, ServiceProcess>,
    pub schedulers: HashMap<String, ServiceProcess>,
    /// Each service's `--http` port (health and metrics), by its log name (`lane-a`,
    /// `transport-h1`, `broker-b1`, `scheduler-s1`).
    pub http: HashMap<String, u16>,
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    overrides: Vec<(String, String)>,
    /// With the shipped server config: each role's password (services, admin, cli).
    passwords: HashMap<String, String>,
    /// A TLS stack's certificates, removed with the stack.
    certs: Option<tempfile::TempDir>,
    /// A deployed stack's auth callout issuer seed (the broker signs agents' identities).
    issuer_seed: Option<(tempfile::TempDir, PathBuf)>,
}

/// The hosts of the shipped `deploy/nats-server.conf` (`turnstile admin nats-config --host
/// host-a --host host-b`).
pub const SHIPPED_HOSTS: [&str; 2] = ["host-a", "host-b"];

/// The hosts every generated test config has users for (tests start more later).
const TEST_HOSTS: [&str; 3] = ["h1", "h2", "h3"];

/// Which server configuration a stack runs.
enum ServerConfig {
    /// The shipped `deploy/nats-server.conf`.
    Shipped,
    /// `turnstile admin nats-config` for these hosts.
    Generated(Vec<String>),
}

impl Stack {
    /// nats-server, the given session-lane replicas and transport hosts.
    pub async fn start(replicas: &[&str], hosts: &[&str]) -> Result<Stack> {
        Self::start_with(replicas, hosts, &[]).await
    }

    /// Like [`Stack::start`], with environment overrides for every service (e.g. timings).
    pub async fn start_with(
        replicas: &[&str],
        hosts: &[&str],
        overrides: &[(&str, &str)],
    ) -> Result<Stack> {
        let mut all: Vec<String> = TEST_HOSTS.iter().map(|h| h.to_string()).collect();
        for h in hosts {
            if !all.iter().any(|a| a == h) {
                all.push(h.to_string());
            }
        }
        let mut stack =
            Self::with_identities(ServerConfig::Generated(all), overrides, None).await?;
        stack.deploy(replicas, hosts).await?;
        Ok(stack)
    }

    /// Like [`Stack::start`], on a nats-server running the shipped `deploy/nats-server.conf`
    /// (its hosts are [`SHIPPED_HOSTS`]).
    pub async fn start_deployed(replicas: &[&str], hosts: &[&str]) -> Result<Stack> {
        let mut stack = Self::with_identities(ServerConfig::Shipped, &[], None).await?;
        stack.deploy(replicas, hosts).await?;
        Ok(stack)
    }

    /// A nats-server with a deployment's identities, nothing provisioned or started: every
    /// service, the provisioning and the test's own client (the `cli` user) connect as their
    /// own users with the permissions `shared/src/permissions.rs` gives them; agents get
    /// identities from the broker's auth callout, which signs with a key made here as an
    /// operator makes it.
    /// With `tls`, the server also requires TLS and verifies clients (its `tls` block is added
    /// to the generated config) and every client connects with the test's certificates.
    async fn with_identities(
        config: ServerConfig,
        overrides: &[(&str, &str)],
        tls: Option<&crate::tls::Files>,
    ) -> Result<Stack> {
        let keys = tempfile::Builder::new().prefix("ts-keys-").tempdir()?;
        let turnstile = |args: &[&str]| -> Result<String> {
            let out = std::process::Command::new(bin_path("turnstile")?)
                .args(args)
                .output()
                .with_context(|| format!("run turnstile {args:?}"))?;
            ensure!(
                out.status.success(),
                "turnstile {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(String::from_utf8(out.stdout)?)
        };
        let seed = keys.path().join("issuer.nk");
        let issuer = turnstile(&["admin", "issuer", "--seed-file", &seed.to_string_lossy()])?;
        let (path, hosts) = match config {
            ServerConfig::Shipped => (
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nats-server.conf"),
                SHIPPED_HOSTS.iter().map(|h| h.to_string()).collect(),
            ),
            ServerConfig::Generated(hosts) => {
                let mut args = vec!["admin", "nats-config", "--http", "none"];
                for h in &hosts {
                    args.extend(["--host", h.as_str()]);
                }
                let path = keys.path().join("nats-server.conf");
                let mut text = turnstile(&args)?;
                if let Some(files) = tls {
                    text.push_str(&crate::tls::server_config(files));
                }
                std::fs::write(&path, text)?;
                (path, hosts)
            }
        };
        let hosts: Vec<HostName> = hosts.iter().map(|h| h.parse()).collect::<Result<_, _>>()?;
        let roles = Role::all(&hosts);
        let passwords: HashMap<String, String> = roles
            .iter()
            .map(|r| (r.user(), turnstile_shared::ids::new_secret()))
            .collect();
        let mut env: Vec<(String, String)> = roles
            .iter()
            .map(|r| (r.password_var(), passwords[&r.user()].clone()))
            .collect();
        env.push(("TS_AUTH_ISSUER".to_string(), issuer.trim().to_string()));
        let cli = Some(("cli".to_string(), passwords["cli"].clone()));
        let client_tls = tls.map(crate::tls::Files::client_env).unwrap_or_default();
        let nats = NatsServer::start_with_config(&path, env, cli, client_tls).await?;
        let mut stack = Self::assemble(nats, overrides, passwords).await?;
        stack.issuer_seed = Some((keys, seed));
        Ok(stack)
    }

    /// What a deployment does on a fresh server: provision, start the session-lane replicas,
    /// the transport hosts, one broker and one scheduler, and wait until they all serve.
    async fn deploy(&mut self, replicas: &[&str], hosts: &[&str]) -> Result<()> {
        self.provision().await?;
        for r in replicas {
            self.spawn_lane(r)?;
        }
        for h in hosts {
            self.spawn_transport(h)?;
        }
        self.spawn_broker("b1")?;
        self.spawn_scheduler("s1")?;
        if let Err(e) = self.wait_serving(!replicas.is_empty()).await {
            bail!("{e:#}\n{}", self.logs());
        }
        Ok(())
    }

    /// A turn whose agent starts a step with its own tools, run to its end, and the step's
    /// result handed back in a delivery turn: the whole path through every service.
    pub async fn turn_with_a_step_handed_back(&self, session: &SessionId) -> Result<()> {
        let turn = self
            .send(session, "start the build\n!step build 300ms\n!sleep 1s")
            .await?;
        let rec = self.wait_turn(&turn, Duration::from_secs(30)).await?;
        anyhow::ensure!(
            matches!(
                rec.state,
                turnstile_shared::records::TurnState::Completed { .. }
            ),
            "turn: {:?}",
            rec.state
        );
        let deliveries = wait_deliveries(self, session, 1, Duration::from_secs(30)).await?;
        anyhow::ensure!(
            deliveries.iter().any(|d| matches!(
                d.state,
                turnstile_shared::records::TurnState::Completed { .. }
            ) && d.text.contains("build")),
            "the step's result was not handed over: {deliveries:?}"
        );
        Ok(())
    }

    /// A nats-server with the test identities and nothing else: not provisioned, no service
    /// started.
    pub async fn bare(overrides: &[(&str, &str)]) -> Result<Stack> {
        let hosts = TEST_HOSTS.iter().map(|h| h.to_string()).collect();
        Self::with_identities(ServerConfig::Generated(hosts), overrides, None).await
    }

    async fn assemble(
        nats: NatsServer,
        overrides: &[(&str, &str)],
        passwords: HashMap<String, String>,
    ) -> Result<Stack> {
        turnstile_tests::init_tracing();
        let client = nats.client().await?;
        let js = async_nats::jetstream::new(client.clone());
        Ok(Stack {
            nats,
            dir: tempfile::Builder::new().prefix("ts-it-").tempdir()?,
            lanes: HashMap::new(),
            transports: HashMap::new(),
            brokers: HashMap::new(),
            schedulers: HashMap::new(),
            http: HashMap::new(),
            client,
            js,
            overrides: overrides
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            passwords,
            certs: None,
            issuer_seed: None,
        })
    }

    /// Like [`Stack::start`], on a nats-server that requires TLS and verifies clients, with a
    /// CA, server and client certificates made for this test (`openssl`). Every service, the
    /// provisioning, the agents' tools and the test's client connect with `TURNSTILE_TLS_*`.
    pub async fn start_tls(replicas: &[&str], hosts: &[&str]) -> Result<Stack> {
        let certs = tempfile::Builder::new().prefix("ts-tls-").tempdir()?;
        let files = crate::tls::make_certificates(certs.path())?;
        let tls = files.client_env();
        let overrides: Vec<(&str, &str)> = tls.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let all = TEST_HOSTS.iter().map(|h| h.to_string()).collect();
        let mut stack =
            Self::with_identities(ServerConfig::Generated(all), &overrides, Some(&files)).await?;
        stack.certs = Some(certs);
        stack.deploy(replicas, hosts).await?;
        Ok(stack)
    }

    /// A client on `role`'s own user of the shipped config, and the server errors it receives
    /// (where a permission refusal shows).
    pub async fn connect_as(
        &self,
        role: &str,
    ) -> Result<(
        async_nats::Client,
        tokio::sync::mpsc::UnboundedReceiver<String>,
    )> {
        let pw = self
            .passwords
            .get(role)
            .with_context(|| format!("no user {role} in this stack"))?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let client = async_nats::ConnectOptions::with_user_and_password(role.into(), pw.clone())
            .event_callback(move |event| {
                let tx = tx.clone();
                async move {
                    if let async_nats::Event::ServerError(e) = event {
                        let _ = tx.send(e.to_string());
                    }
                }
            })
            .connect(self.nats.url())
            .await
            .with_context(|| format!("connect as {role}"))?;
        Ok((client, rx))
    }

    /// JetStream as `role` (e.g. to put a forged message where only that service may).
    pub async fn js_as(&self, role: &str) -> Result<async_nats::jetstream::Context> {
        let (client, _) = self.connect_as(role).await?;
        Ok(async_nats::jetstream::new(client))
    }

    /// The operator's URL (the `cli` user), for a worker or a tool run by the test.
    pub fn operator_url(&self) -> String {
        match self.passwords.get("cli") {
            Some(pw) => self.nats.url_as("cli", pw),
            None => self.nats.url(),
        }
    }

    /// `role`'s password in a stack on the shipped config.
    pub fn password(&self, role: &str) -> Result<String> {
        self.passwords
            .get(role)
            .cloned()
            .with_context(|| format!("no user {role} in this stack"))
    }

    /// The CA file of a TLS stack.
    pub fn tls_ca(&self) -> Option<String> {
        self.certs
            .as_ref()
            .map(|d| d.path().join("ca.pem").to_string_lossy().into_owned())
    }

    /// The services' environment with `role`'s own NATS identity, when the stack has them.
    pub fn env_as(&self, role: &str) -> Vec<(String, String)> {
        let mut env = self.env();
        if let Some(pw) = self.passwords.get(role) {
            for (k, v) in env.iter_mut() {
                if k == "TURNSTILE_NATS_URL" {
                    *v = self.nats.url_as(role, pw);
                }
            }
        }
        // The broker answers the auth callout and ends stopped sessions' connections.
        if let (Some((_, seed)), "notification-broker") = (&self.issuer_seed, role) {
            env.push((
                "TURNSTILE_AUTH_ISSUER_SEED_FILE".into(),
                seed.to_string_lossy().into_owned(),
            ));
            if let Some(pw) = self.passwords.get("revoker") {
                env.push((
                    "TURNSTILE_SYSTEM_NATS_URL".into(),
                    self.nats.url_as("revoker", pw),
                ));
            }
        }
        env
    }

    /// The deployment's provisioning step, as an operator runs it: `turnstile admin provision`
    /// with the same timings as the services (the hosts bucket's TTL is the host TTL).
    pub async fn provision(&self) -> Result<()> {
        let out = tokio::process::Command::new(bin_path("turnstile")?)
            .args(["admin", "provision"])
            .envs(self.env_as("admin"))
            .output()
            .await
            .context("run turnstile admin provision")?;
        ensure!(
            out.status.success(),
            "turnstile admin provision failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Waits (bounded) until every service's API answers, so a test's first call does not
    /// race a service still starting (any reply counts, an error reply too).
    pub async fn wait_serving(&self, lanes: bool) -> Result<()> {
        let mut apis = vec![
            subj::SCHEDULES_LIST.to_string(),
            Principal::Operator.exec(subj::TREE),
        ];
        if lanes {
            apis.push(subj::SESSION_LIST.to_string());
        }
        for subject in &apis {
            wait_until(
                &format!("{subject} to answer"),
                Duration::from_secs(30),
                || async move {
                    let r: Result<serde_json::Value, api::ApiError> =
                        api::call(&self.client, subject, &serde_json::json!({}), API).await;
                    Ok(match r {
                        Err(e) if e.code.is_transient() => None,
                        _ => Some(()),
                    })
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Short timings so fail-over takes seconds in tests (production defaults are 30 s).
    fn env(&self) -> Vec<(String, String)> {
        [
            ("TURNSTILE_NATS_URL", self.nats.url()),
            ("TURNSTILE_LANE_ACK_WAIT", "2s".to_string()),
            ("TURNSTILE_LANE_PIN_TTL", "2s".to_string()),
            ("TURNSTILE_TRANSPORT_ACK_WAIT", "2s".to_string()),
            ("TURNSTILE_HOST_TTL", "3s".to_string()),
            ("RUST_LOG", "info,async_nats=warn".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .filter(|(k, _)| !self.overrides.iter().any(|(o, _)| o == k))
        .chain(self.overrides.iter().cloned())
        .collect()
    }

    /// `args` plus `--http 127.0.0.1:<a free port>`, the port remembered under `name`.
    fn with_http(&mut self, name: &str, mut args: Vec<String>) -> Result<Vec<String>> {
        let port = turnstile_tests::free_port()?;
        self.http.insert(name.to_string(), port);
        args.extend(["--http".to_string(), format!("127.0.0.1:{port}")]);
        Ok(args)
    }

    pub fn spawn_lane(&mut self, replica: &str) -> Result<()> {
        let args = self.with_http(
            &format!("lane-{replica}"),
            vec!["--replica".to_string(), replica.to_string()],
        )?;
        let p = ServiceProcess::spawn_in(
            self.dir.path(),
            "turnstile-session-lane",
            &args,
            &self.env_as("session-lane"),
            &format!("lane-{replica}"),
        )?;
        self.lanes.insert(replica.to_string(), p);
        Ok(())
    }

    pub fn spawn_broker(&mut self, replica: &str) -> Result<()> {
        let args = self.with_http(
            &format!("broker-{replica}"),
            vec!["--replica".to_string(), replica.to_string()],
        )?;
        let p = ServiceProcess::spawn_in(
            self.dir.path(),
            "turnstile-notification-broker",
            &args,
            &self.env_as("notification-broker"),
            &format!("broker-{replica}"),
        )?;
        self.brokers.insert(replica.to_string(), p);
        Ok(())
    }

    pub fn spawn_scheduler(&mut self, replica: &str) -> Result<()> {
        let args = self.with_http(
            &format!("scheduler-{replica}"),
            vec!["--replica".to_string(), replica.to_string()],
        )?;
        let p = ServiceProcess::spawn_in(
            self.dir.path(),
            "turnstile-scheduler",
            &args,
            &self.env_as("scheduler"),
            &format!("scheduler-{replica}"),
        )?;
        self.schedulers.insert(replica.to_string(), p);
        Ok(())
    }

    pub fn spawn_transport(&mut self, host: &str) -> Result<()> {
        let data = self.dir.path().join(format!("host-{host}"));
        let args = vec![
            "--host".to_string(),
            host.to_string(),
            "--data-dir".to_string(),
            data.to_string_lossy().into_owned(),
            "--mock-state-dir".to_string(),
            self.mock_dir().to_string_lossy().into_owned(),
            "--agent-bin".to_string(),
            self.override_of("TURNSTILE_AGENT_BIN")
                .map_or_else(|| bin_path("turnstile"), |b| Ok(PathBuf::from(b)))?
                .to_string_lossy()
                .into_owned(),
            "--ready-timeout".to_string(),
            "20s".to_string(),
            "--claude-bin".to_string(),
            self.override_of("TURNSTILE_CLAUDE_BIN")
                .map(PathBuf::from)
                .or_else(|| turnstile_tests::agent_cli("claude").ok())
                .unwrap_or_else(|| PathBuf::from("claude"))
                .to_string_lossy()
                .into_owned(),
            "--codex-bin".to_string(),
            self.override_of("TURNSTILE_CODEX_BIN")
                .map(PathBuf::from)
                .or_else(|| turnstile_tests::agent_cli("codex").ok())
                .unwrap_or_else(|| PathBuf::from("codex"))
                .to_string_lossy()
                .into_owned(),
        ];
        let args = self.with_http(&format!("transport-{host}"), args)?;
        let p = ServiceProcess::spawn_in(
            self.dir.path(),
            "turnstile-transport-agent",
            &args,
            &self.env_as(&Role::Transport(host.parse()?).user()),
            &format!("transport-{host}"),
        )?;
        self.transports.insert(host.to_string(), p);
        Ok(())
    }

    /// The value a test gave `name` among the services' environment overrides.
    fn override_of(&self, name: &str) -> Option<String> {
        self.overrides
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }

    pub fn mock_dir(&self) -> PathBuf {
        self.dir.path().join("mock-agent")
    }

    /// The tail of every service's log, for a failing test's report.
    pub fn logs(&self) -> String {
        let mut out = format!("--- nats-server\n{}\n", self.nats.log_tail(20));
        for (name, p) in self
            .lanes
            .iter()
            .chain(self.transports.iter())
            .chain(self.brokers.iter())
            .chain(self.schedulers.iter())
        {
            out.push_str(&format!("--- {name}\n{}\n", p.log_tail(40)));
        }
        out
    }

    /// Creates a mock-agent session, waiting for a transport host to heartbeat first.
    pub async fn create_session(&self, name: &str, host: Option<&str>) -> Result<SessionId> {
        self.create_session_of(AgentKind::Mock, name, host).await
    }

    pub async fn create_session_of(
        &self,
        agent: AgentKind,
        name: &str,
        host: Option<&str>,
    ) -> Result<SessionId> {
        let req = CreateSession {
            agent,
            name: name.to_string(),
            host: host.map(|h| h.parse()).transpose()?,
            cwd: None,
            id: None,
            launch: None,
            ready_timeout_ms: None,
            policy: None,
        };
        self.create_session_with(req).await
    }

    /// Creates a session as `req` says, waiting for a transport host to heartbeat first.
    pub async fn create_session_with(&self, req: CreateSession) -> Result<SessionId> {
        let rec: SessionRecord = wait_until("session create", Duration::from_secs(20), || {
            let req = req.clone();
            async move {
                match api::call::<_, SessionRecord>(&self.client, subj::SESSION_CREATE, &req, API)
                    .await
                {
                    Ok(r) => Ok(Some(r)),
                    Err(e) if e.code == ErrorCode::NoHost || e.code.is_transient() => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
        })
        .await?;
        Ok(rec.id)
    }

    pub async fn send(&self, session: &SessionId, text: &str) -> Result<TurnId> {
        let req = SendTurn {
            session: session.clone(),
            text: text.to_string(),
            turn: None,
        };
        let rec: TurnRecord = api::call(&self.client, subj::SESSION_SEND, &req, API).await?;
        Ok(rec.id)
    }

    /// Sends each text in order, returning the turn ids.
    pub async fn send_all<S: AsRef<str>>(
        &self,
        session: &SessionId,
        texts: &[S],
    ) -> Result<Vec<TurnId>> {
        let mut turns = Vec::with_capacity(texts.len());
        for t in texts {
            turns.push(self.send(session, t.as_ref()).await?);
        }
        Ok(turns)
    }

    /// Waits until a transport has recorded the turn as being typed.
    pub async fn wait_running(&self, turn: &TurnId) -> Result<TurnRecord> {
        self.wait_turn_state(turn, Duration::from_secs(20), |r| {
            matches!(
                r.state,
                turnstile_shared::records::TurnState::Running { .. }
            )
        })
        .await
    }

    pub async fn show(&self, session: &SessionId) -> Result<SessionView> {
        Ok(api::call(
            &self.client,
            subj::SESSION_SHOW,
            &SessionRef {
                session: session.clone(),
            },
            API,
        )
        .await?)
    }

    /// Waits until the session's lane holds nothing: no item in flight, none queued. The lane
    /// acks its item a moment after the turn's or run's record ends, so a check made right
    /// after that record can still see the item held.
    pub async fn wait_idle(&self, session: &SessionId) -> Result<SessionView> {
        turnstile_tests::wait_until("the lane to go idle", Duration::from_secs(20), || async {
            let v = self.show(session).await?;
            Ok((!v.busy && v.queued == 0).then_some(v))
        })
        .await
    }

    /// The stream sequences of every item stored on the session's lane (in flight, queued, or
    /// done and not removed yet), oldest first.
    pub async fn lane_items(&self, session: &SessionId) -> Result<Vec<u64>> {
        use async_nats::jetstream::stream::DirectGetErrorKind;
        let lanes = self.js.get_stream_no_info(subjects::LANE_STREAM).await?;
        let subject = subjects::lane(session);
        let mut seqs = Vec::new();
        loop {
            let from = seqs.last().map_or(1, |s| s + 1);
            match lanes
                .direct_get_next_for_subject(subject.as_str(), Some(from))
                .await
            {
                Ok(m) => seqs.push(m.sequence),
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(seqs),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits until nothing of the session's lane is stored any more: every item done with is
    /// removed (its lane removes it a moment after acking it).
    pub async fn wait_lane_emptied(&self, session: &SessionId) -> Result<()> {
        wait_until(
            "the lane's items to be removed",
            Duration::from_secs(20),
            || async { Ok(self.lane_items(session).await?.is_empty().then_some(())) },
        )
        .await
    }

    pub async fn turn(&self, turn: &TurnId) -> Result<Option<TurnRecord>> {
        let kv = self.js.get_key_value(subjects::TURNS_BUCKET).await?;
        match kv.get(turn.as_str()).await? {
            Some(b) => Ok(Some(serde_json::from_slice(&b)?)),
            None => Ok(None),
        }
    }

    /// Waits (event-driven, on the turn's KV key) for the turn to end.
    pub async fn wait_turn(&self, turn: &TurnId, timeout: Duration) -> Result<TurnRecord> {
        let kv = self.js.get_key_value(subjects::TURNS_BUCKET).await?;
        let mut watch = kv.watch_with_history(turn.as_str()).await?;
        let found = tokio::time::timeout(timeout, async {
            while let Some(entry) = watch.next().await {
                let entry = entry?;
                if let Ok(r) = serde_json::from_slice::<TurnRecord>(&entry.value) {
                    if r.state.is_terminal() {
                        return Ok::<_, anyhow::Error>(r);
                    }
                }
            }
            bail!("watch of turn {turn} ended")
        })
        .await;
        match found {
            Ok(r) => r,
            Err(_) => bail!(
                "turn {turn} did not end within {timeout:?}; now {:?}",
                self.turn(turn).await.ok().flatten().map(|r| r.state)
            ),
        }
    }

    /// Sends a transport turn command as the lane sends it (under the lane's identity), and
    /// waits for its store.
    pub async fn send_command(
        &self,
        host: &HostName,
        command: &turnstile_shared::records::TurnCommand,
    ) -> Result<()> {
        self.js_as("session-lane")
            .await?
            .publish(
                subjects::transport(host, "turn"),
                command.envelope()?.encode()?,
            )
            .await?
            .await?;
        Ok(())
    }

    /// SIGKILLs a session-lane replica and reaps it.
    pub async fn kill_lane(&mut self, replica: &str) -> Result<()> {
        self.lanes
            .get_mut(replica)
            .with_context(|| format!("replica {replica}"))?
            .kill()
            .await
    }

    /// Everything a session-lane replica has logged so far.
    pub fn lane_log(&self, replica: &str) -> Result<String> {
        let p = self
            .lanes
            .get(replica)
            .with_context(|| format!("replica {replica}"))?;
        Ok(std::fs::read_to_string(p.log_path())?)
    }

    /// Freezes (SIGSTOP) a session-lane replica where it stands: it keeps its connection and
    /// whatever it was handed, and acts on nothing. Returns its pid, to kill or resume it.
    pub fn freeze_lane(&self, replica: &str) -> Result<u32> {
        let pid = self.lanes.get(replica).and_then(|p| p.pid());
        freeze(pid, &format!("replica {replica}"))
    }

    /// Freezes (SIGSTOP) a broker replica where it stands, as [`Stack::freeze_lane`] does a
    /// lane replica. Returns its pid.
    pub fn freeze_broker(&self, replica: &str) -> Result<u32> {
        let pid = self.brokers.get(replica).and_then(|p| p.pid());
        freeze(pid, &format!("broker {replica}"))
    }

    /// Waits until every end on the ended queue is taken and acked, one way or the other.
    pub async fn wait_ended_drained(&self) -> Result<()> {
        let steps = self.js.get_stream(subjects::STEP_STREAM).await?;
        turnstile_tests::wait_until("the ended queue drained", Duration::from_secs(20), || {
            let steps = steps.clone();
            async move {
                let info = steps.consumer_info(subjects::BROKER_ENDED_CONSUMER).await?;
                Ok((info.num_pending == 0 && info.num_ack_pending == 0).then_some(()))
            }
        })
        .await
    }

    /// Waits until the host's transport has handled (acked) every command it was sent.
    pub async fn wait_commands_handled(&self, host: &HostName) -> Result<()> {
        let transport = self.js.get_stream(subjects::TRANSPORT_STREAM).await?;
        turnstile_tests::wait_until(
            "the transport's commands handled",
            Duration::from_secs(20),
            || async {
                let info = transport
                    .consumer_info(subjects::transport_consumer(host))
                    .await?;
                Ok((info.num_pending == 0 && info.num_ack_pending == 0).then_some(()))
            },
        )
        .await
    }

    pub async fn wait_turn_state(
        &self,
        turn: &TurnId,
        timeout: Duration,
        pred: impl Fn(&TurnRecord) -> bool,
    ) -> Result<TurnRecord> {
        let kv = self.js.get_key_value(subjects::TURNS_BUCKET).await?;
        let mut watch = kv.watch_with_history(turn.as_str()).await?;
        tokio::time::timeout(timeout, async {
            while let Some(entry) = watch.next().await {
                if let Ok(r) = serde_json::from_slice::<TurnRecord>(&entry?.value) {
                    if pred(&r) {
                        return Ok(r);
                    }
                }
            }
            bail!("watch of turn {turn} ended")
        })
        .await
        .with_context(|| format!("turn {turn} never reached the awaited state"))?
    }

    /// Every event kept so far, in stream order.
    pub async fn events(&self) -> Result<Vec<Envelope>> {
        self.stored_events()
            .await?
            .iter()
            .map(|(_, payload)| Ok(Envelope::decode(payload)?))
            .collect()
    }

    /// Every event stored in `TS_EVENTS`, as (subject, payload), oldest first.
    pub async fn stored_events(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let stream = self.js.get_stream(subjects::EVENTS_STREAM).await?;
        let mut out = Vec::new();
        let mut seq = 0;
        loop {
            match stream
                .direct_get_next_for_subject(subjects::EVENTS_ALL, Some(seq + 1))
                .await
            {
                Ok(m) => {
                    seq = m.sequence;
                    out.push((m.subject.to_string(), m.payload.to_vec()));
                }
                Err(e)
                    if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound =>
                {
                    return Ok(out)
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The messages a session's mock agent received, from its transcript file.
    pub async fn transcript(&self, session: &SessionId) -> Result<Vec<String>> {
        let kv = self.js.get_key_value(subjects::SESSIONS_BUCKET).await?;
        let rec: SessionRecord = serde_json::from_slice(
            &kv.get(session.as_str())
                .await?
                .with_context(|| format!("no session {session}"))?,
        )?;
        let conv = rec
            .conversation
            .with_context(|| format!("session {session} has no conversation id yet"))?;
        let text = std::fs::read_to_string(self.mock_dir().join(format!("{conv}.jsonl")))?;
        text.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l)?;
                Ok(v["message"].as_str().unwrap_or_default().to_string())
            })
            .collect()
    }
}

impl Drop for Stack {
    /// Agents outlive their transport by design (re-adoption); a finished test ends them.
    fn drop(&mut self) {
        // Transports first: a live one could relaunch an agent into a fresh tmux server right
        // after the server below is killed, and leak it.
        for p in self.transports.values() {
            if let Some(pid) = p
                .pid()
                .and_then(|p| i32::try_from(p).ok())
                .filter(|p| *p > 1)
            {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
        for host in self.transports.keys() {
            let sock = self
                .dir
                .path()
                .join(format!("host-{host}"))
                .join("tmux.sock");
            let _ = std::process::Command::new("tmux")
                .arg("-S")
                .arg(sock)
                .arg("kill-server")
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// Passes a scenario's result through, printing every service's log tail if it failed.
pub fn report(stack: &Stack, r: Result<()>) -> Result<()> {
    // Every service runs on its least-privilege identity: a permission the server refused one
    // of them fails the test, whatever else it checked (a stale permission table).
    let r = r.and_then(|()| {
        let refused = stack.service_refusals();
        ensure!(
            refused.is_empty(),
            "the server refused a service a permission:\n{}",
            refused.join("\n")
        );
        // Every event the test made is one docs/asyncapi.yaml describes.
        crate::asyncapi::check_stack(stack)
    });
    if r.is_err() {
        eprintln!("{}", stack.logs());
    }
    r
}

impl Stack {
    /// The server's permission violations by a service's connection (named by the service;
    /// tests' own probes connect unnamed or as `test-…`).
    pub fn service_refusals(&self) -> Vec<String> {
        self.nats
            .log_tail(1_000_000)
            .lines()
            .filter(|l| {
                l.contains("Violation") && l.contains(":rust:") && !l.contains(":rust:test-")
            })
            .map(str::to_string)
            .collect()
    }
}

/// Counts how often each message appears in a transcript.
pub fn count(transcript: &[String], message: &str) -> usize {
    transcript.iter().filter(|m| m.as_str() == message).count()
}

impl Stack {
    /// Every turn ends `completed`.
    pub async fn all_complete(&self, turns: &[TurnId]) -> Result<()> {
        self.all_complete_within(turns, Duration::from_secs(60))
            .await
    }

    /// Every turn completes, each within `timeout` (a bound that tells a fast path from a
    /// timeout's fallback).
    pub async fn all_complete_within(&self, turns: &[TurnId], timeout: Duration) -> Result<()> {
        for t in turns {
            let rec = self.wait_turn(t, timeout).await?;
            anyhow::ensure!(
                matches!(
                    rec.state,
                    turnstile_shared::records::TurnState::Completed { .. }
                ),
                "{t}: {:?}",
                rec.state
            );
        }
        Ok(())
    }

    /// R14 as the agent sees it: each message reached the agent exactly once, nothing else did.
    pub async fn typed_exactly_once<S: AsRef<str>>(
        &self,
        session: &SessionId,
        texts: &[S],
    ) -> Result<()> {
        let transcript = self.transcript(session).await?;
        for t in texts {
            let t = t.as_ref();
            anyhow::ensure!(
                count(&transcript, t) == 1,
                "{t:?} not exactly once in {transcript:?}"
            );
        }
        anyhow::ensure!(
            transcript.len() == texts.len(),
            "unexpected messages in {transcript:?}"
        );
        Ok(())
    }
}

/// R1: per session, `turn.started`/`turn.completed|failed` strictly alternate for the same turn
/// (no two turns' intervals overlap); returns the turns in the order they started.
pub fn serial_turns(events: &[Envelope], session: &SessionId) -> Result<Vec<TurnId>> {
    let mut order = Vec::new();
    let mut open: Option<(TurnId, chrono::DateTime<chrono::Utc>)> = None;
    for e in events
        .iter()
        .filter(|e| e.session.as_ref() == Some(session))
    {
        match e.kind.as_str() {
            "turn.started" => {
                let t = e.turn.clone().context("turn.started without turn")?;
                if let Some((o, _)) = &open {
                    bail!("turn {t} started while {o} was still in flight");
                }
                open = Some((t.clone(), e.at));
                order.push(t);
            }
            "turn.completed" | "turn.failed" => {
                let t = e.turn.clone().context("turn end without turn")?;
                match open.take() {
                    Some((o, started)) if o == t => {
                        if e.at < started {
                            bail!("turn {t} ended before it started");
                        }
                    }
                    Some((o, _)) => bail!("turn {t} ended while {o} was the one in flight"),
                    // Ended without starting here: only the stop path ends queued turns.
                    None if e.kind == "turn.failed" => {}
                    None => bail!("turn {t} completed without having started"),
                }
            }
            _ => {}
        }
    }
    Ok(order)
}

/// The execution registry and the broker's APIs, as tests see them.
impl Stack {
    pub async fn session_record(&self, session: &SessionId) -> Result<SessionRecord> {
        let kv = self.js.get_key_value(subjects::SESSIONS_BUCKET).await?;
        Ok(serde_json::from_slice(
            &kv.get(session.as_str())
                .await?
                .with_context(|| format!("no session {session}"))?,
        )?)
    }

    /// The credentials the session's agent was launched with.
    pub async fn caller(&self, session: &SessionId) -> Result<Caller> {
        Ok(Caller {
            session: Some(session.clone()),
            step: None,
            token: self.session_record(session).await?.token,
        })
    }

    pub async fn exec(&self, id: &ExecutionId) -> Result<Option<ExecutionRecord>> {
        let kv = self.js.get_key_value(subjects::EXECUTIONS_BUCKET).await?;
        match kv.get(id.as_str()).await? {
            Some(b) => Ok(Some(serde_json::from_slice(&b)?)),
            None => Ok(None),
        }
    }

    /// Waits (on the record's KV key) until the execution satisfies `pred`.
    pub async fn wait_exec(
        &self,
        id: &ExecutionId,
        timeout: Duration,
        pred: impl Fn(&ExecutionRecord) -> bool,
    ) -> Result<ExecutionRecord> {
        let kv = self.js.get_key_value(subjects::EXECUTIONS_BUCKET).await?;
        let mut watch = kv.watch_with_history(id.as_str()).await?;
        let found = tokio::time::timeout(timeout, async {
            while let Some(entry) = watch.next().await {
                if let Ok(r) = serde_json::from_slice::<ExecutionRecord>(&entry?.value) {
                    if pred(&r) {
                        return Ok(r);
                    }
                }
            }
            bail!("watch of execution {id} ended")
        })
        .await;
        match found {
            Ok(r) => r,
            Err(_) => bail!(
                "execution {id} never reached the awaited state; now {:?}",
                self.exec(id).await.ok().flatten().map(|r| r.status)
            ),
        }
    }

    pub async fn tree(&self, id: &ExecutionId) -> Result<TreeNode> {
        Ok(api::call(
            &self.client,
            &Principal::Operator.exec(subj::TREE),
            &ExecRef { id: id.clone() },
            API,
        )
        .await?)
    }

    pub async fn start_step(&self, req: &StartStep) -> Result<ExecutionRecord, api::ApiError> {
        let subject = Principal::of(&req.caller).steps(subj::START);
        api::call(&self.client, &subject, req, API).await
    }

    /// Makes `stream` refuse every write of more than 64 bytes (as a store refusing writes
    /// does); returns its configuration for [`Stack::restore_stream`].
    pub async fn refuse_writes(
        &self,
        stream: &str,
    ) -> Result<async_nats::jetstream::stream::Config> {
        let admin = self.js_as("admin").await?;
        let config = admin.get_stream(stream).await?.info().await?.config.clone();
        admin
            .update_stream(async_nats::jetstream::stream::Config {
                max_message_size: 64,
                ..config.clone()
            })
            .await?;
        Ok(config)
    }

    /// Puts a stream's configuration back (after [`Stack::refuse_writes`]).
    pub async fn restore_stream(
        &self,
        config: async_nats::jetstream::stream::Config,
    ) -> Result<()> {
        self.js_as("admin").await?.update_stream(config).await?;
        Ok(())
    }

    /// `turnstile cancel ID`, as the operator.
    pub async fn cancel(&self, id: &ExecutionId) -> Result<serde_json::Value, api::ApiError> {
        let subject = subj::exec(subj::OPERATOR, subj::CANCEL);
        api::call(&self.client, &subject, &ExecRef { id: id.clone() }, API).await
    }

    /// Waits until the kept events satisfy `pred` (re-reading the stream as it grows).
    pub async fn wait_events<T>(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[Envelope]) -> Option<T>,
    ) -> Result<T> {
        let pred = &pred;
        wait_until(what, timeout, || async move {
            let events = self.events().await?;
            Ok(pred(&events))
        })
        .await
    }

    /// Ids of the session's delivery turns, in start order.
    pub async fn delivery_turns(&self, session: &SessionId) -> Result<Vec<TurnRecord>> {
        let mut out = Vec::new();
        for e in self.events().await? {
            if e.kind == "turn.started" && e.session.as_ref() == Some(session) {
                if let Some(t) = &e.turn {
                    if let Some(rec) = self.turn(t).await? {
                        if rec.delivery.is_some()
                            && !out.iter().any(|r: &TurnRecord| r.id == rec.id)
                        {
                            out.push(rec);
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

/// The step ids a delivery message lists (one `- NAME [STATUS] stp_...: summary` line each).
pub fn listed_steps(message: &str) -> Vec<String> {
    message
        .lines()
        .filter_map(|l| l.strip_prefix("- "))
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("stp_")))
        .map(|w| w.trim_end_matches(':').to_string())
        .collect()
}

/// Sends a signal to one process (`STOP` freezes a service between two of its writes).
/// SIGSTOP to `who`'s process, whose pid is known if it runs; returns the pid.
fn freeze(pid: Option<u32>, who: &str) -> Result<u32> {
    let pid = pid.with_context(|| format!("{who}'s pid"))?;
    signal(pid, rustix::process::Signal::STOP)?;
    Ok(pid)
}

pub fn signal(pid: u32, sig: rustix::process::Signal) -> Result<()> {
    let raw = i32::try_from(pid)?;
    anyhow::ensure!(raw > 1, "refusing to signal pid {pid}");
    let pid = rustix::process::Pid::from_raw(raw).context("pid")?;
    rustix::process::kill_process(pid, sig).with_context(|| format!("signal {raw}"))?;
    Ok(())
}

/// Waits until the tree under `id` satisfies `pred`.
pub async fn wait_until_tree(
    stack: &Stack,
    id: &ExecutionId,
    timeout: Duration,
    pred: impl Fn(&TreeNode) -> bool,
) -> Result<TreeNode> {
    let pred = &pred;
    wait_until("execution tree", timeout, || async move {
        match stack.tree(id).await {
            Ok(t) if pred(&t) => Ok(Some(t)),
            Ok(_) => Ok(None),
            Err(e) if e.to_string().contains("not_found") => Ok(None),
            Err(e) => Err(e),
        }
    })
    .await
}

/// Waits until `n` delivery turns of the session have ended; returns them in start order.
pub async fn wait_deliveries(
    stack: &Stack,
    session: &SessionId,
    n: usize,
    timeout: Duration,
) -> Result<Vec<TurnRecord>> {
    wait_until("delivery turns", timeout, || async move {
        let d = stack.delivery_turns(session).await?;
        Ok((d.len() >= n && d.iter().all(|r| r.state.is_terminal())).then_some(d))
    })
    .await
}

/// Runs (R5), as tests drive them.
impl Stack {
    pub async fn start_run(
        &self,
        session: &SessionId,
        messages: &[&str],
        finalizer: Option<&str>,
    ) -> Result<turnstile_shared::runs::RunRecord> {
        self.start_run_with(session, messages, finalizer, Default::default())
            .await
    }

    pub async fn start_run_with(
        &self,
        session: &SessionId,
        messages: &[&str],
        finalizer: Option<&str>,
        limits: turnstile_shared::runs::RunLimits,
    ) -> Result<turnstile_shared::runs::RunRecord> {
        let req = turnstile_shared::runs::StartRun {
            session: session.clone(),
            messages: messages.iter().map(|m| m.to_string()).collect(),
            finalizer: finalizer.map(str::to_string),
            limits,
            schedule: None,
            id: None,
        };
        Ok(api::call(&self.client, subj::RUNS_START, &req, API).await?)
    }

    /// Asks for the run to be cancelled (R7): a queued run ends at once, a running one at its
    /// next boundary. Returns the record as the cancel left it.
    pub async fn cancel_run(
        &self,
        run: &turnstile_shared::RunId,
    ) -> Result<turnstile_shared::runs::RunRecord> {
        let req = turnstile_shared::runs::RunRef { run: run.clone() };
        Ok(api::call(&self.client, subj::RUNS_CANCEL, &req, API).await?)
    }

    /// `turnstile run retry RUN`: the run's record as answered (queued again).
    pub async fn retry_run(
        &self,
        run: &turnstile_shared::RunId,
    ) -> Result<turnstile_shared::runs::RunRecord, api::ApiError> {
        let req = turnstile_shared::runs::RunRef { run: run.clone() };
        api::call(&self.client, subj::RUNS_RETRY, &req, API).await
    }

    /// Waits (on the run's KV key) until it has ended.
    pub async fn wait_run(
        &self,
        run: &turnstile_shared::RunId,
        timeout: Duration,
    ) -> Result<turnstile_shared::runs::RunRecord> {
        let kv = self.js.get_key_value(subjects::RUNS_BUCKET).await?;
        let mut watch = kv.watch_with_history(run.as_str()).await?;
        tokio::time::timeout(timeout, async {
            while let Some(entry) = watch.next().await {
                if let Ok(r) =
                    serde_json::from_slice::<turnstile_shared::runs::RunRecord>(&entry?.value)
                {
                    if r.state.is_terminal() {
                        return Ok(r);
                    }
                }
            }
            bail!("watch of run {run} ended")
        })
        .await
        .with_context(|| format!("run {run} did not end within {timeout:?}"))?
    }
}

/// Schedules and their slot records (R11).
impl Stack {
    pub async fn add_schedule(
        &self,
        spec: &turnstile_shared::schedules::ScheduleSpec,
    ) -> Result<turnstile_shared::schedules::ScheduleRecord> {
        Ok(api::call(&self.client, subj::SCHEDULES_ADD, spec, API).await?)
    }

    /// Every slot record of the schedule, oldest first.
    pub async fn slots(&self, name: &str) -> Result<Vec<turnstile_shared::schedules::SlotRecord>> {
        use futures::TryStreamExt;
        let kv = self.js.get_key_value(subjects::SLOTS_BUCKET).await?;
        let keys: Vec<String> = kv.keys().await?.try_collect().await?;
        let mut out = Vec::new();
        for k in keys.iter().filter(|k| k.starts_with(&format!("{name}."))) {
            if let Some(b) = kv.get(k).await? {
                out.push(serde_json::from_slice::<
                    turnstile_shared::schedules::SlotRecord,
                >(&b)?);
            }
        }
        out.sort_by_key(|r| r.slot);
        Ok(out)
    }

    /// Waits until the schedule has at least `n` slot records satisfying `pred`.
    pub async fn wait_slots(
        &self,
        name: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<turnstile_shared::schedules::SlotRecord>> {
        wait_until("slot records", timeout, || async move {
            let s = self.slots(name).await?;
            Ok((s.len() >= n).then_some(s))
        })
        .await
    }
}

/// A schedule spec with test defaults: second-level cron in UTC.
pub fn schedule(
    name: &str,
    cron: &str,
    session: &SessionId,
    messages: &[&str],
) -> turnstile_shared::schedules::ScheduleSpec {
    turnstile_shared::schedules::ScheduleSpec {
        name: name.to_string(),
        cron: cron.to_string(),
        tz: "UTC".to_string(),
        session: session.clone(),
        messages: messages.iter().map(|m| m.to_string()).collect(),
        finalizer: None,
        overlap: Default::default(),
        catchup_window: Duration::from_secs(3600),
        catchup: Default::default(),
        late_threshold: Duration::from_secs(5),
        limits: Default::default(),
    }
}

/// Completions of the session still in `TS_COMPLETION` (pending or unacked).
pub async fn completion_backlog(stack: &Stack, s: &turnstile_shared::SessionId) -> Result<u64> {
    let stream = stack
        .js
        .get_stream(turnstile_shared::subjects::COMPLETION_STREAM)
        .await?;
    let mut subjects = stream
        .info_with_subjects(turnstile_shared::subjects::completion_session_all(s))
        .await?;
    let mut total = 0u64;
    while let Some(entry) = futures::StreamExt::next(&mut subjects).await {
        total += entry?.1 as u64;
    }
    Ok(total)
}

impl Stack {
    /// Waits (on the run's KV key) until it satisfies `pred`.
    pub async fn wait_run_state(
        &self,
        run: &turnstile_shared::RunId,
        timeout: Duration,
        pred: impl Fn(&turnstile_shared::runs::RunRecord) -> bool,
    ) -> Result<turnstile_shared::runs::RunRecord> {
        let kv = self.js.get_key_value(subjects::RUNS_BUCKET).await?;
        let mut watch = kv.watch_with_history(run.as_str()).await?;
        tokio::time::timeout(timeout, async {
            while let Some(entry) = watch.next().await {
                if let Ok(r) =
                    serde_json::from_slice::<turnstile_shared::runs::RunRecord>(&entry?.value)
                {
                    if pred(&r) {
                        return Ok(r);
                    }
                }
            }
            bail!("watch of run {run} ended")
        })
        .await
        .with_context(|| format!("run {run} never reached the awaited state"))?
    }
}

impl Stack {
    /// A step report with credentials for no step: the broker must refuse it (and count and
    /// announce the refusal, `auth.refused`). Returns what the call answered.
    pub async fn report_with_a_wrong_token(
        &self,
    ) -> Result<turnstile_shared::step_api::ReportAck, api::ApiError> {
        use turnstile_shared::step_api::{Report, StepReport};
        let step = turnstile_shared::StepId::new();
        api::call(
            &self.client,
            &Principal::Step(step.clone()).steps(subj::REPORT),
            &StepReport {
                step,
                token: "not-a-token".into(),
                report: Report::Heartbeat,
            },
            API,
        )
        .await
    }
}
