//! The campaign's nats nodes and what a fault does to one (kill and start, pause and resume,
//! cut off and mend, a graceful restart), whichever runs them: local processes (`local`: one
//! server, or three in network namespaces) or Docker running docker-compose.yml's cluster
//! profile (`compose`, `--nats compose`; `docker`: the commands it is driven by, and the sweep
//! of what a campaign killed outright left). Nodes are named `nats-<i>` in the plan.

pub mod compose;
pub mod docker;
mod local;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Where the campaign's nats nodes run (`--nats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Local,
    Compose,
}

impl std::str::FromStr for Kind {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "local" => Ok(Self::Local),
            "compose" => Ok(Self::Compose),
            other => anyhow::bail!("--nats takes `local` or `compose`, not `{other}`"),
        }
    }
}

pub enum Nodes {
    Local(local::Local),
    Compose(compose::Compose),
}

impl Nodes {
    /// `stores.len()` nodes, each store on its path (`None`: a directory of the node's own).
    pub async fn start(kind: Kind, dir: &Path, stores: Vec<Option<PathBuf>>) -> Result<Self> {
        match kind {
            Kind::Local => Ok(Self::Local(local::Local::start(dir, stores).await?)),
            Kind::Compose => {
                let stores = stores
                    .into_iter()
                    .enumerate()
                    .map(|(i, s)| s.unwrap_or_else(|| dir.join(format!("store-{i}"))))
                    .collect::<Vec<_>>();
                for s in &stores {
                    std::fs::create_dir_all(s)
                        .with_context(|| format!("create {}", s.display()))?;
                }
                Ok(Self::Compose(compose::Compose::up(dir, &stores).await?))
            }
        }
    }

    pub fn urls(&self) -> Vec<String> {
        match self {
            Self::Local(n) => n.urls(),
            Self::Compose(n) => n.urls(),
        }
    }

    pub async fn kill(&mut self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.kill(i).await,
            Self::Compose(n) => n.kill(i).await,
        }
    }

    /// Starts a killed node again on its own address and store.
    pub async fn start_again(&mut self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.start_again(i).await,
            Self::Compose(n) => n.start(i).await,
        }
    }

    pub async fn pause(&mut self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.pause(i),
            Self::Compose(n) => n.pause(i).await,
        }
    }

    pub async fn resume(&mut self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.resume(i),
            Self::Compose(n) => n.resume(i).await,
        }
    }

    /// Cuts a node off the network: its connections go silent until [`Self::mend`].
    pub async fn cut(&self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.cut(i),
            Self::Compose(n) => n.cut(i).await,
        }
    }

    pub async fn mend(&self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.mend(i),
            Self::Compose(n) => n.mend(i).await,
        }
    }

    /// Stops a node as an operator does (SIGTERM, 10 s) and starts it again.
    pub async fn restart_graceful(&mut self, name: &str) -> Result<()> {
        let i = index(name)?;
        match self {
            Self::Local(n) => n.restart_graceful(i).await,
            Self::Compose(n) => n.restart_graceful(i).await,
        }
    }

    /// Every node resumed, mended and running (after the faults, whatever lift failed).
    pub async fn heal(&mut self) -> Result<()> {
        match self {
            Self::Local(n) => n.heal().await,
            Self::Compose(n) => n.heal().await,
        }
    }

    /// Paused nodes resumed, on the way out (a compose project is removed as a whole).
    pub fn resume_all(&self) {
        if let Self::Local(n) = self {
            n.resume_all();
        }
    }

    pub fn keep_logs(&self, dir: &Path) {
        match self {
            Self::Local(n) => n.keep_logs(dir),
            Self::Compose(n) => n.keep_logs(dir),
        }
    }
}

/// The index of a node's name in the plan (`nats-1` is 1).
pub fn index(name: &str) -> Result<usize> {
    name.strip_prefix("nats-")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no nats node {name}"))
}
