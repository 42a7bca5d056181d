//! Test-harness library for Turnstile: real `nats-server` and service child processes with
//! bounded readiness waits (never fixed sleeps), SIGKILL fault injection and cleanup on drop.
//!
//! * [`NatsServer`] — a JetStream-enabled `nats-server` on a random port with a file store
//!   that survives [`NatsServer::kill`] + [`NatsServer::restart`].
//! * [`ServiceProcess`] — one of the workspace binaries (see [`bin_path`]) run as a child
//!   process whose output goes to a log file, for crash/restart tests.
//! * [`wait_until`] — bounded polling for state that has no event to wait on.

pub mod model;
mod nats;
mod process;
mod wait;

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};

use anyhow::Context as _;

pub use nats::{nats_server_bin, NatsServer, Placement};
pub use process::{bin_path, ServiceProcess};
pub use wait::{wait_lanes_pulled, wait_until};

/// The workspace root: the parent of this crate's manifest directory.
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// A real agent CLI (`claude`, `codex`): `$TURNSTILE_<NAME>_BIN`, else what
/// `scripts/install-agent-clis.sh` put in `.tools/bin`. Missing is an error, never a skip: the
/// suite proves the adapters against the real binaries.
pub fn agent_cli(name: &str) -> anyhow::Result<PathBuf> {
    let var = format!("TURNSTILE_{}_BIN", name.to_ascii_uppercase());
    let bin = std::env::var_os(&var)
        .filter(|b| !b.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".tools/bin").join(name));
    anyhow::ensure!(
        bin.is_file(),
        "{} is missing: run scripts/install-agent-clis.sh (or set {var})",
        bin.display()
    );
    Ok(bin)
}

/// Where a test keeps what outlives it (a screenshot, the event kinds the suite saw):
/// `target/test-artifacts/` (under `CARGO_TARGET_DIR` when set).
pub fn artifact(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("test-artifacts");
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir.join(name))
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, release it).
///
/// Another process may take it before it is used; callers that spawn servers on it retry.
pub fn free_port() -> anyhow::Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0 for a port")?;
    Ok(listener.local_addr()?.port())
}

/// Installs a `tracing` subscriber for tests (idempotent; later calls are no-ops).
///
/// The filter comes from `RUST_LOG` (default `info`); output goes through the test writer,
/// so it is captured per test like `println!`.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // `try_init` fails when a global subscriber is already set, which is exactly the
    // "called twice" case that must be harmless.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
        assert!(manifest.contains("[workspace]"));
    }

    #[test]
    fn init_tracing_is_idempotent() {
        init_tracing();
        init_tracing();
        tracing::info!("tracing initialised twice without panicking");
    }

    #[test]
    fn free_port_is_nonzero_and_bindable() {
        let port = free_port().unwrap();
        assert_ne!(port, 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    }
}
