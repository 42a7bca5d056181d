//! Which sessions have a delivery armed, or a run holding their deliveries (R3, R4), as far as
//! this replica can tell from the lifecycle events and its own marker creates. Routing ahead
//! ([`super::early`]) sends a lane item beside the marker's create only to a session it sees
//! with none armed, and reserves the session as it does, so ends arriving together send one
//! item, not one each. An item sent where a delivery is armed all the same is an extra
//! delivery on the lane: harmless (it finds nothing left to carry, and does not wait), but one
//! more item than the session's one. The view is a hint. A session it misses (a replica
//! restarted, a run taken over by another lane replica before its next round, another broker
//! replica arming a moment ago) costs at worst such an extra item; a session it wrongly holds
//! armed costs the round trip routing ahead would have saved. A delivery that finds nothing
//! to carry ends without an event, so its session stays armed here until the next delivery
//! is queued (there is one marker a session) or [`FORGET`] passes without news.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::EventKind;
use turnstile_shared::{subjects, SessionId};

/// How long an entry stands without news of its session (a lost end event). A run's rounds
/// are news; a delivery turn may take as long as the transport's turn timeout.
const FORGET: Duration = Duration::from_secs(3600);

/// What holds a session's deliveries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Holder {
    /// A delivery armed (or reserved by this replica while its marker's create is on its way).
    Delivery(String),
    Run(String),
    /// Someone a marker create found, whom this replica has not heard of.
    Someone,
}

/// How often entries past [`FORGET`] are swept (a look-up ignores them meanwhile).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

#[derive(Default)]
pub(crate) struct ArmedSessions {
    inner: Mutex<Entries>,
    /// Whether the events are followed: until they are, every session counts as armed.
    following: AtomicBool,
}

#[derive(Default)]
struct Entries {
    by_session: HashMap<SessionId, Holders>,
    swept: Option<Instant>,
}

impl Entries {
    /// Forgets entries without news for [`FORGET`], at most once every [`SWEEP_EVERY`]: a
    /// scan of every armed session, kept off the path of each end.
    fn sweep(&mut self) {
        if self.swept.is_some_and(|at| at.elapsed() < SWEEP_EVERY) {
            return;
        }
        self.by_session.retain(|_, h| h.news.elapsed() < FORGET);
        self.swept = Some(Instant::now());
    }
}

struct Holders {
    held: HashSet<Holder>,
    news: Instant,
}

impl Holders {
    /// Forgets what an entry without news for [`FORGET`] held: it may not be swept yet.
    fn forget_if_stale(&mut self) {
        if self.news.elapsed() >= FORGET {
            self.held.clear();
        }
    }
}

impl ArmedSessions {
    /// Whether `session` has a delivery armed or a run holding it, as far as this replica knows.
    pub(crate) fn armed(&self, session: &SessionId) -> bool {
        !self.following.load(Ordering::Relaxed)
            || self.inner.lock().is_ok_and(|m| {
                m.by_session
                    .get(session)
                    .is_some_and(|h| h.news.elapsed() < FORGET)
            })
    }

    /// Reserves `session` for `delivery`, whose marker's create is on its way, if it is
    /// unarmed: whether it was (the caller may then send its item ahead).
    pub(crate) fn reserve(&self, session: &SessionId, delivery: &str) -> bool {
        if self.armed(session) {
            return false;
        }
        self.hold(session, Holder::Delivery(delivery.to_string()));
        true
    }

    /// `delivery`'s marker was created: it holds `session` now.
    pub(crate) fn created(&self, session: &SessionId, delivery: &str) {
        self.hold(session, Holder::Delivery(delivery.to_string()));
    }

    /// `delivery`'s marker create found `session` armed by someone else.
    pub(crate) fn lost(&self, session: &SessionId, delivery: &str) {
        self.release(session, &Holder::Delivery(delivery.to_string()));
        self.hold(session, Holder::Someone);
    }

