//! The campaign's nats nodes as local processes: one nats-server, or a three-node cluster
//! whose nodes run in network namespaces of their own (net.rs), so one can be cut off. A kill
//! is a SIGKILL of the process and a start runs it again on its own port and store; a pause is
//! SIGSTOP.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rustix::process::Signal;
use turnstile_tests::{NatsServer, Placement};

use super::super::net::Net;
use super::super::signal::signal;

pub struct Local {
    nats: Vec<NatsServer>,
    /// The cluster's own network, to cut a node off (none on a single server, or where it
    /// could not be set up: `no_net` says why).
    net: Option<Net>,
    no_net: Option<String>,
}

impl Local {
    /// `stores.len()` nodes (1 or 3), each store at its path.
    pub async fn start(dir: &Path, stores: Vec<Option<PathBuf>>) -> Result<Self> {
        let replicas = stores.len();
        let (net, no_net) = if replicas > 1 {
            match Net::create(replicas) {
                Ok(n) => (Some(n), None),
                Err(e) => (None, Some(format!("{e:#}"))),
            }
        } else {
            (None, Some("a single server is not cut off".to_string()))
        };
        let placements: Vec<Placement> = stores
            .into_iter()
            .enumerate()
            .map(|(i, store_dir)| Placement {
                store_dir,
                ..net.as_ref().map(|n| n.placement(i)).unwrap_or_default()
            })
            .collect();
        let nats = if replicas > 1 {
            crate::cluster::start_placed(dir, crate::cluster::Sync::Default, placements).await?
        } else {
            let placement = placements.into_iter().next().unwrap_or_default();
            vec![NatsServer::start_placed(None, placement).await?]
        };
        Ok(Self { nats, net, no_net })
    }

    pub fn urls(&self) -> Vec<String> {
        self.nats.iter().map(NatsServer::url).collect()
    }

    pub async fn kill(&mut self, i: usize) -> Result<()> {
        self.node(i)?.kill().await
    }

    pub async fn start_again(&mut self, i: usize) -> Result<()> {
        self.node(i)?.restart().await
    }

    pub fn pause(&mut self, i: usize) -> Result<()> {
        let pid = self.node(i)?.pid().context("not running")?;
        signal(pid, Signal::STOP)
    }

    pub fn resume(&mut self, i: usize) -> Result<()> {
        let pid = self.node(i)?.pid().context("not running")?;
        signal(pid, Signal::CONT)
    }

    pub fn cut(&self, i: usize) -> Result<()> {
        self.net()?.cut(i)
    }

    pub fn mend(&self, i: usize) -> Result<()> {
        self.net()?.mend(i)
    }

    pub async fn restart_graceful(&mut self, i: usize) -> Result<()> {
        self.node(i)?
            .restart_graceful(Duration::from_secs(10))
            .await
    }

    /// Every node resumed, mended and running.
    pub async fn heal(&mut self) -> Result<()> {
        if let Some(net) = &self.net {
            for i in 0..self.nats.len() {
                let _ = net.mend(i);
            }
        }
        for n in &mut self.nats {
            match n.pid() {
                Some(pid) => {
                    let _ = signal(pid, Signal::CONT);
                }
                None => n.restart().await?,
            }
        }
        Ok(())
    }

    /// Every paused node resumed (so a SIGKILL on the way out takes).
    pub fn resume_all(&self) {
        for n in &self.nats {
            if let Some(pid) = n.pid() {
                let _ = signal(pid, Signal::CONT);
            }
        }
    }

    /// A copy of each node's log at `<dir>/nats-<i>.log` (the node's own directory goes with it).
    pub fn keep_logs(&self, dir: &Path) {
        for (i, n) in self.nats.iter().enumerate() {
            let to = dir.join(format!("nats-{i}.log"));
            if let Err(e) = std::fs::copy(n.log_path(), &to) {
                eprintln!("chaos: keep {}: {e}", to.display());
            }
        }
    }

    fn node(&mut self, i: usize) -> Result<&mut NatsServer> {
        self.nats
            .get_mut(i)
            .with_context(|| format!("no nats node nats-{i}"))
    }

    fn net(&self) -> Result<&Net> {
        match (&self.net, &self.no_net) {
            (Some(net), _) => Ok(net),
            (None, why) => bail!(
                "no network of its own: {}",
                why.as_deref().unwrap_or("not set up")
            ),
        }
    }
}
