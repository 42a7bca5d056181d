//! Follows every run record change durably and keeps the run and its messages as nodes of the
//! execution tree: run → messages → turns → steps (R6), so `turnstile tree run_…` shows what a
//! run did, and the run's node is settled only when its whole tree is.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use tokio_util::sync::CancellationToken;
use turnstile_shared::execution::{ExecKind, ExecStatus, ExecutionRecord, Scope, StepResult};
use turnstile_shared::kv::{Change, KvError};
use turnstile_shared::runs::{RunRecord, RunState};
use turnstile_shared::{consume, topology, ExecutionId};

use crate::ctx::Ctx;

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) {
    consume::until_shutdown("run mirror", &shutdown, || consume(&ctx, &shutdown)).await
}

async fn consume(
    ctx: &Arc<Ctx>,
    shutdown: &CancellationToken,
) -> Result<(), consume::ConsumeError> {
    let consumer = topology::ensure_runs_mirror_consumer(&ctx.js, &ctx.topology).await?;
    consume::each_message_showing_progress(consumer, shutdown, |msg| {
        let ctx = ctx.clone();
        async move { handle(&ctx, msg).await }
    })
    .await
}

async fn handle(ctx: &Ctx, msg: jetstream::Message) {
    let Ok(run) = serde_json::from_slice::<RunRecord>(&msg.payload) else {
        let _ = msg.ack().await;
        return;
    };
    match mirror(ctx, &run).await {
        Ok(()) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(run = %run.id, error = %e, "mirror run; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
                .await;
        }
    }
}

fn run_status(run: &RunRecord) -> ExecStatus {
    match &run.state {
        RunState::Queued => ExecStatus::Queued,
        RunState::Running { started_at } => ExecStatus::Running {
            started_at: *started_at,
            worker: None,
            heartbeat_at: None,
        },
        RunState::Completed {
            started_at,
            ended_at,
        } => ExecStatus::Completed {
            started_at: Some(*started_at),
            ended_at: *ended_at,
            result: StepResult {
                exit_code: None,
                summary: format!("{} rounds", run.rounds()),
                output: Vec::new(),
            },
        },
        RunState::Failed {
            started_at,
            ended_at,
            reason,
            detail,
            ..
        } => ExecStatus::Failed {
            started_at: *started_at,
            ended_at: *ended_at,
            reason: reason.clone(),
            result: StepResult {
                exit_code: None,
                summary: detail.clone(),
                output: Vec::new(),
            },
        },
    }
}

async fn mirror(ctx: &Ctx, run: &RunRecord) -> Result<(), KvError> {
    let run_id = ExecutionId::from(&run.id);
    let texts = run.texts();
    let messages: Vec<ExecutionId> = (0..run.progress.len())
        .map(|i| ExecutionId::message(&run.id, i))
        .collect();
    let base = |id: ExecutionId, kind, name: String, parent, status, children| ExecutionRecord {
        id,
        kind,
        name,
        parent,
        scope: Scope::Session,
        session: run.session.clone(),
        owner: Some(run.session.clone()),
        watchers: Vec::new(),
        created_at: run.created_at,
        work: None,
        token: None,
        children,
        handed_over: Vec::new(),
        status,
    };
    let name = run.schedule.clone().unwrap_or_else(|| "run".to_string());
    upsert(
        ctx,
        base(
            run_id.clone(),
            ExecKind::Run,
            name,
            None,
            run_status(run),
            messages.clone(),
        ),
    )
    .await?;
    for (i, (id, progress)) in messages.iter().zip(&run.progress).enumerate() {
        let text = texts.get(i).copied().unwrap_or_default();
        let label = text
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(48)
            .collect::<String>();
        let status = if progress.done {
            ExecStatus::Completed {
                started_at: None,
                ended_at: chrono::Utc::now(),
                result: StepResult {
                    exit_code: None,
                    summary: format!("{} rounds", progress.turns.len()),
                    output: Vec::new(),
                },
            }
        } else {
            match run_status(run) {
                s @ ExecStatus::Failed { .. } => s,
                ExecStatus::Completed { ended_at, .. } => ExecStatus::Completed {
                    started_at: None,
                    ended_at,
                    result: StepResult::default(),
                },
                _ => ExecStatus::Running {
                    started_at: run.created_at,
                    worker: None,
                    heartbeat_at: None,
                },
            }
        };
        let turns = progress.turns.iter().map(ExecutionId::from).collect();
        upsert(
            ctx,
            base(
                id.clone(),
                ExecKind::Message,
                label,
                Some(run_id.clone()),
                status,
                turns,
            ),
        )
        .await?;
    }
    Ok(())
}

/// Creates or updates the node: children are merged (the turn mirror appends too), a
/// terminal status is never left.
async fn upsert(ctx: &Ctx, node: ExecutionRecord) -> Result<(), KvError> {
    ctx.buckets
        .executions
        .modify::<ExecutionRecord, _>(node.id.as_str(), |cur| match cur {
            None => Change::Write(node.clone()),
            Some(r) => {
                let mut next = r.clone();
                for c in &node.children {
                    if !next.children.contains(c) {
                        next.children.push(c.clone());
                    }
                }
                if !r.status.is_terminal() {
                    next.status = node.status.clone();
                }
                if next == *r {
                    Change::Keep
                } else {
                    Change::Write(next)
                }
            }
        })
        .await?;
    Ok(())
}
