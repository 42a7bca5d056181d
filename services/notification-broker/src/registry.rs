//! The execution registry in KV: turn nodes mirrored from the lane's turn records, step nodes
//! created by the API, the parent-to-children index, the tree walk, and cancellation by
//! ownership (R6, R7). Every change is a revision compare-and-set.

use turnstile_shared::execution::{
    exec_reason, ExecKind, ExecStatus, ExecutionRecord, Scope, StepResult,
};
use turnstile_shared::kv::{Change, KvError};
use turnstile_shared::lane::LaneItem;
use turnstile_shared::records::{TurnRecord, TurnState};
use turnstile_shared::step_api::{Ended, TreeNode};
use turnstile_shared::{events, subjects, ExecutionId, SessionId, TurnId};

use crate::ctx::Ctx;

#[derive(Debug, thiserror::Error)]
pub(crate) enum RegistryError {
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Publish(#[from] events::PublishError),
    #[error(transparent)]
    Envelope(#[from] turnstile_shared::EnvelopeError),
    #[error("read lane of {session}: {source}")]
    Lane {
        session: SessionId,
        source: async_nats::Error,
    },
}

pub(crate) async fn get(ctx: &Ctx, id: &ExecutionId) -> Result<Option<ExecutionRecord>, KvError> {
    Ok(get_at(ctx, id).await?.map(|(r, _)| r))
}

/// The record and the revision it was read at.
pub(crate) async fn get_at(
    ctx: &Ctx,
    id: &ExecutionId,
) -> Result<Option<(ExecutionRecord, u64)>, KvError> {
    ctx.buckets
        .executions
        .get::<ExecutionRecord>(id.as_str())
        .await
}

/// A turn's execution status; `None` while it only waits (R2: queued items are not running
/// executions of anything).
fn turn_status(state: &TurnState) -> Option<ExecStatus> {
    let last = |output: &[String]| output.last().cloned().unwrap_or_default();
    match state {
        TurnState::Queued => None,
        TurnState::Running { typed_at, host, .. } => Some(ExecStatus::Running {
            started_at: *typed_at,
            worker: Some(host.to_string()),
            heartbeat_at: None,
        }),
        TurnState::Completed {
            typed_at,
            ended_at,
            output,
            ..
        } => Some(ExecStatus::Completed {
            started_at: Some(*typed_at),
            ended_at: *ended_at,
            result: StepResult {
                exit_code: None,
                summary: last(output),
                output: Vec::new(),
            },
        }),
        TurnState::Failed {
            ended_at,
            reason,
            detail,
            ..
        } => Some(ExecStatus::Failed {
            started_at: None,
            ended_at: *ended_at,
            reason: reason.clone(),
            result: StepResult {
                exit_code: None,
                summary: detail.clone(),
                output: Vec::new(),
            },
        }),
    }
}

/// Mirrors a turn record into the registry once it holds the lane (R2), under its run
/// message if a run typed it. Returns the node.
pub(crate) async fn mirror_turn(
    ctx: &Ctx,
    turn: &TurnRecord,
) -> Result<Option<ExecutionRecord>, KvError> {
    let node = upsert_turn(ctx, turn).await?;
    if let (Some(parent), Some(_)) = (&turn.parent, &node) {
        add_child(ctx, parent, &ExecutionId::from(&turn.id)).await?;
    }
    Ok(node)
}

async fn upsert_turn(ctx: &Ctx, turn: &TurnRecord) -> Result<Option<ExecutionRecord>, KvError> {
    let Some(status) = turn_status(&turn.state) else {
        return Ok(None);
    };
    let (kind, name) = match &turn.delivery {
        Some(_) => (ExecKind::Delivery, "delivery".to_string()),
        None => (ExecKind::Turn, turn_name(&turn.text)),
    };
    ctx.buckets
        .executions
        .modify::<ExecutionRecord, _>(turn.id.as_str(), |cur| match cur {
            Some(r) if r.status.is_terminal() || r.status == status => Change::Keep,
            Some(r) => Change::Write(ExecutionRecord {
                status: status.clone(),
                ..r.clone()
            }),
            None => Change::Write(ExecutionRecord {
                id: turn.id.clone().into(),
                kind,
                name: name.clone(),
                parent: turn.parent.clone(),
                scope: Scope::Turn,
                session: turn.session.clone(),
                owner: Some(turn.session.clone()),
                watchers: Vec::new(),
                created_at: turn.queued_at,
                work: None,
                token: None,
                children: Vec::new(),
                handed_over: Vec::new(),
                status: status.clone(),
            }),
        })
        .await
}

fn turn_name(text: &str) -> String {
    let first = text.lines().next().unwrap_or("").trim();
    let mut name: String = first.chars().take(48).collect();
    if first.chars().count() > 48 {
        name.push('…');
    }
    name
}

/// Appends `child` to the parent's index (idempotent). Starts under one parent are
/// serialized in this replica, so a burst of them (an agent starting 1,000 steps) does not
/// turn into a compare-and-set storm on the parent's record.
pub(crate) async fn add_child(
    ctx: &Ctx,
    parent: &ExecutionId,
    child: &ExecutionId,
) -> Result<(), KvError> {
    append_child(ctx, parent, child, false).await.map(|_| ())
}

/// Appends a new step to its parent's index unless the parent has ended; `false` then: the
/// step must not start. One compare-and-set with the parent's end, which writes the same
/// record: a child appended before that end is in the record the end's cancellation walks
/// (R7), and one that comes after it finds the end.
pub(crate) async fn add_live_child(
    ctx: &Ctx,
    parent: &ExecutionId,
    child: &ExecutionId,
) -> Result<bool, KvError> {
    append_child(ctx, parent, child, true).await
}

/// Whether `child` is in the parent's index afterwards.
async fn append_child(
    ctx: &Ctx,
    parent: &ExecutionId,
    child: &ExecutionId,
    live_only: bool,
) -> Result<bool, KvError> {
    let lock = ctx.parent_lock(parent);
    let _held = lock.lock().await;
    let result = ctx
        .buckets
        .executions
        .modify::<ExecutionRecord, _>(parent.as_str(), |cur| match cur {
            Some(r) if live_only && r.status.is_terminal() => Change::Keep,
            Some(r) if !r.children.contains(child) => {
                let mut next = r.clone();
                next.children.push(child.clone());
                Change::Write(next)
            }
            _ => Change::Keep,
        })
        .await;
    drop(_held);
    ctx.release_parent_lock(parent, lock);
    Ok(result?
        .is_some_and(|r| !(live_only && r.status.is_terminal()) && r.children.contains(child)))
}

/// Why `step` must be cancelled at birth, if it must: its parent ended between the step's
/// index entry and its record, so that end's cancellation walk found no record to cancel, and
/// the start cancels it as the walk would have (R7): under a cancelled step (what it owns is
/// cancelled with it), or `turn`-scoped under a turn that ended, looking through
/// `session`-scoped steps as the turn's walk does. Read after the record is written: either a
/// read here sees the end, or the end's walk comes after the record and sees it. Also checked
/// by a repeated start before it hands the work out again (`api::steps`).
pub(crate) async fn orphaned_by(
    ctx: &Ctx,
    step: &ExecutionRecord,
) -> Result<Option<&'static str>, RegistryError> {
    if step.scope == Scope::Detached {
        return Ok(None);
    }
    let mut at = step.parent.clone();
    let mut first = true;
    for _ in 0..MAX_DEPTH {
        let Some(id) = at else {
            return Ok(None);
        };
        let Some(node) = get(ctx, &id).await? else {
            return Ok(None);
        };
        match node.kind {
            ExecKind::Step if first && matches!(node.status, ExecStatus::Cancelled { .. }) => {
                return Ok(Some(exec_reason::PARENT_CANCELLED));
            }
            // The turn's walk looks through `session`-scoped steps for `turn`-scoped work; a
            // `turn`-scoped step between is cancelled by it and cancels what it owns (checked
            // above when it is the parent); a `detached` one is not reached.
            ExecKind::Step if step.scope == Scope::Turn && node.scope == Scope::Session => {}
            ExecKind::Turn | ExecKind::Delivery => {
                let ended = step.scope == Scope::Turn && node.status.is_terminal();
                return Ok(ended.then_some(exec_reason::TURN_ENDED));
            }
            _ => return Ok(None),
        }
        first = false;
        at = node.parent.clone();
    }
    Ok(None)
}

/// The turn the session's lane holds right now, read off its consumer (R1, R6): the item in
/// flight when one is pending, decoded from the lane stream.
pub(crate) async fn lane_occupant(
    ctx: &Ctx,
    session: &SessionId,
) -> Result<Option<TurnId>, RegistryError> {
    let lane_err = |e: async_nats::Error| RegistryError::Lane {
        session: session.clone(),
        source: e,
    };
    let stream = ctx
        .js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| lane_err(e.into()))?;
    let info = match stream.consumer_info(subjects::lane_consumer(session)).await {
        Ok(i) => i,
        Err(_) => return Ok(None),
    };
    if info.num_ack_pending == 0 {
        return Ok(None);
    }
    let msg = match stream.direct_get(info.delivered.stream_sequence).await {
        Ok(m) => m,
        Err(_) => return Ok(None),
    };
    let Ok(item) = LaneItem::decode(&msg.payload, session) else {
        return Ok(None);
    };
    Ok(turnstile_shared::lane::current_turn(&item, &ctx.buckets.runs).await?)
}

