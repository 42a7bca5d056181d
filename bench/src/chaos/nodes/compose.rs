//! The compose file's cluster profile as the campaign's cluster (`--nats compose`): its three
//! nats services (`nats`, `nats-2`, `nats-3`, docker-compose.yml) brought up by docker-compose
//! on the nats image scripts/build-images.sh builds (`turnstile-nats:local`; built here from
//! the harness's nats-server when missing), with the profile's own restart policy, command
//! line and cluster routes. What the campaign sets through the file's variables and a
//! generated override (nothing in docker-compose.yml is changed for it):
//! - the config: the shipped cluster config's `cluster` and `jetstream` blocks (routes by
//!   service name, `sync_interval: always`), open: no accounts, since the campaign's services
//!   and workload connect without users (the shipped accounts are run by test-compose.sh and
//!   the integration suite's `deployed` tests);
//! - each store (`/data`) on the campaign's small disk, so a disk-full fault can fill it;
//! - a network with fixed addresses, so a node started again keeps its address (the services
//!   run on the host and connect to the containers' addresses).
//!
//! Faults as Docker does them: `docker kill` (SIGKILL) then `docker start`; `docker pause` and
//! `unpause` (the cgroup freezer: a SIGSTOP the process cannot see); the container's veth set
//! down on the host's side (silent, as in net.rs: no reset, no FIN); `docker restart` after a
//! full disk is freed (SIGTERM, then SIGKILL after 10 s).
//!
//! The project is named `tschaos<pid>`; the next campaign removes what one no longer running
//! left (`docker::sweep_orphans`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::docker::{docker, ensure_image, ip, ip_out, output, IMAGE, PROJECT_PREFIX};

/// The profile's nats services, in the campaign's node order (`nats-0` is `nats`).
pub const SERVICES: [&str; 3] = ["nats", "nats-2", "nats-3"];

pub struct Compose {
    project: String,
    /// docker-compose.yml and the campaign's override.
    files: [PathBuf; 2],
    /// The variables docker-compose.yml reads.
    env: Vec<(String, String)>,
    /// Each node's fixed address.
    addrs: Vec<String>,
    /// The host-side veth of each node cut off now (its name changes when a node restarts).
    cut: std::sync::Mutex<BTreeMap<usize, String>>,
}

impl Compose {
    /// Brings the profile's three nats services up, each store at `stores[i]`, and waits
    /// (≤ 90 s) until every node answers JetStream requests.
    pub async fn up(dir: &Path, stores: &[PathBuf]) -> Result<Self> {
        anyhow::ensure!(
            stores.len() == SERVICES.len(),
            "the profile has three nodes"
        );
        docker(&["info", "--format", "{{.ServerVersion}}"])
            .await
            .context("no Docker engine answers")?;
        ensure_image().await?;
        let pid = std::process::id();
        let project = format!("{PROJECT_PREFIX}{pid}");
        let subnet = format!("10.{}.{}", 150 + (pid / 256) % 50, pid % 256);
        let addrs: Vec<String> = (0..SERVICES.len())
            .map(|i| format!("{subnet}.{}", 11 + i))
            .collect();
        let config = dir.join("nats-compose.conf");
        std::fs::write(&config, CONFIG).with_context(|| format!("write {}", config.display()))?;
        let env_file = dir.join("compose.env");
        std::fs::write(&env_file, "").with_context(|| format!("write {}", env_file.display()))?;
        let overlay = dir.join("compose.chaos.yml");
        std::fs::write(&overlay, override_file(&subnet, &addrs, stores))
            .with_context(|| format!("write {}", overlay.display()))?;
        let env = vec![
            ("NATS_CONFIG".into(), config.to_string_lossy().into_owned()),
            ("NATS_IMAGE".into(), IMAGE.into()),
            (
                "TURNSTILE_ENV_FILE".into(),
                env_file.to_string_lossy().into_owned(),
            ),
            (
                "NATS_PORT".into(),
                turnstile_tests::free_port()?.to_string(),
            ),
            (
                "NATS_MONITOR_PORT".into(),
                turnstile_tests::free_port()?.to_string(),
            ),
        ];
        let this = Self {
            project,
            files: [
                turnstile_tests::workspace_root().join("docker-compose.yml"),
                overlay,
            ],
            env,
            addrs,
            cut: Default::default(),
        };
        let mut up = vec!["--profile", "cluster", "up", "-d", "--no-build"];
        up.extend(SERVICES);
        this.compose(&up).await?;
        for i in 0..SERVICES.len() {
            this.wait_answers(i, Duration::from_secs(90)).await?;
        }
        Ok(this)
    }

