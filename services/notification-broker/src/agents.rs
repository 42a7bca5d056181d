//! Background agents (step kind `agent`): the broker gives each its own session on the
//! parent's host and runs the prompt there as a run, so the R5 rule holds for it too. The step
//! completes with the agent's final reply when that run ends, and only then (its run ends only
//! once everything it started is done and handed back to it). Session and run ids are derived
//! from the step, so a retry after a crash finds them instead of starting twice (R14).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use chrono::Utc;
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, ApiError, CreateSession, SessionRef};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::EventKind;
use turnstile_shared::execution::{
    agent_run, agent_session, agent_step_of, ExecStatus, ExecutionRecord, StepResult, StepWork,
};
use turnstile_shared::kv::Change;
use turnstile_shared::records::{SessionRecord, TurnRecord, TurnState};
use turnstile_shared::runs::{RunRecord, RunState, StartRun};
use turnstile_shared::step_api::{step_kind, Ended, StepWorkItem};
use turnstile_shared::{consume, subjects, topology, ExecutionId, RunId};

use crate::ctx::Ctx;
use crate::registry;
use crate::step_events::step_event;

const API: Duration = Duration::from_secs(10);
/// Lines of the agent's last reply kept as the step's output.
const REPLY_LINES: usize = 20;

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    tokio::join!(
        consume::until_shutdown("agent launches", &shutdown, || launches(&ctx, &shutdown)),
        consume::until_shutdown("run ends", &shutdown, || run_ends(&ctx, &shutdown)),
    );
}

async fn launches(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
    let consumer = topology::ensure_agents_consumer(&ctx.js, &ctx.topology).await?;
    consume::each_message_showing_progress(consumer, shutdown, |msg| {
        let ctx = ctx.clone();
        async move { launch(&ctx, msg).await }
    })
    .await
}

async fn run_ends(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
    let consumer = topology::ensure_run_ends_consumer(&ctx.js, &ctx.topology).await?;
    consume::each_message_showing_progress(consumer, shutdown, |msg| {
        let ctx = ctx.clone();
        async move { run_ended(&ctx, msg).await }
    })
    .await
}

#[derive(Debug, thiserror::Error)]
enum AgentError {
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error(transparent)]
    Registry(#[from] registry::RegistryError),
}

