//! `turnstile dev`: a local nats-server and every service in this process, plus a demo session
//! on the mock agent whose lifecycle is printed as it happens. It runs with a deployment's
//! accounts ([`identities`]): every service on its own user, agents on identities from the
//! broker's auth callout, the operator's credentials in a file whose path it prints.

mod identities;

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, ApiError, CreateSession, ErrorCode, SendTurn};
use turnstile_shared::permissions::{Role, ACCOUNT};
use turnstile_shared::records::{AgentKind, SessionRecord, TurnRecord};
use turnstile_shared::schedules::{ScheduleRecord, ScheduleSpec};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::HostName;

use crate::events::{self, EventsArgs};

#[derive(clap::Args)]
pub struct DevArgs {
    /// Where NATS, the transport and mock agents keep their state.
    #[arg(long, default_value = ".data/dev")]
    data_dir: PathBuf,
    /// Port of the local nats-server.
    #[arg(long, default_value_t = 4222)]
    port: u16,
    /// Start the stack without the demo session.
    #[arg(long)]
    no_demo: bool,
}

const DEMO: &[&str] = &[
    "Summarise the layout of this repository.\n!sleep 1s\n!reply services/, shared/, cli/ and tests/.",
    "Run the test suite and tell me how it went.\n!sleep 2s\n!reply 15 passed, 0 failed.",
    "Thanks, that is all for now.",
];

pub async fn run(args: DevArgs) -> anyhow::Result<ExitCode> {
    turnstile_shared::telemetry::init_with_default("warn");
    let data_dir = std::path::absolute(&args.data_dir).context("resolve --data-dir")?;
    std::fs::create_dir_all(&data_dir).with_context(|| format!("create {}", data_dir.display()))?;
    let host: HostName = "local".parse().context("host name")?;
    let ids = identities::Identities::load(&data_dir, args.port, &host)?;
    let mut nats = start_nats(&data_dir, args.port, &ids).await?;
    let operator = ids.url(&Role::Cli)?;
    println!(
        "NATS: nats://127.0.0.1:{} (operator credentials: {}; `set -a; . {}; set +a` in \
         another shell, then `turnstile session list`)",
        args.port,
        ids.operator_env.display(),
        ids.operator_env.display()
    );
    let shutdown = CancellationToken::new();
    turnstile_shared::telemetry::cancel_on_signal(shutdown.clone());

    let client = turnstile_shared::config::connect_once(&operator, "turnstile-dev")
        .await
        .context("connect to local NATS")?;
    // The deployment's provisioning step (`turnstile admin provision`, as `admin`), before the
    // services start: they only bind the topology.
    let admin = turnstile_shared::config::connect_once(&ids.url(&Role::Admin)?, "turnstile-admin")
        .await
        .context("connect as admin")?;
    turnstile_shared::topology::provision(
        &async_nats::jetstream::new(admin.clone()),
        &Default::default(),
    )
    .await
    .context("provision the topology")?;
    let _ = admin.drain().await;

    let mut lane = turnstile_session_lane::Config::new(ids.url(&Role::SessionLane)?);
    lane.replica = "dev".to_string();
    let mut transport = turnstile_transport_agent::Config::new(
        ids.url(&Role::Transport(host.clone()))?,
        host,
        data_dir.join("transport-local"),
    );
    transport.mock_state_dir = data_dir.join("mock-agent");
    if let Ok(exe) = std::env::current_exe() {
        transport.agent_bin = exe;
    }
    let services = tokio::spawn({
        let shutdown = shutdown.clone();
        let mut broker = turnstile_notification_broker::Config::new(ids.url(&Role::Broker)?);
        broker.callout = Some(turnstile_notification_broker::CalloutConfig {
            issuer_seed: ids.issuer_seed.clone(),
            account: ACCOUNT.to_string(),
            ttl: Duration::from_secs(3600),
            system_url: Some(ids.url(&Role::Revoker)?),
        });
        let scheduler = turnstile_scheduler::Config::new(ids.url(&Role::Scheduler)?);
        async move {
            let (a, b, c, d) = tokio::join!(
                turnstile_session_lane::run(lane, shutdown.clone()),
                turnstile_transport_agent::run(transport, shutdown.clone()),
                turnstile_notification_broker::run(broker, shutdown.clone()),
                turnstile_scheduler::run(scheduler, shutdown.clone()),
            );
            for (name, r) in [
                ("session-lane", a.map_err(anyhow::Error::from)),
                ("transport-agent", b.map_err(anyhow::Error::from)),
                ("notification-broker", c.map_err(anyhow::Error::from)),
                ("scheduler", d.map_err(anyhow::Error::from)),
            ] {
                if let Err(e) = r {
                    eprintln!("{name}: {e:#}");
                    shutdown.cancel();
                }
            }
        }
    });

    println!(
        "services: session-lane, transport-agent (host local), notification-broker, scheduler"
    );
    println!("events (also: turnstile events, with the operator credentials):");
    let printer = tokio::spawn({
        let client = client.clone();
        async move {
            let args = EventsArgs {
                session: None,
                replay: false,
                no_follow: false,
                json: false,
            };
            if let Err(e) = events::follow(&client, &args, &mut std::io::stdout()).await {
                eprintln!("events: {e:#}");
            }
        }
    });
    if !args.no_demo {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            r = demo(&client) => if let Err(e) = r { eprintln!("demo: {e:#}") },
        }
    }
    shutdown.cancelled().await;
    printer.abort();
    let _ = tokio::time::timeout(Duration::from_secs(15), services).await;
    // In production agents outlive their transport; in dev, Ctrl-C ends the whole stack.
    let _ = tokio::process::Command::new("tmux")
        .arg("-S")
        .arg(data_dir.join("transport-local/tmux.sock"))
        .arg("kill-server")
        .stderr(Stdio::null())
        .status()
        .await;
    let _ = nats.kill().await;
    Ok(ExitCode::SUCCESS)
}

