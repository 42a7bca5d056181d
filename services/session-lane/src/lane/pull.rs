//! Lane pull requests without a subscription per lane. async-nats's pull stream gives every
//! consumer its own inbox subscription (a channel whose first block holds 32 messages, about
//! 6 KB) and a task of its own holding a copy of the consumer's info (about 3 KB): at 10,000
//! idle lanes that was half of this service's memory. Here one subscription on
//! `<inbox>.*.*` receives every lane's responses (a request's reply subject is
//! `<inbox>.<session>.<token>`; items arrive under their own subject, `ts.lane.<session>`), and
//! a lane's outstanding request is a oneshot in [`PullHub`]'s map, by session.
//!
//! The protocol is the pull stream's, for one message at a time: a request
//! (`CONSUMER.MSG.NEXT`) asks for one item within `expiry` in the lane's priority group,
//! carrying the pin the server gave this replica (R1: only the pinned replica is served); a
//! status reply (408 expired, 409 terminated, 423 pin mismatch) ends a request and the next
//! one is sent. A request lost with its connection is renewed when the hub sees a reconnect,
//! or after its expiry at the latest (there are no idle heartbeats: at 10,000 idle lanes they
//! were 2,000 messages a second to wake on). A response that arrives for a lane no longer waiting
//! (stopped, or its request renewed) is given back at once with a nak, so the lane's one
//! unacked slot is never held by nobody.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::{Message, StatusCode};
use futures::StreamExt;
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use turnstile_shared::{subjects, SessionId};

/// How long past its expiry a request may stay unanswered before it is taken for lost.
const LOST_MARGIN: Duration = Duration::from_secs(2);
/// How often the hub looks for a reconnect (a state read, no I/O).
const RECONNECT_CHECK: Duration = Duration::from_millis(200);
/// Pause before the next request after a reply that says the server cannot serve one now.
const UNAVAILABLE_PAUSE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub(crate) enum PullError {
    #[error("request next item of {consumer}: {source}")]
    Request {
        consumer: String,
        source: async_nats::PublishError,
    },
    #[error("consumer {consumer}: {status} {description}")]
    Status {
        consumer: String,
        status: StatusCode,
        description: String,
    },
    #[error("consumer {0} was deleted")]
    Deleted(String),
}

struct Waiter {
    token: u64,
    tx: oneshot::Sender<Message>,
}

/// One per replica: the shared reply subscription and who waits on which reply.
pub(crate) struct PullHub {
    client: async_nats::Client,
    js: jetstream::Context,
    inbox: String,
    next_token: AtomicU64,
    /// Per session: the request its lane waits on, and where to hand the reply.
    waiters: Mutex<HashMap<String, Waiter>>,
    /// Set once a survivor took this replica's lanes: nothing is given back from then on.
    fenced: CancellationToken,
    /// How many times the connection has been made (bumped when the hub sees a reconnect):
    /// what a wait for a reply lost with the old connection watches (`handoff::reconnect`).
    connects: tokio::sync::watch::Sender<u64>,
}

impl PullHub {
    /// Subscribes the shared inbox and starts the task that routes replies to their lanes.
    pub(crate) async fn start(
        client: async_nats::Client,
        js: jetstream::Context,
        fenced: CancellationToken,
        shutdown: CancellationToken,
    ) -> Result<Arc<Self>, async_nats::SubscribeError> {
        let inbox = client.new_inbox();
        let replies = client.subscribe(format!("{inbox}.*.*")).await?;
        let hub = Arc::new(Self {
            client,
            js,
            inbox,
            next_token: AtomicU64::new(1),
            waiters: Mutex::new(HashMap::new()),
            fenced,
            connects: tokio::sync::watch::Sender::new(0),
        });
        tokio::spawn(hub.clone().route(replies, shutdown));
        Ok(hub)
    }

    /// Changes each time the hub sees the connection made again (within
    /// `RECONNECT_CHECK`).
    pub(crate) fn reconnects(&self) -> tokio::sync::watch::Receiver<u64> {
        self.connects.subscribe()
    }

