//! A real `nats-server` (JetStream, file store) per test, started with a bounded readiness
//! wait instead of sleeps, SIGKILLable and restartable on the same port and store directory
//! so tests can prove that state survives a broker crash.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::process::{kill_and_wait, kill_on_drop_and_reap, log_since, log_tail, open_log};

/// Overall budget for one start or restart, including port-in-use retries.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between readiness probes and between spawn retries.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);
/// Upper bound for a single readiness probe (connect + JetStream account query).
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
const LOG_TAIL_LINES: usize = 30;

/// Path of the `nats-server` binary: `$NATS_SERVER_BIN`, else
/// `<workspace root>/.tools/bin/nats-server`, else `nats-server` on `PATH`.
pub fn nats_server_bin() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN").filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        anyhow::ensure!(
            bin.is_file(),
            "NATS_SERVER_BIN={} does not exist",
            bin.display()
        );
        return Ok(bin);
    }
    let tools = crate::workspace_root().join(".tools/bin/nats-server");
    if tools.is_file() {
        return Ok(tools);
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(found) = std::env::split_paths(&path)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
        {
            return Ok(found);
        }
    }
    anyhow::bail!(
        "nats-server not found (looked at $NATS_SERVER_BIN, {}, and PATH); \
         run `bash scripts/install-nats-server.sh` from the workspace root",
        tools.display()
    )
}

/// Where a server runs, beyond the defaults (loopback; a store in the server's own temp dir).
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// A network namespace to run in (`ip netns exec NS`) and the address the server listens
    /// on there: a fault test cuts the namespace off the network, and the server's
    /// connections go silent without closing.
    pub netns: Option<(String, String)>,
    /// A store directory of the caller's (a small filesystem of its own, to fill up).
    pub store_dir: Option<PathBuf>,
}

/// A `nats-server` child process with JetStream and a file store in its own temp dir.
///
/// Listens on `127.0.0.1:<port>`; the port and store stay the same across
/// [`NatsServer::restart`]. The process is SIGKILLed when this value is dropped.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    bin: PathBuf,
    port: u16,
    monitor_port: u16,
    /// Server name, unique per instance and stable across restarts; the readiness probe checks
    /// it so a different server that grabbed the port is never mistaken for this one.
    name: String,
    store_dir: PathBuf,
    log_path: PathBuf,
    /// A server configuration file (accounts, users, permissions); the flags above override
    /// its address, port, store and monitoring port.
    config: Option<PathBuf>,
    /// Environment of the server process (a config's `$PASSWORD` variables).
    env: Vec<(String, String)>,
    /// The user the readiness probe and [`NatsServer::client`] connect as, with a config.
    user: Option<(String, String)>,
    /// TLS files the probe and [`NatsServer::client`] connect with (`TURNSTILE_TLS_*` names).
    tls: Vec<(&'static str, String)>,
    /// The address it listens on (`127.0.0.1` unless placed in a network namespace).
    host: String,
    /// The network namespace it runs in (`ip netns exec`), if any.
    netns: Option<String>,
    // Declared last: removed only after the child is gone.
    _dir: TempDir,
}

impl NatsServer {
    /// Starts a server on a random free port and waits (≤ 10 s) until JetStream answers.
    pub async fn start() -> anyhow::Result<NatsServer> {
        Self::start_inner(None, Vec::new(), None, Vec::new(), Placement::default()).await
    }