/// Queues the end of an execution for the ended consumer (the one writer of terminal states).
pub(crate) async fn publish_end(ctx: &Ctx, ended: &Ended) -> Result<(), RegistryError> {
    send_end(ctx, ended).await?.await.map(|_| ())
}

/// [`publish_end`], sent now: the returned future waits for the stream's acknowledgement and
/// gives the message's sequence on the ended queue.
pub(crate) async fn send_end(
    ctx: &Ctx,
    ended: &Ended,
) -> Result<impl std::future::Future<Output = Result<u64, RegistryError>>, RegistryError> {
    let env = ended.envelope()?;
    let ack =
        events::send_stored(&ctx.js, subjects::step_ended(&ended.execution), &env, None).await?;
    Ok(async move { ack.await.map_err(RegistryError::from) })
}

/// Which descendants a cancellation reaches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Reach {
    /// Everything owned: children of any scope but `detached`.
    Owned,
    /// Only `turn`-scoped work (looking through `session`-scoped nodes): a turn that ended.
    TurnScoped,
}

/// What a cancellation walk did.
pub(crate) struct Walked {
    /// The nodes it cancelled.
    pub cancelled: Vec<ExecutionId>,
    /// Index entries it met with no record yet: see [`recheck_unrecorded`].
    pub unrecorded: Vec<ExecutionId>,
}

