//! The ends this replica's lanes are about to hand over, as the registry records them. A
//! delivery hands a completion over only once the registry holds its execution's end (R8,
//! R12); for an end routed ahead, its registry write goes out beside the delivery item, so a
//! read made when the item arrives costs a round trip the write has usually finished within.
//! One watch over the executions bucket per replica (new writes only, like the turns watch)
//! keeps the last [`KEPT`] ended records here instead: the record of an end that just armed a
//! delivery arrives with its item, and the check reads nothing.
//!
//! Only what admits is taken from here: an end recorded, for a session that owns or watches
//! it, and not handed to that session already. Anything else (not seen, not ended, another
//! session's, handed over) is read from the registry as before, so a watch that breaks costs
//! a read, never a wrong hand-over: what was kept is forgotten when it breaks. An ended
//! record never changes its end (the first end wins); a watcher added later, or a hand-over
//! recorded, arrives as the record's next write.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use turnstile_shared::delivery::Completion;
use turnstile_shared::execution::{ExecStatus, ExecutionRecord};
use turnstile_shared::kv::Bucket;
use turnstile_shared::{ExecutionId, SessionId};

use turnstile_shared::bucket_watch::Watched;

/// How many ended records are kept, the oldest forgotten first. An end is looked up within
/// milliseconds of its write; at 1,000 ends a second this is four seconds of them.
const KEPT: usize = 4096;

/// An ended execution, as far as a hand-over needs it.
#[derive(Debug, Clone)]
struct Ended {
    completion: Completion,
    owner: Option<SessionId>,
    watchers: Vec<SessionId>,
    /// Sessions a completed turn handed it to already: never admitted from here (the read
    /// refuses them).
    handed: Vec<SessionId>,
}

impl Ended {
    fn of(record: &ExecutionRecord) -> Option<Self> {
        record.status.is_terminal().then(|| Self {
            completion: Completion::of(record),
            owner: record.owner.clone(),
            watchers: record.watchers.clone(),
            handed: record
                .handed_over
                .iter()
                .map(|h| h.session.clone())
                .collect(),
        })
    }

    fn admits(&self, session: &SessionId) -> bool {
        (self.owner.as_ref() == Some(session) || self.watchers.contains(session))
            && !self.handed.contains(session)
    }
}

#[derive(Default)]
struct Kept {
    order: VecDeque<ExecutionId>,
    ended: HashMap<ExecutionId, Ended>,
}

impl Kept {
    fn put(&mut self, id: ExecutionId, ended: Ended) {
        if self.ended.insert(id.clone(), ended).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > KEPT {
            if let Some(old) = self.order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }
}

struct Inner {
    kept: Mutex<Kept>,
    /// Woken on every ended record kept.
    arrived: Notify,
    /// Whether the watch is up: while it is not, nothing waits on it.
    following: AtomicBool,
}

/// One per replica; cheap to clone.
#[derive(Clone)]
pub(crate) struct EndedView {
    inner: Arc<Inner>,
}

impl EndedView {
    /// Starts the watch, which runs until `cancel` (re-watching after an interruption).
    pub(crate) fn start(bucket: Bucket, cancel: CancellationToken) -> Self {
        let view = Self::detached();
        tokio::spawn(follow(bucket, view.clone(), cancel));
        view
    }

    /// A view nothing feeds yet (tests; and the state before the watch is up).
    fn detached() -> Self {
        Self {
            inner: Arc::new(Inner {
                kept: Mutex::default(),
                arrived: Notify::new(),
                following: AtomicBool::new(false),
            }),
        }
    }

    /// The completion `session` is to be told of, if this view holds `execution`'s end and
    /// the end admits `session`. `None` means "read the registry", never "refuse".
    pub(crate) fn admitted(
        &self,
        execution: &ExecutionId,
        session: &SessionId,
    ) -> Option<Completion> {
        let kept = self.inner.kept.lock().ok()?;
        kept.ended
            .get(execution)
            .filter(|e| e.admits(session))
            .map(|e| e.completion.clone())
    }

    /// Like [`EndedView::admitted`], waiting up to `within` for the end to arrive while the
    /// watch is up: for an end whose write went out beside the item now being handled.
    pub(crate) async fn admitted_within(
        &self,
        execution: &ExecutionId,
        session: &SessionId,
        within: Duration,
    ) -> Option<Completion> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let arrived = self.inner.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(c) = self.admitted(execution, session) {
                return Some(c);
            }
            if !self.following() {
                return None;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return None;
            }
        }
    }

    /// Whether the watch is up.
    pub(crate) fn following(&self) -> bool {
        self.inner.following.load(Ordering::Relaxed)
    }

    fn keep(&self, key: &str, value: &[u8]) {
        let Ok(id) = key.parse::<ExecutionId>() else {
            return;
        };
        // Most writes are a running step's (its start, its heartbeats): only an end is read
        // whole.
        if ExecStatus::stored_has_ended(value) != Some(true) {
            return;
        }
        let Ok(record) = serde_json::from_slice::<ExecutionRecord>(value) else {
            return;
        };
        let Some(ended) = Ended::of(&record) else {
            return;
        };
        if let Ok(mut kept) = self.inner.kept.lock() {
            kept.put(id, ended);
        }
        self.inner.arrived.notify_waiters();
    }

    fn forget(&self, key: &str) {
        let Ok(id) = key.parse::<ExecutionId>() else {
            return;
        };
        if let Ok(mut kept) = self.inner.kept.lock() {
            kept.ended.remove(&id);
        }
    }

    fn set_following(&self, up: bool) {
        self.inner.following.store(up, Ordering::Relaxed);
        if !up {
            // Writes made until the next watch are missed (a hand-over among them): what is
            // kept may be stale, so it is forgotten and read afresh.
            if let Ok(mut kept) = self.inner.kept.lock() {
                *kept = Kept::default();
            }
            // Waiters fall back to a read at once.
            self.inner.arrived.notify_waiters();
        }
    }
}

