//! A lane that just handed completions over keeps a pull for its session's next ones out for
//! a while ([`STANDBY_FOR`]): a session whose turns start work gets its completions one after
//! another, and each would otherwise cost its delivery a fetch (a round trip) after its item
//! arrived. With a standby out, the server pushes a completion to this replica as it stores
//! it, beside its delivery item, and the delivery takes it from here.
//!
//! What a standby received is this replica's (ack-pending) until a delivery takes it, so:
//! - a delivery that finds its standby open takes everything in it and fetches nothing (every
//!   completion stored since it opened was pushed to it; those before, at its opening); one
//!   that finds it closed (expired, or full at the cap) takes what it holds and fetches too;
//! - a delivery's recheck after clearing its marker counts what the standby holds, and what
//!   the server delivered that has not arrived yet ([`Standbys::owes`]), as pending: a
//!   completion stored while the marker was still set arms no delivery of its own (R3);
//! - what waited longer than a third of the ack wait (a long turn held the lane) is given
//!   back (nak) and fetched again, before the server would send it again;
//! - at shutdown, what is held is given back with the lanes.
//!
//! Idle sessions hold none: a standby is opened only by a delivery that carried something,
//! and is not renewed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::time::Instant;
use turnstile_shared::delivery::DELIVERY_CAP;
use turnstile_shared::SessionId;

/// How long a standby pull stays out after the delivery that opened it.
pub(crate) const STANDBY_FOR: Duration = Duration::from_secs(5);
/// What share of the lanes' ack wait a message may wait in a standby before it is given back
/// rather than carried ([`Standbys::new`]): well before the server would send it again.
const STALE_SHARE: u32 = 3;
/// Standbys kept before closed, empty ones are swept.
const SWEEP_ABOVE: usize = 1024;

#[derive(Default)]
struct State {
    held: Vec<(Instant, jetstream::Message)>,
    open: bool,
    /// The highest consumer sequence of a delivery this replica received for the session.
    seen: u64,
    /// When it last changed: a closed standby that holds nothing fresh is swept a while after.
    touched: Option<Instant>,
}

#[derive(Default)]
struct Standby {
    state: Mutex<State>,
    arrived: Notify,
}

/// What a delivery found in its session's standby.
pub(crate) struct Held {
    pub messages: Vec<jetstream::Message>,
    /// Still out: every completion stored from now on is pushed to it.
    pub open: bool,
}

/// Every session's standby on this replica.
pub(crate) struct Standbys {
    map: Mutex<HashMap<SessionId, Arc<Standby>>>,
    /// How long a message may wait in a standby (a third of the ack wait).
    stale: Duration,
}

impl Standbys {
    /// For completion consumers whose ack wait is `ack_wait`.
    pub(crate) fn new(ack_wait: Duration) -> Self {
        Self {
            map: Mutex::default(),
            stale: ack_wait / STALE_SHARE,
        }
    }

    /// Opens a standby for `session` unless one is open.
    pub(crate) fn open(&self, consumer: PullConsumer, session: &SessionId) {
        let standby = {
            let Ok(mut map) = self.map.lock() else { return };
            if map.len() > SWEEP_ABOVE {
                sweep(&mut map, self.stale);
            }
            let standby = map.entry(session.clone()).or_default().clone();
            let Ok(mut s) = standby.state.lock() else {
                return;
            };
            if s.open {
                return;
            }
            s.open = true;
            s.touched = Some(Instant::now());
            drop(s);
            standby
        };
        let session = session.clone();
        tokio::spawn(async move {
            if let Err(e) = serve(&standby, consumer).await {
                tracing::debug!(%session, error = %e, "completion standby closed");
            }
            if let Ok(mut s) = standby.state.lock() {
                s.open = false;
                s.touched = Some(Instant::now());
            }
            standby.arrived.notify_waiters();
        });
    }

    fn get(&self, session: &SessionId) -> Option<Arc<Standby>> {
        self.map.lock().ok()?.get(session).cloned()
    }

    /// Takes what `session`'s standby holds. Anything that waited past a third of the ack
    /// wait is given back instead (and then reported closed, so the caller fetches it again).
    pub(crate) async fn take(&self, session: &SessionId) -> Option<Held> {
        let standby = self.get(session)?;
        let (held, open) = {
            let mut s = standby.state.lock().ok()?;
            (std::mem::take(&mut s.held), s.open)
        };
        let mut messages = Vec::with_capacity(held.len());
        let mut gave_back = false;
        for (at, m) in held {
            if at.elapsed() > self.stale {
                let _ = m.ack_with(AckKind::Nak(None)).await;
                gave_back = true;
            } else {
                messages.push(m);
            }
        }
        Some(Held {
            messages,
            open: open && !gave_back,
        })
    }

