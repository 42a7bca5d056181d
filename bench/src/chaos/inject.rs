//! Carries out a plan's faults on the campaign's stack, each at its time, and lifts each after
//! its hold: a killed process is started again (a nats node on its own port and store), a
//! paused one resumed. After each fault is lifted a probe turn goes to an idle session on the
//! host it hit (or any host), and the time until that turn completes is the fault's recovery
//! time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::process::Signal;
use serde::Serialize;
use tokio::sync::Mutex;
use turnstile_shared::api::SendTurn;
use turnstile_shared::records::{TurnRecord, TurnState};
use turnstile_shared::subjects::api as subj;
use turnstile_shared::{SessionId, TurnId};

use super::plan::{Fault, FaultKind, Rng};
use super::signal::signal;
use super::stack::ChaosStack;
use super::workload::{call, Sessions};

/// What became of one fault.
#[derive(Debug, Clone, Serialize)]
pub struct Injected {
    pub kind: &'static str,
    pub target: String,
    /// Seconds from the campaign's start.
    pub at_s: f64,
    /// How long it was held (0 for a kill that is not undone).
    pub hold_s: f64,
    /// From the fault's lifting to the probe turn's completion; `None`: the probe did not
    /// complete within its bound, or could not be sent.
    pub recovery_ms: Option<u64>,
    /// Why the fault could not be applied, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// How long a probe turn may take before its fault counts as not recovered.
const PROBE_BOUND: Duration = Duration::from_secs(90);

pub struct Injector {
    pub stack: Arc<Mutex<ChaosStack>>,
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub probes: Vec<(String, SessionId)>,
    pub started: Instant,
    pub rng: std::sync::Mutex<Rng>,
    /// Sessions whose agents may be killed: (host, session).
    pub agents: Vec<(String, SessionId)>,
}

impl Injector {
    pub fn new(
        stack: Arc<Mutex<ChaosStack>>,
        client: async_nats::Client,
        sessions: &Sessions,
        hosts: &[(String, SessionId)],
        seed: u64,
        started: Instant,
    ) -> Self {
        Self {
            stack,
            js: async_nats::jetstream::new(client.clone()),
            client,
            probes: sessions.probes.clone(),
            started,
            rng: std::sync::Mutex::new(Rng::new(seed.rotate_left(29) ^ 0xFA17)),
            agents: hosts.to_vec(),
        }
    }

    /// Applies `fault` now, lifts it after its hold, then probes. Returns what happened.
    pub async fn apply(&self, fault: &Fault) -> Injected {
        let at_s = self.started.elapsed().as_secs_f64();
        let mut out = Injected {
            kind: fault.kind.name(),
            target: fault.target.clone(),
            at_s,
            hold_s: fault.hold.as_secs_f64(),
            recovery_ms: None,
            skipped: None,
        };
        let host = match self.hit(fault).await {
            Ok(host) => host,
            Err(e) => {
                out.skipped = Some(format!("{e:#}"));
                return out;
            }
        };
        if !fault.hold.is_zero() {
            tokio::time::sleep(fault.hold).await;
        }
        if let Err(e) = self.lift(fault).await {
            out.skipped = Some(format!("lift: {e:#}"));
            return out;
        }
        out.recovery_ms = self.probe(host.as_deref()).await;
        out
    }

    /// Does the fault; returns the host it hit, if it hit one.
    async fn hit(&self, fault: &Fault) -> Result<Option<String>> {
        let mut stack = self.stack.lock().await;
        match fault.kind {
            FaultKind::KillService => {
                stack.service(&fault.target)?.kill().await?;
                stack.down.insert(fault.target.clone());
                Ok(host_of(&fault.target))
            }
            FaultKind::PauseService | FaultKind::HostGone => {
                let pid = stack.service(&fault.target)?.pid().context("not running")?;
                signal(pid, Signal::STOP)?;
                Ok(host_of(&fault.target))
            }
            FaultKind::KillNats => {
                stack.nodes()?.kill(&fault.target).await?;
                Ok(None)
            }
            FaultKind::PauseNats => {
                stack.nodes()?.pause(&fault.target).await?;
                Ok(None)
            }
            FaultKind::PartitionNats => {
                stack.nodes()?.cut(&fault.target).await?;
                Ok(None)
            }
            FaultKind::DiskFull => {
                stack.disk(&fault.target)?.fill()?;
                Ok(None)
            }
            FaultKind::KillAgent => {
                let (host, session) = {
                    let mut rng = self
                        .rng
                        .lock()
                        .map_err(|_| anyhow::anyhow!("rng poisoned"))?;
                    rng.pick(&self.agents).clone()
                };
                let pid = stack
                    .agent_pid(&host, session.as_str())
                    .context("the session has no agent running")?;
                signal(pid, Signal::KILL)?;
                Ok(Some(host))
            }
            FaultKind::KillTmux => {
                stack.kill_tmux(&fault.target)?;
                Ok(Some(fault.target.clone()))
            }
        }
    }

