//! The backstop for runs queued with nothing on their lane to start them.
//!
//! A run's record is written `queued` before its lane item (R14), and only the item starts it.
//! If the item is lost after its publish was acknowledged (seen in the fault campaign: during a
//! three-node cluster's quorum loss, lanes whose consumers the server reported deleted never
//! handed out runs queued then), or never stored (a start whose publish failed and whose caller
//! did not retry), the run stays `queued` for ever and its schedule's overlap policy may skip
//! every later slot because of it. Nothing else would ever notice.
//!
//! So each replica keeps the runs last written `queued` (the loop is shared's `backstop`). A
//! retried run is among them: `runs.retry` writes it `queued` again keeping the failed attempt's
//! driver claim (a later item supersedes it), then publishes its item; a publish that failed there
//! (NATS killed or paused at that moment, seen in test.sh's seed-1 campaign on CI) left it queued
//! for ever while this backstop followed only runs with no driver. A run still so after
//! [`Config::orphan_run_after`](crate::Config) is checked against its lane: if no item not yet done
//! there names it, its item is published again (the lane serves a repeat of a run item from the
//! record, so publishing one too many is harmless, and replicas racing to do so publish the same
//! message id). A run queued on a session that is stopped or gone can never start: it ends `failed:
//! session_stopped` (R12).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream::DirectGetErrorKind;
use chrono::Utc;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use turnstile_shared::backstop::{self, Backstop, CheckError, Verdict};
use turnstile_shared::events::{self, EventKind};
use turnstile_shared::kv::{Bucket, Change};
use turnstile_shared::lane::LaneItem;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::runs::{run_reason, RunItem, RunRecord, RunState};
use turnstile_shared::{subjects, RunId, SessionId};

use crate::ctx::Ctx;

/// Just what a write must say to be followed here (the rest of the record is not decoded).
#[derive(Deserialize)]
pub(crate) struct Glance {
    session: SessionId,
    #[serde(flatten)]
    state: RunState,
}

struct QueuedRuns(Arc<Ctx>);

impl Backstop for QueuedRuns {
    type Id = RunId;
    type Glance = Glance;
    /// The run's session (logs name it).
    type Note = SessionId;
    const KIND: &'static str = "run";
    const BUCKET: &'static str = "runs";

    fn bucket(&self) -> Bucket {
        self.0.buckets.runs.clone()
    }

    fn waiting(g: &Glance) -> Option<SessionId> {
        waits(&g.state).then(|| g.session.clone())
    }

    async fn check(&self, id: &RunId, _: &SessionId) -> Result<Verdict, CheckError> {
        check(&self.0, id).await
    }
}

/// Follows the runs bucket and sweeps every `after / 2` until `cancel`.
pub(crate) async fn run(ctx: Arc<Ctx>, after: Duration, cancel: CancellationToken) {
    backstop::run(Arc::new(QueuedRuns(ctx)), after, cancel).await;
}

/// Whether a run waits for its item: `queued` (first time, or again after a retry, when a
/// driver claim of the failed attempt is still stored; only the item moves it on either way).
fn waits(state: &RunState) -> bool {
    matches!(state, RunState::Queued)
}

/// Reads the run and its session afresh and acts on what they say.
async fn check(ctx: &Ctx, id: &RunId) -> Result<Verdict, CheckError> {
    let Some((run, _)) = ctx.buckets.runs.get::<RunRecord>(id.as_str()).await? else {
        return Ok(Verdict::Settled);
    };
    if !waits(&run.state) {
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
    Ok(Verdict::Republished)
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
            Some(r) if waits(&r.state) => {
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
