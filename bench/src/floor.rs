//! The raw JetStream floor: publish and wait for the PubAck, receive on a durable pull
//! consumer, and `double_ack` (an acknowledged ack): one durable hand-off, nothing of ours.
//! Measured back to back (the floor every ratio is taken against) and, beside it, each round
//! trip after an idle pause ([`IDLE`]), as each completion sample starts: on a virtual machine
//! a round trip after a pause pays for waking the threads of both sides.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use async_nats::jetstream::{consumer, stream};
use futures::StreamExt;

use crate::deployment::{Deployment, FLOOR_STREAM, FLOOR_SUBJECT};

/// The pause before each round trip of [`measure_after_idle`]: a completion sample starts
/// once the previous one has settled, a few milliseconds of quiet.
pub const IDLE: Duration = Duration::from_millis(5);

pub async fn measure(d: &Deployment, n: usize) -> Result<serde_json::Value> {
    measure_spaced(d, n, Duration::ZERO).await
}

/// The floor with [`IDLE`] before each round trip (not inside the time).
pub async fn measure_after_idle(d: &Deployment, n: usize) -> Result<serde_json::Value> {
    measure_spaced(d, n, IDLE).await
}

async fn measure_spaced(d: &Deployment, n: usize, pause: Duration) -> Result<serde_json::Value> {
    let mut floor = Floor::open(&d.floor, d.replicas).await?;
    floor.block(100, pause).await?;
    Ok(crate::stats::summary(floor.block(n, pause).await?))
}

/// A floor client of its own (connection, stream, durable pull consumer) that measures round
/// trips in blocks: between a path's samples, so the path is set beside the floor measured
/// while it ran. This machine's floor moves by half within minutes; one measured a minute
/// before the path is compared with the machine of a minute before.
pub struct Floor {
    js: async_nats::jetstream::Context,
    messages: consumer::pull::Stream,
}

impl Floor {
    pub async fn open(url: &str, replicas: usize) -> Result<Self> {
        let client = Deployment::connect(url).await?;
        let js = async_nats::jetstream::new(client);
        let s = js
            .create_stream(stream::Config {
                name: FLOOR_STREAM.into(),
                subjects: vec![FLOOR_SUBJECT.into()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                num_replicas: replicas,
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
        let messages = c.messages().await?;
        Ok(Self { js, messages })
    }

    /// `n` round trips, `pause` before each (not timed); each one's time in microseconds.
    pub async fn block(&mut self, n: usize, pause: Duration) -> Result<Vec<f64>> {
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let t0 = Instant::now();
            self.js.publish(FLOOR_SUBJECT, "x".into()).await?.await?;
            let msg = self.messages.next().await.context("floor stream ended")??;
            msg.double_ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
            samples.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        Ok(samples)
    }

    /// `n` round trips back to back after a few unmeasured ones (the first after a pause
    /// wakes both sides' threads): the floor as every ratio takes it.
    pub async fn warm_block(&mut self, n: usize) -> Result<Vec<f64>> {
        self.block(WARM_UP, Duration::ZERO).await?;
        self.block(n, Duration::ZERO).await
    }
}

/// Round trips made before a block's measured ones.
const WARM_UP: usize = 10;
