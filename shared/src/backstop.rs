//! The loop behind the backstops for records left waiting on a message that is gone: a run
//! `queued` whose lane item was lost (the session-lane's `orphan_runs`), a step `queued`
//! whose work item was lost (the broker's `orphan_steps`). The record is written before its
//! message, and only the message moves it on; a message lost after its publish was
//! acknowledged (a server killed before it wrote it out, a full disk) or never stored (a
//! caller that gave up) leaves the record waiting for ever, and nothing else would notice.
//!
//! Each replica follows the bucket's writes (one watch, new writes only, plus a read of the
//! last hour's writes whenever the watch is made) and keeps the records whose latest write
//! says they wait. One still waiting after `after` is handed to [`Backstop::check`], which
//! looks for its message and publishes it again if it is gone; it is checked again `after`
//! later while it waits. What each kind of record waits on, and how its message is found, is
//! the kind's own.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::Future;
use std::hash::Hash;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::Operation;
use chrono::Utc;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::bucket_watch::{self, Watched};
use crate::kv::Bucket;

/// How far back the bucket is read when the watch is (re)made: a record left waiting before
/// that was found by a sweep then (unless no replica ran for an hour).
const LOOKBACK: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// What a check found.
pub enum Verdict {
    /// Still waiting, its message there: checked again later.
    Waiting,
    /// Still waiting, its message just published again: checked again later.
    Republished,
    /// Not waiting any more (moved on, ended by the check, or gone).
    Settled,
}

/// Why a check could not finish (it is tried again at the next sweep).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("read {what}: {source}")]
    Read {
        what: &'static str,
        source: async_nats::Error,
    },
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    #[error(transparent)]
    Envelope(#[from] crate::envelope::EnvelopeError),
    #[error(transparent)]
    Publish(#[from] crate::events::PublishError),
}

/// One kind of record a backstop follows.
pub trait Backstop: Send + Sync + 'static {
    /// The record's id, its bucket key.
    type Id: FromStr + Display + Eq + Hash + Clone + Send + 'static;
    /// Just the part of a record that tells whether it waits (the rest is not decoded).
    type Glance: DeserializeOwned;
    /// What is kept of a waiting record until it is checked.
    type Note: Send + 'static;

    /// The record kind, as logs name it (`run`, `step`).
    const KIND: &'static str;
    /// The bucket, as logs name it.
    const BUCKET: &'static str;

    /// The bucket the records are in.
    fn bucket(&self) -> Bucket;

    /// What to keep of a record whose latest write is `glance`, if it waits on its message.
    fn waiting(glance: &Self::Glance) -> Option<Self::Note>;

    /// Reads the record afresh, looks for its message and acts.
    fn check(
        &self,
        id: &Self::Id,
        note: &Self::Note,
    ) -> impl Future<Output = Result<Verdict, CheckError>> + Send;
}

/// A waiting record: since when this replica knows it so, and when it was last checked.
struct Kept<N> {
    note: N,
    since: Instant,
    checked: Option<Instant>,
}

/// What the watch tells the sweep loop.
enum Seen<I, N> {
    Up,
    /// A record's latest write, and what to keep of it if it waits.
    Record(I, Option<N>),
}

/// Follows `backstop`'s bucket and sweeps every `after / 2` until `cancel`.
pub async fn run<B: Backstop>(backstop: Arc<B>, after: Duration, cancel: CancellationToken) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Seen<B::Id, B::Note>>();
    tokio::spawn(bucket_watch::follow_new(
        backstop.bucket(),
        B::BUCKET,
        cancel.child_token(),
        move |w| {
            let seen = match w {
                Watched::Up => Seen::Up,
                Watched::Down => return,
                Watched::Entry(e) => {
                    // Other records share some buckets (turns and runs are mirrored among
                    // the steps): only ids of this kind are followed.
                    let Ok(id) = e.key.parse::<B::Id>() else {
                        return;
                    };
                    let note = (e.operation == Operation::Put)
                        .then(|| serde_json::from_slice::<B::Glance>(&e.value).ok())
                        .flatten()
                        .as_ref()
                        .and_then(B::waiting);
                    Seen::Record(id, note)
                }
            };
            let _ = tx.send(seen);
        },
    ));
    let mut kept: HashMap<B::Id, Kept<B::Note>> = HashMap::new();
    let mut tick = tokio::time::interval((after / 2).max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            seen = rx.recv() => match seen {
                None => return,
                Some(Seen::Up) => read_recent(&*backstop, &mut kept).await,
                Some(Seen::Record(id, note)) => keep(&mut kept, id, note),
            },
            _ = tick.tick() => sweep(&*backstop, &mut kept, after).await,
        }
    }
}

/// Keeps or forgets a record by its latest write.
fn keep<I: Eq + Hash, N>(kept: &mut HashMap<I, Kept<N>>, id: I, note: Option<N>) {
    match note {
        Some(note) => {
            kept.entry(id).or_insert_with(|| Kept {
                note,
                since: Instant::now(),
                checked: None,
            });
        }
        None => {
            kept.remove(&id);
        }
    }
}

/// The last hour's writes, read when the watch is made: what was left waiting before this
/// replica started, or while its watch was down.
async fn read_recent<B: Backstop>(backstop: &B, kept: &mut HashMap<B::Id, Kept<B::Note>>) {
    let since = Utc::now() - LOOKBACK;
    match backstop
        .bucket()
        .entries_written_since::<B::Glance>(">", Some(since))
        .await
    {
        // Oldest first: each key's latest write is kept last.
        Ok(entries) => {
            for (key, glance) in entries {
                if let Ok(id) = key.parse::<B::Id>() {
                    keep(kept, id, B::waiting(&glance));
                }
            }
        }
        Err(e) => {
            tracing::warn!(kind = B::KIND, error = %e, "read the records written lately; the next watch reads them")
        }
    }
}

/// Checks every record waiting for at least `after` and not checked within `after`.
async fn sweep<B: Backstop>(
    backstop: &B,
    kept: &mut HashMap<B::Id, Kept<B::Note>>,
    after: Duration,
) {
    let due: Vec<B::Id> = kept
        .iter()
        .filter(|(_, k)| {
            k.since.elapsed() >= after && k.checked.is_none_or(|at| at.elapsed() >= after)
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in due {
        let Some(k) = kept.get(&id) else {
            continue;
        };
        match backstop.check(&id, &k.note).await {
            Ok(verdict @ (Verdict::Waiting | Verdict::Republished)) => {
                if let Some(k) = kept.get_mut(&id) {
                    if k.checked.is_none() && matches!(verdict, Verdict::Waiting) {
                        tracing::info!(kind = B::KIND, id = %id, waiting_s = k.since.elapsed().as_secs(),
                            "waiting this long: its item is there, not yet taken");
                    }
                    k.checked = Some(Instant::now());
                }
            }
            Ok(Verdict::Settled) => {
                kept.remove(&id);
            }
            Err(e) => {
                tracing::warn!(kind = B::KIND, id = %id, error = %e, "check a waiting record; trying again at the next sweep");
            }
        }
    }
}