    pub fn urls(&self) -> Vec<String> {
        self.addrs
            .iter()
            .map(|a| format!("nats://{a}:4222"))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    pub async fn kill(&self, i: usize) -> Result<()> {
        docker(&["kill", "--signal", "KILL", &self.container(i)?]).await?;
        Ok(())
    }

    /// Starts a node again (it may already run: the restart policy may have started it) and
    /// waits (≤ 30 s) until it answers.
    pub async fn start(&self, i: usize) -> Result<()> {
        docker(&["start", &self.container(i)?]).await?;
        self.wait_answers(i, Duration::from_secs(30)).await
    }

    pub async fn pause(&self, i: usize) -> Result<()> {
        docker(&["pause", &self.container(i)?]).await?;
        Ok(())
    }

    pub async fn resume(&self, i: usize) -> Result<()> {
        let container = self.container(i)?;
        if self.state(&container).await?.paused {
            docker(&["unpause", &container]).await?;
        }
        Ok(())
    }

    /// Sets the node's veth down on the host's side: nothing in or out until [`Self::mend`].
    pub async fn cut(&self, i: usize) -> Result<()> {
        let veth = self.veth(i).await?;
        ip(&["link", "set", &veth, "down"]).await?;
        self.cut_veths()?.insert(i, veth);
        Ok(())
    }

    /// Sets the node's veth up again (a veth gone with a restart counts as mended).
    pub async fn mend(&self, i: usize) -> Result<()> {
        let Some(veth) = self.cut_veths()?.remove(&i) else {
            return Ok(());
        };
        let listed = ip_out(&["-o", "link", "show"]).await?;
        if listed.contains(&format!(" {veth}@")) {
            ip(&["link", "set", &veth, "up"]).await?;
        }
        Ok(())
    }

    /// What an operator does after a full disk is freed: `docker restart` (SIGTERM, 10 s).
    pub async fn restart_graceful(&self, i: usize) -> Result<()> {
        docker(&["restart", "--time", "10", &self.container(i)?]).await?;
        self.wait_answers(i, Duration::from_secs(30)).await
    }

    /// Every node resumed, mended and running.
    pub async fn heal(&self) -> Result<()> {
        for i in 0..self.len() {
            let _ = self.mend(i).await;
            self.resume(i).await?;
            let container = self.container(i)?;
            if !self.state(&container).await?.running {
                self.start(i).await?;
            }
        }
        Ok(())
    }

    /// Each node's log (`docker logs`) written to `<dir>/nats-<i>.log`.
    pub fn keep_logs(&self, dir: &Path) {
        for i in 0..self.len() {
            let to = dir.join(format!("nats-{i}.log"));
            let Ok(container) = self.container(i) else {
                continue;
            };
            match std::process::Command::new("docker")
                .args(["logs", &container])
                .output()
            {
                Ok(out) => {
                    let mut text = out.stdout;
                    text.extend_from_slice(&out.stderr);
                    if let Err(e) = std::fs::write(&to, text) {
                        eprintln!("chaos: keep {}: {e}", to.display());
                    }
                }
                Err(e) => eprintln!("chaos: docker logs {container}: {e}"),
            }
        }
    }

    /// The container docker-compose named for node `i` (`<project>_<service>_1`).
    fn container(&self, i: usize) -> Result<String> {
        let service = SERVICES
            .get(i)
            .with_context(|| format!("no nats node {i} in the compose profile"))?;
        Ok(format!("{}_{service}_1", self.project))
    }

    async fn compose(&self, args: &[&str]) -> Result<String> {
        let mut command = tokio::process::Command::new("docker-compose");
        command.arg("-p").arg(&self.project);
        for f in &self.files {
            command.arg("-f").arg(f);
        }
        command.args(args).envs(self.env.iter().cloned());
        output(command, &format!("docker-compose {}", args.join(" "))).await
    }

    async fn state(&self, container: &str) -> Result<State> {
        let out = docker(&[
            "inspect",
            "--format",
            "{{.State.Running}} {{.State.Paused}} {{.State.Pid}}",
            container,
        ])
        .await?;
        let mut words = out.split_whitespace();
        Ok(State {
            running: words.next() == Some("true"),
            paused: words.next() == Some("true"),
            pid: words.next().and_then(|p| p.parse().ok()).unwrap_or(0),
        })
    }

    /// The host-side veth of the node's `eth0` (the peer index `eth0@if<N>` names).
    async fn veth(&self, i: usize) -> Result<String> {
        let state = self.state(&self.container(i)?).await?;
        if !state.running || state.pid == 0 {
            bail!("nats node {i} is not running: nothing to cut");
        }
        let pid = state.pid.to_string();
        let mut command = tokio::process::Command::new("nsenter");
        command.args(["-t", &pid, "-n", "ip", "-o", "link", "show", "eth0"]);
        let inside = output(command, "nsenter ip link show eth0").await?;
        let peer = inside
            .split_whitespace()
            .nth(1)
            .and_then(|name| name.split("@if").nth(1))
            .map(|n| n.trim_end_matches(':').to_string())
            .with_context(|| format!("no veth peer in {inside:?}"))?;
        let listed = ip_out(&["-o", "link", "show"]).await?;
        listed
            .lines()
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next()? == format!("{peer}:"))
                    .then(|| words.next())
                    .flatten()
                    .and_then(|n| n.split('@').next())
                    .map(str::to_string)
            })
            .with_context(|| format!("no host link of index {peer}"))
    }

    fn cut_veths(&self) -> Result<std::sync::MutexGuard<'_, BTreeMap<usize, String>>> {
        self.cut
            .lock()
            .map_err(|_| anyhow::anyhow!("the cut list is poisoned"))
    }

    /// Until the node answers a JetStream request on its own address (bounded).
    async fn wait_answers(&self, i: usize, bound: Duration) -> Result<()> {
        let url = self
            .urls()
            .get(i)
            .cloned()
            .with_context(|| format!("no nats node {i}"))?;
        turnstile_tests::wait_until(
            &format!("nats node {i} ({url}) to answer JetStream"),
            bound,
            || {
                let url = url.clone();
                async move {
                    let connect = async_nats::ConnectOptions::new()
                        .connection_timeout(Duration::from_secs(1))
                        .connect(url.as_str());
                    let Ok(Ok(client)) =
                        tokio::time::timeout(Duration::from_secs(2), connect).await
                    else {
                        return Ok(None);
                    };
                    let js = async_nats::jetstream::new(client);
                    let info = tokio::time::timeout(Duration::from_secs(2), js.query_account());
                    Ok(matches!(info.await, Ok(Ok(_))).then_some(()))
                }
            },
        )
        .await
    }
}

