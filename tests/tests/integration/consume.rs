//! The broker's queues show progress while a message is handled, so a handler slower than the
//! consumer's short ack wait (2 s, so that a dead replica's messages move soon) is not joined
//! by a second handler of the same message on another replica.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use async_nats::jetstream::consumer::{pull, AckPolicy};
use async_nats::jetstream::stream;
use tokio_util::sync::CancellationToken;
use turnstile_tests::NatsServer;

#[tokio::test]
async fn a_message_handled_longer_than_its_ack_wait_is_not_handed_out_again() -> Result<()> {
    let nats = NatsServer::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client);
    let s = js
        .create_stream(stream::Config {
            name: "SLOW".into(),
            subjects: vec!["slow.>".into()],
            ..Default::default()
        })
        .await?;
    let consumer = s
        .create_consumer(pull::Config {
            durable_name: Some("slow".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await?;
    js.publish("slow.one", "work".into()).await?.await?;
    let handled = Arc::new(AtomicUsize::new(0));
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let shutdown = CancellationToken::new();
    let puller = {
        let (handled, shutdown) = (handled.clone(), shutdown.clone());
        tokio::spawn(async move {
            turnstile_shared::consume::each_message_showing_progress(consumer, &shutdown, |msg| {
                let (handled, done) = (handled.clone(), done_tx.clone());
                async move {
                    handled.fetch_add(1, Ordering::SeqCst);
                    // Three ack waits of work.
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    let _ = msg.double_ack().await;
                    let _ = done.send(());
                }
            })
            .await
        })
    };
    tokio::time::timeout(Duration::from_secs(20), done_rx.recv())
        .await
        .context("the handler never finished")?;
    shutdown.cancel();
    let _ = puller.await;
    let n = handled.load(Ordering::SeqCst);
    ensure!(n == 1, "the message was handled {n} times");
    Ok(())
}
