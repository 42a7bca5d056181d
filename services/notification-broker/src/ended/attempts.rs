//! The inline attempts of this replica, by execution (`Inline`, which `Ctx` holds), and how
//! long another replica gives a report's end back. Apart from `inline.rs`, which runs the
//! attempts on `Ctx` and records the ends through `mod.rs`, so that `Ctx` and `mod.rs` need
//! not import a file that imports them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use turnstile_shared::ExecutionId;

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
    pub(super) execution: ExecutionId,
    pub(super) done: watch::Sender<Option<bool>>,
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
    pub(super) fn holds(
        &self,
        execution: &ExecutionId,
        attempt: &watch::Sender<Option<bool>>,
    ) -> bool {
        self.attempts
            .lock()
            .is_ok_and(|a| is_entry_of(&a, execution, attempt))
    }

    /// Drops the entry of this attempt (not of a later one for the same execution).
    pub(super) fn forget(&self, execution: &ExecutionId, attempt: &watch::Sender<Option<bool>>) {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

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
