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
use crate::topology::TopologyError;

/// Why a consumer loop stopped; its caller logs it and resumes ([`until_shutdown`]).
#[derive(Debug, thiserror::Error)]
pub enum ConsumeError {
    /// The durable consumer could not be made or found (NATS down, a stream being moved).
    #[error(transparent)]
    Bind(#[from] TopologyError),
    /// The consumer's pull stream could not be opened (a consumer deleted meanwhile).
    #[error("open the pull stream: {0}")]
    Open(#[from] jetstream::consumer::StreamError),
    /// The pull stream ended (its connection closed).
    #[error("the pull stream ended")]
    Ended,
}

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
/// the pull stream fails or ends (the caller resumes with [`until_shutdown`]). The handler
/// acks, and shows progress itself if it holds a message long.
pub async fn each_message<H, Fut>(
    consumer: PullConsumer,
    shutdown: &CancellationToken,
    handle: H,
) -> Result<(), ConsumeError>
where
    H: Fn(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    pull_each(consumer, shutdown, None, handle).await
}

/// Like [`each_message`], for a consumer whose ack wait is short so that a dead replica's
/// messages move soon: while a handler runs, the message's progress is acked every third of
/// the consumer's own ack wait, so slow handling is not redelivered meanwhile.
pub async fn each_message_showing_progress<H, Fut>(
    consumer: PullConsumer,
    shutdown: &CancellationToken,
    handle: H,
) -> Result<(), ConsumeError>
where
    H: Fn(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let every = (consumer.cached_info().config.ack_wait / 3).max(Duration::from_millis(100));
    pull_each(consumer, shutdown, Some(every), handle).await
}

async fn pull_each<H, Fut>(
    consumer: PullConsumer,
    shutdown: &CancellationToken,
    progress: Option<Duration>,
    handle: H,
) -> Result<(), ConsumeError>
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
            Some(Ok(msg)) => match (progress, msg.reply.clone()) {
                (Some(every), Some(reply)) => {
                    let client = msg.context.client();
                    tokio::spawn(with_progress(handle(msg), client, reply, every));
                }
                _ => {
                    tokio::spawn(handle(msg));
                }
            },
            Some(Err(e)) => tracing::debug!(error = %e, "pull"),
            None => return Err(ConsumeError::Ended),
        }
    }
}

/// Runs `work`, acking the message's progress (a progress ack to its reply subject) every `every`
/// until it ends: in the handler's own task, so a message handled at once costs nothing more.
async fn with_progress(
    work: impl Future<Output = ()>,
    client: async_nats::Client,
    reply: async_nats::Subject,
    every: Duration,
) {
    tokio::pin!(work);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            biased;
            _ = &mut work => return,
            _ = tick.tick() => {
                // The client's own spelling of a progress ack: the server ignores any other
                // (a hand-written "+WIP" was, and every handler longer than the ack wait had
                // its message redelivered to a second handler meanwhile).
                let wip = bytes::Bytes::from(async_nats::jetstream::AckKind::Progress);
                if let Err(e) = client.publish(reply.clone(), wip).await {
                    tracing::debug!(error = %e, "progress ack");
                }
            }
        }
    }
}
