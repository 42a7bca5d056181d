//! Ends reported through the step API are recorded and routed at once by the replica that
//! took the report, beside the store of their message on the ended queue (sent just ahead of
//! the write), instead of after that message's trip back out of the queue: two hops off the
//! completion path. The queued
//! message stays the durable record and the backstop. The consumer that takes it on this
//! replica waits for the attempt already under way and acks the message if it succeeded, or
//! records the end itself if it failed; a message taken by another replica (or redelivered
//! after a crash) is recorded again there, which is idempotent (the first end wins, its
//! completions and events are de-duplicated by id). An attempt whose message was not stored
//! runs on: its worker, told the report failed, reports again, and that report finds the end
//! recorded and stores its message then (`api::steps`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use turnstile_shared::removal::Removed;
use turnstile_shared::step_api::Ended;
use turnstile_shared::subjects;

use super::attempts::Announced;
use crate::ctx::Ctx;

/// How long an attempt's outcome waits for its message's consumer on this replica when the
/// message could not be removed; past this the message went to another replica (which
/// records it again) and the entry is dropped.
const KEEP: Duration = Duration::from_secs(30);

impl Announced {
    /// Records and routes the end now, off the caller's task. `stored` gives the end
    /// message's sequence on the ended queue once it is stored.
    pub(crate) fn start(self, ctx: &Arc<Ctx>, ended: Ended, stored: oneshot::Receiver<u64>) {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let ok = match super::record_end(&ctx, &ended, true).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(execution = %ended.execution, error = %e, "inline end; its queued message records it");
                    false
                }
            };
            drop(ended);
            let _ = self.done.send(Some(ok));
            // Taken already by this replica's consumer (the common case): nothing to keep.
            if !ctx.inline.holds(&self.execution, &self.done) {
                return;
            }
            // Not taken here: it waits on the queue, or another replica was given it (which
            // gives it back for a moment, `GRACE`). Recorded: the message is removed, so it
            // is not recorded again (an empty delivery for every such copy). Otherwise, or if
            // it cannot be removed, kept for the consumer a while.
            if ok && remove(&ctx, stored).await {
                ctx.inline.forget(&self.execution, &self.done);
                return;
            }
            tokio::time::sleep(KEEP).await;
            ctx.inline.forget(&self.execution, &self.done);
        });
    }

    /// The end message was not sent: nothing to wait for.
    pub(crate) fn cancel(self, ctx: &Ctx) {
        ctx.inline.forget(&self.execution, &self.done);
    }
}

/// Removes a recorded end's message from the ended queue; whether it is gone.
async fn remove(ctx: &Ctx, stored: oneshot::Receiver<u64>) -> bool {
    let Ok(seq) = stored.await else {
        return false;
    };
    match turnstile_shared::removal::remove(&ctx.js, subjects::STEP_STREAM, seq).await {
        Ok(Removed::Now | Removed::Already) => true,
        Ok(Removed::Denied) => false,
        Err(e) => {
            tracing::debug!(seq, error = %e, "remove a recorded end's message");
            false
        }
    }
}
