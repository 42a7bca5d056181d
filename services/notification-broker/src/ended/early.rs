//! The round trips of routing that do not depend on an end's outcome: each target session's
//! read and its delivery marker's create (one round trip each: a delivery removes its marker
//! without leaving a removal behind). They start beside the end's registry write, so routing
//! finds the create done, or nearly, when it stores the completion and publishes the lane
//! item; the session read runs on in a task of its own and is waited for only after that.
//! Every marker they create is owed its item until routing publishes it ([`Early::owed`]): no
//! marker waits without one.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::task::JoinHandle;
use turnstile_shared::delivery::DeliveryMarker;
use turnstile_shared::kv::KvError;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::SessionId;

use crate::Ctx;

/// A delivery marker this end created, whose item is not out yet.
pub(super) type Owed = (SessionId, DeliveryMarker, u64);

/// A target session's read, running on in its own task: routing waits for it only after
/// the lane item is out (a stopped target's item is then taken back).
pub(super) type SessionRead = JoinHandle<Result<Option<(SessionRecord, u64)>, KvError>>;

/// What was done for a target ahead of routing: its session read started and a marker
/// create tried.
pub(super) struct Ahead {
    pub active: SessionRead,
    pub marker: DeliveryMarker,
    pub created: Result<Option<u64>, KvError>,
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
    done: HashMap<SessionId, Ahead>,
    owed: Vec<Owed>,
}

impl Early {
    /// Makes the reads and creates for `targets` (none: nothing runs); the markers they
    /// created are owed from then on.
    pub(super) async fn run(ctx: &Arc<Ctx>, targets: Vec<SessionId>) -> Self {
        let done = if targets.is_empty() {
            HashMap::new()
        } else {
            ahead(ctx, targets).await
        };
        let owed = done
            .iter()
            .filter_map(|(t, a)| match &a.created {
                Ok(Some(rev)) => Some((t.clone(), a.marker.clone(), *rev)),
                _ => None,
            })
            .collect();
        Self {
            ctx: ctx.clone(),
            done,
            owed,
        }
    }

    /// `target`'s results; made now if the early round trips did not cover it.
    pub(super) async fn take(&mut self, target: &SessionId) -> Ahead {
        match self.done.remove(target) {
            Some(a) => a,
            None => {
                let mut made = ahead(&self.ctx, vec![target.clone()]).await;
                let a = made.remove(target).unwrap_or_else(|| Ahead {
                    active: tokio::spawn(async { Ok(None) }),
                    marker: fresh_marker(),
                    created: Ok(None),
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

async fn ahead(ctx: &Ctx, targets: Vec<SessionId>) -> HashMap<SessionId, Ahead> {
    futures::future::join_all(targets.into_iter().map(|t| async move {
        let marker = fresh_marker();
        let created = ctx.buckets.deliveries.create(t.as_str(), &marker);
        let sessions = ctx.buckets.sessions.clone();
        let key = t.to_string();
        let active = tokio::spawn(async move { sessions.get::<SessionRecord>(&key).await });
        let created = created.await;
        (
            t,
            Ahead {
                active,
                marker,
                created,
            },
        )
    }))
    .await
    .into_iter()
    .collect()
}
