//! The round trips of routing that do not depend on an end's outcome: each target session's
//! read and its delivery marker's create (two round trips when the marker was removed
//! before, as it is after every delivery). They start beside the end's registry write and
//! run on while the completion is stored, so routing waits for them only before it
//! publishes the lane item. Every marker they create is owed its item until routing
//! publishes it ([`Early::owed`]): no marker waits without one.

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

/// What was done for a target ahead of routing: its session read and a marker create tried.
pub(super) struct Ahead {
    pub active: Result<Option<(SessionRecord, u64)>, KvError>,
    pub marker: DeliveryMarker,
    pub created: Result<Option<u64>, KvError>,
}

pub(super) fn fresh_marker() -> DeliveryMarker {
    DeliveryMarker {
        delivery: turnstile_shared::DeliveryId::new(),
        armed_at: chrono::Utc::now(),
    }
}

/// The early round trips of one end, in flight or done, and the markers still owed.
pub(super) struct Early {
    ctx: Arc<Ctx>,
    targets: Vec<SessionId>,
    task: Option<JoinHandle<HashMap<SessionId, Ahead>>>,
    done: HashMap<SessionId, Ahead>,
    owed: Vec<Owed>,
}

impl Early {
    /// Starts the reads and creates for `targets` (none: nothing runs).
    pub(super) fn start(ctx: &Arc<Ctx>, targets: Vec<SessionId>) -> Self {
        let task = (!targets.is_empty()).then(|| {
            let ctx = ctx.clone();
            let targets = targets.clone();
            tokio::spawn(async move { ahead(&ctx, targets).await })
        });
        Self {
            ctx: ctx.clone(),
            targets,
            task,
            done: HashMap::new(),
            owed: Vec::new(),
        }
    }

    /// Whether `target`'s round trips were started here.
    pub(super) fn covers(&self, target: &SessionId) -> bool {
        self.targets.contains(target)
    }

    /// Waits for the round trips (once); the markers they created are owed from then on.
    pub(super) async fn ready(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        // A task that died leaves its markers unnamed: an armed marker older than the trust
        // window is checked against the lane by the next router (`arming::claim`).
        self.done = task.await.unwrap_or_default();
        for (t, a) in &self.done {
            if let Ok(Some(rev)) = &a.created {
                self.owed.push((t.clone(), a.marker.clone(), *rev));
            }
        }
    }

    /// `target`'s results, after [`ready`](Self::ready); made now if they are missing.
    pub(super) async fn take(&mut self, target: &SessionId) -> Ahead {
        self.ready().await;
        match self.done.remove(target) {
            Some(a) => a,
            None => {
                let mut made = ahead(&self.ctx, vec![target.clone()]).await;
                let a = made.remove(target).unwrap_or_else(|| Ahead {
                    active: Ok(None),
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

    /// A marker created by routing itself, owed its item like the early ones.
    pub(super) fn owe(&mut self, target: &SessionId, marker: &DeliveryMarker, rev: u64) {
        self.owed.push((target.clone(), marker.clone(), rev));
    }

    /// `target`'s item is out (or it needs none): its marker is no longer owed.
    pub(super) fn paid(&mut self, target: &SessionId) {
        self.owed.retain(|(t, _, _)| t != target);
    }

    /// The markers still owed an item, once the round trips are done.
    pub(super) async fn owed(mut self) -> Vec<Owed> {
        self.ready().await;
        self.owed
    }
}

async fn ahead(ctx: &Ctx, targets: Vec<SessionId>) -> HashMap<SessionId, Ahead> {
    futures::future::join_all(targets.into_iter().map(|t| async move {
        let marker = fresh_marker();
        let (active, created) = tokio::join!(
            ctx.buckets.sessions.get::<SessionRecord>(t.as_str()),
            ctx.buckets
                .deliveries
                .create_over_removed(t.as_str(), &marker),
        );
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
