//! Idempotent provisioning of every stream, bucket and consumer. Each service calls
//! [`provision`] at start, so any of them can be the first to run against an empty server.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, stream};

use crate::ids::{HostName, SessionId};
use crate::subjects;

/// Timings baked into streams and consumers. Defaults suit production; tests shorten them so
/// fail-over happens in seconds.
#[derive(Debug, Clone)]
pub struct TopologyConfig {
    /// How long a lane item may go without an ack or progress ack before it is redelivered.
    pub lane_ack_wait: Duration,
    /// How long a session-lane replica keeps a lane's pin without pulling.
    pub lane_pin_ttl: Duration,
    /// Redelivery wait for transport commands (progress-acked while a turn runs).
    pub transport_ack_wait: Duration,
    /// Redelivery wait of the broker's queues (ends, mirrors, agent launches, run ends),
    /// progress-acked while a message is handled: a killed broker replica's messages go to
    /// another replica this long after its last progress.
    pub service_ack_wait: Duration,
    /// A host whose heartbeat is older than this drops out of the hosts bucket.
    pub host_ttl: Duration,
    /// Per-stream consumer ceiling (the server's default of 1,000 is far too low for lanes).
    pub max_consumers: i32,
    /// How long lifecycle events (and dead letters) are kept.
    pub events_max_age: Duration,
    /// How long a finished record stays after its last write (`retention`): runs, slots,
    /// stopped sessions; turns and executions `tree_margin` longer.
    pub record_retention: Duration,
    /// How much longer than runs the turns and executions are kept: a run's tree stays whole
    /// for the run's own retention as long as the run lasted less than this.
    pub tree_margin: Duration,
    /// Copies of every stream and bucket in a JetStream cluster (1 on a single server; 3 to
    /// survive the loss of any one of three servers).
    pub replicas: usize,
}

impl Default for TopologyConfig {
    fn default() -> Self {
        Self {
            lane_ack_wait: Duration::from_secs(30),
            lane_pin_ttl: Duration::from_secs(30),
            transport_ack_wait: Duration::from_secs(30),
            service_ack_wait: Duration::from_secs(2),
            host_ttl: Duration::from_secs(15),
            max_consumers: 1_000_000,
            events_max_age: Duration::from_secs(7 * 24 * 3600),
            record_retention: crate::retention::DEFAULT_RECORD_RETENTION,
            tree_margin: crate::retention::DEFAULT_TREE_MARGIN,
            replicas: 1,
        }
    }
}

impl TopologyConfig {
    /// How often a holder of a lane item or transport command must show progress.
    pub fn progress_interval(&self) -> Duration {
        (self.lane_ack_wait.min(self.transport_ack_wait) / 3).max(Duration::from_millis(200))
    }

    /// Pull requests must be renewed well within the pin TTL or the pin is lost between pulls.
    pub fn lane_pull_expiry(&self) -> Duration {
        (self.lane_pin_ttl / 3).max(Duration::from_secs(1))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("create stream {name}: {source}")]
    Stream {
        name: String,
        source: async_nats::Error,
    },
    #[error("create kv bucket {name}: {source}")]
    Bucket {
        name: String,
        source: async_nats::Error,
    },
    #[error(
        "open {what} {name}: {source} (is the topology provisioned? run `turnstile admin \
         provision` against this NATS first)"
    )]
    Bind {
        what: &'static str,
        name: String,
        source: async_nats::Error,
    },
    #[error("create consumer {name} on {stream}: {source}")]
    Consumer {
        stream: String,
        name: String,
        source: async_nats::Error,
    },
    #[error(transparent)]
    LaneMigration(#[from] crate::lane_migration::MigrationError),
}

