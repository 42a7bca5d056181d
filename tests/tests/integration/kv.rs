//! The store primitives the hot paths lean on, against a real nats-server: a delivery marker
//! is removed and armed again on every completion, so its create must write over a removal,
//! and must never write over a live marker (R3: one armed delivery per session).

use anyhow::{ensure, Context, Result};
use chrono::Utc;
use turnstile_shared::delivery::DeliveryMarker;
use turnstile_shared::topology::{self, TopologyConfig};
use turnstile_shared::{DeliveryId, SessionId};
use turnstile_tests::NatsServer;

fn marker() -> DeliveryMarker {
    DeliveryMarker {
        delivery: DeliveryId::new(),
        armed_at: Utc::now(),
    }
}

#[tokio::test]
async fn a_marker_is_created_over_its_removal_and_never_over_a_live_one() -> Result<()> {
    let nats = NatsServer::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client);
    topology::provision(&js, &TopologyConfig::default()).await?;
    let buckets = topology::bind(&js).await?;
    let deliveries = &buckets.deliveries;
    let key = SessionId::new().to_string();

    let first = marker();
    let rev1 = deliveries
        .create_over_removed(&key, &first)
        .await?
        .context("a fresh key is created")?;
    ensure!(
        deliveries
            .create_over_removed(&key, &marker())
            .await?
            .is_none(),
        "a live marker was written over"
    );
    ensure!(deliveries.delete_at(&key, rev1).await?, "remove the marker");
    for round in 0..3 {
        let next = marker();
        let rev = deliveries
            .create_over_removed(&key, &next)
            .await?
            .with_context(|| format!("round {round}: not created over the removal"))?;
        let (stored, at) = deliveries
            .get::<DeliveryMarker>(&key)
            .await?
            .context("the marker just created is not there")?;
        ensure!(
            stored.delivery == next.delivery && at == rev,
            "read back {stored:?} at {at}"
        );
        ensure!(
            deliveries
                .create_over_removed(&key, &marker())
                .await?
                .is_none()
                && deliveries.create(&key, &marker()).await?.is_none(),
            "round {round}: a live marker was written over"
        );
        ensure!(deliveries.delete_at(&key, rev).await?, "remove the marker");
    }
    Ok(())
}
