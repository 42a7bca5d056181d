//! The backstop for runs queued with nothing on their lane to start them.
//!
//! A run's record is written `queued` before its lane item (R14), and only the item starts it.
//! If the item is lost after its publish was acknowledged (seen in the fault campaign: during a
//! three-node cluster's quorum loss, lanes whose consumers the server reported deleted never
//! handed out runs queued then), or never stored (a start whose publish failed and whose caller
//! did not retry), the run stays `queued` for ever and its schedule's overlap policy may skip
//! every later slot because of it. Nothing else would ever notice.
//!
//! So each replica follows the runs bucket's writes (one watch, new writes only, plus a read of
//! the last hour's writes whenever the watch is made) and keeps the runs last written `queued`
//! with no driver. A run still so after [`Config::orphan_run_after`](crate::Config) is checked
//! against its lane: if no item not yet done there names it, its item is published again (the
//! lane serves a repeat of a run item from the record, so publishing one too many is harmless,
//! and replicas racing to do so publish the same message id). A run queued on a session that
//! is stopped or gone can never start: it ends `failed: session_stopped` (R12).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::Operation;
use async_nats::jetstream::stream::DirectGetErrorKind;
use chrono::Utc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use turnstile_shared::events::{self, EventKind};
use turnstile_shared::kv::Change;
use turnstile_shared::lane::LaneItem;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::runs::{run_reason, RunItem, RunRecord, RunState};
use turnstile_shared::{subjects, RunId, SessionId};

use crate::ctx::Ctx;
use turnstile_shared::bucket_watch::{self, Watched};

/// How far back the runs bucket is read when the watch is (re)made: a run queued before
/// that and stranded since was found by a sweep then (unless no replica ran for an hour).
const LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// A run last written `queued` with no driver: since when this replica knows it so, and
/// when it last found the run's item on its lane.
struct Queued {
    session: SessionId,
    since: Instant,
    checked: Option<Instant>,
}

/// What the watch tells the sweep loop.
enum Seen {
    Up,
    /// A run's latest write, with its session if it says `queued` with no driver.
    Run(RunId, Option<SessionId>),
}

/// Follows the runs bucket and sweeps every `after / 2` until `cancel`.
pub(crate) async fn run(ctx: Arc<Ctx>, after: Duration, cancel: CancellationToken) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(bucket_watch::follow_new(
        ctx.buckets.runs.clone(),
        "runs",
        cancel.child_token(),
        move |w| {
            let seen = match w {
                Watched::Up => Seen::Up,
                Watched::Down => return,
                Watched::Entry(e) => {
                    let Ok(id) = e.key.parse::<RunId>() else {
                        return;
                    };
                    let record = (e.operation == Operation::Put)
                        .then(|| serde_json::from_slice::<RunRecord>(&e.value).ok())
                        .flatten();
                    Seen::Run(id, record.as_ref().and_then(waiting))
                }
            };
            let _ = tx.send(seen);
        },
    ));
    let mut queued: HashMap<RunId, Queued> = HashMap::new();
    let mut tick = tokio::time::interval((after / 2).max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            seen = rx.recv() => match seen {
                None => return,
                Some(Seen::Up) => read_recent(&ctx, &mut queued).await,
                Some(Seen::Run(id, session)) => note(&mut queued, id, session),
            },
            _ = tick.tick() => sweep(&ctx, &mut queued, after).await,
        }
    }
}

/// The run's session, if the record says it waits for its item: `queued`, no driver.
fn waiting(r: &RunRecord) -> Option<SessionId> {
    (matches!(r.state, RunState::Queued) && r.driver.is_none()).then(|| r.session.clone())
}

/// Keeps or forgets a run by its latest write (`session`: it waits for its item).
fn note(queued: &mut HashMap<RunId, Queued>, id: RunId, session: Option<SessionId>) {
    match session {
        Some(session) => {
            queued.entry(id).or_insert_with(|| Queued {
                session,
                since: Instant::now(),
                checked: None,
            });
        }
        None => {
            queued.remove(&id);
        }
    }
}