/// Cancels the live descendants of `root` that `reach` covers. Each cancelled node's own
/// children are cancelled by the ended consumer when it records the cancel.
pub(crate) async fn cancel_under(
    ctx: &Ctx,
    root: &ExecutionRecord,
    reach: Reach,
    reason: &str,
) -> Result<Walked, RegistryError> {
    let (cancelled, unrecorded) =
        walk(ctx, &root.id, root.children.clone(), reach, reason, true).await?;
    Ok(Walked {
        cancelled,
        unrecorded,
    })
}

/// The second look at the index entries a walk met with no record. Such an entry is a step
/// start between its entry and its record; the start reads the parent after writing its
/// record and cancels its own step if the parent has ended (`orphaned_by`), unless its
/// broker replica died between the two. So, [`UNRECORDED_GRACE`] after the walk, a step
/// recorded since is cancelled here as the walk would have. A start that takes longer than
/// that and then dies is not covered (nor is this look, if its own replica dies first: the
/// mirror and ended consumers hold their message until it is done, so theirs is redelivered;
/// an operator's cancel is not). Only steps are looked at: a turn, whose record comes only
/// when it runs, is not the walk's to follow once it starts later. Returns what it cancelled.
pub(crate) async fn recheck_unrecorded(
    ctx: &Ctx,
    root: &ExecutionId,
    unrecorded: Vec<ExecutionId>,
    reach: Reach,
    reason: &str,
) -> Vec<ExecutionId> {
    if unrecorded.is_empty() {
        return Vec::new();
    }
    tokio::time::sleep(UNRECORDED_GRACE).await;
    match walk(ctx, root, unrecorded, reach, reason, false).await {
        Ok((late, never)) => {
            if !late.is_empty() {
                tracing::info!(%root, count = late.len(), "{LATE_CANCELLED}");
            }
            if !never.is_empty() {
                tracing::debug!(%root, count = never.len(), "index entries with no record (starts cut off before their record)");
            }
            late
        }
        Err(e) => {
            tracing::warn!(%root, error = %e, "second look at unrecorded index entries");
            Vec::new()
        }
    }
}

