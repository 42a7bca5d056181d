//! Which sessions have a delivery armed, or a run holding their deliveries (R3, R4), as far as
//! this replica can tell from the lifecycle events and its own marker creates. Routing ahead
//! ([`super::early`]) sends a lane item beside the marker's create only to a session it
//! believes has none armed: an item sent where a delivery is armed would be an extra delivery
//! on the lane (harmless, it finds nothing left to carry, but one more item queued than the
//! session's one). The view is a hint: a session it misses costs at worst such an extra item,
//! a session it wrongly holds armed costs the round trip it would have saved. Its entries are
//! forgotten after [`FORGET`] in any case.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use turnstile_shared::envelope::Envelope;
use turnstile_shared::events::EventKind;
use turnstile_shared::{subjects, SessionId};

/// How long an entry stands without news of its session (a lost end event).
const FORGET: Duration = Duration::from_secs(120);

/// Stands for a holder this replica knows of only by a create that found the session armed.
const SOMEONE: &str = "?";

#[derive(Default)]
pub(crate) struct ArmedSessions {
    inner: Mutex<HashMap<SessionId, Holders>>,
    /// Whether the events are followed: until they are, every session counts as armed.
    following: AtomicBool,
}

struct Holders {
    /// Deliveries armed and runs holding the session (by id).
    ids: HashSet<String>,
    since: Instant,
}

impl ArmedSessions {
    /// Whether `session` has a delivery armed or a run holding it, as far as this replica knows.
    pub(crate) fn armed(&self, session: &SessionId) -> bool {
        !self.following.load(Ordering::Relaxed)
            || self
                .inner
                .lock()
                .is_ok_and(|m| m.get(session).is_some_and(|h| h.since.elapsed() < FORGET))
    }

    /// A delivery (or run) now holds `session`.
    pub(crate) fn hold(&self, session: &SessionId, id: &str) {
        if let Ok(mut m) = self.inner.lock() {
            m.retain(|_, h| h.since.elapsed() < FORGET);
            let h = m.entry(session.clone()).or_insert_with(|| Holders {
                ids: HashSet::new(),
                since: Instant::now(),
            });
            h.ids.insert(id.to_string());
            h.since = Instant::now();
        }
    }

    /// A marker create found `session` armed by someone this replica has not heard of.
    pub(crate) fn found_armed(&self, session: &SessionId) {
        self.hold(session, SOMEONE);
    }

    /// A delivery or run of `session` ended (or the session stopped: `None`).
    fn release(&self, session: &SessionId, id: Option<&str>) {
        if let Ok(mut m) = self.inner.lock() {
            let empty = match (m.get_mut(session), id) {
                (Some(h), Some(id)) => {
                    h.ids.remove(id);
                    // Whoever the create found is done too, or will say so when it is.
                    h.ids.remove(SOMEONE);
                    h.ids.is_empty()
                }
                (Some(_), None) => true,
                (None, _) => false,
            };
            if empty {
                m.remove(session);
            }
        }
    }

    /// Follows the sessions' delivery and run events until `shutdown`.
    pub(crate) async fn follow(
        &self,
        client: &async_nats::Client,
        shutdown: &CancellationToken,
    ) -> Result<(), async_nats::SubscribeError> {
        let stops = subjects::session_event("*", EventKind::SessionStopped.as_str());
        let mut subs = Vec::new();
        for subject in subjects::arming_events().into_iter().chain([stops]) {
            subs.push(client.subscribe(subject).await?);
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
        match kind {
            EventKind::DeliveryQueued => {
                if let Some(d) = id("delivery") {
                    self.hold(session, &d)
                }
            }
            EventKind::RunStarted => {
                if let Some(r) = id("run") {
                    self.hold(session, &r)
                }
            }
            EventKind::DeliveryCompleted | EventKind::DeliveryFailed => {
                self.release(session, id("delivery").as_deref())
            }
            EventKind::RunCompleted | EventKind::RunFailed => {
                self.release(session, id("run").as_deref())
            }
            EventKind::SessionStopped => self.release(session, None),
            _ => {}
        }
    }
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
            EventKind::DeliveryQueued,
            &s,
            json!({ "delivery": "d2" }),
        ));
        armed.apply(&ev(
            EventKind::DeliveryCompleted,
            &s,
            json!({ "delivery": "d1" }),
        ));
        assert!(armed.armed(&s), "d2 is still armed");
        armed.apply(&ev(
            EventKind::DeliveryFailed,
            &s,
            json!({ "delivery": "d2" }),
        ));
        assert!(!armed.armed(&s));
    }

    #[test]
    fn a_run_holds_its_session_and_a_stop_forgets_it() {
        let armed = following();
        let s = SessionId::new();
        armed.apply(&ev(EventKind::RunStarted, &s, json!({ "run": "run_1" })));
        assert!(armed.armed(&s));
        armed.apply(&ev(EventKind::RunCompleted, &s, json!({ "run": "run_1" })));
        assert!(!armed.armed(&s));
        armed.found_armed(&s);
        assert!(armed.armed(&s), "armed by someone unheard of");
        armed.apply(&ev(EventKind::SessionStopped, &s, json!({})));
        assert!(!armed.armed(&s));
    }

    #[test]
    fn someone_unheard_of_is_done_when_a_delivery_of_the_session_ends() {
        let armed = following();
        let s = SessionId::new();
        armed.found_armed(&s);
        armed.apply(&ev(
            EventKind::DeliveryCompleted,
            &s,
            json!({ "delivery": "d9" }),
        ));
        assert!(!armed.armed(&s));
    }
}
