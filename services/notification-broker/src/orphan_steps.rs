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
//! So each replica keeps the steps last written `queued` (the loop is shared's `backstop`); a
//! step still so after [`Config::orphan_step_after`](crate::Config) is looked for on its work
//! subject: the step stream is a work queue, so what is stored there
//! past its consumer's ack floor is exactly the work not yet done. If its item is not among
//! it, the item is published again. Publishing one too many is harmless: a worker starts a
//! step only by moving its record from `queued` to `running` (compare-and-set), so a second
//! copy finds it taken (R2); replicas racing publish the same message id.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use turnstile_shared::backstop::{self, Backstop, CheckError, Verdict};
use turnstile_shared::execution::{ExecStatus, ExecutionRecord, StepWork};
use turnstile_shared::kv::Bucket;
use turnstile_shared::step_api::StepWorkItem;
use turnstile_shared::{events, subjects, work_queue, ExecutionId, StepId};

use crate::ctx::Ctx;

/// Stored items read at most when looking for one step's item; past that it is taken as
/// there (a queue that long is being served, or is waiting for its workers).
const SCAN: usize = 10_000;

/// Just what a write must say to be followed here (the rest of the record is not decoded).
#[derive(Deserialize)]
pub(crate) struct Glance {
    #[serde(flatten)]
    status: ExecStatus,
}

struct QueuedSteps(Arc<Ctx>);

impl Backstop for QueuedSteps {
    type Id = StepId;
    type Glance = Glance;
    type Note = ();
    const KIND: &'static str = "step";
    const BUCKET: &'static str = "executions";

    fn bucket(&self) -> Bucket {
        self.0.buckets.executions.clone()
    }

    fn waiting(glance: &Glance) -> Option<()> {
        (glance.status == ExecStatus::Queued).then_some(())
    }

    async fn check(&self, id: &StepId, (): &()) -> Result<Verdict, CheckError> {
        check(&self.0, id).await
    }
}

/// Follows the executions bucket and sweeps every `after / 2` until `cancel`.
pub(crate) async fn run(ctx: Arc<Ctx>, after: Duration, cancel: CancellationToken) {
    backstop::run(Arc::new(QueuedSteps(ctx)), after, cancel).await;
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
    let item = StepWorkItem::of(&record, id.clone(), work.clone());
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
    let (subject, consumer) = work.queue();
    work_queue::holds(
        &ctx.js,
        subjects::STEP_STREAM,
        &consumer,
        &subject,
        SCAN,
        |env| env.data_as::<StepWorkItem>().is_ok_and(|i| i.step == *step),
    )
    .await
    .map_err(|e| CheckError::Read {
        what: "the step work queue",
        source: e.into(),
    })
}
