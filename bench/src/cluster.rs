//! A three-node JetStream cluster on loopback for the lanes benchmark's durability figures
//! (`--replicas 3`), with nats-server's default `sync_interval` or `always` (`--sync always`).
//! Each node is the test harness's server (random ports, its own store, bounded readiness),
//! given a config with the cluster block; the three start together, because none answers for
//! JetStream before a meta leader is elected.

use std::path::Path;

use anyhow::{Context, Result};
use turnstile_tests::{NatsServer, Placement};

/// How the cluster's nodes flush their store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// nats-server's default: fsync every two minutes (acknowledged writes can be lost on
    /// power loss or an OS crash).
    Default,
    /// fsync before every acknowledgement.
    Always,
}

impl Sync {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "default" => Ok(Sync::Default),
            "always" => Ok(Sync::Always),
            other => anyhow::bail!("--sync takes `default` or `always`, not `{other}`"),
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Sync::Default => "default (fsync every 2 min)",
            Sync::Always => "always (fsync before every ack)",
        }
    }
}

/// Writes each node's config and starts the three nodes at once. Returns them in order; the
/// first is the one clients connect to.
pub async fn start(dir: &Path, sync: Sync) -> Result<Vec<NatsServer>> {
    start_placed(dir, sync, vec![Placement::default(); 3]).await
}

/// Like [`start`], each node placed as given (a network namespace and address of its own, a
/// store on a filesystem of its own): the fault campaign's cluster.
pub async fn start_placed(
    dir: &Path,
    sync: Sync,
    placements: Vec<Placement>,
) -> Result<Vec<NatsServer>> {
    anyhow::ensure!(placements.len() == 3, "a cluster here has three nodes");
    let ports: Vec<u16> = (0..3)
        .map(|_| turnstile_tests::free_port())
        .collect::<Result<_>>()?;
    let hosts: Vec<String> = placements
        .iter()
        .map(|p| {
            p.netns
                .as_ref()
                .map_or_else(|| "127.0.0.1".to_string(), |(_, host)| host.clone())
        })
        .collect();
    let routes: Vec<String> = ports
        .iter()
        .zip(&hosts)
        .map(|(p, h)| format!("nats://{h}:{p}"))
        .collect();
    let mut configs = Vec::new();
    for (i, (port, host)) in ports.iter().zip(&hosts).enumerate() {
        let mut text = String::new();
        if sync == Sync::Always {
            text.push_str("jetstream {\n  sync_interval: always\n}\n");
        }
        text.push_str(&format!(
            "cluster {{\n  name: turnstile-bench\n  listen: {host}:{port}\n  routes: [{}]\n}}\n",
            routes.join(", ")
        ));
        let path = dir.join(format!("node-{i}.conf"));
        std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        configs.push(path);
    }
    let mut placements = placements.into_iter();
    let mut next = || placements.next().unwrap_or_default();
    let (a, b, c) = tokio::join!(
        NatsServer::start_placed(Some(&configs[0]), next()),
        NatsServer::start_placed(Some(&configs[1]), next()),
        NatsServer::start_placed(Some(&configs[2]), next()),
    );
    let nodes = vec![a?, b?, c?];
    placeable(&nodes[0].url()).await?;
    Ok(nodes)
}

/// Waits (bounded) until the cluster places a stream on all three nodes: each node answers
/// for JetStream before the meta leader has heard from every peer, and a replicated stream
/// created then is refused "no suitable peers for placement" (one `failover --replicas 3`
/// run in five failed so).
async fn placeable(url: &str) -> Result<()> {
    let js = async_nats::jetstream::new(async_nats::connect(url).await?);
    let name = "TS_BENCH_PLACEABLE";
    turnstile_tests::wait_until(
        "the cluster places a stream on three nodes",
        std::time::Duration::from_secs(30),
        || {
            let js = js.clone();
            async move {
                let config = async_nats::jetstream::stream::Config {
                    name: name.to_string(),
                    num_replicas: 3,
                    ..Default::default()
                };
                match js.create_stream(config).await {
                    Ok(_) => {
                        js.delete_stream(name).await?;
                        Ok(Some(()))
                    }
                    Err(_) => Ok(None),
                }
            }
        },
    )
    .await
}
