//! Provisioning: every stream and bucket created, or brought up to date, idempotently; the
//! two buckets an older build made in a form the server cannot update are made again once.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

use crate::subjects;

use super::{stream_config, TopologyConfig, TopologyError};

/// Creates (or brings up to date) every stream and bucket. Run with an
/// identity that may manage streams (`turnstile admin provision`, `turnstile dev`); services
/// only [`bind`].
pub async fn provision(js: &jetstream::Context, cfg: &TopologyConfig) -> Result<(), TopologyError> {
    use stream::RetentionPolicy::{Limits, WorkQueue};
    // A deployment of an older build keeps its lanes on a work-queue stream: it gives up the
    // lane subjects first, so the lane stream below may take them (`lane_migration`).
    let legacy_lanes = crate::lane_migration::retire(js).await?;
    let mut streams = vec![
        // Limits, not work-queue: on a work-queue stream every consumer created is checked
        // against every other for overlap, a cost in proportion to the lanes already there.
        // Each item is removed by its lane once done with it (`lane::send_removal`).
        stream_config(subjects::LANE_STREAM, &[subjects::LANE_ALL], Limits),
        stream_config(
            subjects::TRANSPORT_STREAM,
            &[subjects::TRANSPORT_ALL],
            WorkQueue,
        ),
        stream_config(
            subjects::COMPLETION_STREAM,
            &[subjects::COMPLETION_ALL],
            WorkQueue,
        ),
        stream_config(subjects::STEP_STREAM, &[subjects::STEP_ALL], WorkQueue),
        stream_config(subjects::EVENTS_STREAM, &[subjects::EVENTS_ALL], Limits),
        stream_config(
            subjects::DEADLETTER_STREAM,
            &[subjects::DEADLETTER_ALL],
            Limits,
        ),
    ];
    for s in &mut streams {
        s.max_consumers = cfg.max_consumers;
        s.num_replicas = cfg.replicas;
        // The lanes keep an item until its lane is done with it, however long it waits.
        if s.retention == Limits && s.name != subjects::LANE_STREAM {
            s.max_age = cfg.events_max_age;
            // The server refuses a duplicate window longer than the age limit.
            s.duplicate_window = s.duplicate_window.min(cfg.events_max_age);
        }
    }
    for config in streams {
        let name = config.name.clone();
        js.create_or_update_stream(config)
            .await
            .map_err(|e| TopologyError::Stream {
                name,
                source: e.into(),
            })?;
    }
    let bucket = |name: &str, max_age: Duration| kv::Config {
        bucket: name.to_string(),
        history: 1,
        max_age,
        storage: stream::StorageType::File,
        num_replicas: cfg.replicas,
        ..Default::default()
    };
    let record = cfg.record_retention;
    let tree = record + cfg.tree_margin;
    for (config, retention) in [
        (
            bucket(subjects::SESSIONS_BUCKET, Duration::ZERO),
            Some(record),
        ),
        (bucket(subjects::TURNS_BUCKET, Duration::ZERO), Some(tree)),
        (bucket(subjects::HOSTS_BUCKET, cfg.host_ttl), None),
        (
            bucket(subjects::EXECUTIONS_BUCKET, Duration::ZERO),
            Some(tree),
        ),
        (bucket(subjects::RUNS_BUCKET, Duration::ZERO), Some(record)),
        (bucket(subjects::SCHEDULES_BUCKET, Duration::ZERO), None),
        // Entries live as long as their work; removed by purge, so no marker is left.
        (bucket(subjects::OWNED_BUCKET, Duration::ZERO), None),
        (bucket(subjects::SLOTS_BUCKET, Duration::ZERO), Some(record)),
    ] {
        let name = config.bucket.clone();
        let err = |e: async_nats::Error| TopologyError::Bucket {
            name: name.clone(),
            source: e,
        };
        match retention {
            None => {
                js.create_or_update_key_value(config)
                    .await
                    .map_err(|e| err(e.into()))?;
            }
            Some(retention) => {
                js.create_or_update_stream(record_bucket_stream(&config, retention))
                    .await
                    .map_err(|e| err(e.into()))?;
            }
        }
    }
    provision_deliveries(js, &bucket(subjects::DELIVERIES_BUCKET, Duration::ZERO)).await?;
    provision_replicas(js, bucket(subjects::REPLICAS_BUCKET, Duration::ZERO)).await?;
    if legacy_lanes {
        crate::lane_migration::finish(js).await?;
    }
    Ok(())
}

