//! The round trips of routing that need not wait for an end's registry write, made beside it:
//! each target session's read and its delivery marker's create (one round trip each: a
//! delivery removes its marker without leaving a removal behind). For a worker's report this
//! replica is recording at once (`Inline`), also the completion's store and the delivery's
//! lane item, built from the record as that end writes it ([`Ending`]): the item then reaches
//! the lane with the end's write, not two round trips after it.
//!
//! Nothing acts on that end before the registry holds it: the lane hands a completion over
//! only once its record has ended, and says what the record says (R8, R12). The item goes
//! out beside the marker's create, before it is known to succeed, and only to a session this
//! replica believes has no delivery armed ([`super::armed`]). If the create finds one armed
//! all the same, the item is an extra delivery, which carries whatever is pending when it
//! runs (or nothing, and clears itself): never a result twice, never one lost.
//!
//! Every marker this end creates is owed its item until one is out ([`Early::owed`]): no
//! marker waits without one. The session read runs on in a task of its own and is waited for
//! only after the item is out.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use turnstile_shared::arming::{self, ArmError};
use turnstile_shared::delivery::{Completion, DeliveryMarker};
use turnstile_shared::events::{self, PublishError};
use turnstile_shared::execution::ExecutionRecord;
use turnstile_shared::kv::KvError;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::{subjects, SessionId};

use crate::ctx::Ctx;

/// A delivery marker this end created, whose item is not out yet.
pub(super) type Owed = (SessionId, DeliveryMarker, u64);

/// A target session's read, running on in its own task: routing waits for it only after
/// the lane item is out (a stopped target's item is then taken back).
pub(super) type SessionRead = JoinHandle<Result<Option<(SessionRecord, u64)>, KvError>>;

/// What was done for a target ahead of routing: its session read started and a marker
/// create tried; for an end routed ahead, its completion's store and its lane item.
pub(super) struct Ahead {
    pub active: SessionRead,
    pub marker: DeliveryMarker,
    pub created: Result<Option<u64>, KvError>,
    pub sent: Option<Sent>,
}

/// The completion and lane item of an end routed ahead.
pub(super) struct Sent {
    pub stored: Result<(), PublishError>,
    /// How long the completion's store took.
    pub store_took: Duration,
    /// The item's sequence on the lane stream, if one went out.
    pub item: Option<Result<u64, ArmError>>,
}

fn fresh_marker() -> DeliveryMarker {
    DeliveryMarker {
        delivery: turnstile_shared::DeliveryId::new(),
        armed_at: chrono::Utc::now(),
    }
}

/// The early round trips of one end, once done, and the markers still owed.
pub(super) struct Early {
    ctx: Arc<Ctx>,
    /// When the round trips went out, beside the end's write.
    began: Instant,
    done: HashMap<SessionId, Ahead>,
    owed: Vec<Owed>,
}

/// What is made ahead for an end: for `targets`, the reads and creates; for an end routed
/// ahead, also its completion and item, from `ending` (the record as the end writes it).
pub(super) enum Ending<'a> {
    Targets(Vec<SessionId>),
    Routed(&'a ExecutionRecord),
}

impl Early {
    /// Makes the round trips for `ending`'s targets; the markers they created are owed from
    /// then on, unless their item went out with them.
    pub(super) async fn run(ctx: &Arc<Ctx>, ending: Ending<'_>) -> Self {
        let began = Instant::now();
        let done = match &ending {
            Ending::Targets(t) if t.is_empty() => HashMap::new(),
            Ending::Targets(t) => ahead(ctx, t.clone(), None).await,
            Ending::Routed(record) => ahead(ctx, record.targets(), Some(record)).await,
        };
        let owed = done
            .iter()
            .filter_map(|(t, a)| match (&a.created, &a.sent) {
                (
                    Ok(Some(_)),
                    Some(Sent {
                        item: Some(Ok(_)), ..
                    }),
                ) => None,
                (Ok(Some(rev)), _) => Some((t.clone(), a.marker.clone(), *rev)),
                _ => None,
            })
            .collect();
        Self {
            ctx: ctx.clone(),
            began,
            done,
            owed,
        }
    }

    /// How long ago what was sent ahead went out (with the end's write).
    pub(super) fn since_sent(&self) -> Duration {
        self.began.elapsed()
    }