    /// Routes each reply to the lane waiting on it; watches for reconnects, after which every
    /// waiting lane renews its request (the server may have lost it).
    async fn route(
        self: Arc<Self>,
        mut replies: async_nats::Subscriber,
        shutdown: CancellationToken,
    ) {
        let mut connects = self.client.statistics().connects.load(Ordering::Relaxed);
        let mut check = tokio::time::interval(RECONNECT_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                reply = replies.next() => match reply {
                    Some(msg) => self.deliver(msg).await,
                    None => break,
                },
                _ = check.tick() => {
                    let now = self.client.statistics().connects.load(Ordering::Relaxed);
                    if now != connects {
                        connects = now;
                        // Dropping the senders wakes every waiting lane to send a new request.
                        self.lock().clear();
                        self.connects.send_replace(now);
                        tracing::debug!("reconnected: lane pull requests renewed");
                    }
                }
            }
        }
        let _ = replies.unsubscribe().await;
        self.lock().clear();
    }

    /// Items arrive under their own subject (`ts.lane.<session>`), statuses under the
    /// request's reply subject (`<inbox>.<session>.<token>`): either names the lane. A status
    /// answers one request, so one for a request already replaced is dropped.
    async fn deliver(&self, msg: Message) {
        let waiter = match subjects::lane_session(msg.subject.as_str()) {
            Some(session) => self.lock().remove(session),
            None => {
                let mut tokens = msg.subject.as_str().rsplitn(3, '.');
                let token = tokens.next().and_then(|t| t.parse::<u64>().ok());
                let session = tokens.next();
                match (session, token) {
                    (Some(session), Some(token)) => {
                        let mut waiters = self.lock();
                        match waiters.get(session) {
                            Some(w) if w.token == token => waiters.remove(session),
                            _ => None,
                        }
                    }
                    _ => None,
                }
            }
        };
        let orphan = match waiter {
            Some(w) => match w.tx.send(msg) {
                Ok(()) => return,
                Err(msg) => msg,
            },
            None => msg,
        };
        // An item (not a status) nobody waits for: give it back so the lane's one unacked
        // slot is free for the request that replaced this one.
        if orphan.status.is_none_or(|s| s == StatusCode::OK) && !self.fenced.is_cancelled() {
            if let Some(ack) = orphan.reply.clone() {
                if let Err(e) = self.client.publish(ack, "-NAK".into()).await {
                    tracing::debug!(subject = %orphan.subject, error = %e, "give back an unclaimed lane item");
                }
            }
        }
    }

    /// How many lanes have a pull request waiting for its reply.
    pub(crate) fn waiting(&self) -> usize {
        self.lock().len()
    }

    /// Forgets a lane's request if it is still the one waiting.
    fn forget(&self, session: &str, token: u64) {
        let mut waiters = self.lock();
        if waiters.get(session).is_some_and(|w| w.token == token) {
            waiters.remove(session);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiter>> {
        // A panic while holding this lock leaves only a map of senders: still usable.
        self.waiters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One lane's pulls: at most one request outstanding, kept across calls to [`LanePull::next`]
/// (so a `select!` that drops the call does not drop the request).
pub(crate) struct LanePull {
    hub: Arc<PullHub>,
    session: String,
    subject: String,
    consumer: String,
    expiry: Duration,
    pin: Option<String>,
    outstanding: Option<Outstanding>,
}

struct Outstanding {
    token: u64,
    rx: oneshot::Receiver<Message>,
    lost_at: Instant,
}

#[derive(Serialize)]
struct PullRequest<'a> {
    batch: usize,
    #[serde(with = "nanos")]
    expires: Duration,
    group: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
}

mod nanos {
    pub(super) fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
}

impl LanePull {
    pub(crate) fn new(hub: Arc<PullHub>, session: &SessionId, expiry: Duration) -> Self {
        let consumer = subjects::lane_consumer(session);
        Self {
            session: session.to_string(),
            subject: subjects::lane_pull(session),
            consumer,
            hub,
            expiry,
            pin: None,
            outstanding: None,
        }
    }

    /// The lane's next item. Cancel-safe: an outstanding request survives a dropped call.
    pub(crate) async fn next(&mut self) -> Result<jetstream::Message, PullError> {
        loop {
            if self.outstanding.is_none() {
                self.request().await?;
            }
            let Some(out) = self.outstanding.as_mut() else {
                continue;
            };
            let reply = tokio::select! {
                r = &mut out.rx => r.ok(),
                _ = tokio::time::sleep_until(out.lost_at) => None,
            };
            let token = out.token;
            self.outstanding = None;
            let Some(msg) = reply else {
                // Lost (expired unanswered, or a reconnect cleared it): ask again.
                self.hub.forget(&self.session, token);
                continue;
            };
            match msg.status.unwrap_or(StatusCode::OK) {
                StatusCode::OK => {
                    if let Some(id) = msg
                        .headers
                        .as_ref()
                        .and_then(|h| h.get_last(subjects::PIN_ID_HEADER))
                    {
                        if self.pin.as_deref() != Some(id.as_str()) {
                            self.pin = Some(id.as_str().to_string());
                        }
                    }
                    return Ok(jetstream::Message {
                        message: msg,
                        context: self.hub.js.clone(),
                    });
                }
                StatusCode::TIMEOUT | StatusCode::NOT_FOUND => {}
                StatusCode::PIN_ID_MISMATCH => self.pin = None,
                StatusCode::REQUEST_TERMINATED => {
                    let description = msg.description.unwrap_or_default();
                    if description == "Consumer Deleted" {
                        return Err(PullError::Deleted(self.consumer.clone()));
                    }
                    if description.starts_with("Exceeded Max") {
                        tokio::time::sleep(UNAVAILABLE_PAUSE).await;
                    }
                }
                status => {
                    tokio::time::sleep(UNAVAILABLE_PAUSE).await;
                    return Err(PullError::Status {
                        consumer: self.consumer.clone(),
                        status,
                        description: msg.description.unwrap_or_default(),
                    });
                }
            }
        }
    }

    async fn request(&mut self) -> Result<(), PullError> {
        let token = self.hub.next_token.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.hub
            .lock()
            .insert(self.session.clone(), Waiter { token, tx });
        let body = serde_json::to_vec(&PullRequest {
            batch: 1,
            expires: self.expiry,
            group: subjects::LANE_GROUP,
            id: self.pin.as_deref(),
        })
        .unwrap_or_default();
        let reply = format!("{}.{}.{token}", self.hub.inbox, self.session);
        if let Err(source) = self
            .hub
            .client
            .publish_with_reply(self.subject.clone(), reply, body.into())
            .await
        {
            self.hub.forget(&self.session, token);
            return Err(PullError::Request {
                consumer: self.consumer.clone(),
                source,
            });
        }
        self.outstanding = Some(Outstanding {
            token,
            rx,
            lost_at: Instant::now() + self.expiry + LOST_MARGIN,
        });
        Ok(())
    }
}

impl Drop for LanePull {
    fn drop(&mut self) {
        if let Some(out) = self.outstanding.take() {
            self.hub.forget(&self.session, out.token);
        }
    }
}
