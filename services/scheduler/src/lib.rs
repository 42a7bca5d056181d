//! The scheduler service: schedules and slot claims (issue 4 fills it in). For now it connects and provisions the
//! topology, so a deployment can already run every service.

use tokio_util::sync::CancellationToken;
use turnstile_shared::topology::{self, TopologyConfig};

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

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connect to NATS at {url}: {source}")]
    Connect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error(transparent)]
    Topology(#[from] topology::TopologyError),
}

/// Connects, provisions, and idles until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let client = turnstile_shared::config::connect(&config.nats_url, "scheduler")
        .await
        .map_err(|source| Error::Connect {
            url: config.nats_url.clone(),
            source,
        })?;
    let js = async_nats::jetstream::new(client.clone());
    topology::provision(&js, &config.topology).await?;
    tracing::info!("scheduler running");
    shutdown.cancelled().await;
    let _ = client.flush().await;
    Ok(())
}
