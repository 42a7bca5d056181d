//! A three-node JetStream cluster on loopback for the lanes benchmark's durability figures
//! (`--replicas 3`), with nats-server's default `sync_interval` or `always` (`--sync always`).
//! Each node is the test harness's server (random ports, its own store, bounded readiness),
//! given a config with the cluster block; the three start together, because none answers for
//! JetStream before a meta leader is elected.

use std::path::Path;

use anyhow::{Context, Result};
use turnstile_tests::NatsServer;

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
    let ports: Vec<u16> = (0..3)
        .map(|_| turnstile_tests::free_port())
        .collect::<Result<_>>()?;
    let routes: Vec<String> = ports
        .iter()
        .map(|p| format!("nats://127.0.0.1:{p}"))
        .collect();
    let mut configs = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let mut text = String::new();
        if sync == Sync::Always {
            text.push_str("jetstream {\n  sync_interval: always\n}\n");
        }
        text.push_str(&format!(
            "cluster {{\n  name: turnstile-bench\n  listen: 127.0.0.1:{port}\n  routes: [{}]\n}}\n",
            routes.join(", ")
        ));
        let path = dir.join(format!("node-{i}.conf"));
        std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
        configs.push(path);
    }
    let (a, b, c) = tokio::join!(
        NatsServer::start_with_config(&configs[0], Vec::new(), None, Vec::new()),
        NatsServer::start_with_config(&configs[1], Vec::new(), None, Vec::new()),
        NatsServer::start_with_config(&configs[2], Vec::new(), None, Vec::new()),
    );
    Ok(vec![a?, b?, c?])
}