async fn follow(bucket: Bucket, view: EndedView, cancel: CancellationToken) {
    turnstile_shared::bucket_watch::follow_new(bucket, "executions", cancel, |w| match w {
        Watched::Up => view.set_following(true),
        Watched::Down => view.set_following(false),
        Watched::Entry(entry) => match entry.operation {
            Operation::Put => view.keep(&entry.key, &entry.value),
            Operation::Delete | Operation::Purge => view.forget(&entry.key),
        },
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnstile_shared::execution::{ExecKind, ExecStatus, Scope, StepResult};
    use turnstile_shared::StepId;

    fn record(owner: &SessionId, status: ExecStatus) -> ExecutionRecord {
        ExecutionRecord {
            id: StepId::new().into(),
            kind: ExecKind::Step,
            name: "n".into(),
            parent: None,
            scope: Scope::Session,
            session: owner.clone(),
            owner: Some(owner.clone()),
            watchers: vec![],
            created_at: chrono::Utc::now(),
            work: None,
            token: None,
            children: vec![],
            handed_over: Vec::new(),
            status,
        }
    }

    fn ended() -> ExecStatus {
        ExecStatus::Completed {
            started_at: None,
            ended_at: chrono::Utc::now(),
            result: StepResult {
                exit_code: Some(0),
                summary: "done".into(),
                output: vec![],
            },
        }
    }

    fn put(view: &EndedView, r: &ExecutionRecord) {
        let bytes = serde_json::to_vec(r).expect("encode");
        view.keep(r.id.as_str(), &bytes);
    }

    #[test]
    fn only_an_end_recorded_for_its_owner_or_watcher_is_admitted() {
        let view = EndedView::detached();
        let (ours, theirs) = (SessionId::new(), SessionId::new());
        let running = record(&ours, ExecStatus::Queued);
        put(&view, &running);
        assert!(
            view.admitted(&running.id, &ours).is_none(),
            "not ended: read"
        );
        let started = ExecutionRecord {
            status: ExecStatus::Running {
                started_at: chrono::Utc::now(),
                worker: None,
                heartbeat_at: None,
            },
            ..running.clone()
        };
        put(&view, &started);
        assert!(view.admitted(&started.id, &ours).is_none(), "running: read");
        let done = ExecutionRecord {
            status: ended(),
            ..running.clone()
        };
        put(&view, &done);
        let c = view.admitted(&done.id, &ours).expect("admitted");
        assert_eq!(c, Completion::of(&done), "what the record says (R12)");
        assert!(
            view.admitted(&done.id, &theirs).is_none(),
            "another session's: read (and refused there)"
        );
        let watched = ExecutionRecord {
            watchers: vec![theirs.clone()],
            ..done.clone()
        };
        put(&view, &watched);
        assert!(
            view.admitted(&done.id, &theirs).is_some(),
            "a watcher added"
        );
        let handed = ExecutionRecord {
            handed_over: vec![turnstile_shared::execution::HandedOver {
                session: ours.clone(),
                turn: turnstile_shared::TurnId::new(),
                at: chrono::Utc::now(),
            }],
            ..watched.clone()
        };
        put(&view, &handed);
        assert!(
            view.admitted(&done.id, &ours).is_none(),
            "handed to ours already: read (and refused there)"
        );
        assert!(
            view.admitted(&done.id, &theirs).is_some(),
            "not handed to the watcher yet"
        );
        view.forget(done.id.as_str());
        assert!(view.admitted(&done.id, &ours).is_none(), "removed: read");
    }

    #[test]
    fn a_broken_watch_forgets_what_it_kept() {
        let view = EndedView::detached();
        let s = SessionId::new();
        let done = ExecutionRecord {
            status: ended(),
            ..record(&s, ExecStatus::Queued)
        };
        view.set_following(true);
        put(&view, &done);
        assert!(view.admitted(&done.id, &s).is_some());
        // A hand-over written while the watch is down would be missed: read instead.
        view.set_following(false);
        assert!(view.admitted(&done.id, &s).is_none());
    }

    #[test]
    fn keeps_the_latest_and_forgets_the_oldest() {
        let view = EndedView::detached();
        let s = SessionId::new();
        let all: Vec<ExecutionRecord> = (0..=KEPT)
            .map(|_| ExecutionRecord {
                status: ended(),
                ..record(&s, ExecStatus::Queued)
            })
            .collect();
        for r in &all {
            put(&view, r);
        }
        assert!(
            view.admitted(&all[0].id, &s).is_none(),
            "the oldest forgotten"
        );
        assert!(view.admitted(&all[KEPT].id, &s).is_some());
    }

    #[tokio::test]
    async fn a_wait_ends_when_the_end_arrives_or_at_once_without_a_watch() {
        let view = EndedView::detached();
        let s = SessionId::new();
        let done = ExecutionRecord {
            status: ended(),
            ..record(&s, ExecStatus::Queued)
        };
        let long = Duration::from_secs(30);
        // No watch up: a read at once, not a wait.
        assert!(view.admitted_within(&done.id, &s, long).await.is_none());
        view.set_following(true);
        let waiting = tokio::spawn({
            let (view, id, s) = (view.clone(), done.id.clone(), s.clone());
            async move { view.admitted_within(&id, &s, long).await }
        });
        tokio::task::yield_now().await;
        put(&view, &done);
        let got = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("woken by the end")
            .expect("task");
        assert!(got.is_some());
    }
}