/// The last hour's writes, read when the watch is made: what was queued before this replica
/// started, or while its watch was down.
async fn read_recent(ctx: &Ctx, queued: &mut HashMap<RunId, Queued>) {
    let since = Utc::now() - LOOKBACK;
    match ctx
        .buckets
        .runs
        .entries_written_since::<RunRecord>(">", Some(since))
        .await
    {
        // Oldest first: each key's latest write is noted last.
        Ok(entries) => {
            for (key, record) in entries {
                if let Ok(id) = key.parse::<RunId>() {
                    note(queued, id, waiting(&record));
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "read the runs written lately; the next watch reads them")
        }
    }
}

/// Checks every run queued for at least `after` and not found on its lane within `after`.
async fn sweep(ctx: &Ctx, queued: &mut HashMap<RunId, Queued>, after: Duration) {
    let due: Vec<RunId> = queued
        .iter()
        .filter(|(_, q)| {
            q.since.elapsed() >= after && q.checked.is_none_or(|at| at.elapsed() >= after)
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in due {
        match check(ctx, &id).await {
            Ok(Verdict::Waiting) => {
                if let Some(q) = queued.get_mut(&id) {
                    q.checked = Some(Instant::now());
                }
            }
            Ok(Verdict::Settled) => {
                queued.remove(&id);
            }
            Err(e) => {
                let session = queued.get(&id).map(|q| q.session.to_string());
                tracing::warn!(run = %id, ?session, error = %e, "check a queued run; trying again at the next sweep");
            }
        }
    }
}

enum Verdict {
    /// Still queued, its item on the lane (or just published again): checked again later.
    Waiting,
    /// Not queued any more, or ended here.
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

/// Reads the run and its session afresh and acts on what they say.
async fn check(ctx: &Ctx, id: &RunId) -> Result<Verdict, CheckError> {
    let Some((run, _)) = ctx.buckets.runs.get::<RunRecord>(id.as_str()).await? else {
        return Ok(Verdict::Settled);
    };
    if waiting(&run).is_none() {
        return Ok(Verdict::Settled);
    }
    let session = ctx
        .buckets
        .sessions
        .get::<SessionRecord>(run.session.as_str())
        .await?;
    if !session.is_some_and(|(s, _)| s.is_active()) {
        end_stopped(ctx, id).await?;
        return Ok(Verdict::Settled);
    }
    if on_lane(ctx, &run).await? {
        return Ok(Verdict::Waiting);
    }
    let item = LaneItem::Run(RunItem {
        run: id.clone(),
        attempt: run.attempt,
    });
    let env = item.to_envelope(&run.session)?;
    let env = {
        let id = format!("{}:again", env.id);
        env.with_id(id)
    };
    events::publish_durable(&ctx.js, subjects::lane(&run.session), &env, None).await?;
    tracing::warn!(run = %id, session = %run.session, attempt = run.attempt,
        "a run queued with no item on its lane: its item is published again");
    Ok(Verdict::Waiting)
}

/// Whether the session's lane holds an item not yet done that starts this run (this attempt).
async fn on_lane(ctx: &Ctx, run: &RunRecord) -> Result<bool, CheckError> {
    let read = |what| move |e: async_nats::Error| CheckError::Read { what, source: e };
    let stream = ctx
        .js
        .get_stream_no_info(subjects::LANE_STREAM)
        .await
        .map_err(|e| read("the lane stream")(e.into()))?;
    let subject = subjects::lane(&run.session);
    let mut seq = turnstile_shared::lane::undone_from(&stream, &run.session)
        .await
        .map_err(read("the lane consumer"))?;
    loop {
        let msg = match stream
            .direct_get_next_for_subject(subject.as_str(), Some(seq))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(read("the lane's items")(e.into())),
        };
        seq = msg.sequence + 1;
        if let Ok(LaneItem::Run(item)) = LaneItem::decode(&msg.payload, &run.session) {
            if item.run == run.id && item.attempt == run.attempt {
                return Ok(true);
            }
        }
    }
}

/// A run queued on a session that is stopped or gone can never start: it ends so, and
/// `run.failed` says it.
pub(crate) async fn end_stopped(
    ctx: &Ctx,
    id: &RunId,
) -> Result<(), turnstile_shared::kv::KvError> {
    let ended_at = Utc::now();
    let mut ended = false;
    let rec = ctx
        .buckets
        .runs
        .modify::<RunRecord, _>(id.as_str(), |cur| match cur {
            Some(r) if matches!(r.state, RunState::Queued) && r.driver.is_none() => {
                ended = true;
                Change::Write(RunRecord {
                    state: stopped(ended_at),
                    ..r.clone()
                })
            }
            _ => {
                ended = false;
                Change::Keep
            }
        })
        .await?;
    if let Some(rec) = rec.filter(|_| ended) {
        tracing::info!(run = %id, session = %rec.session, "a run queued on a stopped session ended failed: session_stopped");
        let data = serde_json::json!({ "state": rec.state, "rounds": rec.rounds() });
        crate::lane::run_event(ctx, &rec, EventKind::RunFailed, data).await;
    }
    Ok(())
}

/// The end of a run that never started because its session stopped.
fn stopped(ended_at: chrono::DateTime<Utc>) -> RunState {
    RunState::Failed {
        started_at: None,
        ended_at,
        reason: run_reason::SESSION_STOPPED.to_string(),
        detail: "the session was stopped before this run started".to_string(),
        message_index: 0,
        execution: None,
    }
}
