//! The one way the campaign signals a process: one pid at a time, never a group (the
//! workplace's procps `kill -PGID` kills every process of the machine).

use anyhow::{bail, Context, Result};

/// One signal to one process (never a group: see the workplace's warning about `kill -PGID`).
pub fn signal(pid: u32, sig: rustix::process::Signal) -> Result<()> {
    let raw = i32::try_from(pid)?;
    if raw <= 1 {
        bail!("refusing to signal pid {pid}");
    }
    let pid = rustix::process::Pid::from_raw(raw).context("pid")?;
    rustix::process::kill_process(pid, sig).with_context(|| format!("signal {raw}"))?;
    Ok(())
}
