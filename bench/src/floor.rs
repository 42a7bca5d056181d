//! The raw JetStream floor: publish and wait for the PubAck, receive on a durable pull
//! consumer, and `double_ack` (an acknowledged ack): one durable hand-off, nothing of ours.

use std::time::Instant;

use anyhow::{Context, Result};
use async_nats::jetstream::{consumer, stream};
use futures::StreamExt;

pub async fn measure(nats: &turnstile_tests::NatsServer, n: usize) -> Result<serde_json::Value> {
    let client = nats.client().await?;
    let js = async_nats::jetstream::new(client);
    let s = js
        .create_stream(stream::Config {
            name: "BENCH_FLOOR".into(),
            subjects: vec!["bench.floor".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
    let c = s
        .create_consumer(consumer::pull::Config {
            durable_name: Some("floor".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 1,
            ..Default::default()
        })
        .await?;
    let mut messages = c.messages().await?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 100 {
        let t0 = Instant::now();
        js.publish("bench.floor", "x".into()).await?.await?;
        let msg = messages.next().await.context("floor stream ended")??;
        msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        if i >= 100 {
            samples.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(crate::summary(samples))
}
