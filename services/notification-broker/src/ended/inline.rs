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

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use turnstile_shared::removal::Removed;
use turnstile_shared::step_api::Ended;
use turnstile_shared::subjects;
use turnstile_shared::ExecutionId;

use crate::Ctx;

/// How long an attempt's outcome waits for its message's consumer on this replica when the
/// message could not be removed; past this the message went to another replica (which
/// records it again) and the entry is dropped.
const KEEP: Duration = Duration::from_secs(30);

/// How long another replica's consumer gives a report's end back on its first delivery, so
/// the replica recording it can remove it first.
pub(crate) const GRACE: Duration = Duration::from_secs(1);

/// The outcome of an inline attempt: `None` while it runs, then whether it succeeded.
type Outcome = watch::Receiver<Option<bool>>;

/// The inline attempts of this replica, by execution.
#[derive(Default)]
pub(crate) struct Inline {
    attempts: Mutex<HashMap<ExecutionId, Outcome>>,
}

/// An attempt announced before its end message is published, so the consumer cannot take
/// the message without finding it, and started once that message is on the wire.
pub(crate) struct Announced {
    execution: ExecutionId,
    done: watch::Sender<Option<bool>>,
}

impl Inline {
    /// Registers an attempt for `execution`; [`Announced::start`] it beside the publish of its
    /// end message (a dropped announcement leaves the consumer nothing to wait on).
    pub(crate) fn announce(&self, execution: &ExecutionId) -> Announced {
        let (done, outcome) = watch::channel(None);
        if let Ok(mut a) = self.attempts.lock() {
            a.insert(execution.clone(), outcome);
        }
        Announced {
            execution: execution.clone(),
            done,
        }
    }

    /// What the inline attempt for `execution` came to, if this replica made one: waits for
    /// it to finish. `None`: no attempt here (or it vanished): record the end normally.
    pub(crate) async fn outcome(&self, execution: &ExecutionId) -> Option<bool> {
        let mut outcome = self.attempts.lock().ok()?.remove(execution)?;
        let done = match outcome.wait_for(Option::is_some).await {
            Ok(v) => *v,
            Err(_) => None,
        };
        done
    }

    /// Whether this attempt's entry is still waiting for its consumer.
    fn holds(&self, execution: &ExecutionId, attempt: &watch::Sender<Option<bool>>) -> bool {
        self.attempts
            .lock()
            .is_ok_and(|a| is_entry_of(&a, execution, attempt))
    }

    /// Drops the entry of this attempt (not of a later one for the same execution).
    fn forget(&self, execution: &ExecutionId, attempt: &watch::Sender<Option<bool>>) {
        if let Ok(mut a) = self.attempts.lock() {
            if is_entry_of(&a, execution, attempt) {
                a.remove(execution);
            }
        }
    }
}

fn is_entry_of(
    attempts: &HashMap<ExecutionId, Outcome>,
    execution: &ExecutionId,
    attempt: &watch::Sender<Option<bool>>,
) -> bool {
    attempts
        .get(execution)
        .is_some_and(|o| o.same_channel(&attempt.subscribe()))
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::StepId;

    #[tokio::test]
    async fn the_consumer_learns_what_the_attempt_came_to() {
        let inline = Arc::new(Inline::default());
        let x: ExecutionId = StepId::new().into();
        assert_eq!(
            inline.outcome(&x).await,
            None,
            "no attempt: record normally"
        );

        let attempt = inline.announce(&x);
        let waiting = tokio::spawn({
            let (inline, x) = (inline.clone(), x.clone());
            async move { inline.outcome(&x).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "waits while the attempt runs");
        attempt.done.send(Some(true)).unwrap();
        assert_eq!(waiting.await.unwrap(), Some(true));
        assert!(
            !inline.holds(&x, &attempt.done),
            "the consumer took the entry"
        );

        let failed = inline.announce(&x);
        failed.done.send(Some(false)).unwrap();
        assert_eq!(inline.outcome(&x).await, Some(false), "failed: record it");

        let vanished = inline.announce(&x);
        drop(vanished);
        assert_eq!(inline.outcome(&x).await, None, "an attempt that died");
    }

    #[test]
    fn an_attempt_forgets_only_its_own_entry() {
        let inline = Inline::default();
        let x: ExecutionId = StepId::new().into();
        let old = inline.announce(&x);
        let new = inline.announce(&x);
        inline.forget(&x, &old.done);
        assert!(inline.holds(&x, &new.done), "a later attempt's entry stays");
        inline.forget(&x, &new.done);
        assert!(
            !inline.holds(&x, &new.done),
            "a forgotten attempt leaves no entry"
        );
    }
}
