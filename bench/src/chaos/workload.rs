//! The campaign's workload: what users of Turnstile do, all at once, while faults land. Mock
//! sessions on both hosts get turns whose agents start steps of every scope, nested steps and
//! background agents (each step's command logs its start, so a second run would show), runs
//! of several messages with a finalizer, schedules firing every few seconds under each
//! overlap policy, operator cancellations of what a turn owns, retries of failed runs, and one
//! session stopped while its work runs. Every call retries what is transient (a replica or node is down) within a
//! bound, and gives up on the rest: a call that fails is the campaign's business, not a
//! violation (the history says what became of what was accepted).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use turnstile_shared::api::{self, CreateSession, SendTurn, SessionRef};
use turnstile_shared::principal::Principal;
use turnstile_shared::records::{AgentKind, SessionRecord, TurnRecord};
use turnstile_shared::runs::{RunRecord, RunRef, StartRun};
use turnstile_shared::schedules::{Overlap, ScheduleSpec};
use turnstile_shared::step_api::ExecRef;
use turnstile_shared::subjects::api as subj;
use turnstile_shared::{ExecutionId, RunId, SessionId, TurnId};

use super::history::ScheduleCron;
use super::plan::Rng;

const CALL: Duration = Duration::from_secs(3);
/// How long a call keeps retrying transient refusals (a replica down, a node electing).
const RETRY_FOR: Duration = Duration::from_secs(20);

/// Calls `subject` (every request here is idempotent: it carries its id, or repeating it
/// changes nothing), retrying transient errors and lost replies until [`RETRY_FOR`] passes.
pub async fn call<Req, Resp>(client: &async_nats::Client, subject: &str, req: &Req) -> Result<Resp>
where
    Req: serde::Serialize,
    Resp: serde::de::DeserializeOwned,
{
    api::call_idempotent(client, subject, req, CALL, RETRY_FOR)
        .await
        .map_err(|e| anyhow::anyhow!("{subject}: {e}"))
}

/// The sessions the workload drives.
pub struct Sessions {
    /// Get manual turns and runs.
    pub manual: Vec<SessionId>,
    /// Each the target of one schedule.
    pub scheduled: Vec<SessionId>,
    /// One per host, idle but for the recovery probes.
    pub probes: Vec<(String, SessionId)>,
    /// Stopped halfway through.
    pub stopped: SessionId,
}

pub async fn create(client: &async_nats::Client, hosts: &[&str]) -> Result<Sessions> {
    let mut made = Vec::new();
    for i in 0..12 {
        let host = hosts[i % hosts.len()];
        let req = CreateSession {
            agent: AgentKind::Mock,
            name: format!("chaos-{i}"),
            host: Some(host.parse()?),
            cwd: None,
            id: Some(SessionId::new()),
            launch: None,
            ready_timeout_ms: None,
            policy: None,
        };
        // At the start a host may not heartbeat yet: its create is retried (bounded).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let rec: SessionRecord = loop {
            match api::call::<_, SessionRecord>(client, subj::SESSION_CREATE, &req, CALL).await {
                Ok(r) => break r,
                Err(e)
                    if (e.code == api::ErrorCode::NoHost || e.code.is_transient())
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Err(e) => anyhow::bail!("create session on {host}: {e}"),
            }
        };
        made.push((host.to_string(), rec.id));
    }
    let mut ids = made.into_iter();
    let mut take = |n: usize| -> Vec<(String, SessionId)> { ids.by_ref().take(n).collect() };
    let manual = take(5).into_iter().map(|(_, s)| s).collect();
    let scheduled = take(4).into_iter().map(|(_, s)| s).collect();
    let probes = take(2);
    let stopped = take(1)
        .pop()
        .map(|(_, s)| s)
        .ok_or_else(|| anyhow::anyhow!("no session left to stop"))?;
    Ok(Sessions {
        manual,
        scheduled,
        probes,
        stopped,
    })
}