/// The deliveries bucket's stream allows message deletes: a delivery removes its marker by
/// sequence, leaving no removal for the next arming to write over (one round trip, not two;
/// `kv::Bucket::remove_revision`). A bucket provisioned by an older build denies them, and
/// the server never lifts that on an update, so such a stream is made again, once. Its
/// markers are lost with it; a lost marker whose item is on a lane at worst arms one extra
/// delivery, which finds nothing and clears itself.
async fn provision_deliveries(
    js: &jetstream::Context,
    config: &kv::Config,
) -> Result<(), TopologyError> {
    let err = |e: async_nats::Error| TopologyError::Bucket {
        name: config.bucket.clone(),
        source: e,
    };
    let mut stream = bucket_stream(config);
    stream.deny_delete = false;
    if let Ok(old) = js.get_stream(subjects::DELIVERIES_KV_STREAM).await {
        let info = old.cached_info();
        if info.config.deny_delete {
            tracing::info!(
                stream = subjects::DELIVERIES_KV_STREAM,
                "made again to allow marker removal by sequence (armed markers dropped)"
            );
            js.delete_stream(subjects::DELIVERIES_KV_STREAM)
                .await
                .map_err(|e| err(e.into()))?;
            // Its sequences go on where the old stream's ended: a marker is removed by its
            // revision (its sequence), so a revision an item of the old stream still names
            // must never come to mean another session's marker.
            stream.first_sequence = Some(info.state.last_sequence + 1);
        }
    }
    js.create_or_update_stream(stream)
        .await
        .map_err(|e| err(e.into()))?;
    Ok(())
}

/// The replicas bucket (liveness keys and lane pins) is on file storage like every other.
/// Builds before kept it in memory, to spare the 250 ms renewals a disk write; but a restart
/// of a single server dropped it: every renewal failed from then on, no replica started
/// afterwards could bind, and a killed replica's lanes waited out the pin TTL. The server
/// cannot change a stream's storage, so a memory-stored one is made again, once. What it held
/// is lost with it: each running replica then finds its key gone and stops, fenced, for its
/// supervisor to start again (as after a take-over), and lanes pinned to it are served after
/// their pin TTL.
async fn provision_replicas(
    js: &jetstream::Context,
    config: kv::Config,
) -> Result<(), TopologyError> {
    let name = config.bucket.clone();
    let err = |e: async_nats::Error| TopologyError::Bucket {
        name: name.clone(),
        source: e,
    };
    if let Ok(old) = js.get_stream(subjects::REPLICAS_KV_STREAM).await {
        if old.cached_info().config.storage == stream::StorageType::Memory {
            tracing::warn!(
                stream = subjects::REPLICAS_KV_STREAM,
                "made again on file storage (running session-lane replicas restart, fenced)"
            );
            js.delete_stream(subjects::REPLICAS_KV_STREAM)
                .await
                .map_err(|e| err(e.into()))?;
        }
    }
    js.create_or_update_key_value(config)
        .await
        .map_err(|e| err(e.into()))?;
    Ok(())
}

/// The stream behind a bucket of records with a retention: [`bucket_stream`] plus
/// per-message TTLs and the retention in its metadata (see `retention`). Written as a stream
/// so provisioning again keeps both (a KV update would try to drop them).
fn record_bucket_stream(config: &kv::Config, retention: Duration) -> stream::Config {
    let mut s = bucket_stream(config);
    crate::retention::mark(&mut s, retention);
    s
}

/// What the KV API would create for `config`: one value per key, direct gets, rollups, no
/// deletes through the stream API.
fn bucket_stream(config: &kv::Config) -> stream::Config {
    stream::Config {
        name: format!("KV_{}", config.bucket),
        subjects: vec![format!("$KV.{}.>", config.bucket)],
        max_messages_per_subject: config.history,
        max_age: config.max_age,
        storage: config.storage,
        num_replicas: config.num_replicas.max(1),
        allow_direct: true,
        allow_rollup: true,
        deny_delete: true,
        deny_purge: false,
        discard: stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}
