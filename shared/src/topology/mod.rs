//! The streams, buckets and consumers of a deployment. `turnstile admin provision` (or
//! `turnstile dev`) creates or updates every stream and bucket ([`provision`], in
//! `provision.rs`); a service only [`bind`]s to them, and ensures the durable consumers it
//! reads from (idempotent: `consumers.rs`).

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::subjects;

mod consumers;
mod provision;

pub use consumers::*;
pub use provision::provision;

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
