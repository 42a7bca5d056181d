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

/// A deliveries bucket an older build provisioned denies message deletes, and the server
/// never lifts that on an update. Until provisioning runs again a marker is removed through
/// the KV (a removal marker stays behind); provisioning makes the bucket again, once, and
/// markers are then removed by sequence.
#[tokio::test]
async fn a_deliveries_bucket_that_denies_deletes_is_made_again_by_provisioning() -> Result<()> {
    let nats = NatsServer::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client);
    let old = js
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: subjects::DELIVERIES_BUCKET.into(),
            history: 1,
            ..Default::default()
        })
        .await?;
    let stream = subjects::DELIVERIES_KV_STREAM;
    ensure!(
        js.get_stream(stream)
            .await?
            .cached_info()
            .config
            .deny_delete,
        "an older build's bucket denies deletes"
    );
    let before = turnstile_shared::kv::Bucket::new(old, subjects::DELIVERIES_BUCKET, js.clone());
    let key = SessionId::new().to_string();
    let rev = before.create(&key, &marker()).await?.context("created")?;
    ensure!(
        before.remove_revision(&key, rev).await?,
        "removed through the KV on a bucket that denies deletes"
    );
    ensure!(
        before.get::<DeliveryMarker>(&key).await?.is_none(),
        "the removed marker reads back"
    );

    let last = js
        .get_stream(stream)
        .await?
        .cached_info()
        .state
        .last_sequence;
    topology::provision(&js, &TopologyConfig::default()).await?;
    ensure!(
        !js.get_stream(stream)
            .await?
            .cached_info()
            .config
            .deny_delete,
        "provisioning made the bucket allow deletes"
    );

    let buckets = topology::bind(&js).await?;
    let rev = buckets
        .deliveries
        .create(&key, &marker())
        .await?
        .context("created in the new bucket")?;
    // Its sequences go on from the old stream's: a revision an older delivery item names never
    // comes to mean a marker of the new stream.
    ensure!(
        rev > last,
        "a new marker at revision {rev}, not past {last}"
    );
    ensure!(
        !buckets.deliveries.remove_revision(&key, last).await?
            && buckets
                .deliveries
                .get::<DeliveryMarker>(&key)
                .await?
                .is_some(),
        "an old revision removed a new marker"
    );
    // Provisioning again keeps the bucket (and its markers).
    topology::provision(&js, &TopologyConfig::default()).await?;
    ensure!(
        buckets
            .deliveries
            .get::<DeliveryMarker>(&key)
            .await?
            .map(|(_, r)| r)
            == Some(rev),
        "provisioning again dropped a live marker"
    );
    ensure!(
        buckets.deliveries.remove_revision(&key, rev).await?,
        "removed by sequence"
    );
    let subject = format!("$KV.{}.{key}", subjects::DELIVERIES_BUCKET);
    match js
        .get_stream(stream)
        .await?
        .get_last_raw_message_by_subject(&subject)
        .await
    {
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(()),
        other => anyhow::bail!("the key still holds {other:?}"),
    }
}