    /// What was sent ahead for `target` (taken: [`Early::take`] then finds none).
    pub(super) fn sent(&mut self, target: &SessionId) -> Option<Sent> {
        self.done.get_mut(target).and_then(|a| a.sent.take())
    }

    /// `target`'s results; made now if the early round trips did not cover it.
    pub(super) async fn take(&mut self, target: &SessionId) -> Ahead {
        match self.done.remove(target) {
            Some(a) => a,
            None => {
                let mut made = ahead(&self.ctx, vec![target.clone()], None).await;
                let a = made.remove(target).unwrap_or_else(|| Ahead {
                    active: tokio::spawn(async { Ok(None) }),
                    marker: fresh_marker(),
                    created: Ok(None),
                    sent: None,
                });
                if let Ok(Some(rev)) = &a.created {
                    self.owe(target, &a.marker, *rev);
                }
                a
            }
        }
    }

    /// A marker created for a target the early round trips did not cover, owed its item like
    /// theirs.
    fn owe(&mut self, target: &SessionId, marker: &DeliveryMarker, rev: u64) {
        self.owed.push((target.clone(), marker.clone(), rev));
    }

    /// `target`'s item is out (or it needs none): its marker is no longer owed.
    pub(super) fn paid(&mut self, target: &SessionId) {
        self.owed.retain(|(t, _, _)| t != target);
    }

    /// The markers still owed an item.
    pub(super) fn owed(self) -> Vec<Owed> {
        self.owed
    }
}

async fn ahead(
    ctx: &Ctx,
    targets: Vec<SessionId>,
    ending: Option<&ExecutionRecord>,
) -> HashMap<SessionId, Ahead> {
    let completion = ending.map(Completion::of);
    futures::future::join_all(targets.into_iter().map(|t| {
        let completion = completion.as_ref();
        async move {
            let marker = fresh_marker();
            let created = ctx.buckets.deliveries.create(t.as_str(), &marker);
            let sessions = ctx.buckets.sessions.clone();
            let key = t.to_string();
            let active = tokio::spawn(async move { sessions.get::<SessionRecord>(&key).await });
            let (created, sent) = match (ending, completion) {
                (Some(record), Some(completion)) => {
                    let (created, sent) =
                        tokio::join!(created, send(ctx, &t, record, completion, &marker));
                    (created, Some(sent))
                }
                _ => (created.await, None),
            };
            let delivery = marker.delivery.as_str();
            match &created {
                Ok(Some(_)) => ctx.armed.created(&t, delivery),
                Ok(None) => ctx.armed.lost(&t, delivery),
                Err(_) => ctx.armed.failed(&t, delivery),
            }
            (
                t,
                Ahead {
                    active,
                    marker,
                    created,
                    sent,
                },
            )
        }
    }))
    .await
    .into_iter()
    .collect()
}

/// The completion's store and, if this replica sees the target unarmed and reserves it
/// ([`super::armed`]), the lane item of `marker` (its create still on its way) naming the
/// execution and its end.
async fn send(
    ctx: &Ctx,
    target: &SessionId,
    record: &ExecutionRecord,
    completion: &Completion,
    marker: &DeliveryMarker,
) -> Sent {
    let store = async {
        let began = Instant::now();
        let stored = store_completion(ctx, target, completion).await;
        (stored, began.elapsed())
    };
    let item = async {
        if !ctx.armed.reserve(target, marker.delivery.as_str()) {
            return None;
        }
        let first = arming::First {
            execution: &record.id,
            ended_at: record.status.ended_at(),
        };
        Some(arming::publish_item_ahead(&ctx.js, target, marker, first).await)
    };
    let ((stored, store_took), item) = tokio::join!(store, item);
    Sent {
        stored,
        store_took,
        item,
    }
}

/// Stores `completion` for `target` on the completion stream (de-duplicated per execution and
/// target, R14).
pub(super) async fn store_completion(
    ctx: &Ctx,
    target: &SessionId,
    completion: &Completion,
) -> Result<(), PublishError> {
    let env = completion.envelope(target)?;
    let subject = subjects::completion(target, &completion.execution);
    events::publish_durable(&ctx.js, subject, &env, None).await
}
