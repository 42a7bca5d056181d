//! One subscription to the lifecycle events (`ts.events.>`) shared by every open page: each
//! event goes out once to all of them through a broadcast channel, de-duplicated by its id (a
//! core subscription sees every publish attempt, retries included). Counts the page cannot
//! derive from events without drifting (a session's busy, queue depth and pending
//! completions; a schedule's next fire times) are read again through the API when an event
//! says they changed, a session or schedule at a time and at most every
//! [`REFRESH_DEBOUNCE`], and sent as `session` and `schedule` frames: reads triggered by
//! events, never a polling loop. Core NATS delivers events only while connected, so when the
//! connection comes back the feed tells every page to `Resync` (take a fresh snapshot).

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use turnstile_shared::api::{self, SessionRef, SessionView};
use turnstile_shared::events::EventKind;
use turnstile_shared::schedules::{ScheduleRef, ScheduleView};
use turnstile_shared::subjects::{self, api as subj};
use turnstile_shared::SessionId;

/// Events a page may fall behind by before it is told to resync.
pub const BACKLOG: usize = 4096;
/// How often the connection's reconnect count is looked at (a local counter, not a read).
const RECONNECT_CHECK: Duration = Duration::from_secs(1);
/// Ids of recent events kept to drop repeats (JetStream's own window is 2 minutes).
const RECENT_IDS: usize = 20_000;
/// Changes to one session or schedule within this are read once.
const REFRESH_DEBOUNCE: Duration = Duration::from_millis(100);
/// When a stale session is read once more: a lane acks its item a moment after the event
/// that ends the item's turn or run, so the first read can still show it busy, and no event
/// follows the ack.
const SESSION_SETTLE: Duration = Duration::from_secs(1);
const CALL: Duration = Duration::from_secs(10);

/// What every page receives.
#[derive(Debug, Clone)]
pub enum Feed {
    /// One lifecycle event, as JSON with any token removed.
    Event(Arc<str>),
    /// A session as the API shows it now (busy, queue depth and pending off the lane).
    Session(Arc<str>),
    /// A schedule as the API shows it now (next fire times, latest slots).
    Schedule(Arc<str>),
    /// Events may have been missed (the NATS connection came back): start over.
    Resync,
}

/// What an event says must be read again.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Stale {
    Session(SessionId),
    Schedule(String),
}

/// Subscribes now (flushed, so nothing published after this returns is missed by a page that
/// subscribes to the sender before it takes its snapshot) and forwards until `shutdown`. If
/// the subscription ends, `failed` and `shutdown` are cancelled: the dashboard stops with an
/// error rather than serve pages that no longer change.
pub async fn start(
    client: async_nats::Client,
    shutdown: CancellationToken,
    failed: CancellationToken,
) -> Result<broadcast::Sender<Feed>, async_nats::Error> {
    let sub = client.subscribe(subjects::EVENTS_ALL).await?;
    client.flush().await?;
    let (tx, _) = broadcast::channel(BACKLOG);
    let (stale_tx, stale_rx) = mpsc::unbounded_channel();
    tokio::spawn(refresh(
        client.clone(),
        stale_rx,
        tx.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(forward(client, sub, tx.clone(), stale_tx, shutdown, failed));
    Ok(tx)
}

async fn forward(
    client: async_nats::Client,
    mut sub: async_nats::Subscriber,
    tx: broadcast::Sender<Feed>,
    stale: mpsc::UnboundedSender<Stale>,
    shutdown: CancellationToken,
    failed: CancellationToken,
) {
    let connects = || client.statistics().connects.load(Ordering::Relaxed);
    let mut seen_connects = connects();
    let mut recent = Recent::default();
    let mut tick = tokio::time::interval(RECONNECT_CHECK);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            msg = sub.next() => match msg {
                Some(msg) => {
                    if let Some((event, changed)) = clean(&msg.payload, &mut recent) {
                        // No page open is not an error.
                        let _ = tx.send(Feed::Event(event));
                        if let Some(changed) = changed {
                            let _ = stale.send(changed);
                        }
                    }
                }
                None => {
                    tracing::error!("the event subscription ended; stopping the dashboard");
                    let _ = tx.send(Feed::Resync);
                    failed.cancel();
                    shutdown.cancel();
                    return;
                }
            },
            _ = tick.tick() => {}
        }
        // Looked at after every message too: a steady stream must not hide a reconnect.
        let now = connects();
        if now != seen_connects {
            seen_connects = now;
            tracing::info!("NATS connection re-established; pages resync");
            let _ = tx.send(Feed::Resync);
        }
    }
}

/// The ids of the latest events, oldest dropped first.
#[derive(Default)]
struct Recent {
    order: VecDeque<String>,
    ids: HashSet<String>,
}

