//! `turnstile admin provision`: creates (or brings up to date) every stream and bucket, run
//! once per deployment with an identity that may manage streams. The services only bind the
//! topology at start, so their own identities need no stream or bucket create, update or
//! delete rights.

use std::process::ExitCode;

use clap::Subcommand;
use turnstile_shared::config::TopologyArgs;
use turnstile_shared::subjects;

#[derive(Subcommand)]
pub enum AdminCommand {
    /// Create or update every stream and KV bucket (idempotent). The hosts bucket's TTL is
    /// `--host-ttl`: give the same timings as the services.
    Provision {
        #[command(flatten)]
        topology: TopologyArgs,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(url: &str, cmd: AdminCommand) -> anyhow::Result<ExitCode> {
    let AdminCommand::Provision { topology, json } = cmd;
    let client = turnstile_shared::config::connect_once(url, "turnstile-admin").await?;
    let js = async_nats::jetstream::new(client);
    turnstile_shared::topology::provision(&js, &topology.to_config()).await?;
    let streams = subjects::ALL_STREAMS;
    let buckets = subjects::ALL_BUCKETS;
    if json {
        println!(
            "{}",
            serde_json::json!({ "streams": streams, "buckets": buckets })
        );
    } else {
        println!(
            "provisioned {} streams ({}) and {} buckets ({})",
            streams.len(),
            streams.join(", "),
            buckets.len(),
            buckets.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}