    /// Like [`NatsServer::start`], with a configuration file (e.g. the shipped
    /// `deploy/nats-server.conf`), its environment, and the user to probe and connect as.
    pub async fn start_with_config(
        config: &Path,
        env: Vec<(String, String)>,
        user: Option<(String, String)>,
        tls: Vec<(&'static str, String)>,
    ) -> anyhow::Result<NatsServer> {
        Self::start_inner(
            Some(config.to_path_buf()),
            env,
            user,
            tls,
            Placement::default(),
        )
        .await
    }

    /// Like [`NatsServer::start_with_config`] (no users), placed as `placement` says.
    pub async fn start_placed(
        config: Option<&Path>,
        placement: Placement,
    ) -> anyhow::Result<NatsServer> {
        Self::start_inner(
            config.map(Path::to_path_buf),
            Vec::new(),
            None,
            Vec::new(),
            placement,
        )
        .await
    }

    async fn start_inner(
        config: Option<PathBuf>,
        env: Vec<(String, String)>,
        user: Option<(String, String)>,
        tls: Vec<(&'static str, String)>,
        placement: Placement,
    ) -> anyhow::Result<NatsServer> {
        let bin = nats_server_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("turnstile-nats-")
            .tempdir()
            .context("creating a temp dir for nats-server")?;
        let store_dir = placement
            .store_dir
            .unwrap_or_else(|| dir.path().join("store"));
        std::fs::create_dir_all(&store_dir)
            .with_context(|| format!("creating {}", store_dir.display()))?;
        let mut server = NatsServer {
            child: None,
            bin,
            port: crate::free_port()?,
            monitor_port: 0,
            name: dir.path().file_name().map_or_else(
                || "turnstile-nats".to_string(),
                |unique| unique.to_string_lossy().into_owned(),
            ),
            store_dir,
            log_path: dir.path().join("nats-server.log"),
            config,
            env,
            user,
            tls,
            host: placement
                .netns
                .as_ref()
                .map_or_else(|| "127.0.0.1".to_string(), |(_, host)| host.clone()),
            netns: placement.netns.map(|(ns, _)| ns),
            _dir: dir,
        };
        // A fresh server may pick another port if the random one got taken meanwhile.
        server.launch(false).await?;
        Ok(server)
    }

    /// `nats://127.0.0.1:<port>` (the namespace's address when placed in one).
    pub fn url(&self) -> String {
        format!("nats://{}:{}", self.host, self.port)
    }

    /// `nats://user:password@127.0.0.1:<port>`, for a service's own identity.
    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!("nats://{user}:{password}@{}:{}", self.host, self.port)
    }

    /// Client port (stable across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// HTTP monitoring port of the current process (may change on restart).
    pub fn monitor_port(&self) -> u16 {
        self.monitor_port
    }

    /// JetStream store directory (stable across restarts).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// Log file with the server's stdout and stderr from every start.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path, lines)
    }

