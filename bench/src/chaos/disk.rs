//! A small disk of its own for each nats node's store (a tmpfs mount), so the campaign can
//! fill it: `fill` writes a ballast file until the filesystem answers "no space left on
//! device", `free` removes it. Needs root (mount); where the mount is refused the store stays
//! on the campaign's disk and the disk-full faults are skipped, saying why.
//!
//! What nats-server 2.15 does with a full store, found here: a stream whose write failed stays
//! unwritable after the space is back (a single server), and a cluster node disables JetStream
//! ("JetStream out of File resources, will be DISABLED") and stays out; both come back only by
//! a restart. So lifting the fault is what an operator does: free the space, restart the node.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Room for a campaign's whole store (tmpfs takes memory only for what is written).
const SIZE: &str = "1g";
const BALLAST: &str = "ballast";

pub struct SmallDisk {
    path: PathBuf,
}

impl SmallDisk {
    /// Mounts a tmpfs at `path` (created if missing).
    pub fn mount(path: &Path) -> Result<Self> {
        std::fs::create_dir_all(path).with_context(|| format!("create {}", path.display()))?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={SIZE}"), "tmpfs"])
            .arg(path)
            .output()
            .context("mount")?;
        if !out.status.success() {
            bail!(
                "mount a tmpfs at {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the ballast until the disk is full; returns the bytes written.
    pub fn fill(&self) -> Result<u64> {
        let path = self.path.join(BALLAST);
        let mut file =
            std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
        let chunk = vec![0u8; 1 << 20];
        let mut written = 0u64;
        loop {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => return Err(e).with_context(|| format!("write {}", path.display())),
            }
        }
        Ok(written)
    }

    pub fn free(&self) -> Result<()> {
        let path = self.path.join(BALLAST);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("remove {}", path.display()))
            }
            _ => Ok(()),
        }
    }
}

/// The prefix of a campaign's directory, naming its pid: `ts-chaos-<pid>-`.
pub fn dir_prefix(pid: u32) -> String {
    format!("ts-chaos-{pid}-")
}

/// Unmounts the store disks of campaigns no longer running (one SIGKILLed leaves them
/// mounted); returns the mount points it unmounted.
pub fn sweep_orphans() -> Vec<String> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mut removed = Vec::new();
    for point in mounts.lines().filter_map(|l| l.split_whitespace().nth(1)) {
        let Some(pid) = point
            .split('/')
            .find_map(|part| part.strip_prefix("ts-chaos-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if super::net::running(pid) {
            continue;
        }
        let unmounted = Command::new("umount").arg("-l").arg(point).output();
        if unmounted.is_ok_and(|o| o.status.success()) {
            removed.push(point.to_string());
        }
    }
    removed
}

impl Drop for SmallDisk {
    /// Lazily unmounted: the node using it may still be exiting.
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).output();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use turnstile_tests::{NatsServer, Placement};

    /// A dead campaign's store disk is unmounted by the sweep; a live one's stays.
    #[test]
    fn a_dead_campaigns_disk_is_unmounted_and_a_live_ones_kept() -> anyhow::Result<()> {
        let mut child = Command::new("true").spawn()?;
        let dead_pid = child.id();
        child.wait()?;
        let root = tempfile::tempdir()?;
        let dead_dir = root.path().join(format!("{}x", dir_prefix(dead_pid)));
        let live_dir = root
            .path()
            .join(format!("{}x", dir_prefix(std::process::id())));
        let dead = SmallDisk::mount(&dead_dir.join("store-0"))?;
        let live = SmallDisk::mount(&live_dir.join("store-0"))?;
        let removed = sweep_orphans();
        let mounts = std::fs::read_to_string("/proc/mounts")?;
        let mounted = |d: &SmallDisk| mounts.contains(&*d.path().to_string_lossy());
        assert!(!mounted(&dead), "{removed:?}");
        assert!(mounted(&live), "the live campaign's disk kept");
        assert!(
            removed.contains(&dead.path().to_string_lossy().into_owned()),
            "{removed:?}"
        );
        Ok(())
    }

    /// A full store refuses writes, and after the space is freed and the node restarted (what
    /// the fault's lifting does) the same stream takes writes again.
    #[tokio::test]
    async fn a_full_store_refuses_writes_until_freed_and_restarted() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let disk = SmallDisk::mount(&dir.path().join("store"))?;
        let mut server = NatsServer::start_placed(
            None,
            Placement {
                store_dir: Some(disk.path().to_path_buf()),
                ..Default::default()
            },
        )
        .await?;
        let js = async_nats::jetstream::new(server.client().await?);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "FULL".into(),
            subjects: vec!["full.>".into()],
            ..Default::default()
        })
        .await?;
        let publish = |js: async_nats::jetstream::Context| async move {
            let ack = js.publish("full.x", vec![7u8; 4096].into()).await?;
            tokio::time::timeout(Duration::from_secs(2), ack).await??;
            anyhow::Ok(())
        };
        publish(js.clone()).await?;
        assert!(disk.fill()? > 0);
        let mut refused = false;
        for _ in 0..20 {
            if publish(js.clone()).await.is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused, "a full disk must refuse writes");
        disk.free()?;
        server.restart().await?;
        let js = async_nats::jetstream::new(server.client().await?);
        turnstile_tests::wait_until("writes after the restart", Duration::from_secs(10), || {
            let js = js.clone();
            async move { Ok(publish(js).await.ok()) }
        })
        .await?;
        Ok(())
    }
}
