//! The backstop for steps queued with no work item left to start them.
//!
//! A step's record is written `queued` before its work item is published (`api/steps`), and
//! only the item starts it: a transport agent (`command`), a worker of its queue (`external`)
//! or this broker's agent launcher (`agent`). If the item is lost after its publish was
//! acknowledged (a server killed before it wrote the message out, the store's disk full), or
//! never stored (a start whose publish failed and whose caller did not retry), the step stays
//! `queued` for ever: its parent's run never ends, its completion never comes. Seen once in
//! the fault campaign (a detached command step, queued, never started, nothing logged).
//!
//! So each replica follows the executions bucket's writes (one watch, new writes only, plus a
//! read of the last hour's writes whenever the watch is made) and keeps the steps last
//! written `queued`. A step still so after [`Config::orphan_step_after`](crate::Config) is
//! looked for on its work subject: the step stream is a work queue, so what is stored there
//! past its consumer's ack floor is exactly the work not yet done. If its item is not among
//! it, the item is published again. Publishing one too many is harmless: a worker starts a
//! step only by moving its record from `queued` to `running` (compare-and-set), so a second
//! copy finds it taken (R2); replicas racing publish the same message id.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::stream::DirectGetErrorKind;
use async_nats::jetstream::{self, context::ConsumerInfoErrorKind};
use chrono::Utc;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use turnstile_shared::bucket_watch::{self, Watched};
use turnstile_shared::envelope::Envelope;
use turnstile_shared::execution::{ExecStatus, ExecutionRecord, StepWork};
use turnstile_shared::step_api::StepWorkItem;
use turnstile_shared::{events, subjects, ExecutionId, StepId};

use crate::ctx::Ctx;

/// How far back the executions bucket is read when the watch is (re)made.
const LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// Stored items read at most when looking for one step's item; past that it is taken as
/// there (a queue that long is being served, or is waiting for its workers).
const SCAN: usize = 10_000;

/// A step last written `queued`: since when this replica knows it so, and when it last found
/// the step's item stored.
struct Queued {
    since: Instant,
    checked: Option<Instant>,
}

/// What the watch tells the sweep loop.
enum Seen {
    Up,
    /// A step's latest write: whether it says `queued`.
    Step(StepId, bool),
}

/// Just what a write must say to be followed here (the rest of the record is not decoded).
#[derive(Deserialize)]
struct Glance {
    #[serde(flatten)]
    status: ExecStatus,
}

fn queued(value: &[u8]) -> bool {
    serde_json::from_slice::<Glance>(value).is_ok_and(|g| g.status == ExecStatus::Queued)
}

/// Follows the executions bucket and sweeps every `after / 2` until `cancel`.
pub(crate) async fn run(ctx: Arc<Ctx>, after: Duration, cancel: CancellationToken) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(bucket_watch::follow_new(
        ctx.buckets.executions.clone(),
        "executions",
        cancel.child_token(),
        move |w| {
            let seen = match w {
                Watched::Up => Seen::Up,
                Watched::Down => return,
                Watched::Entry(e) => {
                    // Turns, runs and messages are mirrored here too: only steps are followed.
                    let Ok(id) = e.key.parse::<StepId>() else {
                        return;
                    };
                    Seen::Step(id, e.operation == Operation::Put && queued(&e.value))
                }
            };
            let _ = tx.send(seen);
        },
    ));
    let mut waiting: HashMap<StepId, Queued> = HashMap::new();
    let mut tick = tokio::time::interval((after / 2).max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            seen = rx.recv() => match seen {
                None => return,
                Some(Seen::Up) => read_recent(&ctx, &mut waiting).await,
                Some(Seen::Step(id, queued)) => note(&mut waiting, id, queued),
            },
            _ = tick.tick() => sweep(&ctx, &mut waiting, after).await,
        }
    }
}

/// Keeps or forgets a step by its latest write.
fn note(waiting: &mut HashMap<StepId, Queued>, id: StepId, queued: bool) {
    if queued {
        waiting.entry(id).or_insert_with(|| Queued {
            since: Instant::now(),
            checked: None,
        });
    } else {
        waiting.remove(&id);
    }
}

