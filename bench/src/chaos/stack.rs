//! The campaign's deployment: one nats-server or a three-node cluster (local processes, or
//! docker-compose.yml's cluster profile under Docker: `nodes`), every service as its own
//! process (two replicas of each, two transport hosts with mock agents in tmux), with the short
//! timings the test suite uses, so fail-overs take seconds. Each process can be SIGKILLed and
//! started again, or paused and resumed, by its name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use turnstile_tests::{bin_path, ServiceProcess};

use super::disk::SmallDisk;
use super::nodes::{Kind, Nodes};
use super::signal::signal;

/// Session-lane, broker and scheduler replicas, and the transport hosts.
pub const LANES: [&str; 2] = ["a", "b"];
pub const BROKERS: [&str; 2] = ["b1", "b2"];
pub const SCHEDULERS: [&str; 2] = ["s1", "s2"];
pub const HOSTS: [&str; 2] = ["h1", "h2"];

/// The services' timings: ack waits and pin TTL of 2 s, host TTL of 3 s (as the suite's).
pub const TIMINGS: [(&str, &str); 4] = [
    ("TURNSTILE_LANE_ACK_WAIT", "2s"),
    ("TURNSTILE_LANE_PIN_TTL", "2s"),
    ("TURNSTILE_TRANSPORT_ACK_WAIT", "2s"),
    ("TURNSTILE_HOST_TTL", "3s"),
];

/// How long provisioning is tried on a cluster that has just started.
const PROVISION_BOUND: Duration = Duration::from_secs(90);

pub struct ChaosStack {
    /// The nats nodes (none once torn down).
    nodes: Option<Nodes>,
    /// Each node's store disk, to fill (none where a mount was refused: `no_disk` says why).
    disks: Vec<SmallDisk>,
    pub no_disk: Option<String>,
    /// By name: `lane-a`, `broker-b1`, `scheduler-s1`, `transport-h1`.
    pub services: BTreeMap<String, ServiceProcess>,
    /// Services a `kill_service` fault holds down: the supervisor leaves them to the fault.
    pub down: std::collections::BTreeSet<String>,
    /// Logs, stores, mock agents' transcripts; kept after a failed campaign (`keep`).
    dir: PathBuf,
    cleanup: Option<tempfile::TempDir>,
}

impl ChaosStack {
    pub async fn start(replicas: usize, kind: Kind) -> Result<Self> {
        // What campaigns killed outright left (their cluster network, their store mounts,
        // their compose projects).
        for left in super::net::sweep_orphans()
            .into_iter()
            .chain(super::disk::sweep_orphans())
            .chain(super::nodes::docker::sweep_orphans())
        {
            eprintln!("chaos: removed what a campaign no longer running left: {left}");
        }
        let dir = tempfile::Builder::new()
            .prefix(&super::disk::dir_prefix(std::process::id()))
            .tempdir()?;
        let (disks, no_disk) = match (0..replicas)
            .map(|i| SmallDisk::mount(&dir.path().join(format!("store-{i}"))))
            .collect::<Result<Vec<_>>>()
        {
            Ok(d) => (d, None),
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        };
        let stores = (0..replicas)
            .map(|i| disks.get(i).map(|d| d.path().to_path_buf()))
            .collect();
        let nodes = Nodes::start(kind, dir.path(), stores).await?;
        let mut stack = Self {
            nodes: Some(nodes),
            disks,
            no_disk,
            services: BTreeMap::new(),
            down: Default::default(),
            dir: dir.path().to_path_buf(),
            cleanup: Some(dir),
        };
        stack.provision(replicas).await?;
        for r in LANES {
            stack.spawn(
                "turnstile-session-lane",
                &format!("lane-{r}"),
                &["--replica", r],
            )?;
        }
        for r in BROKERS {
            stack.spawn(
                "turnstile-notification-broker",
                &format!("broker-{r}"),
                &["--replica", r],
            )?;
        }
        for r in SCHEDULERS {
            stack.spawn(
                "turnstile-scheduler",
                &format!("scheduler-{r}"),
                &["--replica", r],
            )?;
        }
        for h in HOSTS {
            let data = stack.host_dir(h).to_string_lossy().into_owned();
            let mock = stack.mock_dir().to_string_lossy().into_owned();
            let agent = bin_path("turnstile")?.to_string_lossy().into_owned();
            stack.spawn(
                "turnstile-transport-agent",
                &format!("transport-{h}"),
                &[
                    "--host",
                    h,
                    "--data-dir",
                    &data,
                    "--mock-state-dir",
                    &mock,
                    "--agent-bin",
                    &agent,
                    "--ready-timeout",
                    "20s",
                ],
            )?;
        }
        Ok(stack)
    }

    /// A client of the campaign's own, on every node (it fails over between them).
    pub async fn connect(&self) -> Result<async_nats::Client> {
        let addrs = self
            .urls()
            .iter()
            .map(|u| u.parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect(addrs)
            .await?)
    }

    /// Every node's URL, comma-separated (as the services read `TURNSTILE_NATS_URL`).
    pub fn url(&self) -> String {
        self.urls().join(",")
    }

    fn urls(&self) -> Vec<String> {
        self.nodes.as_ref().map(Nodes::urls).unwrap_or_default()
    }

    pub fn mock_dir(&self) -> PathBuf {
        self.dir.as_path().join("mock-agent")
    }

    pub fn host_dir(&self, host: &str) -> PathBuf {
        self.dir.as_path().join(format!("host-{host}"))
    }

    /// Where traced step commands log each start.
    pub fn step_log(&self) -> PathBuf {
        self.dir.as_path().join("step-starts.log")
    }