    /// Waits until `session`'s standby holds something, it closes, or `deadline`.
    pub(crate) async fn arrival(&self, session: &SessionId, deadline: Instant) {
        let Some(standby) = self.get(session) else {
            return;
        };
        let arrived = standby.arrived.notified();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        let waiting = standby
            .state
            .lock()
            .is_ok_and(|s| s.open && s.held.is_empty());
        if waiting {
            let _ = tokio::time::timeout_at(deadline, arrived).await;
        }
    }

    /// Notes a delivery this replica received by a fetch (its consumer sequence): a standby
    /// opened later owes only what was delivered after it.
    pub(crate) fn seen(&self, session: &SessionId, consumer_seq: u64) {
        let Ok(mut map) = self.map.lock() else { return };
        let standby = map.entry(session.clone()).or_default();
        if let Ok(mut s) = standby.state.lock() {
            s.seen = s.seen.max(consumer_seq);
            s.touched = Some(Instant::now());
        };
    }

    /// Whether `session`'s standby holds completions, or the server delivered one to it that
    /// has not arrived yet (`delivered`: the consumer's last delivered sequence).
    pub(crate) fn owes(&self, session: &SessionId, delivered: u64) -> bool {
        self.get(session)
            .and_then(|standby| {
                standby
                    .state
                    .lock()
                    .ok()
                    .map(|s| !s.held.is_empty() || (s.open && delivered > s.seen))
            })
            .unwrap_or(false)
    }

    /// Forgets a stopped session's standby. A pull still out ends on its own within
    /// [`STANDBY_FOR`]; what it held comes back when its ack wait lapses.
    pub(crate) fn forget(&self, session: &SessionId) {
        if let Ok(mut map) = self.map.lock() {
            map.remove(session);
        }
    }

    /// How many sessions have a standby here (open or not yet swept).
    pub(crate) fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// The ack subjects of everything held, taken (to give back at shutdown).
    pub(crate) fn give_back(&self) -> Vec<String> {
        let Ok(map) = self.map.lock() else {
            return Vec::new();
        };
        map.values()
            .filter_map(|standby| standby.state.lock().ok())
            .flat_map(|mut s| std::mem::take(&mut s.held))
            .filter_map(|(_, m)| m.reply.as_ref().map(|r| r.to_string()))
            .collect()
    }
}

/// Receives the standby pull's messages until it expires or is full.
async fn serve(standby: &Standby, consumer: PullConsumer) -> Result<(), async_nats::Error> {
    let mut batch = consumer
        .batch()
        .max_messages(DELIVERY_CAP)
        .expires(STANDBY_FOR)
        .messages()
        .await?;
    while let Some(m) = batch.next().await {
        let m = m?;
        let seq = m.info().map(|i| i.consumer_sequence).unwrap_or_default();
        if let Ok(mut s) = standby.state.lock() {
            s.seen = s.seen.max(seq);
            s.touched = Some(Instant::now());
            s.held.push((Instant::now(), m));
        }
        standby.arrived.notify_waiters();
    }
    Ok(())
}

/// Forgets closed standbys untouched for `stale` that hold nothing fresh (what they
/// still hold comes back when its ack wait lapses: a stopped session's, typically).
fn sweep(map: &mut HashMap<SessionId, Arc<Standby>>, stale: Duration) {
    map.retain(|_, standby| {
        standby.state.lock().is_ok_and(|s| {
            s.open
                || s.touched.is_some_and(|at| at.elapsed() < stale)
                || s.held.iter().any(|(at, _)| at.elapsed() < stale)
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_state(standbys: &Standbys, session: &SessionId, state: State) {
        let standby = Arc::new(Standby {
            state: Mutex::new(state),
            arrived: Notify::new(),
        });
        if let Ok(mut map) = standbys.map.lock() {
            map.insert(session.clone(), standby);
        }
    }

    #[test]
    fn a_standby_owes_what_the_server_sent_it_only_while_it_is_out() {
        let standbys = Standbys::new(Duration::from_secs(30));
        let s = SessionId::new();
        assert!(!standbys.owes(&s, 7), "no standby: nothing owed");
        standbys.seen(&s, 7);
        assert!(!standbys.owes(&s, 7), "closed, holding nothing");
        with_state(
            &standbys,
            &s,
            State {
                open: true,
                seen: 7,
                ..State::default()
            },
        );
        assert!(!standbys.owes(&s, 7), "everything delivered arrived");
        assert!(
            standbys.owes(&s, 8),
            "delivered to it, not arrived yet: pending (its router saw the marker)"
        );
        standbys.seen(&s, 8);
        assert!(!standbys.owes(&s, 8));
        with_state(
            &standbys,
            &s,
            State {
                open: false,
                seen: 7,
                ..State::default()
            },
        );
        assert!(
            !standbys.owes(&s, 8),
            "closed: a later delivery went to a fetch, not to it"
        );
    }
}
