//! `turnstile-session-lane`: reads config, starts tracing, runs the service until SIGTERM.

use clap::Parser;
use tokio_util::sync::CancellationToken;
use turnstile_shared::config::{NatsArgs, TopologyArgs};

#[derive(Parser)]
#[command(
    name = "turnstile-session-lane",
    version,
    about = "Turnstile session lanes"
)]
struct Args {
    #[command(flatten)]
    health: turnstile_shared::health::HealthArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    topology: TopologyArgs,
    /// Name of this replica in events (default: lane-<pid>).
    #[arg(long, env = "TURNSTILE_REPLICA")]
    replica: Option<String>,
    /// How long a run may stay queued with no item on its lane before its item is published
    /// again (a backstop for an item the store lost).
    #[arg(long, env = "TURNSTILE_ORPHAN_RUN_AFTER", default_value = "60s", value_parser = turnstile_shared::duration::parse_flag)]
    orphan_run_after: std::time::Duration,
    /// How long a turn may go untaken by its live host before the lane looks for its command
    /// and sends it again if it is not stored (a backstop for a command the store lost).
    #[arg(long, env = "TURNSTILE_LOST_COMMAND_AFTER", default_value = "30s", value_parser = turnstile_shared::duration::parse_flag)]
    lost_command_after: std::time::Duration,
    /// How often every lane is swept for a consumer past stored items or completions waiting
    /// with no delivery armed (each repaired when seen two sweeps running).
    #[arg(long, env = "TURNSTILE_SWEEP_EVERY", default_value = "30s", value_parser = turnstile_shared::duration::parse_flag)]
    sweep_every: std::time::Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    turnstile_shared::telemetry::init();
    let args = Args::parse();
    let mut config = turnstile_session_lane::Config::new(args.nats.url);
    config.topology = args.topology.to_config();
    config.orphan_run_after = args.orphan_run_after;
    config.lost_command_after = args.lost_command_after;
    config.sweep_every = args.sweep_every;
    if let Some(r) = args.replica {
        config.replica = r;
    }
    let shutdown = CancellationToken::new();
    turnstile_shared::telemetry::cancel_on_signal(shutdown.clone());
    turnstile_shared::health::spawn(&args.health, &config.health, &shutdown);
    turnstile_session_lane::run(config, shutdown).await?;
    Ok(())
}