    async fn provision(&self, replicas: usize) -> Result<()> {
        let js = async_nats::jetstream::new(self.connect().await?);
        let topology = turnstile_shared::topology::TopologyConfig {
            lane_ack_wait: Duration::from_secs(2),
            lane_pin_ttl: Duration::from_secs(2),
            transport_ack_wait: Duration::from_secs(2),
            host_ttl: Duration::from_secs(3),
            replicas,
            ..Default::default()
        };
        // A cluster just started may still be electing its JetStream leader: provisioning is
        // tried again until it works, within a bound, as the deployment's provision step is
        // (docker-compose.yml: `restart: on-failure`).
        let deadline = tokio::time::Instant::now() + PROVISION_BOUND;
        loop {
            match turnstile_shared::topology::provision(&js, &topology).await {
                Ok(_) => return Ok(()),
                Err(e) if tokio::time::Instant::now() < deadline => {
                    eprintln!("chaos: provision: {e}; trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("provision within {PROVISION_BOUND:?}"))
                }
            }
        }
    }

    fn spawn(&mut self, bin: &str, name: &str, args: &[&str]) -> Result<()> {
        let mut env: Vec<(String, String)> = TIMINGS
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.push(("TURNSTILE_NATS_URL".into(), self.url()));
        env.push((
            "RUST_LOG".into(),
            log_filter(std::env::var("TURNSTILE_CHAOS_LOG").ok()),
        ));
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let p =
            ServiceProcess::spawn_in(self.dir.as_path(), bin, &args, &env, &format!("{name}.log"))?;
        self.services.insert(name.to_string(), p);
        Ok(())
    }

    pub fn service(&mut self, name: &str) -> Result<&mut ServiceProcess> {
        self.services
            .get_mut(name)
            .with_context(|| format!("no service {name}"))
    }

    /// The nats nodes, to fault one.
    pub fn nodes(&mut self) -> Result<&mut Nodes> {
        self.nodes.as_mut().context("the stack is torn down")
    }

    /// The store disk of a node, when the stack has them.
    pub fn disk(&self, name: &str) -> Result<&SmallDisk> {
        if let Some(why) = &self.no_disk {
            bail!("no disk of its own: {why}");
        }
        let i = super::nodes::index(name)?;
        self.disks
            .get(i)
            .with_context(|| format!("no disk for {name}"))
    }

    /// Mends every node's network, resumes and starts every node, frees every store disk
    /// (after the faults, whatever lift failed).
    pub async fn heal_nodes(&mut self) -> Result<()> {
        for d in &self.disks {
            let _ = d.free();
        }
        self.nodes()?.heal().await
    }

    /// The tmux socket of a host's transport agent.
    pub fn tmux_socket(&self, host: &str) -> PathBuf {
        self.host_dir(host).join("tmux.sock")
    }

    /// The pid of the agent in a session's pane on `host`, if it has one.
    pub fn agent_pid(&self, host: &str, session: &str) -> Option<u32> {
        let out = std::process::Command::new("tmux")
            .arg("-S")
            .arg(self.tmux_socket(host))
            .args([
                "list-panes",
                "-t",
                &format!("={session}"),
                "-F",
                "#{pane_pid}",
            ])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    }

    /// Kills a host's tmux server (every terminal of the host at once).
    pub fn kill_tmux(&self, host: &str) -> Result<()> {
        let status = std::process::Command::new("tmux")
            .arg("-S")
            .arg(self.tmux_socket(host))
            .arg("kill-server")
            .stderr(std::process::Stdio::null())
            .status()?;
        // A host whose tmux server is gone already has nothing to kill: not an error.
        let _ = status;
        Ok(())
    }

    pub fn log_dir(&self) -> &Path {
        self.dir.as_path()
    }

    /// Keeps the campaign's directory (logs, transcripts) after the stack is gone, with a
    /// copy of each nats node's log (`nats-<i>.log`; the node's own directory goes with it).
    pub fn keep(&mut self) {
        if let Some(d) = self.cleanup.take() {
            let _ = d.keep();
        }
        if let Some(nodes) = &self.nodes {
            nodes.keep_logs(&self.dir);
        }
    }
}

impl ChaosStack {
    /// Ends everything now (a campaign stopped by a signal): every process, the tmux servers,
    /// the cluster's network and the store mounts. The directory is kept when [`Self::keep`]
    /// was called.
    pub fn teardown(&mut self) {
        self.resume_all();
        self.services.clear();
        self.nodes = None;
        self.disks.clear();
        self.no_disk = Some("torn down".into());
        self.cleanup = None;
    }

    /// Paused processes are resumed (so a SIGKILL takes); tmux servers are ended.
    fn resume_all(&self) {
        for p in self.services.values() {
            if let Some(pid) = p.pid() {
                let _ = signal(pid, rustix::process::Signal::CONT);
            }
        }
        if let Some(nodes) = &self.nodes {
            nodes.resume_all();
        }
        for h in HOSTS {
            let _ = self.kill_tmux(h);
        }
    }
}

impl Drop for ChaosStack {
    fn drop(&mut self) {
        self.resume_all();
    }
}

/// The services' log filter: `TURNSTILE_CHAOS_LOG` when set (a replay read closely, e.g.
/// `info,async_nats=warn,turnstile_session_lane::lane=debug`), else info without the client's
/// chatter.
fn log_filter(chaos_log: Option<String>) -> String {
    chaos_log
        .filter(|f| !f.trim().is_empty())
        .unwrap_or_else(|| "info,async_nats=warn".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_services_log_at_info_unless_the_campaign_is_told_otherwise() {
        assert_eq!(log_filter(None), "info,async_nats=warn");
        assert_eq!(log_filter(Some(" ".into())), "info,async_nats=warn");
        let close = "info,async_nats=warn,turnstile_session_lane=debug";
        assert_eq!(log_filter(Some(close.into())), close);
    }
}
