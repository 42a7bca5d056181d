//! Child processes of the workspace's own binaries, for fault tests that SIGKILL a service
//! and start it again; plus the log-file and cleanup helpers shared with the NATS helper.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use tempfile::TempDir;
use tokio::process::{Child, Command};

/// Path of the workspace binary `name`.
///
/// Looks in `$TURNSTILE_BIN_DIR` when set, else in the cargo target directory of the running
/// test executable (`target/<profile>/deps/<test>` → `target/<profile>/`).
pub fn bin_path(name: &str) -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("TURNSTILE_BIN_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().context("locating the running test executable")?;
            let mut dir = exe
                .parent()
                .with_context(|| format!("{} has no parent directory", exe.display()))?;
            if dir.file_name() == Some(OsStr::new("deps")) {
                dir = dir.parent().unwrap_or(dir);
            }
            dir.to_path_buf()
        }
    };
    let path = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !path.is_file() {
        anyhow::bail!(
            "binary `{name}` not found at {}; run `cargo build --workspace --bins` first \
             (or point TURNSTILE_BIN_DIR at the directory holding it)",
            path.display()
        );
    }
    Ok(path)
}

/// A running (or killed) workspace binary whose stdout and stderr are appended to a log file.
///
/// The child is SIGKILLed when this value is dropped.
#[derive(Debug)]
pub struct ServiceProcess {
    child: Option<Child>,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log_path: PathBuf,
    // Declared last: the temp dir is removed only after the child is gone.
    _dir: Option<TempDir>,
}

impl ServiceProcess {
    /// Starts `bin` with `args` and extra `envs`, logging to `<new temp dir>/<log_name>`.
    ///
    /// `bin` is a workspace binary name resolved with [`bin_path`], or a path (absolute, or
    /// containing `/`) used as is. Must be called inside a tokio runtime.
    pub fn spawn(
        bin: &str,
        args: &[String],
        envs: &[(String, String)],
        log_name: &str,
    ) -> anyhow::Result<ServiceProcess> {
        let dir = tempfile::Builder::new()
            .prefix("turnstile-proc-")
            .tempdir()
            .context("creating a temp dir for the process log")?;
        let log_path = dir.path().join(log_name);
        Self::spawn_logged(bin, args, envs, log_path, Some(dir))
    }

    /// Like [`ServiceProcess::spawn`] but logs to `<log_dir>/<log_name>` (appending), so several
    /// processes of one test can share a directory that outlives them.
    pub fn spawn_in(
        log_dir: &Path,
        bin: &str,
        args: &[String],
        envs: &[(String, String)],
        log_name: &str,
    ) -> anyhow::Result<ServiceProcess> {
        Self::spawn_logged(bin, args, envs, log_dir.join(log_name), None)
    }

    fn spawn_logged(
        bin: &str,
        args: &[String],
        envs: &[(String, String)],
        log_path: PathBuf,
        dir: Option<TempDir>,
    ) -> anyhow::Result<ServiceProcess> {
        let program = if bin.contains('/') || Path::new(bin).is_absolute() {
            PathBuf::from(bin)
        } else {
            bin_path(bin)?
        };
        let mut process = ServiceProcess {
            child: None,
            program,
            args: args.to_vec(),
            envs: envs.to_vec(),
            log_path,
            _dir: dir,
        };
        process.start()?;
        Ok(process)
    }

    fn start(&mut self) -> anyhow::Result<()> {
        let (stdout, stderr) = open_log(&self.log_path, &self.program, &self.args)?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawning {}", self.program.display()))?;
        tracing::debug!(program = %self.program.display(), pid = ?child.id(), "spawned");
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILLs the process and waits until it has exited (no-op if it already exited).
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            kill_and_wait(child)
                .await
                .with_context(|| format!("killing {}", self.program.display()))?;
        }
        Ok(())
    }

    /// Kills the process if still running, then starts it again with the same program,
    /// arguments and environment, appending to the same log file.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await?;
        self.child = None;
        self.start()
    }

    /// The exit status if the process has exited, `None` while it runs.
    pub fn try_exit_status(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => anyhow::bail!("{} was never started", self.program.display()),
        }
    }

    /// Waits (bounded) for the process to exit by itself and returns its status.
    pub async fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let child = self.child.as_mut().context("process was never started")?;
        match tokio::time::timeout(timeout, child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => anyhow::bail!(
                "{} did not exit within {timeout:?}; log tail:\n{}",
                self.program.display(),
                log_tail(&self.log_path, 30)
            ),
        }
    }

    /// The last `lines` lines of the process log (an explanatory line if it cannot be read).
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path, lines)
    }

    /// Path of the log file receiving stdout and stderr.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// OS process id while the process has not been reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            kill_on_drop_and_reap(child);
        }
    }
}

