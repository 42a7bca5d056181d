//! The scheduler service: schedules and slot claims (issue 4 fills it in). For now it
//! connects and provisions the topology, so a deployment can already run every service.

pub mod cron;

use tokio_util::sync::CancellationToken;
use turnstile_shared::topology::TopologyConfig;

#[derive(Debug, Clone)]
pub struct Config {
    pub nats_url: String,
    pub topology: TopologyConfig,
}

impl Config {
    pub fn new(nats_url: impl Into<String>) -> Self {
        Self {
            nats_url: nats_url.into(),
            topology: TopologyConfig::default(),
        }
    }
}

pub use turnstile_shared::config::StartError as Error;

/// Connects, provisions, and idles until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let started =
        turnstile_shared::config::start(&config.nats_url, "scheduler", &config.topology).await?;
    tracing::info!("scheduler running");
    shutdown.cancelled().await;
    let _ = started.client.flush().await;
    Ok(())
}