/// The buckets every service opens.
#[derive(Clone)]
pub struct Buckets {
    pub sessions: crate::kv::Bucket,
    pub turns: crate::kv::Bucket,
    pub hosts: crate::kv::Bucket,
    pub executions: crate::kv::Bucket,
    pub deliveries: crate::kv::Bucket,
    pub runs: crate::kv::Bucket,
    pub schedules: crate::kv::Bucket,
    pub slots: crate::kv::Bucket,
    pub replicas: crate::kv::Bucket,
    pub owned: crate::kv::Bucket,
}

fn stream_config(
    name: &str,
    subjects: &[&str],
    retention: stream::RetentionPolicy,
) -> stream::Config {
    stream::Config {
        name: name.to_string(),
        subjects: subjects.iter().map(|s| s.to_string()).collect(),
        retention,
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        allow_direct: true,
        ..Default::default()
    }
}

/// Opens the provisioned topology without changing it: what a service does at start, so it
/// needs no stream or bucket create, update or delete rights. An absent stream or bucket is a
/// [`TopologyError::Bind`] naming it.
pub async fn bind(js: &jetstream::Context) -> Result<Buckets, TopologyError> {
    for name in subjects::ALL_STREAMS {
        js.get_stream(name).await.map_err(|e| TopologyError::Bind {
            what: "stream",
            name: name.to_string(),
            source: e.into(),
        })?;
    }
    let open = |name: &'static str| async move {
        js.get_key_value(name)
            .await
            .map(|store| crate::kv::Bucket::new(store, name, js.clone()))
            .map_err(|e| TopologyError::Bind {
                what: "kv bucket",
                name: name.to_string(),
                source: e.into(),
            })
    };
    Ok(Buckets {
        sessions: open(subjects::SESSIONS_BUCKET).await?,
        turns: open(subjects::TURNS_BUCKET).await?,
        hosts: open(subjects::HOSTS_BUCKET).await?,
        executions: open(subjects::EXECUTIONS_BUCKET).await?,
        deliveries: open(subjects::DELIVERIES_BUCKET).await?,
        runs: open(subjects::RUNS_BUCKET).await?,
        schedules: open(subjects::SCHEDULES_BUCKET).await?,
        slots: open(subjects::SLOTS_BUCKET).await?,
        replicas: open(subjects::REPLICAS_BUCKET).await?,
        owned: open(subjects::OWNED_BUCKET).await?,
    })
}

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

/// A session's exclusive lane consumer: one item in flight, pinned to one replica (R1).
pub async fn ensure_lane_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    session: &SessionId,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::lane_consumer(session);
    let config = consumer::pull::Config {
        durable_name: Some(name.clone()),
        filter_subject: subjects::lane(session),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: cfg.lane_ack_wait,
        max_ack_pending: 1,
        max_deliver: -1,
        priority_policy: consumer::PriorityPolicy::PinnedClient,
        priority_groups: vec![subjects::LANE_GROUP.to_string()],
        priority_timeout: cfg.lane_pin_ttl,
        ..Default::default()
    };
    create_consumer(js, subjects::LANE_STREAM, &name, config).await
}

/// The one consumer of a host's transport commands.
pub async fn ensure_transport_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    host: &HostName,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::transport_consumer(host);
    let config = durable(
        &name,
        subjects::transport_host_all(host),
        cfg.transport_ack_wait,
        100_000,
    );
    create_consumer(js, subjects::TRANSPORT_STREAM, &name, config).await
}

/// A session's pending completions (R3): pulled in batches by its delivery turns, held
/// unacked (with progress acks) until the turn that handed them over completed.
pub async fn ensure_completion_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    session: &SessionId,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::completion_consumer(session);
    let config = durable(
        &name,
        subjects::completion_session_all(session),
        cfg.lane_ack_wait,
        10_000,
    );
    create_consumer(js, subjects::COMPLETION_STREAM, &name, config).await
}

/// A host's `command` step work, taken by its transport agent.
pub async fn ensure_step_command_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    host: &HostName,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::step_command_consumer(host);
    step_work_consumer(js, cfg, name, subjects::step_command(host)).await
}

