//! The raw JetStream floor: publish and wait for the PubAck, receive on a durable pull
//! consumer, and `double_ack` (an acknowledged ack): one durable hand-off, nothing of ours.

use std::time::Instant;

use anyhow::{Context, Result};
use async_nats::jetstream::{consumer, stream};
use futures::StreamExt;

use crate::deployment::{Deployment, FLOOR_STREAM, FLOOR_SUBJECT};

pub async fn measure(d: &Deployment, n: usize) -> Result<serde_json::Value> {
    let client = Deployment::connect(&d.floor).await?;
    let js = async_nats::jetstream::new(client);
    let s = js
        .create_stream(stream::Config {
            name: FLOOR_STREAM.into(),
            subjects: vec![FLOOR_SUBJECT.into()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            num_replicas: d.replicas,
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
        js.publish(FLOOR_SUBJECT, "x".into()).await?.await?;
        let msg = messages.next().await.context("floor stream ended")??;
        msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        if i >= 100 {
            samples.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(crate::summary(samples))
}