async fn launch(ctx: &Ctx, msg: jetstream::Message) {
    let item = match Envelope::decode(&msg.payload)
        .and_then(|env| env.expect_kind(step_kind::WORK).map(|()| env))
        .and_then(|env| env.data_as::<StepWorkItem>())
    {
        Ok(i) => i,
        Err(e) => {
            tracing::warn!(error = %e, "unreadable agent launch; dropped");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    match start_agent(ctx, &item).await {
        Ok(()) => {
            let _ = msg.double_ack().await;
        }
        Err(e) => {
            tracing::warn!(step = %item.step, error = %e, "launch agent; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        }
    }
}

/// Creates the agent's session and queues its run, then marks the step running.
async fn start_agent(ctx: &Ctx, item: &StepWorkItem) -> Result<(), AgentError> {
    let StepWork::Agent { prompt, host } = &item.work else {
        return Ok(());
    };
    let exec_id = ExecutionId::from(&item.step);
    let Some(record) = registry::get(ctx, &exec_id).await? else {
        return Ok(());
    };
    if record.status.is_terminal() {
        return Ok(());
    }
    let (Some(session), Some(run)) = (agent_session(&item.step), agent_run(&item.step)) else {
        return Ok(());
    };
    let parent_session = ctx
        .buckets
        .sessions
        .get::<SessionRecord>(item.session.as_str())
        .await?
        .map(|(r, _)| r)
        .ok_or_else(|| ApiError::not_found(format!("no session {}", item.session)))?;
    let create = CreateSession {
        agent: parent_session.agent,
        name: format!("agent-{}", item.name),
        host: Some(host.clone()),
        cwd: parent_session.cwd.clone(),
        id: Some(session.clone()),
        launch: None,
        ready_timeout_ms: None,
        policy: Some(parent_session.policy.clone()),
    };
    let _: SessionRecord =
        api::call(&ctx.client, subjects::api::SESSION_CREATE, &create, API).await?;
    let start = StartRun {
        session: session.clone(),
        messages: vec![prompt.clone()],
        finalizer: None,
        limits: Default::default(),
        schedule: None,
        id: Some(run.clone()),
    };
    let _: RunRecord = api::call(&ctx.client, subjects::api::RUNS_START, &start, API).await?;
    let worker = format!("agent:{session}");
    let now = Utc::now();
    let next = ctx
        .buckets
        .executions
        .modify::<ExecutionRecord, _>(exec_id.as_str(), |cur| match cur {
            Some(r) if r.status == ExecStatus::Queued => Change::Write(ExecutionRecord {
                status: ExecStatus::Running {
                    started_at: now,
                    worker: Some(worker.clone()),
                    heartbeat_at: None,
                },
                ..r.clone()
            }),
            _ => Change::Keep,
        })
        .await?;
    if let Some(rec) = next.filter(|r| matches!(r.status, ExecStatus::Running { .. })) {
        step_event(ctx, &rec, EventKind::StepRunning).await;
    }
    Ok(())
}

async fn run_ended(ctx: &Ctx, msg: jetstream::Message) {
    let run: Option<RunId> = Envelope::decode(&msg.payload)
        .ok()
        .and_then(|env| env.data.get("run").cloned())
        .and_then(|v| serde_json::from_value(v).ok());
    let Some(run) = run else {
        let _ = msg.ack().await;
        return;
    };
    match finish_agent(ctx, &run).await {
        Ok(()) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(%run, error = %e, "finish agent step; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        }
    }
}

/// If the run is a background agent's, ends its step with the agent's final reply (or the
/// run's failure), then stops the agent's session.
async fn finish_agent(ctx: &Ctx, run: &RunId) -> Result<(), AgentError> {
    let Some(step) = agent_step_of(run) else {
        return Ok(());
    };
    let exec_id = ExecutionId::from(&step);
    let Some(record) = registry::get(ctx, &exec_id).await? else {
        return Ok(());
    };
    if !matches!(record.work, Some(StepWork::Agent { .. })) {
        return Ok(());
    }
    let Some((run_rec, _)) = ctx.buckets.runs.get::<RunRecord>(run.as_str()).await? else {
        return Ok(());
    };
    if !record.status.is_terminal() {
        let started_at = record.status.started_at();
        let status = match &run_rec.state {
            RunState::Completed { ended_at, .. } => {
                let output = final_reply(ctx, &run_rec).await?;
                ExecStatus::Completed {
                    started_at,
                    ended_at: *ended_at,
                    result: StepResult {
                        exit_code: None,
                        summary: output.last().cloned().unwrap_or_else(|| "done".into()),
                        output,
                    },
                }
            }
            RunState::Failed {
                ended_at,
                reason,
                detail,
                ..
            } => ExecStatus::Failed {
                started_at,
                ended_at: *ended_at,
                reason: reason.clone(),
                result: StepResult {
                    exit_code: None,
                    summary: detail.clone(),
                    output: Vec::new(),
                },
            },
            _ => return Ok(()),
        };
        registry::publish_end(
            ctx,
            &Ended {
                execution: exec_id,
                status,
                known: None,
            },
        )
        .await?;
    }
    // Its work is done and handed back: the agent's session ends (R13).
    if let Some(session) = agent_session(&step) {
        let stop: Result<SessionRecord, ApiError> = api::call(
            &ctx.client,
            subjects::api::SESSION_STOP,
            &SessionRef { session },
            API,
        )
        .await;
        if let Err(e) = stop {
            tracing::debug!(%run, error = %e, "stop agent session");
        }
    }
    Ok(())
}

/// The agent's last reply: the output of the run's last turn.
async fn final_reply(ctx: &Ctx, run: &RunRecord) -> Result<Vec<String>, AgentError> {
    let Some(turn) = run.progress.last().and_then(|m| m.turns.last()) else {
        return Ok(Vec::new());
    };
    let rec = ctx.buckets.turns.get::<TurnRecord>(turn.as_str()).await?;
    Ok(match rec.map(|(r, _)| r.state) {
        Some(TurnState::Completed { output, .. }) => {
            let skip = output.len().saturating_sub(REPLY_LINES);
            output.into_iter().skip(skip).collect()
        }
        _ => Vec::new(),
    })
}
