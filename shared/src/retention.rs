//! How long finished records are kept. A record that is finished (a run or turn that ended, an
//! execution that reached its end, a decided slot, a stopped session) is written with a
//! per-message TTL, the bucket's retention, and the server removes it that long after its last
//! write; a live record is written without one and stays until it is rewritten. So a bucket's
//! size follows the work in flight plus one retention window of history, and nothing live is
//! ever removed for its age.
//!
//! The retention is set at provisioning (`TopologyConfig::record_retention`) and written into
//! each bucket's stream metadata under [`METADATA_KEY`]; services read it when they bind, so
//! every replica applies the same one without configuration of its own.

use std::time::Duration;

use async_nats::jetstream::stream;

/// The stream metadata entry holding a bucket's retention of finished records, in seconds.
pub const METADATA_KEY: &str = "turnstile.finished_ttl_secs";

/// Default retention of finished records: long enough for a month of `run show`/`tree`.
pub const DEFAULT_RECORD_RETENTION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Default extra time turns and executions are kept beyond runs (a run's tree stays whole for
/// the run's retention if the run lasted less than this).
pub const DEFAULT_TREE_MARGIN: Duration = Duration::from_secs(7 * 24 * 3600);

/// Whether a record is finished: written with its bucket's retention as TTL when it is.
pub trait Retained {
    fn finished(&self) -> bool;
}

/// Values that never finish on their own (heartbeats, pins, schedules).
macro_rules! never_finished {
    ($($t:ty),*) => { $(impl Retained for $t { fn finished(&self) -> bool { false } })* };
}
never_finished!(String);

/// The retention a bucket's stream was provisioned with (`None`: keep finished records).
pub fn finished_ttl(config: &stream::Config) -> Option<Duration> {
    if !config.allow_message_ttl {
        return None;
    }
    config
        .metadata
        .get(METADATA_KEY)
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
}

/// Marks a bucket's stream config with `retention` (TTLs allowed, the retention in metadata).
pub fn mark(config: &mut stream::Config, retention: Duration) {
    config.allow_message_ttl = true;
    config.metadata.insert(
        METADATA_KEY.to_string(),
        retention.as_secs().max(1).to_string(),
    );
}