/// The shared consumer of the workers serving one `external` step queue.
pub async fn ensure_step_external_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    queue: &str,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::step_external_consumer(queue);
    step_work_consumer(js, cfg, name, subjects::step_external(queue)).await
}

async fn step_work_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    name: String,
    filter: String,
) -> Result<consumer::PullConsumer, TopologyError> {
    let config = durable(&name, filter, cfg.transport_ack_wait, 100_000);
    create_consumer(js, subjects::STEP_STREAM, &name, config).await
}

/// The broker's queue of execution ends to record and route (shared by its replicas).
pub async fn ensure_ended_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::BROKER_ENDED_CONSUMER.to_string();
    let config = durable(
        &name,
        subjects::STEP_ENDED_ALL.to_string(),
        cfg.service_ack_wait,
        1_000,
    );
    create_consumer(js, subjects::STEP_STREAM, &name, config).await
}

/// The broker's queue of background agents to launch.
pub async fn ensure_agents_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::BROKER_AGENTS_CONSUMER.to_string();
    let config = durable(
        &name,
        subjects::STEP_AGENT.to_string(),
        cfg.service_ack_wait,
        100_000,
    );
    create_consumer(js, subjects::STEP_STREAM, &name, config).await
}

/// The broker's view of run ends (to finish background-agent steps), from the event stream.
pub async fn ensure_run_ends_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = subjects::BROKER_RUN_ENDS_CONSUMER.to_string();
    let config = consumer::pull::Config {
        filter_subject: String::new(),
        filter_subjects: subjects::RUN_ENDS.iter().map(|s| s.to_string()).collect(),
        ..durable(&name, String::new(), cfg.service_ack_wait, 1_000)
    };
    create_consumer(js, subjects::EVENTS_STREAM, &name, config).await
}

/// The broker's durable view of every turn record change (mirror and R7 on turn end).
pub async fn ensure_turns_mirror_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    mirror_consumer(
        js,
        cfg,
        subjects::BROKER_TURNS_CONSUMER,
        subjects::TURNS_KV_STREAM,
        subjects::TURNS_KV_ALL,
    )
    .await
}

/// The broker's durable view of every run record change (runs and messages in the tree).
pub async fn ensure_runs_mirror_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
) -> Result<consumer::PullConsumer, TopologyError> {
    mirror_consumer(
        js,
        cfg,
        subjects::BROKER_RUNS_CONSUMER,
        subjects::RUNS_KV_STREAM,
        subjects::RUNS_KV_ALL,
    )
    .await
}

async fn mirror_consumer(
    js: &jetstream::Context,
    cfg: &TopologyConfig,
    name: &str,
    stream: &str,
    filter: &str,
) -> Result<consumer::PullConsumer, TopologyError> {
    let name = name.to_string();
    let config = durable(&name, filter.to_string(), cfg.service_ack_wait, 1_000);
    create_consumer(js, stream, &name, config).await
}

/// A durable pull consumer with explicit acks and unlimited redelivery: every consumer of
/// ours but the lanes' (which add the pinned-client priority group).
fn durable(
    name: &str,
    filter: String,
    ack_wait: Duration,
    max_ack_pending: i64,
) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(name.to_string()),
        filter_subject: filter,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait,
        max_ack_pending,
        max_deliver: -1,
        ..Default::default()
    }
}

async fn create_consumer(
    js: &jetstream::Context,
    stream_name: &str,
    name: &str,
    config: consumer::pull::Config,
) -> Result<consumer::PullConsumer, TopologyError> {
    let err = |e: async_nats::Error| TopologyError::Consumer {
        stream: stream_name.to_string(),
        name: name.to_string(),
        source: e,
    };
    let stream = js
        .get_stream_no_info(stream_name)
        .await
        .map_err(|e| err(e.into()))?;
    stream
        .create_consumer(config)
        .await
        .map_err(|e| err(e.into()))
}