/// One schedule per overlap policy, every 3 seconds, each on its own session.
pub async fn schedules(
    client: &async_nats::Client,
    sessions: &[SessionId],
    trace: &Path,
) -> Result<Vec<ScheduleCron>> {
    let trace = trace.display();
    let mut out = Vec::new();
    let policies = [
        Overlap::Skip,
        Overlap::BufferOne,
        Overlap::CancelOther,
        Overlap::AllowAll,
    ];
    for (i, (session, overlap)) in sessions.iter().zip(policies).enumerate() {
        let name = format!("chaos-{i}");
        let spec = ScheduleSpec {
            name: name.clone(),
            cron: "*/3 * * * * *".into(),
            tz: "UTC".into(),
            session: session.clone(),
            messages: vec![format!(
                "scheduled check\n!step sched 1s --trace {trace}\n!sleep 300ms"
            )],
            finalizer: Some("wrap up".into()),
            overlap,
            catchup_window: Duration::from_secs(3600),
            catchup: Default::default(),
            late_threshold: Duration::from_secs(5),
            limits: Default::default(),
        };
        let _: serde_json::Value = call(client, subj::SCHEDULES_ADD, &spec).await?;
        out.push(ScheduleCron {
            name,
            cron: spec.cron,
            zone: spec.tz,
        });
    }
    Ok(out)
}

/// Pauses every schedule, so the stack can go quiet.
pub async fn pause(client: &async_nats::Client, schedules: &[ScheduleCron]) -> Result<()> {
    for s in schedules {
        let req = turnstile_shared::schedules::PauseSchedule {
            name: s.name.clone(),
            note: "campaign over".into(),
        };
        let _: serde_json::Value = call(client, subj::SCHEDULES_PAUSE, &req).await?;
    }
    Ok(())
}

/// What the workload did, for the figures.
#[derive(Default)]
pub struct Counts {
    pub turns: AtomicU64,
    pub runs: AtomicU64,
    pub cancels: AtomicU64,
    pub retries: AtomicU64,
    pub refused: AtomicU64,
}

/// The manual workload's state between actions.
pub struct Driver<'a> {
    pub client: &'a async_nats::Client,
    pub sessions: &'a Sessions,
    pub trace: String,
    pub rng: Rng,
    pub counts: &'a Counts,
    next: u64,
    turns: Vec<TurnId>,
    runs: Vec<RunId>,
}

impl<'a> Driver<'a> {
    pub fn new(
        client: &'a async_nats::Client,
        sessions: &'a Sessions,
        trace: &Path,
        seed: u64,
        counts: &'a Counts,
    ) -> Self {
        Self {
            client,
            sessions,
            trace: trace.display().to_string(),
            rng: Rng::new(seed ^ 0x005E_ED0F_u64.rotate_left(17)),
            counts,
            next: 0,
            turns: Vec::new(),
            runs: Vec::new(),
        }
    }

