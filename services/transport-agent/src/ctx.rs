//! What the transport's tasks share (`Ctx`: the config, the NATS handles, the adapters and the
//! per-session state), with the service's `Config` and `Error`. Apart from `lib.rs`, which
//! builds the adapters and starts the tasks, so that the tasks need not import the file that
//! calls them.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use turnstile_shared::config::StartError;
use turnstile_shared::records::AgentKind;
use turnstile_shared::topology::{Buckets, TopologyConfig};
use turnstile_shared::{HostName, SessionId, TurnId};

use crate::adapters::{Adapter, SessionSpec};

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub host: HostName,
    pub topology: TopologyConfig,
    /// Holds the private tmux socket and the agents' default working directory.
    pub data_dir: PathBuf,
    /// The `turnstile` binary, whose `mock-agent` subcommand the mock adapter launches.
    pub agent_bin: PathBuf,
    /// Where mock agents keep their conversations.
    pub mock_state_dir: PathBuf,
    /// The Claude Code CLI the `claude` adapter runs.
    pub claude_bin: PathBuf,
    /// The Codex CLI the `codex` adapter runs.
    pub codex_bin: PathBuf,
    /// R9: how long a launch or resume may take to reach a ready prompt.
    pub ready_timeout: Duration,
    /// A turn whose agent is not back at its prompt by then fails with `turn_timeout`.
    pub turn_timeout: Duration,
    /// What `/healthz` and `/readyz` report (served by the binary with `--http`).
    pub health: std::sync::Arc<turnstile_shared::health::Health>,
}

impl Config {
    /// The NATS address the agents and step processes this transport launches connect to:
    /// the server only, never this transport's own credentials. They connect as their own
    /// session or step (the auth callout issues them identities of that scope).
    pub fn agent_nats_url(&self) -> String {
        turnstile_shared::config::split_credentials(&self.nats_url).0
    }

    pub fn new(nats_url: impl Into<String>, host: HostName, data_dir: PathBuf) -> Self {
        Self {
            health: turnstile_shared::health::Health::new(),
            nats_url: nats_url.into(),
            host,
            topology: TopologyConfig::default(),
            agent_bin: default_agent_bin(),
            mock_state_dir: data_dir.join("mock-agent"),
            claude_bin: PathBuf::from("claude"),
            codex_bin: PathBuf::from("codex"),
            data_dir,
            ready_timeout: Duration::from_secs(120),
            turn_timeout: Duration::from_secs(3600),
        }
    }
}

/// `turnstile` next to this executable (or this executable when it is `turnstile`), else PATH.
pub fn default_agent_bin() -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        if exe.file_name().is_some_and(|n| n == "turnstile") {
            return exe;
        }
        if let Some(sibling) = exe.parent().map(|d| d.join("turnstile")) {
            if sibling.exists() {
                return sibling;
            }
        }
    }
    PathBuf::from("turnstile")
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("prepare data dir {dir}: {source}")]
    DataDir { dir: String, source: std::io::Error },
}

pub(crate) struct Ctx {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: Buckets,
    pub config: Config,
    pub adapters: HashMap<AgentKind, Arc<dyn Adapter>>,
    pub sessions: Mutex<HashMap<SessionId, SessionSpec>>,
    /// Turns this process is typing or watching: a redelivered command for one is a duplicate.
    pub active: Mutex<HashSet<TurnId>>,
    /// Bumped by every stop (under the `sessions` lock): a spec read from the sessions bucket
    /// is cached only if no stop came between its read and its caching, so a stopped
    /// session's spec is never cached again (and no set of stopped sessions need be kept).
    pub stops: std::sync::atomic::AtomicU64,
    pub launch_locks: Mutex<HashMap<SessionId, Arc<tokio::sync::Mutex<()>>>>,
    /// Names this process to the broker when it takes a step (one per process start).
    pub worker: String,
    /// Steps this process runs, and the last ones it finished (`steps_held`).
    pub steps: Mutex<crate::steps_held::StepsHeld>,
}

impl Ctx {
    /// Registers the sizes of this process's per-session maps with the metrics
    /// (`turnstile_session_state_entries`), read at each scrape while the agent lives.
    pub(crate) fn probe_session_state(self: &Arc<Self>) {
        let m = turnstile_shared::metrics::metrics();
        m.probe_of("session_specs", self, |c| {
            c.sessions.lock().map(|m| m.len()).unwrap_or(0)
        });
        m.probe_of("launch_locks", self, |c| {
            c.launch_locks.lock().map(|m| m.len()).unwrap_or(0)
        });
        m.probe_of("active_turns", self, |c| {
            c.active.lock().map(|m| m.len()).unwrap_or(0)
        });
        m.probe_of("running_steps", self, |c| {
            c.steps.lock().map(|m| m.running()).unwrap_or(0)
        });
    }

    /// Takes a delivery of a step's work (`steps_held::Claim`).
    pub(crate) fn claim_step(&self, step: &turnstile_shared::StepId) -> crate::steps_held::Claim {
        self.steps
            .lock()
            .map(|mut s| s.claim(step))
            .unwrap_or(crate::steps_held::Claim::Running)
    }

    /// The step's end was reported, or its start refused: never run here again.
    pub(crate) fn finish_step(&self, step: &turnstile_shared::StepId) {
        if let Ok(mut s) = self.steps.lock() {
            s.finish(step);
        }
    }

    /// The step was let go unreported: another delivery may run it.
    pub(crate) fn release_step(&self, step: &turnstile_shared::StepId) {
        if let Ok(mut s) = self.steps.lock() {
            s.release(step);
        }
    }
}
