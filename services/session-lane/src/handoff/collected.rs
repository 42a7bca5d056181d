//! The executions whose completions this replica's lanes collected lately. A delivery item
//! names the completion that armed it (`first`) and waits for it when its fetch does not find
//! it, since an item can overtake its completion's store. But an item the broker sent ahead
//! of its marker's create may be an extra delivery, running after the one that was armed and
//! took that completion already: it must not hold the lane waiting for a completion handed
//! over. What this replica collected tells the two apart; after a lane moves to another
//! replica, the wait is bounded (`arming::FIRST_WAIT`).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use turnstile_shared::ExecutionId;

/// How many collected executions are remembered, the oldest forgotten first. A delivery
/// carries at most 100; the next item of its session runs right after it.
const REMEMBERED: usize = 4096;

#[derive(Default)]
pub(crate) struct Collected {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    order: VecDeque<ExecutionId>,
    set: HashSet<ExecutionId>,
}

impl Collected {
    /// Remembers executions whose completions a lane just collected.
    pub(crate) fn note<'a>(&self, executions: impl IntoIterator<Item = &'a ExecutionId>) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for e in executions {
            if inner.set.insert(e.clone()) {
                inner.order.push_back(e.clone());
            }
        }
        while inner.order.len() > REMEMBERED {
            if let Some(old) = inner.order.pop_front() {
                inner.set.remove(&old);
            }
        }
    }

    /// Whether a lane of this replica collected `execution`'s completion lately.
    pub(crate) fn knows(&self, execution: &ExecutionId) -> bool {
        self.inner
            .lock()
            .is_ok_and(|inner| inner.set.contains(execution))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::StepId;

    #[test]
    fn remembers_the_latest_and_forgets_the_oldest() {
        let c = Collected::default();
        let first: ExecutionId = StepId::new().into();
        c.note([&first]);
        assert!(c.knows(&first));
        let rest: Vec<ExecutionId> = (0..REMEMBERED).map(|_| StepId::new().into()).collect();
        c.note(&rest);
        assert!(!c.knows(&first), "the oldest is forgotten past the bound");
        assert!(rest.iter().all(|e| c.knows(e)));
        c.note([&rest[0]]);
        assert!(c.knows(&rest[0]), "noting again keeps it");
    }
}
