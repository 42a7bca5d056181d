//! The store primitives the hot paths lean on, against a real nats-server: a delivery marker
//! is removed and armed again on every completion, so its removal must leave nothing for the
//! next create to write over, and a create must never write over a live marker (R3: one armed
//! delivery per session).

use anyhow::{ensure, Context, Result};
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use chrono::Utc;
use turnstile_shared::delivery::DeliveryMarker;
use turnstile_shared::topology::{self, TopologyConfig};
use turnstile_shared::{subjects, DeliveryId, SessionId};
use turnstile_tests::NatsServer;

fn marker() -> DeliveryMarker {
    DeliveryMarker {
        delivery: DeliveryId::new(),
        armed_at: Utc::now(),
    }
}

#[tokio::test]
async fn a_removed_marker_leaves_nothing_behind_and_a_live_one_is_never_written_over() -> Result<()>
{
    let nats = NatsServer::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client);
    topology::provision(&js, &TopologyConfig::default()).await?;
    let buckets = topology::bind(&js).await?;
    let deliveries = &buckets.deliveries;
    let stream = js.get_stream(subjects::DELIVERIES_KV_STREAM).await?;
    let key = SessionId::new().to_string();
    let subject = format!("$KV.{}.{key}", subjects::DELIVERIES_BUCKET);

    let mut rev = deliveries
        .create(&key, &marker())
        .await?
        .context("a fresh key is created")?;
    for round in 0..3 {
        ensure!(
            deliveries.create(&key, &marker()).await?.is_none(),
            "round {round}: a live marker was written over"
        );
        ensure!(
            deliveries.remove_revision(&key, rev).await?,
            "round {round}: remove the marker"
        );
        ensure!(
            !deliveries.remove_revision(&key, rev).await?,
            "round {round}: a marker removed twice"
        );
        // Nothing is left on the key's subject: no removal marker for the next create to
        // read and write over (one round trip, not two).
        match stream.get_last_raw_message_by_subject(&subject).await {
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
            other => anyhow::bail!("round {round}: the key still holds {other:?}"),
        }
        ensure!(
            deliveries.get::<DeliveryMarker>(&key).await?.is_none(),
            "round {round}: a removed marker reads back"
        );
        let next = marker();
        let old = rev;
        rev = deliveries
            .create(&key, &next)
            .await?
            .with_context(|| format!("round {round}: not created after the removal"))?;
        let (stored, at) = deliveries
            .get::<DeliveryMarker>(&key)
            .await?
            .context("the marker just created is not there")?;
        ensure!(
            stored.delivery == next.delivery && at == rev,
            "read back {stored:?} at {at}"
        );
        ensure!(
            !deliveries.remove_revision(&key, old).await?
                && deliveries.get::<DeliveryMarker>(&key).await?.is_some(),
            "round {round}: removing an older revision took the live marker"
        );
    }
    Ok(())
}