impl Recent {
    /// `false` when `id` was seen already.
    fn first(&mut self, id: &str) -> bool {
        if self.ids.contains(id) {
            return false;
        }
        if self.order.len() >= RECENT_IDS {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        self.order.push_back(id.to_string());
        self.ids.insert(id.to_string());
        true
    }
}

/// The event as the page gets it (one line of JSON, tokens removed) and what it makes stale;
/// `None` for a repeat or what is not JSON (`turnstile events` shows such messages raw).
fn clean(payload: &[u8], recent: &mut Recent) -> Option<(Arc<str>, Option<Stale>)> {
    let mut value: Value = serde_json::from_slice(payload).ok()?;
    if let Some(id) = value["id"].as_str() {
        if !recent.first(id) {
            return None;
        }
    }
    super::snapshot::redact(&mut value);
    let changed = value["type"]
        .as_str()
        .and_then(|k| k.parse::<EventKind>().ok())
        .and_then(|k| stale_after(k, &value));
    Some((Arc::from(value.to_string()), changed))
}

/// What an event of kind `k` makes stale: its schedule (next fires, slots), or its session
/// (the lane's busy and queue, pending completions).
fn stale_after(k: EventKind, event: &Value) -> Option<Stale> {
    use EventKind as K;
    match k {
        K::SlotFired
        | K::SlotSkipped
        | K::SlotMissed
        | K::ScheduleAdded
        | K::SchedulePaused
        | K::ScheduleResumed => event["data"]["schedule"]
            .as_str()
            .map(|s| Stale::Schedule(s.to_string())),
        K::SessionCreated
        | K::SessionStopped
        | K::TurnQueued
        | K::TurnStarted
        | K::TurnCompleted
        | K::TurnFailed
        | K::DeliveryQueued
        | K::DeliveryCompleted
        | K::DeliveryFailed
        | K::CompletionRouted
        | K::RunQueued
        | K::RunStarted
        | K::RunCompleted
        | K::RunFailed
        | K::RunRetried => event["session"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .map(Stale::Session),
        _ => None,
    }
}

/// Reads what events made stale, in batches gathered over [`REFRESH_DEBOUNCE`], and sends it
/// to the pages.
async fn refresh(
    client: async_nats::Client,
    mut stale: mpsc::UnboundedReceiver<Stale>,
    tx: broadcast::Sender<Feed>,
    shutdown: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            s = stale.recv() => match s {
                Some(s) => s,
                None => return,
            },
        };
        tokio::time::sleep(REFRESH_DEBOUNCE).await;
        let mut batch = BTreeSet::from([first]);
        while let Ok(s) = stale.try_recv() {
            batch.insert(s);
        }
        let sessions: Vec<Stale> = batch
            .iter()
            .filter(|s| matches!(s, Stale::Session(_)))
            .cloned()
            .collect();
        let reads = batch.into_iter().map(|s| read(&client, s));
        for frame in futures::future::join_all(reads).await.into_iter().flatten() {
            let _ = tx.send(frame);
        }
        if !sessions.is_empty() {
            tokio::spawn(read_again(client.clone(), sessions, tx.clone()));
        }
    }
}

/// The sessions of a batch read once more after [`SESSION_SETTLE`].
async fn read_again(client: async_nats::Client, sessions: Vec<Stale>, tx: broadcast::Sender<Feed>) {
    tokio::time::sleep(SESSION_SETTLE).await;
    let reads = sessions.into_iter().map(|s| read(&client, s));
    for frame in futures::future::join_all(reads).await.into_iter().flatten() {
        let _ = tx.send(frame);
    }
}

/// One stale thing, read again; `None` when the read failed (the next event or snapshot
/// corrects it) or it is gone.
async fn read(client: &async_nats::Client, stale: Stale) -> Option<Feed> {
    match stale {
        Stale::Session(session) => {
            show::<_, SessionView>(client, subj::SESSION_SHOW, &SessionRef { session })
                .await
                .map(Feed::Session)
        }
        Stale::Schedule(name) => {
            show::<_, ScheduleView>(client, subj::SCHEDULES_SHOW, &ScheduleRef { name })
                .await
                .map(Feed::Schedule)
        }
    }
}

/// A `show` API's answer, as the frame the page gets.
async fn show<Req: serde::Serialize, View: serde::de::DeserializeOwned + serde::Serialize>(
    client: &async_nats::Client,
    subject: &str,
    req: &Req,
) -> Option<Arc<str>> {
    match api::call::<_, View>(client, subject, req, CALL).await {
        Ok(view) => frame(&view),
        Err(e) => {
            tracing::debug!(subject, error = %e, "refresh");
            None
        }
    }
}

fn frame<T: serde::Serialize>(view: &T) -> Option<Arc<str>> {
    let mut value = serde_json::to_value(view).ok()?;
    super::snapshot::redact(&mut value);
    Some(Arc::from(value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_reach_pages_once_without_tokens_and_say_what_they_change() {
        let mut recent = Recent::default();
        let s = SessionId::new();
        let raw = format!(
            r#"{{"v":1,"id":"a","type":"turn.queued","session":"{s}",
            "data":{{"token":"secret","text":"x"}}}}"#
        );
        let (line, changed) = clean(raw.as_bytes(), &mut recent).expect("json");
        assert!(!line.contains("secret"), "{line}");
        assert_eq!(changed, Some(Stale::Session(s)));
        assert!(clean(raw.as_bytes(), &mut recent).is_none(), "a repeat");
        let slot = br#"{"v":1,"id":"b","type":"slot.fired","data":{"schedule":"n"}}"#;
        let (_, changed) = clean(slot, &mut recent).expect("json");
        assert_eq!(changed, Some(Stale::Schedule("n".into())));
        assert!(clean(b"not json", &mut recent).is_none());
    }

    #[test]
    fn the_recent_ids_are_bounded() {
        let mut recent = Recent::default();
        for i in 0..RECENT_IDS + 10 {
            assert!(recent.first(&i.to_string()));
        }
        assert_eq!(recent.order.len(), RECENT_IDS);
        assert!(recent.first("0"), "the oldest was forgotten");
    }
}