async fn demo(client: &async_nats::Client) -> anyhow::Result<()> {
    let create = CreateSession {
        agent: AgentKind::Mock,
        name: "demo".into(),
        host: None,
        cwd: None,
        id: None,
        launch: None,
        ready_timeout_ms: None,
        policy: None,
    };
    // The transport's first heartbeat may not be in yet.
    let mut session: Option<SessionRecord> = None;
    for _ in 0..100 {
        match api::call::<_, SessionRecord>(
            client,
            subj::SESSION_CREATE,
            &create,
            Duration::from_secs(5),
        )
        .await
        {
            Ok(s) => {
                session = Some(s);
                break;
            }
            Err(ApiError { code, .. }) if code == ErrorCode::NoHost || code.is_transient() => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(e.into()),
        }
    }
    let Some(session) = session else {
        bail!("no transport host came up")
    };
    for text in DEMO {
        let req = SendTurn {
            session: session.id.clone(),
            text: text.to_string(),
            turn: None,
        };
        let _: TurnRecord =
            api::call(client, subj::SESSION_SEND, &req, Duration::from_secs(5)).await?;
    }
    // A schedule whose runs start background steps during a turn: each run hands their
    // results back in one batch and ends only then (R5).
    let spec = ScheduleSpec {
        name: "demo-every-30s".into(),
        cron: "*/30 * * * * *".into(),
        tz: "UTC".into(),
        session: session.id.clone(),
        messages: vec![DEMO_SCHEDULED.to_string()],
        finalizer: Some("summarise what the checks found".into()),
        overlap: Default::default(),
        catchup_window: Duration::from_secs(3600),
        catchup: Default::default(),
        late_threshold: Duration::from_secs(60),
        limits: Default::default(),
    };
    let added: Result<ScheduleRecord, ApiError> =
        api::call(client, subj::SCHEDULES_ADD, &spec, Duration::from_secs(5)).await;
    match added {
        Ok(_) => {}
        Err(e) if e.code == ErrorCode::Exists => {}
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// The demo schedule's message: two background steps started from one turn.
const DEMO_SCHEDULED: &str = "run the scheduled checks\n!step lint 2s\n!step test 3s\n!sleep 4s";

/// nats-server from PATH or `.tools/bin`, on 127.0.0.1:`port` with the dev identities' config,
/// its store under `data_dir`.
async fn start_nats(
    data_dir: &Path,
    port: u16,
    ids: &identities::Identities,
) -> anyhow::Result<tokio::process::Child> {
    let bin =
        find_nats_server().context("no nats-server found: run scripts/install-nats-server.sh")?;
    let log = std::fs::File::create(data_dir.join("nats-server.log"))
        .context("create nats-server.log")?;
    let mut child = tokio::process::Command::new(&bin)
        .arg("-c")
        .arg(&ids.config)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(data_dir.join("nats"))
        .envs(ids.server_env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("start {}", bin.display()))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "nats-server exited ({status}); see {}",
                data_dir.join("nats-server.log").display()
            );
        }
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(child);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("nats-server did not listen on port {port} within 10s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn find_nats_server() -> Option<PathBuf> {
    let mut candidates = vec![PathBuf::from(".tools/bin/nats-server")];
    if let Ok(exe) = std::env::current_exe() {
        // target/<profile>/turnstile -> <workspace>/.tools/bin
        if let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            candidates.push(root.join(".tools/bin/nats-server"));
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nats-server")));
    }
    candidates.into_iter().find(|p| p.is_file())
}
