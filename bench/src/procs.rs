//! The services as processes of this build (`turnstile-session-lane`, the transport agent with
//! the instant agent, the broker, the scheduler), so each one's resident memory can be read off
//! `/proc` and a replica can be SIGKILLed. Used by `scale` and `soak`.

use anyhow::{Context, Result};
use turnstile_tests::ServiceProcess;

use crate::deployment::{Deployment, HOST};

pub struct Services {
    pub lane: ServiceProcess,
    pub transport: ServiceProcess,
    pub broker: ServiceProcess,
    pub scheduler: ServiceProcess,
    _data: tempfile::TempDir,
}

pub fn spawn(bin: &str, args: &[&str], url: &str, log: &str) -> Result<ServiceProcess> {
    let env = vec![
        ("TURNSTILE_NATS_URL".to_string(), url.to_string()),
        ("RUST_LOG".to_string(), "info".to_string()),
    ];
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    ServiceProcess::spawn(bin, &args, &env, log)
}

impl Services {
    pub fn start(d: &Deployment) -> Result<Self> {
        let data = tempfile::tempdir()?;
        let dir = data.path().to_string_lossy().into_owned();
        Ok(Self {
            lane: spawn(
                "turnstile-session-lane",
                &["--replica", "a"],
                &d.lane,
                "lane-a.log",
            )?,
            transport: spawn(
                "turnstile-transport-agent",
                &["--host", HOST, "--data-dir", &dir],
                &d.transport,
                "transport.log",
            )?,
            broker: spawn(
                "turnstile-notification-broker",
                &[],
                &d.broker,
                "broker.log",
            )?,
            scheduler: spawn("turnstile-scheduler", &[], &d.admin, "scheduler.log")?,
            _data: data,
        })
    }

    /// Each process by name, nats-server first.
    pub fn pids(&self, d: &Deployment) -> Vec<(&'static str, Option<u32>)> {
        vec![
            ("nats-server", d.server_pid()),
            ("session-lane", self.lane.pid()),
            ("transport-agent", self.transport.pid()),
            ("notification-broker", self.broker.pid()),
            ("scheduler", self.scheduler.pid()),
        ]
    }
}

/// Resident memory (kB, from `/proc/<pid>/status`) of each process.
pub fn rss_all(procs: &[(&'static str, Option<u32>)]) -> Result<Vec<(&'static str, u64)>> {
    each(procs, rss_kb)
}

/// CPU time each process has run so far, in nanoseconds.
pub fn cpu_ns_all(procs: &[(&'static str, Option<u32>)]) -> Result<Vec<(&'static str, u64)>> {
    each(procs, cpu_ns)
}

/// `read` of each running process, by name.
fn each(
    procs: &[(&'static str, Option<u32>)],
    read: fn(u32) -> Result<u64>,
) -> Result<Vec<(&'static str, u64)>> {
    procs
        .iter()
        .map(|(name, pid)| {
            let pid = pid.with_context(|| format!("{name} is not running"))?;
            Ok((*name, read(pid)?))
        })
        .collect()
}

/// The sum over a process's live threads of their time on a CPU (`schedstat`'s first field).
fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread may end between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(&path) else {
            continue;
        };
        total += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("unreadable {}", path.display()))?;
    }
    Ok(total)
}

fn rss_kb(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no VmRSS for pid {pid}"))
}
