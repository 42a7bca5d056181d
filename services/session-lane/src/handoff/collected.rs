//! The executions whose completions this replica's lanes collected lately. A delivery item
//! names the completion that armed it (`first`) and waits for it when its fetch does not find
//! it, since an item can overtake its completion's store. But an item the broker sent ahead
//! of its marker's create may be an extra delivery, running after the one that was armed and
//! took that completion already: it must not hold the lane waiting for a completion handed
//! over. What this replica collected tells the two apart; after a lane moves to another
//! replica, the wait is bounded (`arming::FIRST_WAIT`).

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;
use std::sync::Mutex;

use turnstile_shared::{ExecutionId, SessionId};

/// How many entries are remembered, the oldest forgotten first. A delivery carries at most
/// 100; the next item of its session runs right after it.
const REMEMBERED: usize = 4096;

/// A bounded memory of recent keys, the oldest forgotten first.
pub(crate) struct Recent<K> {
    inner: Mutex<Inner<K>>,
}

struct Inner<K> {
    order: VecDeque<K>,
    set: HashSet<K>,
}

impl<K> Default for Recent<K> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                order: VecDeque::new(),
                set: HashSet::new(),
            }),
        }
    }
}

/// Executions whose completions this replica's lanes collected lately.
pub(crate) type Collected = Recent<ExecutionId>;

/// Completions this replica's lanes handed over lately (a completed turn carried them), by
/// session: a copy of one that comes back (a standby held it, or the server handed it out
/// again before its ack or removal landed) is never carried a second time (R3, R14).
pub(crate) type HandedOver = Recent<(SessionId, ExecutionId)>;

impl<K: Eq + Hash + Clone> Recent<K> {
    /// Remembers `keys`.
    pub(crate) fn note<'a>(&self, keys: impl IntoIterator<Item = &'a K>)
    where
        K: 'a,
    {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        for k in keys {
            if inner.set.insert(k.clone()) {
                inner.order.push_back(k.clone());
            }
        }
        while inner.order.len() > REMEMBERED {
            if let Some(old) = inner.order.pop_front() {
                inner.set.remove(&old);
            }
        }
    }

    /// Whether `key` was noted lately.
    pub(crate) fn knows(&self, key: &K) -> bool {
        self.inner.lock().is_ok_and(|inner| inner.set.contains(key))
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
