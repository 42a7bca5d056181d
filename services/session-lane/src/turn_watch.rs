//! One watch over the turns bucket per replica, fanned out to the lane workers waiting on a
//! turn. Waiting on a turn's outcome is event-driven, with no consumer created per turn.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use turnstile_shared::bucket_watch::Watched;
use turnstile_shared::kv::Bucket;
use turnstile_shared::records::TurnRecord;
use turnstile_shared::TurnId;

type Waiters = Arc<Mutex<HashMap<TurnId, watch::Sender<Option<TurnRecord>>>>>;

#[derive(Clone)]
pub(crate) struct TurnWatch {
    waiters: Waiters,
}

/// Dropping it unregisters the wait (R13: nothing keeps waiting on a turn nobody awaits).
pub(crate) struct TurnWaiter {
    turn: TurnId,
    waiters: Waiters,
    pub rx: watch::Receiver<Option<TurnRecord>>,
}

impl Drop for TurnWaiter {
    fn drop(&mut self) {
        if let Ok(mut w) = self.waiters.lock() {
            w.remove(&self.turn);
        }
    }
}

impl TurnWatch {
    pub fn start(bucket: Bucket, cancel: CancellationToken) -> Self {
        let waiters: Waiters = Arc::default();
        tokio::spawn(watch_loop(bucket, waiters.clone(), cancel));
        Self { waiters }
    }

    /// Registers interest in `turn`; register before dispatching so no update is missed.
    pub fn wait(&self, turn: &TurnId) -> TurnWaiter {
        let (tx, rx) = watch::channel(None);
        if let Ok(mut w) = self.waiters.lock() {
            w.insert(turn.clone(), tx);
        }
        TurnWaiter {
            turn: turn.clone(),
            waiters: self.waiters.clone(),
            rx,
        }
    }
}

async fn watch_loop(bucket: Bucket, waiters: Waiters, cancel: CancellationToken) {
    turnstile_shared::bucket_watch::follow_new(bucket, "turns", cancel, |w| {
        if let Watched::Entry(entry) = w {
            route(&waiters, &entry.key, &entry.value);
        }
    })
    .await
}

fn route(waiters: &Waiters, key: &str, value: &[u8]) {
    let Ok(turn) = key.parse::<TurnId>() else {
        return;
    };
    let Ok(w) = waiters.lock() else { return };
    if let Some(tx) = w.get(&turn) {
        match serde_json::from_slice::<TurnRecord>(value) {
            Ok(rec) => {
                tx.send_replace(Some(rec));
            }
            Err(e) => tracing::warn!(%turn, error = %e, "unreadable turn record"),
        }
    }
}