    /// OS process id while the server runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// SIGSTOPs the server: its connections stay open and nothing is answered until
    /// [`NatsServer::resume`] (a SIGKILL on drop still ends it).
    /// Returns once every thread of the server is stopped (bounded: 2 s), so nothing sent
    /// after it is answered.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal(rustix::process::Signal::STOP)?;
        let pid = self.pid().context("nats-server is not running")?;
        let stopped = || {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))?;
            let mut all = true;
            for task in tasks {
                let stat = std::fs::read_to_string(task?.path().join("stat"))?;
                // The state follows the command's closing parenthesis.
                let state = stat.rsplit(')').next().unwrap_or_default().trim_start();
                all &= state.starts_with('T') || state.starts_with('t');
            }
            std::io::Result::Ok(all)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while !stopped()? {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "nats-server did not stop within 2 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal(rustix::process::Signal::CONT)
    }

    /// One signal to the server's process (never a group).
    fn signal(&self, sig: rustix::process::Signal) -> anyhow::Result<()> {
        let pid = self.pid().context("nats-server is not running")?;
        let pid = rustix::process::Pid::from_raw(i32::try_from(pid)?).context("pid")?;
        rustix::process::kill_process(pid, sig).context("signal nats-server")?;
        Ok(())
    }

    /// SIGKILLs the server and waits for it to exit (no-op when not running).
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            kill_and_wait(&mut child)
                .await
                .context("killing nats-server")?;
        }
        Ok(())
    }

    /// Stops the server as an operator's service manager does (SIGTERM: it closes its
    /// connections and writes its stores' state), waits (≤ `grace`, then SIGKILL) for it to
    /// exit, and starts it again on the same port and store (≤ 10 s until JetStream answers).
    pub async fn restart_graceful(&mut self, grace: Duration) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                }
            }
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                tracing::warn!(?grace, "nats-server did not stop on SIGTERM; killing it");
            }
        }
        self.restart().await
    }

    /// Starts the server again on the same port and store directory (killing it first if it
    /// still runs) and waits (≤ 10 s) until JetStream answers. Retries while the old port is
    /// still held.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await?;
        self.launch(true).await
    }

    /// A client connected to this server that reconnects quickly (≤ 250 ms between attempts)
    /// after a kill/restart, so tests do not wait out the default multi-second backoff.
    pub async fn client(&self) -> anyhow::Result<async_nats::Client> {
        with_user(async_nats::ConnectOptions::new(), &self.user, &self.tls)
            .connection_timeout(Duration::from_secs(2))
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts as u64 * 25).min(250))
            })
            .connect(self.url())
            .await
            .with_context(|| format!("connecting to {}", self.url()))
    }

    /// Spawns and waits for readiness until [`START_TIMEOUT`], retrying when a port is in use
    /// (`keep_port` = false also moves the client port in that case).
    async fn launch(&mut self, keep_port: bool) -> anyhow::Result<()> {
        let started = Instant::now();
        let deadline = started + START_TIMEOUT;
        loop {
            let log_offset = std::fs::metadata(&self.log_path).map_or(0, |m| m.len());
            self.monitor_port = crate::free_port()?;
            let child = self.spawn()?;
            match self.wait_ready(child, deadline).await? {
                Ok(child) => {
                    tracing::debug!(url = %self.url(), pid = ?child.id(), "nats-server ready");
                    self.child = Some(child);
                    return Ok(());
                }
                Err(status) => {
                    let in_use =
                        log_since(&self.log_path, log_offset).contains("address already in use");
                    if !in_use || Instant::now() + PROBE_INTERVAL >= deadline {
                        anyhow::bail!(
                            "nats-server on port {} exited during startup ({status}) after {:?}; \
                             log tail:\n{}",
                            self.port,
                            started.elapsed(),
                            self.log_tail(LOG_TAIL_LINES)
                        );
                    }
                    if !keep_port {
                        self.port = crate::free_port()?;
                    }
                    tracing::debug!(port = self.port, "port in use, retrying nats-server spawn");
                    tokio::time::sleep(PROBE_INTERVAL).await;
                }
            }
        }
    }

    fn spawn(&self) -> anyhow::Result<Child> {
        let pairs = [
            ("-a", self.host.clone()),
            ("-p", self.port.to_string()),
            ("-sd", self.store_dir.display().to_string()),
            ("-m", self.monitor_port.to_string()),
            ("-n", self.name.clone()),
        ];
        let mut args = match &self.config {
            Some(c) => vec!["-c".to_string(), c.display().to_string()],
            None => Vec::new(),
        };
        args.push("-js".to_string());
        args.extend(
            pairs
                .into_iter()
                .flat_map(|(flag, value)| [flag.to_string(), value]),
        );
        let (stdout, stderr) = open_log(&self.log_path, &self.bin, &args)?;
        // In a namespace, `ip netns exec` execs the server: the child's pid is the server's.
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        command
            .args(&args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.display()))
    }

    /// Probes until JetStream answers (`Ok(Ok(child))`), the child exits (`Ok(Err(status))`),
    /// or `deadline` passes (then the child is killed and an error with the log tail returned).
    async fn wait_ready(
        &self,
        mut child: Child,
        deadline: Instant,
    ) -> anyhow::Result<Result<Child, ExitStatus>> {
        let mut last_err = String::from("no probe completed");
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(Err(status));
            }
            let now = Instant::now();
            if now >= deadline {
                let _ = kill_and_wait(&mut child).await;
                anyhow::bail!(
                    "nats-server at {} not ready within {START_TIMEOUT:?}; last probe error: \
                     {last_err}; log tail:\n{}",
                    self.url(),
                    self.log_tail(LOG_TAIL_LINES)
                );
            }
            let budget = PROBE_TIMEOUT.min(deadline - now);
            match tokio::time::timeout(
                budget,
                probe(&self.url(), &self.name, &self.user, &self.tls),
            )
            .await
            {
                Ok(Ok(())) => return Ok(Ok(child)),
                Ok(Err(err)) => last_err = format!("{err:#}"),
                Err(_) => last_err = format!("probe timed out after {budget:?}"),
            }
            tokio::time::sleep(PROBE_INTERVAL).await;
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            kill_on_drop_and_reap(child);
        }
    }
}