    /// `delivery`'s marker create failed: what it reserved is given up.
    pub(crate) fn failed(&self, session: &SessionId, delivery: &str) {
        self.release(session, &Holder::Delivery(delivery.to_string()));
    }

    fn hold(&self, session: &SessionId, holder: Holder) {
        if let Ok(mut m) = self.inner.lock() {
            m.sweep();
            let h = m
                .by_session
                .entry(session.clone())
                .or_insert_with(|| Holders {
                    held: HashSet::new(),
                    news: Instant::now(),
                });
            h.forget_if_stale();
            if matches!(holder, Holder::Delivery(_)) {
                // One marker a session: a delivery armed means the ones before it are done.
                h.held
                    .retain(|x| !matches!(x, Holder::Delivery(_) | Holder::Someone));
            }
            h.held.insert(holder);
            h.news = Instant::now();
        }
    }

    /// A delivery or run of `session` ended (`Someone` with it: whoever a create found is done
    /// too, or says so when it is).
    fn release(&self, session: &SessionId, holder: &Holder) {
        if let Ok(mut m) = self.inner.lock() {
            if let Some(h) = m.by_session.get_mut(session) {
                h.forget_if_stale();
                h.held.remove(holder);
                h.held.remove(&Holder::Someone);
                h.news = Instant::now();
                if h.held.is_empty() {
                    m.by_session.remove(session);
                }
            }
        }
    }

    fn forget(&self, session: &SessionId) {
        if let Ok(mut m) = self.inner.lock() {
            m.by_session.remove(session);
        }
    }