    /// One action, drawn; a failed call is counted and otherwise ignored.
    pub async fn step(&mut self) {
        self.next += 1;
        let roll = self.rng.below(100);
        let done = match roll {
            0..=59 => self.turn().await,
            60..=74 => self.run().await,
            75..=89 => self.cancel().await,
            _ => self.retry().await,
        };
        if done.is_err() {
            self.counts.refused.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Work for the session stopped halfway: a long step it owns and a detached one.
    pub async fn doomed_work(&mut self) -> Result<()> {
        let t = &self.trace;
        let text = format!(
            "[doomed] long work\n!step owned 60s --trace {t}\n!step free 2s --scope detached --trace {t}"
        );
        self.send(self.sessions.stopped.clone(), text).await
    }

    pub async fn stop_doomed(&self) -> Result<()> {
        let req = SessionRef {
            session: self.sessions.stopped.clone(),
        };
        let _: SessionRecord = call(self.client, subj::SESSION_STOP, &req).await?;
        Ok(())
    }

    fn directives(&mut self) -> String {
        let (n, t) = (self.next, &self.trace);
        let mut out = String::new();
        if self.rng.below(2) == 0 {
            out.push_str(&format!("\n!step s{n}-own 1s --trace {t}"));
        }
        if self.rng.below(3) == 0 {
            out.push_str(&format!("\n!step s{n}-turn 3s --scope turn --trace {t}"));
        }
        if self.rng.below(4) == 0 {
            out.push_str(&format!(
                "\n!step s{n}-free 1500ms --scope detached --trace {t}"
            ));
        }
        if self.rng.below(5) == 0 {
            out.push_str(&format!("\n!step s{n}-bad 500ms fail --trace {t}"));
        }
        // A nested step: the step's own command starts a child with the step's credentials.
        if self.rng.below(5) == 0 {
            out.push_str(&format!("\n!step s{n}-nest 1s --child 1s --trace {t}"));
        }
        // A background agent: a new session on the host runs a run that starts a step.
        if self.rng.below(12) == 0 {
            out.push_str(&format!("\n!step s{n}-bg 1s --agent --trace {t}"));
        }
        out.push_str(&format!("\n!sleep {}ms", 100 + self.rng.below(600)));
        out
    }

    async fn send(&mut self, session: SessionId, text: String) -> Result<()> {
        let turn = TurnId::new();
        let req = SendTurn {
            session,
            text,
            turn: Some(turn.clone()),
        };
        let _: TurnRecord = call(self.client, subj::SESSION_SEND, &req).await?;
        self.counts.turns.fetch_add(1, Ordering::Relaxed);
        self.turns.push(turn);
        Ok(())
    }

    async fn turn(&mut self) -> Result<()> {
        let session = self.rng.pick(&self.sessions.manual).clone();
        let directives = self.directives();
        let text = format!("[m-{}] work{directives}", self.next);
        self.send(session, text).await
    }

    async fn run(&mut self) -> Result<()> {
        let session = self.rng.pick(&self.sessions.manual).clone();
        let n = self.next;
        let first = format!("[r-{n}] first{}", self.directives());
        let second = format!("[r-{n}] second{}", self.directives());
        let req = StartRun {
            session,
            messages: vec![first, second],
            finalizer: Some(format!("[r-{n}] finalize")),
            limits: Default::default(),
            schedule: None,
            id: Some(RunId::new()),
        };
        let run: RunRecord = call(self.client, subj::RUNS_START, &req).await?;
        self.counts.runs.fetch_add(1, Ordering::Relaxed);
        self.runs.push(run.id);
        Ok(())
    }

    /// An operator cancels what a recent turn owns.
    async fn cancel(&mut self) -> Result<()> {
        if self.turns.is_empty() {
            return Ok(());
        }
        let from = self.turns.len().saturating_sub(5);
        let turn = self.rng.pick(&self.turns[from..]).clone();
        let req = ExecRef {
            id: ExecutionId::from(&turn),
        };
        let subject = Principal::Operator.exec(subj::CANCEL);
        match call::<_, serde_json::Value>(self.client, &subject, &req).await {
            Ok(_) => {
                self.counts.cancels.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // A turn not yet running has no node to cancel under.
            Err(e) if e.to_string().contains("not_found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A failed run is retried (its finished turns are not run again).
    async fn retry(&mut self) -> Result<()> {
        let Some(run) = self
            .runs
            .iter()
            .rev()
            .nth(self.rng.below(3) as usize)
            .cloned()
        else {
            return Ok(());
        };
        let rec: RunRecord =
            call(self.client, subj::RUNS_SHOW, &RunRef { run: run.clone() }).await?;
        if !matches!(rec.state, turnstile_shared::runs::RunState::Failed { .. }) {
            return Ok(());
        }
        let _: serde_json::Value = call(self.client, subj::RUNS_RETRY, &RunRef { run }).await?;
        self.counts.retries.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
