//! Keeps one lane worker per active session on this replica, following the sessions bucket.
//! Every replica serves every lane's pull; the consumer's pin decides who gets the items.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::Operation;
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use turnstile_shared::records::SessionRecord;
use turnstile_shared::SessionId;

use crate::ctx::{Ctx, Error};
use crate::lane;
use turnstile_shared::bucket_watch::sleep_or_cancel;

struct Worker {
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

pub(crate) async fn run(ctx: Arc<Ctx>, shutdown: CancellationToken) -> Result<(), Error> {
    let mut workers: HashMap<SessionId, Worker> = HashMap::new();
    'watch: loop {
        let mut watch = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break 'watch,
            w = ctx.buckets.sessions.store().watch_with_history(">") => match w {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(error = %e, "watch sessions bucket; retrying");
                    sleep_or_cancel(&shutdown, Duration::from_millis(500)).await;
                    continue;
                }
            },
        };
        loop {
            let entry = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break 'watch,
                e = watch.next() => e,
            };
            match entry {
                Some(Ok(entry)) => {
                    let Ok(session) = entry.key.parse::<SessionId>() else {
                        tracing::warn!(key = %entry.key, "ignoring foreign key in sessions bucket");
                        continue;
                    };
                    let record = match entry.operation {
                        Operation::Put => {
                            match serde_json::from_slice::<SessionRecord>(&entry.value) {
                                Ok(r) => Some(r),
                                Err(e) => {
                                    tracing::warn!(%session, error = %e, "unreadable session record");
                                    None
                                }
                            }
                        }
                        Operation::Delete | Operation::Purge => None,
                    };
                    apply(
                        &ctx,
                        &mut workers,
                        session,
                        record.filter(|r| r.is_active()),
                    );
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "sessions watch interrupted; re-watching");
                    continue 'watch;
                }
                None => continue 'watch,
            }
        }
    }
    stop_all(workers, ctx.topology.lane_ack_wait).await;
    Ok(())
}

/// Starts a worker for a newly active session, stops the worker of one no longer active.
fn apply(
    ctx: &Arc<Ctx>,
    workers: &mut HashMap<SessionId, Worker>,
    session: SessionId,
    active: Option<SessionRecord>,
) {
    workers.retain(|_, w| !w.task.is_finished());
    ctx.placement
        .session(&session, active.as_ref().map(|r| &r.host));
    match active {
        Some(record) if !workers.contains_key(&session) => {
            let cancel = CancellationToken::new();
            let task = tokio::spawn(lane::run_lane(ctx.clone(), record, cancel.clone()));
            workers.insert(session, Worker { cancel, task });
        }
        Some(_) => {}
        None => {
            if let Some(w) = workers.remove(&session) {
                w.cancel.cancel();
            }
            // Whichever replica answered the stop, this one drops its state too (R13).
            ctx.forget_session(&session);
        }
    }
}

/// Cancels every worker and waits (bounded) for them to hand their items back.
async fn stop_all(workers: HashMap<SessionId, Worker>, grace: Duration) {
    for w in workers.values() {
        w.cancel.cancel();
    }
    let all = futures::future::join_all(workers.into_values().map(|w| w.task));
    if tokio::time::timeout(grace, all).await.is_err() {
        tracing::warn!("lane workers did not stop within {grace:?}");
    }
}