    /// Follows the sessions' delivery and run events until `shutdown`. Counts as following
    /// only once the server took the subscriptions: a deployment whose config lacks the grant
    /// (its refusal is logged and fails `/readyz`) sends nothing ahead.
    pub(crate) async fn follow(
        &self,
        client: &async_nats::Client,
        shutdown: &CancellationToken,
    ) -> Result<(), FollowError> {
        let stops = subjects::session_event("*", EventKind::SessionStopped.as_str());
        let refusals = turnstile_shared::config::permission_refusals();
        let mut subs = Vec::new();
        for subject in subjects::arming_events().into_iter().chain([stops]) {
            subs.push(client.subscribe(subject).await?);
        }
        // A refused subscription is answered before the flush's reply; the refusal reaches
        // the connection's event callback a moment later.
        client.flush().await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        if turnstile_shared::config::permission_refusals() > refusals
            && turnstile_shared::config::last_permission_refusal()
                .is_some_and(|r| r.contains("ts.events.session"))
        {
            return Err(FollowError::Refused);
        }
        let mut events = futures::stream::select_all(subs);
        self.following.store(true, Ordering::Relaxed);
        loop {
            let msg = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                m = events.next() => match m { Some(m) => m, None => break },
            };
            if let Ok(env) = Envelope::decode(&msg.payload) {
                self.apply(&env);
            }
        }
        self.following.store(false, Ordering::Relaxed);
        Ok(())
    }

    fn apply(&self, env: &Envelope) {
        let Some(session) = env.session.as_ref() else {
            return;
        };
        let Ok(kind) = env.kind.parse::<EventKind>() else {
            return;
        };
        let id = |field: &str| env.data[field].as_str().map(str::to_string);
        match (kind, id("delivery"), id("run")) {
            (EventKind::DeliveryQueued, Some(d), _) => self.hold(session, Holder::Delivery(d)),
            (EventKind::DeliveryCompleted | EventKind::DeliveryFailed, Some(d), _) => {
                self.release(session, &Holder::Delivery(d))
            }
            // A run taken over by another lane replica emits no `run.started`: its rounds say
            // it holds the session.
            (EventKind::RunStarted | EventKind::RunRound, _, Some(r)) => {
                self.hold(session, Holder::Run(r))
            }
            (EventKind::RunCompleted | EventKind::RunFailed, _, Some(r)) => {
                self.release(session, &Holder::Run(r))
            }
            (EventKind::SessionStopped, _, _) => self.forget(session),
            _ => {}
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum FollowError {
    #[error("subscribe: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    #[error("flush: {0}")]
    Flush(#[from] async_nats::client::FlushError),
    #[error("the server refused the subscriptions (this identity's grant lacks them)")]
    Refused,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use turnstile_shared::events::session_event;

    fn ev(kind: EventKind, s: &SessionId, data: serde_json::Value) -> Envelope {
        session_event(kind, s, None, &data).expect("event")
    }

    fn following() -> ArmedSessions {
        let armed = ArmedSessions::default();
        armed.following.store(true, Ordering::Relaxed);
        armed
    }

    #[test]
    fn every_session_counts_as_armed_until_the_events_are_followed() {
        let armed = ArmedSessions::default();
        assert!(armed.armed(&SessionId::new()));
        assert!(!armed.reserve(&SessionId::new(), "d1"));
    }

    #[test]
    fn a_session_is_armed_from_its_delivery_queued_to_that_delivery_ended() {
        let armed = following();
        let s = SessionId::new();
        assert!(!armed.armed(&s));
        armed.apply(&ev(
            EventKind::DeliveryQueued,
            &s,
            json!({ "delivery": "d1" }),
        ));
        armed.apply(&ev(
            EventKind::DeliveryCompleted,
            &s,
            json!({ "delivery": "d1" }),
        ));
        assert!(!armed.armed(&s));
        // A delivery that carried nothing says nothing; the next one queued replaces it.
        armed.apply(&ev(
            EventKind::DeliveryQueued,
            &s,
            json!({ "delivery": "d2" }),
        ));
        armed.apply(&ev(
            EventKind::DeliveryQueued,
            &s,
            json!({ "delivery": "d3" }),
        ));
        armed.apply(&ev(
            EventKind::DeliveryFailed,
            &s,
            json!({ "delivery": "d3" }),
        ));
        assert!(!armed.armed(&s), "d2 was done once d3 was armed");
    }

    #[test]
    fn ends_arriving_together_reserve_the_session_once() {
        let armed = following();
        let s = SessionId::new();
        assert!(armed.reserve(&s, "d1"), "the first sends its item ahead");
        assert!(!armed.reserve(&s, "d2"), "the second finds it reserved");
        armed.failed(&s, "d1");
        assert!(
            armed.reserve(&s, "d3"),
            "a failed create gives the reservation up"
        );
        armed.lost(&s, "d3");
        assert!(armed.armed(&s), "its create found someone else armed");
        armed.apply(&ev(
            EventKind::DeliveryCompleted,
            &s,
            json!({ "delivery": "dx" }),
        ));
        assert!(
            !armed.armed(&s),
            "whoever it was is done once a delivery ends"
        );
    }

    #[test]
    fn a_run_holds_its_session_from_any_of_its_rounds_and_a_stop_forgets_it() {
        let armed = following();
        let s = SessionId::new();
        armed.apply(&ev(
            EventKind::RunRound,
            &s,
            json!({ "run": "run_1", "turn": "t" }),
        ));
        assert!(armed.armed(&s), "a run taken over says so by its rounds");
        armed.apply(&ev(
            EventKind::DeliveryCompleted,
            &s,
            json!({ "delivery": "d9" }),
        ));
        assert!(armed.armed(&s), "a delivery's end is not the run's");
        armed.apply(&ev(EventKind::RunFailed, &s, json!({ "run": "run_1" })));
        assert!(!armed.armed(&s));
        armed.apply(&ev(EventKind::RunStarted, &s, json!({ "run": "run_2" })));
        armed.apply(&ev(EventKind::SessionStopped, &s, json!({})));
        assert!(!armed.armed(&s));
    }
}
