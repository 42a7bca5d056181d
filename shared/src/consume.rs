//! The two loops every durable consumer of ours runs: keep consuming until shutdown, resuming
//! after errors (NATS restarts, a deleted consumer) with a capped backoff; and hand each
//! message to its own task, so one slow message never holds up the rest.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::retry::Backoff;

/// Runs `attempt` until it returns `Ok` or `shutdown` fires; an error is logged (with `what`)
/// and the attempt repeated after 100 ms, doubling to 2 s.
/// How a consumer loop resumes after NATS restarts or a deleted consumer.
pub const RESUME: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));

pub async fn until_shutdown<F, Fut, E>(what: &str, shutdown: &CancellationToken, mut attempt: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Display,
{
    let mut delays = RESUME.delays();
    while !shutdown.is_cancelled() {
        match attempt().await {
            Ok(()) => break,
            Err(e) => {
                tracing::warn!(what, error = %e, "interrupted; resuming");
                if !delays.wait_or_cancel(shutdown).await {
                    break;
                }
            }
        }
    }
}

/// Pulls from `consumer` and spawns `handle` for each message until `shutdown`; an `Err` when
/// the pull stream fails or ends (the caller resumes with [`until_shutdown`]). While a message
/// is handled, its progress is acknowledged every `progress` (a third of the consumer's ack
/// wait), so the ack wait can be short, and a dead replica's messages move soon, without
/// slow handling being redelivered meanwhile.
pub async fn each_message<H, Fut>(
    consumer: PullConsumer,
    shutdown: &CancellationToken,
    progress: Duration,
    handle: H,
) -> Result<(), async_nats::Error>
where
    H: Fn(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut messages = consumer.messages().await?;
    loop {
        let next = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            n = messages.next() => n,
        };
        match next {
            Some(Ok(msg)) => {
                let guard = ProgressGuard::start(&msg, progress);
                let work = handle(msg);
                tokio::spawn(async move {
                    work.await;
                    drop(guard);
                });
            }
            Some(Err(e)) => tracing::debug!(error = %e, "pull"),
            None => return Err("pull stream ended".into()),
        }
    }
}

/// Acknowledges a message's progress periodically until dropped (when its handler ends).
struct ProgressGuard(Option<tokio::task::JoinHandle<()>>);

impl ProgressGuard {
    fn start(msg: &jetstream::Message, every: Duration) -> Self {
        let Some(reply) = msg.reply.clone() else {
            return Self(None);
        };
        let client = msg.context.client();
        Self(Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                if client.publish(reply.clone(), "+WIP".into()).await.is_err() {
                    return;
                }
            }
        })))
    }
}

impl Drop for ProgressGuard {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}