/// Logged when the second look cancels something: a start whose own check did not run.
pub(crate) const LATE_CANCELLED: &str = "cancelled a step recorded after the walk passed its entry";

/// How long after a cancellation walk an index entry it met without a record is read again.
/// A start writes its record milliseconds after its entry.
const UNRECORDED_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// One pass from `from`: what it cancelled, and the entries with no record. `whole`: follow
/// every kind of node (the first pass); otherwise steps only (the second look).
async fn walk(
    ctx: &Ctx,
    root: &ExecutionId,
    from: Vec<ExecutionId>,
    reach: Reach,
    reason: &str,
    whole: bool,
) -> Result<(Vec<ExecutionId>, Vec<ExecutionId>), RegistryError> {
    let (mut out, mut unrecorded) = (Vec::new(), Vec::new());
    let mut stack = from;
    let mut seen = 0usize;
    while let Some(id) = stack.pop() {
        seen += 1;
        if seen > MAX_NODES {
            tracing::warn!(%root, "cancellation walk stopped at {MAX_NODES} nodes");
            break;
        }
        let Some(rec) = get(ctx, &id).await? else {
            unrecorded.push(id);
            continue;
        };
        // Turns, messages and runs are not cancelled here (a turn is not interrupted); what
        // they started is.
        if rec.kind != ExecKind::Step {
            if whole {
                stack.extend(rec.children.iter().cloned());
            }
            continue;
        }
        match (rec.scope, reach) {
            (Scope::Detached, _) => continue,
            (Scope::Session, Reach::TurnScoped) => {
                stack.extend(rec.children.iter().cloned());
                continue;
            }
            _ => {}
        }
        if rec.status.is_terminal() {
            continue;
        }
        let ended = Ended::cancelled(rec.id.clone(), reason, rec.status.started_at());
        publish_end(ctx, &ended).await?;
        out.push(rec.id.clone());
    }
    Ok((out, unrecorded))
}

const MAX_NODES: usize = 20_000;
const MAX_DEPTH: usize = 64;

/// The subtree under `id`, with `settled` true where the whole subtree is terminal.
pub(crate) async fn tree(ctx: &Ctx, id: &ExecutionId) -> Result<Option<TreeNode>, KvError> {
    let Some(root) = get(ctx, id).await? else {
        return Ok(None);
    };
    let mut budget = MAX_NODES;
    Ok(Some(build(ctx, root, 0, &mut budget).await?))
}

async fn build(
    ctx: &Ctx,
    record: ExecutionRecord,
    depth: usize,
    budget: &mut usize,
) -> Result<TreeNode, KvError> {
    let mut nodes = Vec::new();
    let mut settled = record.status.is_terminal();
    if depth < MAX_DEPTH {
        let take = record.children.len().min(*budget);
        if take < record.children.len() {
            settled = false;
        }
        *budget -= take;
        // Children are read a few dozen at a time; grandchildren after.
        let mut children = Vec::with_capacity(take);
        for chunk in record.children[..take].chunks(32) {
            for r in futures::future::join_all(chunk.iter().map(|c| get(ctx, c))).await {
                children.push(r?);
            }
        }
        for rec in children.into_iter().flatten() {
            let node = Box::pin(build(ctx, rec, depth + 1, budget)).await?;
            settled &= node.settled;
            nodes.push(node);
        }
    } else if !record.children.is_empty() {
        settled = false;
    }
    Ok(TreeNode {
        record: record.redacted(),
        settled,
        nodes,
    })
}