/// The last hour's writes, read when the watch is made: what was queued before this replica
/// started, or while its watch was down.
async fn read_recent(ctx: &Ctx, waiting: &mut HashMap<StepId, Queued>) {
    let since = Utc::now() - LOOKBACK;
    match ctx
        .buckets
        .executions
        .entries_written_since::<Glance>(">", Some(since))
        .await
    {
        // Oldest first: each key's latest write is noted last.
        Ok(entries) => {
            for (key, glance) in entries {
                if let Ok(id) = key.parse::<StepId>() {
                    note(waiting, id, glance.status == ExecStatus::Queued);
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "read the executions written lately; the next watch reads them")
        }
    }
}

/// Checks every step queued for at least `after` and not found stored within `after`.
async fn sweep(ctx: &Ctx, waiting: &mut HashMap<StepId, Queued>, after: Duration) {
    let due: Vec<StepId> = waiting
        .iter()
        .filter(|(_, q)| {
            q.since.elapsed() >= after && q.checked.is_none_or(|at| at.elapsed() >= after)
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in due {
        match check(ctx, &id).await {
            Ok(verdict @ (Verdict::Waiting | Verdict::Republished)) => {
                if let Some(q) = waiting.get_mut(&id) {
                    if q.checked.is_none() && matches!(verdict, Verdict::Waiting) {
                        tracing::info!(step = %id, queued_s = q.since.elapsed().as_secs(),
                            "a step queued this long: its work item is stored, waiting for a worker");
                    }
                    q.checked = Some(Instant::now());
                }
            }
            Ok(Verdict::Settled) => {
                waiting.remove(&id);
            }
            Err(e) => {
                tracing::warn!(step = %id, error = %e, "check a queued step; trying again at the next sweep");
            }
        }
    }
}

enum Verdict {
    /// Still queued, its item stored: checked again later.
    Waiting,
    /// Still queued, its item just published again: checked again later.
    Republished,
    /// Not queued any more (or gone).
    Settled,
}

#[derive(Debug, thiserror::Error)]
enum CheckError {
    #[error("read {what}: {source}")]
    Read {
        what: &'static str,
        source: async_nats::Error,
    },
    #[error(transparent)]
    Kv(#[from] turnstile_shared::kv::KvError),
    #[error(transparent)]
    Envelope(#[from] turnstile_shared::envelope::EnvelopeError),
    #[error(transparent)]
    Publish(#[from] events::PublishError),
}

/// Looks for the step's item where its workers take work; publishes it again if it is not
/// there. The record is read again after the search: an item taken meanwhile has moved the
/// record on (a worker acks only once the step ended), so a record still `queued` after a
/// search that found nothing means the item is not stored.
async fn check(ctx: &Ctx, id: &StepId) -> Result<Verdict, CheckError> {
    let exec = ExecutionId::from(id);
    let Some((_, work)) = still_queued(ctx, &exec).await? else {
        return Ok(Verdict::Settled);
    };
    if stored(ctx, id, &work).await? {
        return Ok(Verdict::Waiting);
    }
    let Some((record, work)) = still_queued(ctx, &exec).await? else {
        return Ok(Verdict::Settled);
    };
    let item = StepWorkItem {
        step: id.clone(),
        token: record.token.clone().unwrap_or_default(),
        session: record.session.clone(),
        name: record.name.clone(),
        work: work.clone(),
    };
    let env = item.envelope()?;
    let env = {
        let again = format!("{}:again", env.id);
        env.with_id(again)
    };
    let (subject, _) = work.queue();
    events::publish_durable(&ctx.js, subject, &env, None).await?;
    tracing::warn!(step = %id, session = %record.session, kind = work.kind(),
        "a step queued with no work item stored: its item is published again");
    Ok(Verdict::Republished)
}

/// The step's record and its work, if it still says `queued`.
async fn still_queued(
    ctx: &Ctx,
    exec: &ExecutionId,
) -> Result<Option<(ExecutionRecord, StepWork)>, CheckError> {
    let record = ctx
        .buckets
        .executions
        .get::<ExecutionRecord>(exec.as_str())
        .await?
        .map(|(r, _)| r)
        .filter(|r| r.status == ExecStatus::Queued);
    Ok(record.and_then(|r| r.work.clone().map(|w| (r, w))))
}

/// Whether an item of `step` is stored on its work subject past its consumer's ack floor
/// (what a worker can still be handed; a missing consumer hands out everything stored).
async fn stored(ctx: &Ctx, step: &StepId, work: &StepWork) -> Result<bool, CheckError> {
    let read = |what| move |e: async_nats::Error| CheckError::Read { what, source: e };
    let (subject, consumer) = work.queue();
    let stream: jetstream::stream::Stream<()> = ctx
        .js
        .get_stream_no_info(subjects::STEP_STREAM)
        .await
        .map_err(|e| read("the step stream")(e.into()))?;
    let mut seq = match stream.consumer_info(consumer).await {
        Ok(info) => info.ack_floor.stream_sequence + 1,
        Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => 1,
        Err(e) => return Err(read("the step work consumer")(e.into())),
    };
    for _ in 0..SCAN {
        let msg = match stream
            .direct_get_next_for_subject(subject.as_str(), Some(seq))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(read("the step work items")(e.into())),
        };
        seq = msg.sequence + 1;
        let item = Envelope::decode(&msg.payload).and_then(|env| env.data_as::<StepWorkItem>());
        if item.is_ok_and(|i| i.step == *step) {
            return Ok(true);
        }
    }
    Ok(true)
}