/// Opens `path` for appending (creating it and its directory), writes a header naming the
/// command, and returns two handles for the child's stdout and stderr.
pub(crate) fn open_log(
    path: &Path,
    program: &Path,
    args: &[String],
) -> anyhow::Result<(Stdio, Stdio)> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating log dir {}", parent.display()))?;
    }
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening log file {}", path.display()))?;
    writeln!(file, "=== spawn: {} {}", program.display(), args.join(" "))?;
    let stderr = file.try_clone()?;
    Ok((Stdio::from(file), Stdio::from(stderr)))
}

/// Last `lines` lines of a log file, reading at most its final 64 KiB.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    const MAX_BYTES: u64 = 64 * 1024;
    let read = || -> std::io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(MAX_BYTES)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    match read() {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(err) => format!("<cannot read log {}: {err}>", path.display()),
    }
}

/// Log text appended after byte `offset` (empty if unreadable), e.g. by the latest spawn.
pub(crate) fn log_since(path: &Path, offset: u64) -> String {
    let bytes = std::fs::read(path).unwrap_or_default();
    let start = usize::try_from(offset).map_or(bytes.len(), |o| o.min(bytes.len()));
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// SIGKILL (unless already exited) and wait for the exit to be reaped.
pub(crate) async fn kill_and_wait(child: &mut Child) -> std::io::Result<()> {
    if child.try_wait()?.is_some() {
        return Ok(());
    }
    child.kill().await
}

/// Drop-time cleanup: SIGKILL and briefly (≤ 1 s) wait for the exit so temp dirs removed right
/// after are not still being written. Never panics.
pub(crate) fn kill_on_drop_and_reap(child: &mut Child) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    let _ = child.start_kill();
    for _ in 0..200 {
        match child.try_wait() {
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sleep_process_is_killed_and_logs_are_readable() {
        let mut proc =
            ServiceProcess::spawn("/bin/sleep", &["30".to_string()], &[], "sleep.log").unwrap();
        let pid = proc.pid().unwrap();
        assert!(Path::new(&format!("/proc/{pid}")).exists());
        assert!(proc.try_exit_status().unwrap().is_none());
        assert!(proc.log_tail(5).contains("=== spawn: /bin/sleep 30"));

        proc.kill().await.unwrap();
        assert!(proc.pid().is_none(), "a reaped child has no pid");
        let status = proc.try_exit_status().unwrap().unwrap();
        assert!(!status.success());
        proc.kill().await.unwrap(); // idempotent

        proc.restart().await.unwrap();
        let new_pid = proc.pid().unwrap();
        assert!(Path::new(&format!("/proc/{new_pid}")).exists());
        assert_eq!(proc.log_tail(10).matches("=== spawn").count(), 2);
        let log_dir = proc.log_path().parent().unwrap().to_path_buf();
        drop(proc);
        assert!(!log_dir.exists(), "temp dir removed on drop");
    }

    #[tokio::test]
    async fn output_goes_to_the_log_in_a_given_dir() {
        let dir = tempfile::tempdir().unwrap();
        let args = [
            "-c".to_string(),
            "echo out; echo err >&2; exit 3".to_string(),
        ];
        let envs = [("UNUSED_MARKER".to_string(), "1".to_string())];
        let mut proc =
            ServiceProcess::spawn_in(dir.path(), "/bin/sh", &args, &envs, "sh.log").unwrap();
        let status = proc.wait_exit(Duration::from_secs(10)).await.unwrap();
        assert_eq!(status.code(), Some(3));
        let tail = proc.log_tail(2);
        assert!(tail.contains("out") && tail.contains("err"), "{tail}");
        assert_eq!(proc.log_path(), dir.path().join("sh.log"));
    }

    #[test]
    fn bin_path_names_the_build_command_when_missing() {
        let err = bin_path("no-such-turnstile-binary")
            .unwrap_err()
            .to_string();
        assert!(err.contains("cargo build --workspace --bins"), "{err}");
    }

    #[test]
    fn log_tail_of_a_missing_file_explains() {
        assert!(log_tail(Path::new("/nonexistent/x.log"), 3).contains("cannot read log"));
    }
}
