//! `turnstile-transport-agent`: reads config, starts tracing, runs the host's transport.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use turnstile_shared::config::{NatsArgs, TopologyArgs};
use turnstile_shared::duration;
use turnstile_shared::HostName;

#[derive(Parser)]
#[command(
    name = "turnstile-transport-agent",
    version,
    about = "Turnstile transport agent for one host"
)]
struct Args {
    #[command(flatten)]
    health: turnstile_shared::health::HealthArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    topology: TopologyArgs,
    /// This host's name (a NATS subject token).
    #[arg(long, env = "TURNSTILE_HOST")]
    host: HostName,
    /// Where the private tmux socket and agent state live.
    #[arg(long, env = "TURNSTILE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The `turnstile` binary used to launch mock agents.
    #[arg(long, env = "TURNSTILE_AGENT_BIN")]
    agent_bin: Option<PathBuf>,
    /// Mock agents' conversation state (default: <data-dir>/mock-agent).
    #[arg(long)]
    mock_state_dir: Option<PathBuf>,
    /// R9: how long a launch or resume may take to reach a ready prompt.
    /// The Claude Code CLI for `claude` sessions.
    #[arg(long, env = "TURNSTILE_CLAUDE_BIN", default_value = "claude")]
    claude_bin: PathBuf,
    /// The Codex CLI for `codex` sessions.
    #[arg(long, env = "TURNSTILE_CODEX_BIN", default_value = "codex")]
    codex_bin: PathBuf,
    #[arg(long, default_value = "120s", value_parser = duration::parse_flag)]
    ready_timeout: Duration,
    /// A turn not back at the prompt by then fails with `turn_timeout`.
    #[arg(long, env = "TURNSTILE_TURN_TIMEOUT", default_value = "1h", value_parser = duration::parse_flag)]
    turn_timeout: Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    turnstile_shared::telemetry::init();
    let args = Args::parse();
    let data_dir = args
        .data_dir
        .unwrap_or_else(|| PathBuf::from(format!(".data/transport-{}", args.host)));
    let mut config = turnstile_transport_agent::Config::new(args.nats.url, args.host, data_dir);
    config.topology = args.topology.to_config();
    if let Some(b) = args.agent_bin {
        config.agent_bin = b;
    }
    if let Some(d) = args.mock_state_dir {
        config.mock_state_dir = d;
    }
    config.ready_timeout = args.ready_timeout;
    config.claude_bin = args.claude_bin;
    config.codex_bin = args.codex_bin;
    config.turn_timeout = args.turn_timeout;
    let shutdown = CancellationToken::new();
    turnstile_shared::telemetry::cancel_on_signal(shutdown.clone());
    turnstile_shared::health::spawn(&args.health, &config.health, &shutdown);
    turnstile_transport_agent::run(config, shutdown).await?;
    Ok(())
}
