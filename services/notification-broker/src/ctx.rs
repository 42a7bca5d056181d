//! What the broker's tasks share (`Ctx`: the NATS handles, the buckets and this replica's
//! small state) and the service's `Error`. Apart from `lib.rs`, which starts the tasks, so
//! that the tasks need not import the file that calls them.

use std::collections::HashMap;
use std::sync::Arc;

use turnstile_shared::config::StartError;
use turnstile_shared::topology::{Buckets, TopologyConfig};
use turnstile_shared::ExecutionId;

use crate::callout::CalloutError;
use crate::{ended, running};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("start API service: {0}")]
    Api(async_nats::Error),
    #[error("auth callout: {0}")]
    Callout(#[from] CalloutError),
}

pub(crate) struct Ctx {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub buckets: Buckets,
    pub topology: TopologyConfig,
    /// Ends this replica's report handler is recording itself (see `ended`).
    pub inline: ended::Inline,
    /// Sessions with a delivery armed or a run holding them, as this replica sees it
    /// (see `ended`).
    pub armed: ended::ArmedSessions,
    /// Running steps' records as this replica last wrote them (see `running`).
    pub running: running::Running,
    pub parent_locks: std::sync::Mutex<HashMap<ExecutionId, Arc<tokio::sync::Mutex<()>>>>,
}

impl Ctx {
    pub fn parent_lock(&self, parent: &ExecutionId) -> Arc<tokio::sync::Mutex<()>> {
        match self.parent_locks.lock() {
            Ok(mut m) => m.entry(parent.clone()).or_default().clone(),
            Err(_) => Arc::default(),
        }
    }

    /// Forgets the lock once nobody else holds or waits on it.
    pub fn release_parent_lock(&self, parent: &ExecutionId, lock: Arc<tokio::sync::Mutex<()>>) {
        if let Ok(mut m) = self.parent_locks.lock() {
            // Ours plus the map's: nobody else has it.
            if Arc::strong_count(&lock) == 2 {
                m.remove(parent);
            }
        }
    }
}