fn with_user(
    opts: async_nats::ConnectOptions,
    user: &Option<(String, String)>,
    tls: &[(&'static str, String)],
) -> async_nats::ConnectOptions {
    let opts = turnstile_shared::config::with_tls(opts, tls);
    match user {
        Some((u, p)) => opts.user_and_password(u.clone(), p.clone()),
        None => opts,
    }
}

/// Ready means: a client connects to the server named `name` and the JetStream account info
/// request succeeds.
async fn probe(
    url: &str,
    name: &str,
    user: &Option<(String, String)>,
    tls: &[(&'static str, String)],
) -> anyhow::Result<()> {
    let client = with_user(async_nats::ConnectOptions::new(), user, tls)
        .connection_timeout(PROBE_TIMEOUT)
        .connect(url)
        .await?;
    let found = client.server_info().server_name;
    anyhow::ensure!(
        found == name,
        "port answered by server `{found}`, not `{name}`"
    );
    async_nats::jetstream::new(client)
        .query_account()
        .await
        .context("JetStream account query")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::jetstream::{self, stream};

    #[tokio::test]
    async fn jetstream_file_store_survives_sigkill_and_restart() {
        crate::init_tracing();
        let mut server = NatsServer::start().await.unwrap();
        let port = server.port();
        assert_eq!(server.url(), format!("nats://127.0.0.1:{port}"));
        assert!(server.store_dir().is_dir());

        let js = jetstream::new(server.client().await.unwrap());
        js.create_stream(stream::Config {
            name: "HARNESS".to_string(),
            subjects: vec!["harness.>".to_string()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .unwrap();
        let ack = js.publish("harness.one", "survives".into()).await.unwrap();
        let ack = ack.await.unwrap();

        server.kill().await.unwrap();
        assert!(server.pid().is_none());
        assert!(server.client().await.is_err(), "server must be down");

        server.restart().await.unwrap();
        assert_eq!(server.port(), port, "same port after restart");

        // A fresh client reads the message back from the file store.
        let js2 = jetstream::new(server.client().await.unwrap());
        let stream = js2.get_stream("HARNESS").await.unwrap();
        let msg = stream.get_raw_message(ack.sequence).await.unwrap();
        assert_eq!(&msg.payload[..], b"survives");

        // The pre-kill client reconnects to the same port by itself.
        let republish = || async {
            let ack = js.publish("harness.two", "again".into()).await?.await?;
            Ok(Some(ack))
        };
        let ack2 = crate::wait_until(
            "old client to republish",
            Duration::from_secs(10),
            republish,
        )
        .await
        .unwrap();
        assert_eq!(ack2.sequence, ack.sequence + 1);
        assert_eq!(server.log_tail(1000).matches("=== spawn").count(), 2);
    }

    #[tokio::test]
    async fn restart_of_a_running_server_and_drop_cleanup() {
        let mut server = NatsServer::start().await.unwrap();
        let first = server.pid().unwrap();
        server.restart().await.unwrap();
        assert_ne!(server.pid().unwrap(), first);
        let dir = server.log_path().parent().unwrap().to_path_buf();
        drop(server);
        assert!(!dir.exists(), "temp dir removed on drop");
    }

    #[tokio::test]
    async fn restart_retries_while_the_port_is_still_held() {
        let mut server = NatsServer::start().await.unwrap();
        server.kill().await.unwrap();
        let squatter = std::net::TcpListener::bind(("127.0.0.1", server.port())).unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(squatter);
        });
        server.restart().await.unwrap();
        release.await.unwrap();
        assert!(server.log_tail(1000).contains("address already in use"));
        server.client().await.unwrap();
    }

    #[tokio::test]
    async fn a_server_that_exits_fails_fast_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut server = NatsServer {
            child: None,
            bin: PathBuf::from("/bin/false"),
            port: crate::free_port().unwrap(),
            monitor_port: 0,
            name: "exits".to_string(),
            store_dir: dir.path().join("store"),
            log_path: dir.path().join("nats-server.log"),
            config: None,
            env: Vec::new(),
            user: None,
            tls: Vec::new(),
            host: "127.0.0.1".to_string(),
            netns: None,
            _dir: dir,
        };
        let started = Instant::now();
        let err = format!("{:#}", server.launch(true).await.unwrap_err());
        assert!(started.elapsed() < Duration::from_secs(2), "{err}");
        assert!(err.contains("exited during startup"), "{err}");
        assert!(err.contains("=== spawn: /bin/false"), "{err}");
    }

    #[test]
    fn finds_a_nats_server_binary() {
        assert!(nats_server_bin().unwrap().is_file());
    }
}