    async fn lift(&self, fault: &Fault) -> Result<()> {
        let mut stack = self.stack.lock().await;
        match fault.kind {
            FaultKind::KillService => {
                stack.down.remove(&fault.target);
                stack.service(&fault.target)?.restart().await
            }
            FaultKind::PauseService | FaultKind::HostGone => {
                let pid = stack.service(&fault.target)?.pid().context("not running")?;
                signal(pid, Signal::CONT)
            }
            FaultKind::KillNats => stack.nodes()?.start_again(&fault.target).await,
            FaultKind::PauseNats => stack.nodes()?.resume(&fault.target).await,
            FaultKind::PartitionNats => stack.nodes()?.mend(&fault.target).await,
            FaultKind::DiskFull => {
                // What an operator does: free the space, restart the server (gracefully: it
                // writes its stores' state on the way down).
                stack.disk(&fault.target)?.free()?;
                stack.nodes()?.restart_graceful(&fault.target).await
            }
            FaultKind::KillAgent | FaultKind::KillTmux => Ok(()),
        }
    }

    /// Sends a probe turn to the idle session of `host` (the first host's when none) and
    /// times its completion.
    async fn probe(&self, host: Option<&str>) -> Option<u64> {
        let session = self
            .probes
            .iter()
            .find(|(h, _)| Some(h.as_str()) == host)
            .or_else(|| self.probes.first())
            .map(|(_, s)| s.clone())?;
        let lifted = Instant::now();
        let turn = TurnId::new();
        let req = SendTurn {
            session,
            text: format!("[probe {turn}]"),
            turn: Some(turn.clone()),
        };
        let sent: Result<TurnRecord> = call(&self.client, subj::SESSION_SEND, &req).await;
        sent.ok()?;
        let kv = self
            .js
            .get_key_value(turnstile_shared::subjects::TURNS_BUCKET)
            .await
            .ok()?;
        while lifted.elapsed() < PROBE_BOUND {
            if let Ok(Some(bytes)) = kv.get(turn.as_str()).await {
                if let Ok(rec) = serde_json::from_slice::<TurnRecord>(&bytes) {
                    match rec.state {
                        TurnState::Completed { .. } => {
                            return u64::try_from(lifted.elapsed().as_millis()).ok()
                        }
                        TurnState::Failed { .. } => return None,
                        _ => {}
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

/// The host of a transport's name (`transport-h1` → `h1`).
fn host_of(target: &str) -> Option<String> {
    target.strip_prefix("transport-").map(str::to_string)
}

/// How often the supervisor looks for services that exited.
const SUPERVISE_EVERY: Duration = Duration::from_millis(500);

/// What a deployment's supervisor (systemd, a container's restart policy) does: a service
/// that exited by itself (a fenced session-lane replica exits so that it comes back as a new
/// instance) is started again, within [`SUPERVISE_EVERY`]. Services a `kill_service` fault
/// holds down are the fault's to restart. Runs until `stop`; returns how many it restarted.
pub async fn supervise(
    stack: &Mutex<ChaosStack>,
    stop: tokio_util::sync::CancellationToken,
) -> usize {
    let mut restarted = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return restarted,
            _ = tokio::time::sleep(SUPERVISE_EVERY) => {}
        }
        let mut stack = stack.lock().await;
        let ChaosStack { services, down, .. } = &mut *stack;
        for (name, p) in services.iter_mut() {
            if down.contains(name) {
                continue;
            }
            let Ok(Some(status)) = p.try_exit_status() else {
                continue;
            };
            match p.restart().await {
                Ok(()) => {
                    restarted += 1;
                    eprintln!(
                        "chaos: {name} exited ({status}); started again, as its supervisor would"
                    );
                }
                Err(e) => {
                    eprintln!("chaos: {name} exited ({status}); starting it again failed: {e:#}")
                }
            }
        }
    }
}

/// Resumes every process that might be paused and starts every one that is not running, so
/// the stack can recover whatever faults were still held.
pub async fn heal(stack: &Mutex<ChaosStack>) -> Result<()> {
    let mut stack = stack.lock().await;
    for p in stack.services.values_mut() {
        if let Some(pid) = p.pid() {
            let _ = signal(pid, Signal::CONT);
        }
        if p.try_exit_status()?.is_some() {
            p.restart().await?;
        }
    }
    stack.heal_nodes().await
}
