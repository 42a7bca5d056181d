//! The transport agent: one per host. It runs each session's agent in a terminal on this host,
//! types the turns the session lanes dispatch, and records how each turn ended.
//!
//! # Layout
//!
//! [`run`] builds the adapters and starts four tasks on one shared `Ctx`. Calls go down this
//! list, never up:
//!
//! * `steps`: `command` steps run in the session's cwd. Calls `commands` (refusals), `tail`.
//! * `commands`: this host's transport commands (start, turn, stop). Calls the adapters.
//! * `watch`: reports agents that die while their session is idle. Calls `tmux`.
//! * `heartbeat`: this host's TTL'd record in the hosts bucket. Calls nothing here.
//! * `ctx`: what the tasks share (the config, NATS handles, adapters, per-session state),
//!   and the service's `Config` and `Error`. Uses `adapters`' types.
//! * `adapters`: the `Adapter` trait, the instant adapter, and one file per agent (`mock`,
//!   `generic` in tmux panes; `claude`, `codex` headless) with `credentials`, a session's env
//!   file, MCP config and launcher. Call `tmux`, `tail`.
//! * `tail`: the last lines a process wrote, and its exit status. Leaf.
//! * `tmux`: the tmux CLI on the transport's private socket. Leaf.

mod adapters;
mod commands;
mod ctx;
mod heartbeat;
mod steps;
mod steps_held;
mod tail;
mod tmux;
mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;
use turnstile_shared::config::Connected;
use turnstile_shared::records::AgentKind;

pub use adapters::{Adapter, Adopted, InstantAdapter, Ready, SessionSpec, TurnEnd, Unavailable};
use ctx::Ctx;
pub use ctx::{default_agent_bin, Config, Error};

/// Runs the transport agent until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let dir_err = |source| Error::DataDir {
        dir: config.data_dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(&config.mock_state_dir).map_err(dir_err)?;
    let tmux = tmux::Tmux::new(&config.data_dir).map_err(dir_err)?;
    let watched = tmux.clone();
    let generic_tmux = tmux.clone();
    let Connected {
        client,
        js,
        buckets,
    } = turnstile_shared::config::start(
        &config.nats_url,
        &format!("transport-{}", config.host),
        &shutdown,
    )
    .await?;
    config.health.serving(&client);
    let mut adapters: HashMap<AgentKind, Arc<dyn Adapter>> = HashMap::new();
    adapters.insert(
        AgentKind::Mock,
        Arc::new(adapters::mock::MockAdapter {
            tmux,
            agent_bin: config.agent_bin.clone(),
            state_dir: config.mock_state_dir.clone(),
            default_cwd: config.data_dir.clone(),
            data_dir: config.data_dir.clone(),
            nats_url: config.agent_nats_url(),
        }),
    );
    adapters.insert(AgentKind::Instant, Arc::new(InstantAdapter));
    adapters.insert(
        AgentKind::Claude,
        Arc::new(adapters::claude::ClaudeAdapter::new(
            config.claude_bin.clone(),
            config.data_dir.clone(),
            config.agent_nats_url(),
            config.agent_bin.clone(),
        )),
    );
    adapters.insert(
        AgentKind::Tmux,
        Arc::new(adapters::generic::GenericAdapter {
            tmux: generic_tmux,
            data_dir: config.data_dir.clone(),
            nats_url: config.agent_nats_url(),
            turnstile_bin: config.agent_bin.clone(),
            patterns: Default::default(),
        }),
    );
    adapters.insert(
        AgentKind::Codex,
        Arc::new(adapters::codex::CodexAdapter::new(
            config.codex_bin.clone(),
            config.data_dir.clone(),
            config.agent_nats_url(),
            config.agent_bin.clone(),
        )),
    );
    let worker = format!("{}/{}", config.host, uuid::Uuid::now_v7().simple());
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        js,
        buckets,
        config,
        adapters,
        sessions: Mutex::default(),
        active: Mutex::default(),
        stops: Default::default(),
        launch_locks: Mutex::default(),
        worker,
        steps: Mutex::default(),
    });
    ctx.probe_session_state();
    tracing::info!(host = %ctx.config.host, "transport agent running");
    let beat = heartbeat::run(ctx.clone(), shutdown.clone());
    let cmds = commands::run(ctx.clone(), shutdown.clone());
    let steps = steps::run(ctx.clone(), shutdown.clone());
    let watch = watch::run(ctx.clone(), watched, shutdown.clone());
    let (beat, cmds, steps, ()) = tokio::join!(beat, cmds, steps, watch);
    let _ = client.drain().await;
    beat.and(cmds).and(steps)
}
