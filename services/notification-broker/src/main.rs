//! `turnstile-notification-broker`: reads config, starts tracing, runs the service until SIGTERM.

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use turnstile_shared::config::{NatsArgs, TopologyArgs};

#[derive(Parser)]
#[command(name = "turnstile-notification-broker", version)]
struct Args {
    #[command(flatten)]
    health: turnstile_shared::health::HealthArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    topology: TopologyArgs,
    /// This replica's name in logs (several brokers may run).
    #[arg(long, env = "TURNSTILE_REPLICA")]
    replica: Option<String>,
    /// Answer the NATS server's auth callouts with agents' identities: a file holding the
    /// account seed (`SA…`) whose public key is the callout issuer in the server's config
    /// (`turnstile admin issuer` makes one).
    #[arg(long, env = "TURNSTILE_AUTH_ISSUER_SEED_FILE")]
    auth_issuer_seed_file: Option<std::path::PathBuf>,
    /// The account the agents' identities are placed in.
    #[arg(long, env = "TURNSTILE_AUTH_ACCOUNT", default_value = "TURNSTILE")]
    auth_account: String,
    /// How long an agent's credential lives before its client must authenticate again.
    #[arg(long, env = "TURNSTILE_AGENT_CREDENTIAL_TTL", default_value = "1h", value_parser = turnstile_shared::duration::parse_flag)]
    agent_credential_ttl: std::time::Duration,
    /// A system-account identity (URL with user and password) allowed to list and end
    /// connections: a stopped session's open connections then end at once.
    #[arg(long, env = "TURNSTILE_SYSTEM_NATS_URL")]
    system_nats: Option<String>,
    /// How long a step may stay queued before the broker looks for its work item, and
    /// publishes it again if it is not stored (lost to a server crash or a full disk).
    #[arg(long, env = "TURNSTILE_ORPHAN_STEP_AFTER", default_value = "60s", value_parser = turnstile_shared::duration::parse_flag)]
    orphan_step_after: std::time::Duration,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    turnstile_shared::telemetry::init();
    let args = Args::parse();
    let mut config = turnstile_notification_broker::Config::new(args.nats.url);
    config.topology = args.topology.to_config();
    config.orphan_step_after = args.orphan_step_after;
    if let Some(r) = args.replica {
        config.replica = r;
    }
    if let Some(path) = args.auth_issuer_seed_file {
        let seed = std::fs::read_to_string(&path)
            .with_context(|| format!("read the auth issuer seed {}", path.display()))?;
        config.callout = Some(turnstile_notification_broker::CalloutConfig {
            issuer_seed: seed.trim().to_string(),
            account: args.auth_account,
            ttl: args.agent_credential_ttl,
            system_url: args.system_nats,
        });
    }
    let shutdown = CancellationToken::new();
    turnstile_shared::telemetry::cancel_on_signal(shutdown.clone());
    turnstile_shared::health::spawn(&args.health, &config.health, &shutdown);
    turnstile_notification_broker::run(config, shutdown).await?;
    Ok(())
}