impl Drop for Compose {
    /// Everything the project made: containers, network, volumes (what the override bound
    /// stays where it is: the campaign's disks).
    fn drop(&mut self) {
        let mut command = std::process::Command::new("docker-compose");
        command.arg("-p").arg(&self.project);
        for f in &self.files {
            command.arg("-f").arg(f);
        }
        command
            .args(["--profile", "cluster", "down", "-v", "--remove-orphans"])
            .envs(self.env.iter().cloned())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let _ = command.status();
    }
}

struct State {
    running: bool,
    paused: bool,
    pid: u32,
}

/// The campaign's config: the shipped cluster config's `cluster` and `jetstream` blocks,
/// without accounts (see the module's comment).
const CONFIG: &str = r#"# The fault campaign's config for docker-compose.yml's cluster profile: the shipped
# cluster config (deploy/nats-cluster.conf) without its accounts.
server_name: nats
listen: 0.0.0.0:4222
http: 0.0.0.0:8222
cluster {
  name: turnstile
  listen: 0.0.0.0:6222
  routes: [
    "nats://nats:6222",
    "nats://nats-2:6222",
    "nats://nats-3:6222"
  ]
}
jetstream {
  sync_interval: always
}
"#;

/// The override: each node's store on its disk and a fixed address on a subnet of its own.
fn override_file(subnet: &str, addrs: &[String], stores: &[PathBuf]) -> String {
    let mut text = format!(
        "# Written by the fault campaign (bench/src/chaos/nodes/compose.rs).\n\
         networks:\n  default:\n    ipam:\n      config:\n        - subnet: {subnet}.0/24\n\
         services:\n"
    );
    for ((service, addr), store) in SERVICES.iter().zip(addrs).zip(stores) {
        text.push_str(&format!(
            "  {service}:\n    networks:\n      default:\n        ipv4_address: {addr}\n    \
             volumes:\n      - \"{}:/data\"\n",
            store.display()
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    /// The profile's nodes take each of the campaign's faults and come back: a node cut off
    /// goes silent (its clients' connections stay open) and answers once mended; a paused one
    /// answers once resumed; a killed one is down until started again, on the same address and
    /// store. Skips, saying why, where no Docker engine answers.
    #[tokio::test]
    async fn the_compose_profiles_nodes_take_each_fault_and_come_back() -> Result<()> {
        if !super::super::docker::engine_answers().await {
            return Ok(());
        }
        let dir = tempfile::tempdir()?;
        let stores: Vec<PathBuf> = (0..3)
            .map(|i| dir.path().join(format!("store-{i}")))
            .collect();
        for s in &stores {
            std::fs::create_dir_all(s)?;
        }
        let nodes = Compose::up(dir.path(), &stores).await?;
        let urls = nodes.urls();
        assert!(
            stores[0].join("jetstream").is_dir(),
            "the store is on the given disk"
        );
        let connect = |url: String| async move {
            async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(url.as_str())
                .await
        };
        let asker = connect(urls[0].clone()).await?;
        let answerer = connect(urls[1].clone()).await?;
        let mut sub = answerer.subscribe("cut.echo").await?;
        answerer.flush().await?;
        let echo = answerer.clone();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(reply) = m.reply {
                    let _ = echo.publish(reply, m.payload).await;
                }
            }
        });
        let ask = || {
            tokio::time::timeout(
                Duration::from_millis(500),
                asker.request("cut.echo", "hi".into()),
            )
        };
        let answers = || {
            turnstile_tests::wait_until(
                "an answer across the cluster",
                Duration::from_secs(30),
                || async { Ok(matches!(ask().await, Ok(Ok(_))).then_some(())) },
            )
        };
        answers().await?;

        nodes.cut(1).await?;
        assert!(ask().await.is_err(), "a cut node must not answer");
        assert_ne!(
            answerer.connection_state(),
            async_nats::connection::State::Disconnected,
            "a cut is silent: the connection is not closed"
        );
        nodes.mend(1).await?;
        answers().await?;

        nodes.pause(1).await?;
        assert!(ask().await.is_err(), "a paused node must not answer");
        nodes.resume(1).await?;
        answers().await?;

        nodes.kill(0).await?;
        let container = nodes.container(0)?;
        assert!(!nodes.state(&container).await?.running, "killed");
        nodes.start(0).await?;
        assert!(nodes.state(&container).await?.running, "started again");
        let again = connect(urls[0].clone()).await?;
        again.flush().await?;
        Ok(())
    }
}
